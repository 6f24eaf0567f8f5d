"""Token generation (libpipe >= 0.8): a Generator drives a decoder (pipe.h's decoder contract, which
`python -m libpipe.export_llm` writes for Hugging Face causal LMs) step by step, with many sequences
batched and pipelined across the stages; each `generate()` starts one sequence, a Generation.

    with libpipe.Generator("llm.pt", split_at=["model.layers.15:begin"], weights="model.safetensors") as gen:
        for token in gen.generate([1, 2, 3], max_new_tokens=32):       # token ids as they come
            ...
        text = gen.generate("Hello", tokenizer=tok).wait()               # text in, text out
        async for piece in gen.generate("Hello", tokenizer=tok): ...     # asyncio

A generation is read without a thread of its own: iterating blocks in poll() on the generation's
file descriptor (the GIL released), and `async for` / `await` have the event loop watch it.

There is no Session.generate: a generator owns its session (pipe_generator_create builds it and
runs every step on it), so generation starts from the decoder's Plan, Model or path rather than
from a Session made by plan.session(); `generator.session` is the generator's own session,
borrowed, for its per-stage statistics and traces.
"""

import asyncio
import contextlib
import operator
import os
import select
import threading
import time
from collections import namedtuple

from ._header import constants as _constants
from .errors import Error, InvalidArgumentError, Status, UnsupportedError, WaitTimeoutError
from .runtime import (
    _SESSION_DEFAULTS,
    _Closeable,
    _Handle,
    _lib,
    _name_of,
    _session_options,
    _timeout_ms,
    Model,
    Plan,
    Session,
)

__all__ = [
    "FINISH_REASONS",
    "Generation",
    "GenerationInfo",
    "Generator",
    "GeneratorInfo",
    "GeneratorSession",
    "TokenLogprobs",
]

_GENERATOR_DEFAULTS = _constants.DEFAULTS["pipe_generator_options"]
_GENERATION_DEFAULTS = _constants.DEFAULTS["pipe_generation_options"]
# Generation.finish_reason: pipe.h's PIPE_FINISH_* by lower-case name; PIPE_FINISH_NONE (still
# queued or generating) is None.
_FINISH = {value: (None if name == "NONE" else name.lower()) for name, value in _constants.FINISH.items()}
FINISH_REASONS = tuple(reason for reason in _FINISH.values() if reason is not None)

_INT64 = (-(2**63), 2**63 - 1)
_UINT64 = (0, 2**64 - 1)
_READ_CHUNK = 256  # tokens per pipe_generation_read
# A blocking wait polls the descriptor in slices, so that close() from another thread (which waits
# for the calls using the handle) is never held up for long by a generation that does not move.
_POLL_S = 0.25

GeneratorInfo = namedtuple("GeneratorInfo", "slots max_len vocab cache_bytes_per_slot")
GeneratorInfo.__doc__ = """What the decoder offers: slots (sequences holding a KV-cache slot at once),
max_len (tokens per sequence, prompt and generated together), vocab (ids are 0 .. vocab-1),
cache_bytes_per_slot (K and V of every layer, all stages together)."""

TokenLogprobs = namedtuple("TokenLogprobs", "logprob top")
TokenLogprobs.__doc__ = """A generated token's log-probability under the model's distribution at its position
(the log-softmax of the logits, before temperature, top_k and top_p), and top: the likeliest
tokens there as (id, log-probability) pairs, most likely first (generate(top_logprobs=K))."""

GenerationInfo = namedtuple(
    "GenerationInfo",
    "finish_reason prompt_tokens generated_tokens queued_ms time_to_first_token_ms mean_inter_token_ms cached_tokens",
)
GenerationInfo.__doc__ = """One sequence's progress: finish_reason (None while it is queued or
generating, else one of FINISH_REASONS), prompt_tokens, generated_tokens (so far, read or not),
queued_ms (submit to a cache slot), time_to_first_token_ms (submit to the first token),
mean_inter_token_ms (between tokens after the first); each time is None until it is known;
cached_tokens (prompt tokens found in the cache slot, left there by an earlier sequence that began
the same way, and not computed again)."""


def _int(value, what, bounds=_INT64):
    """An integer argument (ints, numpy and torch integers; not floats or bools) within bounds."""
    try:
        if isinstance(value, bool):
            raise TypeError
        x = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"{what} must be an integer, not {type(value).__name__} {value!r}"
        ) from None
    if not bounds[0] <= x <= bounds[1]:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} = {x} is out of range {bounds[0]}..{bounds[1]}")
    return x


def _float(value, what):
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"{what} must be a number, not {type(value).__name__} {value!r}"
        ) from None


def _ids(values, what):
    """A sequence of token ids (list, tuple, numpy or torch 1-D integers) as a list of ints."""
    if isinstance(values, (str, bytes)):
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} must be token ids, not {type(values).__name__}")
    try:
        items = list(values)
    except TypeError:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"{what} must be a sequence of token ids, not {type(values).__name__}"
        ) from None
    return [_int(v, f"{what}[{i}]") for i, v in enumerate(items)]


# ---- text: a tokenizer's encode and decode ------------------------------------------------------


class _Codec:
    """Text to ids and back, through a `tokenizers.Tokenizer` (encode gives an Encoding with .ids)
    or a transformers tokenizer (encode gives a list of ids). Special tokens are added on encode as
    the tokenizer's defaults say (a BOS where its post-processor puts one) and skipped on decode."""

    def __init__(self, tokenizer):
        if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT,
                "tokenizer must be a tokenizers.Tokenizer or a transformers tokenizer (with encode and decode), "
                f"not {type(tokenizer).__name__}",
            )
        self.tokenizer = tokenizer

    def encode(self, text):
        encoded = self.tokenizer.encode(text)
        return _ids(getattr(encoded, "ids", encoded), "the encoded prompt")

    def decode(self, ids):
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class _TextStream:
    """Token ids in, text pieces out, as a sequence grows. Each step decodes every id so far and
    gives the text past what it gave before, so that tokens whose bytes only make a character
    together (byte-level BPE splits multi-byte UTF-8 characters) and decoders that merge pieces
    come out right. A decode ending in U+FFFD (an incomplete UTF-8 character) holds that tail back
    until the next ids complete it; flush() gives whatever is left at the end."""

    def __init__(self, codec):
        self._codec = codec
        self._ids = []
        self._given = ""  # the text handed out so far

    def add(self, token):
        self._ids.append(token)
        return self._give(self._codec.decode(self._ids).rstrip("\ufffd"))

    def flush(self):
        return self._give(self._codec.decode(self._ids))

    def _give(self, text):
        # A decoder may rewrite text it gave before (cleaning a space before punctuation): what was
        # handed out stays out, and only what lies past its length is new.
        piece = text[len(self._given) :]
        self._given += piece
        return piece


# ---- the generator -----------------------------------------------------------------------------------


class _BorrowedHandle:
    """The handle of the session a generator owns: every use goes through the generator's handle
    (the session lives exactly as long as the generator), and closing it does nothing."""

    def __init__(self, owner, ptr):
        self._owner = owner
        self._ptr = ptr

    @contextlib.contextmanager
    def use(self):
        with self._owner.use():
            yield self._ptr

    @property
    def closed(self):
        return self._owner.closed

    def close(self, block=True):
        pass


class GeneratorSession(Session):
    """A generator's own session, borrowed (Generator.session): stats(), trace_start(),
    trace_stop() and check() as for any Session. It runs the generator's steps only, so run(),
    submit() and run_async() raise UnsupportedError; closing it does nothing (the generator does)."""

    def __init__(self, generator_handle, ptr, input_names, transport, world_size, store):
        self._handle = _BorrowedHandle(generator_handle, ptr)
        self.input_names = input_names
        self.num_stages = _lib().pipe_session_num_stages(ptr)
        self.transport, self.world_size, self.store = transport, world_size, store

    def _refuse(self, *args, **kwargs):
        raise UnsupportedError(
            Status.UNSUPPORTED, "a generator's session runs the generator's steps only: use generator.generate()"
        )

    run = submit = _refuse

    async def run_async(self, *args, **kwargs):
        self._refuse()

    def __repr__(self):
        return f"<libpipe.GeneratorSession {self.num_stages} stages{' closed' if self.closed else ''}>"


def _plan_of(model, split_at, stages, policy):
    """The plan to generate from, and what was opened to make it (closed once the generator is
    built: its session keeps what it needs)."""
    if isinstance(model, Plan):
        if split_at is not None or stages is not None:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT, "split_at and stages cut a model; a Plan is already cut (give the Model)"
            )
        return model, []
    opened = []
    try:
        if not isinstance(model, Model):
            if not isinstance(model, (str, bytes, os.PathLike)):
                raise InvalidArgumentError(
                    Status.INVALID_ARGUMENT,
                    f"a Generator is made from a Plan, a Model or a model's path, not {type(model).__name__}",
                )
            model = Model.load(model)
            opened.append(model)
        plan = model.split(split_at, stages=stages, policy=policy)
        opened.append(plan)
        return plan, opened
    except BaseException:
        for handle in reversed(opened):
            handle.close()
        raise


class Generator(_Closeable):
    """Token generation from a decoder: sequences join and leave a batch that is pipelined across
    the stages (continuous batching); each generate() starts one and returns a Generation.

    model: a Plan, a Model (cut with split_at / stages / policy, as Model.split cuts it) or the
    path of a decoder's TorchScript file (loaded, then cut likewise). The session options are
    Plan.session's (threads_per_stage, max_inflight, dtype, weights, quantize, quantize_head,
    quantize_embedding, transport, world_size, store, comm_timeout, devices, outputs; the defaults are
    pipe.h's); the generator has no micro-batching options (a step is one micro-batch). Generator
    options, 0 meaning libpipe's default: max_queued (sequences that may wait for a free cache slot; one more raises BusyError; 0: 4 x
    slots), prefill_chunk (tokens per step, all rows together, so that a long prompt does not
    stall the others' decoding; 0: 256), steps_in_flight (steps in the pipeline at once; 0: one per
    stage, or per core when stages share the cores), max_rows_per_step (sequences per step; 0: slots).

    Creating it builds the session and runs one step to check that the model follows the decoder
    contract (InvalidArgumentError says what differs), otherwise the errors of Plan.session.
    close() (or leaving a `with` block) cancels every generation still going (they raise
    CancelledError), waits for the steps in flight and frees the session; generations stay
    readable until they are closed. generate() is safe from many threads at once."""

    def __init__(
        self,
        model,
        split_at=None,
        *,
        stages=None,
        policy="uniform",
        threads_per_stage=_SESSION_DEFAULTS["threads_per_stage"],
        max_inflight=_SESSION_DEFAULTS["max_inflight"],
        dtype=None,
        weights=None,
        quantize=None,
        quantize_head=None,
        quantize_embedding=None,
        transport=_name_of(_constants.TRANSPORT, _SESSION_DEFAULTS["transport"]).lower(),
        world_size=_SESSION_DEFAULTS["world_size"],
        store=None,
        comm_timeout=None,
        devices=None,
        outputs=_name_of(_constants.OUTPUTS, _SESSION_DEFAULTS["outputs"]).lower().removeprefix("on_"),
        max_queued=_GENERATOR_DEFAULTS["max_queued"],
        prefill_chunk=_GENERATOR_DEFAULTS["prefill_chunk"],
        steps_in_flight=_GENERATOR_DEFAULTS["steps_in_flight"],
        max_rows_per_step=_GENERATOR_DEFAULTS["max_rows_per_step"],
        token=None,
    ):
        session_options = _session_options(
            threads_per_stage=threads_per_stage,
            max_inflight=max_inflight,
            dtype=dtype,
            weights=weights,
            quantize=quantize,
            quantize_head=quantize_head,
            quantize_embedding=quantize_embedding,
            transport=transport,
            world_size=world_size,
            store=store,
            comm_timeout=comm_timeout,
            devices=devices,
            outputs=outputs,
            token=token,
        )
        generator_options = {
            "max_queued": _int(max_queued, "max_queued"),
            "prefill_chunk": _int(prefill_chunk, "prefill_chunk"),
            "steps_in_flight": _int(steps_in_flight, "steps_in_flight"),
            "max_rows_per_step": _int(max_rows_per_step, "max_rows_per_step"),
        }
        lib = _lib()
        plan, opened = _plan_of(model, split_at, stages, policy)
        try:
            with plan._handle.use() as h:
                ptr = lib.pipe_generator_create(h, session_options, generator_options)
            self.input_names = plan.input_names
        finally:
            for handle in reversed(opened):
                handle.close()
        self._handle = _Handle(ptr, lib.pipe_generator_destroy, "generator", 1)
        self.info = GeneratorInfo(**lib.pipe_generator_get_info(ptr))
        self.transport, self.world_size, self.store = transport, int(world_size), store
        self._session = None

    @property
    def session(self):
        """The generator's own session, borrowed (a GeneratorSession): stats() per stage,
        trace_start() / trace_stop(path), check(). Valid until the generator is closed."""
        if self._session is None:
            with self._handle.use() as h:
                ptr = _lib().pipe_generator_session(h)
                self._session = GeneratorSession(
                    self._handle, ptr, self.input_names, self.transport, self.world_size, self.store
                )
        return self._session

    def stats(self):
        """What the generator has done since it was created, as a dict: slots_in_use and queued
        (now), sequences_finished, prompt_tokens, generated_tokens, steps, tokens_per_s (while a
        sequence held a slot), mean_time_to_first_token_ms, mean_inter_token_ms,
        mean_rows_per_step, sampling_ms; steps_in_flight (the engine's limit now: one per stage,
        or 1 where it measured that one step at a time with every core on it is faster),
        steps_one_at_a_time and steps_pipelined (steps launched under each); cached_prompt_tokens
        (prompt tokens found in cache slots instead of prefilled: prefix reuse)."""
        with self._handle.use() as h:
            return _lib().pipe_generator_get_stats(h)

    def generate(
        self,
        prompt,
        max_new_tokens=_GENERATION_DEFAULTS["max_new_tokens"],
        temperature=_GENERATION_DEFAULTS["temperature"],
        top_k=_GENERATION_DEFAULTS["top_k"],
        top_p=_GENERATION_DEFAULTS["top_p"],
        seed=_GENERATION_DEFAULTS["seed"],
        stop_ids=(),
        timeout=None,
        tokenizer=None,
        logprobs=False,
        top_logprobs=0,
        prompt_logprobs=False,
    ):
        """Start generating after `prompt` and return its Generation at once (never waiting: the
        sequence queues while every cache slot is taken).

        prompt: token ids (a sequence of ints, numpy or torch integers), or a str when a
        tokenizer is given. max_new_tokens: tokens to generate at most (the sequence also ends
        when it fills the decoder's max_len). temperature 0 (default) is greedy: the most likely
        token; otherwise the logits are divided by it and the token is sampled among the top_k
        most likely (0: all), then among the fewest whose probability reaches top_p (1: all),
        with the sequence's own random generator: equal seeds and logits give equal tokens.
        stop_ids: ids that end the sequence (the stop id is its last token). timeout: seconds
        from now until the sequence fails with DeadlineExceededError (waiting for a slot
        included; None: no deadline). tokenizer: a `tokenizers.Tokenizer` (or a transformers
        tokenizer) that encodes a str prompt and makes the generation give text. logprobs: keep
        each token's log-probability (Generation.logprobs) under the model's distribution (the
        log-softmax of its logits, before temperature, top_k and top_p), with the top_logprobs
        (0..20) likeliest tokens at its position. prompt_logprobs: score the prompt too
        (Generation.prompt_logprobs: each prompt token's log-probability given those before it,
        with top_logprobs alternatives; OpenAI's echo, perplexity): the prompt then crosses the
        pipeline one token a step, and nothing of it is taken from the cache.

        InvalidArgumentError for an empty prompt, an id outside 0 .. vocab-1, a prompt that
        leaves no room for one token in max_len, or bad options (the message names them);
        BusyError when max_queued sequences already wait (retry once one finished);
        CommunicationError when the session is broken; CancelledError while the generator
        closes."""
        codec = None if tokenizer is None else _Codec(tokenizer)
        if isinstance(prompt, str):
            if codec is None:
                raise InvalidArgumentError(
                    Status.INVALID_ARGUMENT,
                    "a text prompt needs tokenizer= (a tokenizers.Tokenizer); otherwise give token ids",
                )
            ids = codec.encode(prompt)
        else:
            ids = _ids(prompt, "prompt")
        timeout_ms = _timeout_ms(timeout, "timeout")
        options = {
            "max_new_tokens": _int(max_new_tokens, "max_new_tokens"),
            "temperature": _float(temperature, "temperature"),
            "top_k": _int(top_k, "top_k"),
            "top_p": _float(top_p, "top_p"),
            "seed": _int(seed, "seed", _UINT64),
            "stop_ids": _ids(stop_ids, "stop_ids"),
            "timeout_ms": 0 if timeout_ms is None else timeout_ms,
            "logprobs": 1 if logprobs else 0,
            "top_logprobs": _int(top_logprobs, "top_logprobs"),
        }
        if prompt_logprobs:  # only when asked: a libpipe older than 0.15 knows no such field
            options["prompt_logprobs"] = 1
        with self._handle.use() as h:
            ptr = _lib().pipe_generator_submit(h, ids, options)
        return Generation(
            ptr,
            self,
            ids,
            codec,
            options["top_logprobs"] if logprobs else None,
            options["top_logprobs"] if prompt_logprobs else None,
        )

    def __repr__(self):
        i = self.info
        return (
            f"<libpipe.Generator slots={i.slots} max_len={i.max_len} vocab={i.vocab}"
            f"{' closed' if self.closed else ''}>"
        )


# ---- one sequence -----------------------------------------------------------------------------------


class Generation(_Closeable):
    """One sequence being generated (Generator.generate()).

    Iterating gives its tokens as they come (token ids, or text pieces when a tokenizer was
    given), blocking in poll() on its descriptor with the GIL released; the loop ends when the
    sequence does, or raises its error (CancelledError, DeadlineExceededError, ExecutionError of a
    failed step, ...) after the tokens that came before it. `async for` does the same in a
    coroutine, and `await generation` gives what wait() gives; the event loop watches the
    descriptor, so no thread waits for any generation. Cancelling the task that awaits
    cancels the sequence.

    wait() gives the whole output; tokens, text, info and finish_reason say how far it is;
    cancel() stops it; close() (or leaving a `with` block, or dropping it) cancels it if it goes on
    and frees it. A sequence that ended is freed by itself once its outcome is read (its
    descriptor closes); what it gave stays here. Iterate a generation from one thread or task at a
    time (its tokens are handed out once); the other methods are safe from any thread."""

    # The event loop that watches the descriptor, while one does: (loop, fd, future). Only that
    # loop's thread adds and removes the reader; _watch_lock orders it with _finish and close, which
    # may run on any thread (as for Request).
    _watch = None
    _awaiters = 0  # tasks awaiting the watch's future (touched on the loop's thread only)
    _close_deferred = False  # close once the loop has stopped watching (it still uses the fd)
    _closing = False  # close() has begun: no loop may start watching the fd it is about to close

    def __init__(self, ptr, generator, prompt, codec, top_logprobs=None, prompt_top_logprobs=None):
        self._watch_lock = threading.Lock()
        self._handle = _Handle(ptr, _lib().pipe_generation_destroy, "generation", 0)
        self._generator = generator  # kept alive while the sequence may go on
        self.prompt = tuple(prompt)  # the prompt's token ids
        self._codec = codec
        self._stream = None if codec is None else _TextStream(codec)
        # pipe_generation_read is exclusive: this lock guards it and the state below. It is never
        # held while waiting.
        self._lock = threading.Lock()
        self._ids = []  # every token read from libpipe
        self._top_logprobs = top_logprobs  # None: no log-probabilities asked for
        self._logprobs = []  # a TokenLogprobs per token read, when asked (read with it: the C side goes at the end)
        self._prompt_top_logprobs = prompt_top_logprobs  # None: the prompt is not scored
        self._prompt_logprobs = None  # [None, TokenLogprobs per prompt position 1..], read with the first token
        self._next = 0  # tokens iteration has handed out (or fed to the text stream)
        self._flushed = False  # the text stream's tail was handed out
        self._ended = False  # the sequence finished and every token was read
        self._error = None
        self._info = None  # kept at the end
        self._fd = None

    # ---- reading (with self._lock held) ----

    def _pull_locked(self):
        """Reads every token libpipe has for this sequence, without waiting; at the end keeps the
        outcome and frees the C generation."""
        if self._ended:
            return
        lib = _lib()
        with self._handle.use() as h:  # raises if the generation was closed
            while True:
                ids, finished = lib.pipe_generation_read(h, _READ_CHUNK)
                if self._prompt_top_logprobs is not None and self._prompt_logprobs is None and (ids or finished):
                    # Every position is scored before the first token is published (or the end told).
                    scored = [None]
                    with contextlib.suppress(InvalidArgumentError):  # a generation that failed before the end
                        for position in range(1, len(self.prompt)):
                            logprob, top = lib.pipe_generation_prompt_logprobs(h, position, self._prompt_top_logprobs)
                            scored.append(TokenLogprobs(logprob, top))
                    self._prompt_logprobs = scored
                if self._top_logprobs is not None:
                    for index in range(len(self._ids), len(self._ids) + len(ids)):
                        logprob, top = lib.pipe_generation_logprobs(h, index, self._top_logprobs)
                        self._logprobs.append(TokenLogprobs(logprob, top))
                self._ids.extend(ids)
                if finished or len(ids) < _READ_CHUNK:
                    break
            if not finished:
                return
            error = None
            try:
                lib.pipe_generation_wait(h, 0)
            except Error as e:
                error = e
            info = lib.pipe_generation_get_info(h)
        self._error, self._info = error, _generation_info(info)
        self._ended = True
        self._finish()  # outside use(): closing waits for the handle's users

    def _finish(self):
        with self._watch_lock:
            # Unless an event loop still watches the descriptor: closing it first would leave the
            # loop a dead (or reused) number. The loop closes it once it has stopped watching.
            deferred = self._watch is not None
            self._close_deferred = self._close_deferred or deferred
        self._generator = None
        if not deferred:
            self._handle.close()

    def _next_locked(self):
        """The next token (or text piece) for iteration, None when there is none yet."""
        item = self._take_locked()
        if item is None and not self._ended:
            self._pull_locked()
            item = self._take_locked()
        if item is None and self._ended and self._stream is not None and not self._flushed:
            self._flushed = True
            item = self._stream.flush() or None
        return item

    def _take_locked(self):
        while self._next < len(self._ids):
            token = self._ids[self._next]
            self._next += 1
            if self._stream is None:
                return token
            piece = self._stream.add(token)
            if piece:
                return piece
        return None

    def _outcome_locked(self):
        """With the sequence ended: its error raised, or the whole output."""
        if self._error is not None:
            raise self._error
        return list(self._ids) if self._codec is None else self._codec.decode(self._ids)

    # ---- waiting without the GIL ----

    def _poll(self, seconds):
        """Waits until the descriptor is readable (tokens or the end) or `seconds` passed."""
        try:
            with self._handle.use() as h:
                if self._fd is None:
                    self._fd = _lib().pipe_generation_fd(h)
                poller = select.poll()
                poller.register(self._fd, select.POLLIN)
                poller.poll(max(0, min(seconds, _POLL_S)) * 1000)
        except InvalidArgumentError:
            if not self._ended:  # closed by close(), not freed at the end
                raise

    # ---- the synchronous API ----

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            with self._lock:
                item = self._next_locked()
                if item is not None:
                    return item
                if self._ended:
                    self._outcome_locked()  # raises the error, if any
                    raise StopIteration
            self._poll(_POLL_S)

    def wait(self, timeout=None):
        """The whole output once the sequence ended: the list of generated token ids, or with a
        tokenizer their text. timeout: seconds to wait (None: as long as it takes; 0: only
        check); WaitTimeoutError if it goes on then (it is not stopped). The sequence's error
        (CancelledError, DeadlineExceededError, ExecutionError, ...) is raised, again on every
        later wait; the tokens before it stay in `tokens`. Independent of iteration."""
        if timeout is not None and not timeout >= 0:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT, f"timeout must be >= 0 seconds or None, not {timeout!r}"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._pull_locked()
                if self._ended:
                    return self._outcome_locked()
            left = _POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(
                    Status.TIMEOUT, f"the generation is still running after {timeout:g} s; wait again, or cancel it"
                )
            self._poll(left)

    def done(self):
        """True once the sequence ended (whatever the reason) and every token is here. Never
        blocks."""
        with self._lock:
            with contextlib.suppress(InvalidArgumentError):
                self._pull_locked()
            return self._ended or self._handle.closed

    def cancel(self):
        """Stop the sequence: it ends with CancelledError (at once, or when its step in the
        pipeline returns) and frees its cache slot. One that ended is left as it is."""
        with contextlib.suppress(InvalidArgumentError):
            with self._handle.use() as h:
                _lib().pipe_generation_cancel(h)

    @property
    def tokens(self):
        """The token ids generated so far (all of them once it ended), read without waiting."""
        with self._lock:
            with contextlib.suppress(InvalidArgumentError):
                self._pull_locked()
            return list(self._ids)

    @property
    def logprobs(self):
        """A TokenLogprobs per token of `tokens` (read without waiting): its log-probability and the
        likeliest tokens at its position as (id, log-probability) pairs. InvalidArgumentError when
        generate() was not asked for them (logprobs=True)."""
        if self._top_logprobs is None:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT, "this generation keeps no log-probabilities (generate(logprobs=True))"
            )
        with self._lock:
            with contextlib.suppress(InvalidArgumentError):
                self._pull_locked()
            return list(self._logprobs)

    @property
    def prompt_logprobs(self):
        """The prompt's scores (generate(prompt_logprobs=True)): None for its first token, which
        nothing precedes, then a TokenLogprobs per prompt token: its log-probability given the
        tokens before it and the likeliest tokens there. None until the first token arrived (all
        are scored by then); a list cut short when the generation failed before its prompt was
        scored. InvalidArgumentError when generate() was not asked for them."""
        if self._prompt_top_logprobs is None:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT, "this generation did not score its prompt (generate(prompt_logprobs=True))"
            )
        with self._lock:
            with contextlib.suppress(InvalidArgumentError):
                self._pull_locked()
            return None if self._prompt_logprobs is None else list(self._prompt_logprobs)

    @property
    def text(self):
        """The tokenizer's text of `tokens` (InvalidArgumentError without a tokenizer)."""
        if self._codec is None:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT, "this generation has no tokenizer (generate(tokenizer=))"
            )
        return self._codec.decode(self.tokens)

    @property
    def info(self):
        """A GenerationInfo: finish reason, token counts and times so far."""
        if self._info is None:
            with contextlib.suppress(InvalidArgumentError):
                with self._handle.use() as h:
                    return _generation_info(_lib().pipe_generation_get_info(h))
            if self._info is None:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, "this generation is closed")
        return self._info

    @property
    def finish_reason(self):
        """None while the sequence is queued or generating, then "stop" (a stop id), "length"
        (max_new_tokens or max_len), "cancelled", "deadline" or "error" (a failed step)."""
        return self.info.finish_reason

    def fileno(self):
        """A file descriptor that is readable while unread tokens exist or once the sequence
        ended (level-triggered), for select, selectors, poll or an event loop; reading the tokens
        (iteration, tokens, wait) clears it. It belongs to the generation, which closes it when
        the sequence's end is read: stop watching it first. InvalidArgumentError once the
        generation is freed. Iteration and `async for` do all of this."""
        with self._handle.use() as h:
            if self._fd is None:
                self._fd = _lib().pipe_generation_fd(h)
            return self._fd

    # ---- asyncio ----

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            with self._lock:
                item = self._next_locked()
                if item is not None:
                    return item
                if self._ended:
                    self._outcome_locked()
                    raise StopAsyncIteration
            await self._readable()

    def __await__(self):
        """`await generation`: what wait() gives, without blocking the event loop."""
        return self._wait_async().__await__()

    async def _wait_async(self):
        while True:
            with self._lock:
                self._pull_locked()
                if self._ended:
                    return self._outcome_locked()
            await self._readable()

    async def _readable(self):
        """Until the descriptor is readable, with the event loop watching it. Cancelling the
        awaiting task cancels the sequence, as cancelling an awaited asyncio future would."""
        future = self._watched(asyncio.get_running_loop())
        if future is None:
            return
        self._awaiters += 1
        try:
            # Shielded: a cancelled awaiter leaves the future to the others.
            await asyncio.shield(future)
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            self._awaiters -= 1
            if self._awaiters == 0:
                self._unwatch(future, finished=False)

    def _watched(self, loop):
        """The future of `loop` that is resolved when the descriptor is readable (shared by the
        loop's awaiters); None once the sequence ended."""
        with self._watch_lock:
            if self._ended:
                return None
            if self._closing:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, "this generation is closed")
            if self._watch is not None:
                watcher, _, future = self._watch
                if watcher is not loop:
                    raise InvalidArgumentError(
                        Status.INVALID_ARGUMENT, "this generation is already awaited on another event loop"
                    )
                return future
            fd = self.fileno()  # raises if the generation was closed
            future = loop.create_future()
            # Level-triggered: tokens that came before this line wake the loop at once.
            loop.add_reader(fd, self._unwatch, future, True)
            self._watch = (loop, fd, future)
            return future

    def _unwatch(self, future, finished):
        """On the watching loop's thread: stop watching for `future` (nothing if it is no longer
        the watch), resolve it if the descriptor became readable, and close the generation if
        that was put off while the loop watched."""
        with self._watch_lock:
            if self._watch is None or self._watch[2] is not future:
                return
            loop, fd, _ = self._watch
            self._watch = None
            loop.remove_reader(fd)  # before anyone may close fd: under the lock _finish takes
            close = self._close_deferred
        if finished and not future.done():
            future.set_result(None)
        if close:
            self._handle.close()
            self._generator = None

    def close(self):
        if self._handle is not None and not self._handle.closed:
            self.cancel()
        with self._watch_lock:
            if self._watch is not None:
                # An event loop watches the descriptor: the cancelled sequence ends, its
                # descriptor becomes readable, and the loop closes the generation when it wakes.
                self._close_deferred = True
                return
            # Decided under the lock: a loop that comes after this finds the generation closed
            # instead of watching a descriptor that the close below frees.
            self._closing = True
        super().close()
        self._generator = None

    def __repr__(self):
        state = "ended" if self._ended else ("closed" if self.closed else "running")
        return f"<libpipe.Generation {state} prompt={len(self.prompt)} tokens, {len(self._ids)} generated>"


def _generation_info(d):
    """pipe_generation_info's dict as a GenerationInfo (the finish reason named, -1 times None)."""
    return GenerationInfo(
        finish_reason=_FINISH.get(d["finish_reason"], d["finish_reason"]),
        prompt_tokens=d["prompt_tokens"],
        generated_tokens=d["generated_tokens"],
        **{k: (None if d[k] < 0 else d[k]) for k in ("queued_ms", "time_to_first_token_ms", "mean_inter_token_ms")},
        cached_tokens=d["cached_tokens"],
    )
