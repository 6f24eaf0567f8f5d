"""Generation (libpipe.Generator, Generation): greedy tokens against transformers' generate on the
same weights (tiny_decoder.expected.json), sampling, stop ids, the generator's facts and errors.
On the gated decoder (a prompt whose first token is 119 + key is held in stage 1 until the test
opens gate `key`): cancelling, deadlines, a full queue and a failing step, each brought about by
the test before it looks at the one outcome it expects. No verdict depends on how long anything
takes."""

import json
import select
import threading
import time

import numpy as np
import pytest
from conftest import (
    DECODER_SPLIT,
    GATED_FIRST_ID,
    WAIT_LIMIT_S,
    gated_generator,
    inside,
    read_trace,
    timed_linear_shapes,
    wait_until,
)

import libpipe
from libpipe import Status


def cases(expected):
    return list(zip(expected["prompts"], expected["greedy"]))


def first_case(expected):
    return expected["prompts"][0], expected["greedy"][0], expected["max_new_tokens"]


# ---- the generator ---------------------------------------------------------------------------------


def test_info_describes_the_decoder(tiny_generator, decoder_path):
    torch = pytest.importorskip("torch")
    # The reference: the caches and the embedding as the TorchScript file holds them.
    module = torch.jit.load(str(decoder_path))
    caches = [b for n, b in module.named_buffers() if n.endswith(("k_cache", "v_cache"))]
    assert caches, "the decoder has no KV caches"
    slots, _, max_len, _ = caches[0].shape
    per_slot = sum(b[0].numel() * b.element_size() for b in caches)
    vocab = dict(module.named_parameters())["model.embed_tokens.weight"].shape[0]
    info = tiny_generator.info
    assert info == libpipe.GeneratorInfo(slots, max_len, vocab, per_slot)
    assert (info.slots, info.max_len, info.vocab) == (4, 64, 128)  # what decoder_models.py makes


def test_greedy_tokens_equal_transformers(tiny_generator, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    for prompt, want in cases(decoder_expected):
        generation = tiny_generator.generate(prompt, max_new_tokens=n)
        assert generation.prompt == tuple(prompt)
        assert list(generation) == want
        assert generation.done()
        assert generation.tokens == want and generation.wait() == want
        info = generation.info
        assert info.finish_reason == generation.finish_reason == "length"
        assert (info.prompt_tokens, info.generated_tokens) == (len(prompt), n)
        assert info.queued_ms >= 0 and info.time_to_first_token_ms >= 0
        assert n < 2 or info.mean_inter_token_ms >= 0


def test_a_prompt_seen_before_starts_from_its_cached_tokens(tiny_generator, decoder_expected):
    # The second time, the slot the first left holds all of the prompt but its last token (computed for its
    # logits): the same tokens come, from fewer prompt tokens computed.
    n = decoder_expected["max_new_tokens"]
    prompt, want = cases(decoder_expected)[1]
    assert list(tiny_generator.generate(prompt, max_new_tokens=n)) == want
    before = tiny_generator.stats()
    again = tiny_generator.generate(prompt, max_new_tokens=n)
    assert list(again) == want
    assert again.info.cached_tokens == len(prompt) - 1
    after = tiny_generator.stats()
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == len(prompt) - 1
    assert after["prompt_tokens"] - before["prompt_tokens"] == 1


def test_logprobs_equal_the_log_softmax_of_transformers_logits(tiny_generator, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    for (prompt, want), ref in zip(cases(decoder_expected), decoder_expected["greedy_logprobs"]):
        generation = tiny_generator.generate(prompt, max_new_tokens=n, logprobs=True, top_logprobs=5)
        assert list(generation) == want
        got = generation.logprobs
        assert len(got) == len(want)
        for t, lp in enumerate(got):
            assert lp.logprob == pytest.approx(ref["logprob"][t], abs=1e-4)
            assert [x for _, x in lp.top] == pytest.approx(ref["top_logprobs"][t], abs=1e-4)
            assert lp.top[0][0] == want[t]  # greedy: the likeliest
    plain = tiny_generator.generate(cases(decoder_expected)[0][0], max_new_tokens=1)
    plain.wait()
    with pytest.raises(libpipe.InvalidArgumentError, match="logprobs=True"):
        plain.logprobs
    with pytest.raises(libpipe.InvalidArgumentError, match="top_logprobs"):
        tiny_generator.generate(cases(decoder_expected)[0][0], logprobs=True, top_logprobs=21)


def test_prompt_logprobs_equal_the_log_softmax_of_transformers_logits(tiny_generator, decoder_expected):
    # Each prompt token scored given those before it (echo, perplexity), several prompts at once so that their
    # one-token rows share steps with each other and with a plain prompt's chunk; the tokens that follow stay greedy.
    n = decoder_expected["max_new_tokens"]
    scored = [
        tiny_generator.generate(prompt, max_new_tokens=n, prompt_logprobs=True, top_logprobs=5)
        for prompt, _ in cases(decoder_expected)
    ]
    plain_prompt, plain_want = cases(decoder_expected)[0]
    plain = tiny_generator.generate(plain_prompt, max_new_tokens=n)
    assert plain.wait() == plain_want
    for generation, (prompt, want), ref in zip(scored, cases(decoder_expected), decoder_expected["prompt_logprobs"]):
        assert generation.wait() == want
        assert generation.info.cached_tokens == 0
        got = generation.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for position, lp in enumerate(got[1:], start=1):
            assert lp.logprob == pytest.approx(ref["logprob"][position - 1], abs=1e-4)
            assert [x for _, x in lp.top] == pytest.approx(ref["top_logprobs"][position - 1], abs=1e-4)
    with pytest.raises(libpipe.InvalidArgumentError, match="prompt_logprobs=True"):
        plain.prompt_logprobs


def test_prompts_as_numpy_and_torch_integers(tiny_generator, decoder_expected):
    torch = pytest.importorskip("torch")
    prompt, want, n = first_case(decoder_expected)
    assert tiny_generator.generate(np.array(prompt, dtype=np.int64), max_new_tokens=n).wait() == want
    assert tiny_generator.generate(torch.tensor(prompt), max_new_tokens=n).wait() == want


def test_many_sequences_at_once(tiny_generator, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    slots = tiny_generator.info.slots
    # More sequences than cache slots (the rest wait in the queue, within its default bound of 4 x
    # slots): they join and leave the batch as slots free up.
    work = cases(decoder_expected) * max(1, 2 * slots // len(decoder_expected["prompts"]))
    assert len(work) <= 5 * slots
    before = tiny_generator.stats()
    generations = [tiny_generator.generate(p, max_new_tokens=n) for p, _ in work]
    assert [g.wait(WAIT_LIMIT_S) for g in generations] == [want for _, want in work]
    after = tiny_generator.stats()
    assert after["sequences_finished"] - before["sequences_finished"] == len(work)
    assert after["generated_tokens"] - before["generated_tokens"] == n * len(work)
    # Each prompt token is computed, or found in a slot that an earlier sequence of the same prompt left.
    computed = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    assert computed + cached == sum(len(p) for p, _ in work)
    assert computed >= len(work)  # the last token of each, at least
    assert after["steps"] > before["steps"]
    assert (after["slots_in_use"], after["queued"]) == (0, 0)
    assert after["tokens_per_s"] > 0 and after["mean_rows_per_step"] >= 1
    assert after["steps_in_flight"] >= 1
    assert after["steps_one_at_a_time"] + after["steps_pipelined"] == after["steps"]


def test_max_new_tokens_and_stop_ids(tiny_generator, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    shorter = tiny_generator.generate(prompt, max_new_tokens=3)
    assert shorter.wait() == want[:3] and shorter.finish_reason == "length"
    # The last position before the end whose token did not come before: the sequence stops there,
    # with it, and an id it never generates changes nothing.
    assert n >= 2
    k = max(i for i in range(n - 1) if want[i] not in want[:i])
    never = next(i for i in range(128) if i not in want)
    stopped = tiny_generator.generate(prompt, max_new_tokens=n, stop_ids=[never, want[k]])
    assert stopped.wait() == want[: k + 1]
    assert stopped.finish_reason == "stop"


def test_a_sequence_ends_when_its_cache_is_full(tiny_generator, decoder_expected):
    # Every token a cache of max_len positions has room for, as transformers generates them.
    prompt, want = decoder_expected["max_len_prompt"], decoder_expected["max_len_greedy"]
    generation = tiny_generator.generate(prompt, max_new_tokens=tiny_generator.info.max_len)
    assert generation.wait() == want and generation.finish_reason == "length"


def test_sampling_is_reproducible_with_a_seed(tiny_generator, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    sampled = dict(max_new_tokens=n, temperature=1.0, top_p=0.95, seed=1234)
    first = tiny_generator.generate(prompt, **sampled).wait()
    assert tiny_generator.generate(prompt, **sampled).wait() == first
    by_seed = {
        tuple(tiny_generator.generate(prompt, max_new_tokens=n, temperature=1.5, seed=s).wait()) for s in range(4)
    }
    assert len(by_seed) > 1, "four seeds gave the same sampled tokens"
    # top_k = 1 leaves only the most likely token, whatever the seed and temperature: greedy.
    assert tiny_generator.generate(prompt, max_new_tokens=n, temperature=0.7, top_k=1, seed=99).wait() == want


def test_bad_prompts_and_options(tiny_generator, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    info = tiny_generator.info
    before = tiny_generator.stats()
    bad_prompts = {
        "empty": [],
        "id == vocab": [1, info.vocab],
        "negative id": [-1, 2],
        "no room for a token": [1] * info.max_len,
        "text without a tokenizer": "hello",
        "a float id": [1, 2.5],
        "not a sequence": 7,
    }
    for what, bad in bad_prompts.items():
        with pytest.raises(libpipe.InvalidArgumentError) as e:
            tiny_generator.generate(bad)
        assert e.value.status is Status.INVALID_ARGUMENT and e.value.message, what
    bad_options = [
        dict(max_new_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(seed=-1),
        dict(timeout=0),
        dict(stop_ids=[1.5]),
        dict(max_new_tokens="many"),
    ]
    for options in bad_options:
        with pytest.raises(libpipe.InvalidArgumentError) as e:
            tiny_generator.generate(prompt, **options)
        assert e.value.status is Status.INVALID_ARGUMENT and e.value.message, options
    # Nothing was started, and the generator goes on.
    after = tiny_generator.stats()
    assert after["sequences_finished"] == before["sequences_finished"]
    assert tiny_generator.generate(prompt, max_new_tokens=n).wait() == want


def test_generator_from_a_path_a_model_or_a_plan(decoder_path, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    with libpipe.Model.load(decoder_path) as model:
        with libpipe.Generator(model, split_at=DECODER_SPLIT, max_queued=2) as generator:
            assert generator.session.num_stages == 2
            assert generator.generate(prompt, max_new_tokens=n).wait() == want
        with model.split(split_at=DECODER_SPLIT) as plan:
            with plan.generator(prefill_chunk=2, steps_in_flight=1, max_rows_per_step=1) as generator:
                # Prompts prefilled 2 tokens at a time, one step and one row at a time: the same tokens.
                assert generator.generate(prompt, max_new_tokens=n).wait() == want
            with pytest.raises(libpipe.InvalidArgumentError, match="already cut"):
                libpipe.Generator(plan, split_at=DECODER_SPLIT)
    with libpipe.Generator(decoder_path) as generator:  # no markers: one stage
        assert generator.session.num_stages == 1
        assert generator.generate(prompt, max_new_tokens=n).wait() == want
    assert generator.closed
    with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
        generator.generate(prompt)
    with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
        generator.session.stats()


def test_a_model_that_is_not_a_decoder(demo_path):
    with pytest.raises(libpipe.InvalidArgumentError) as e:
        libpipe.Generator(demo_path)
    assert e.value.status is Status.INVALID_ARGUMENT and e.value.message
    with pytest.raises(libpipe.InvalidArgumentError, match="max_queued"):
        libpipe.Generator(demo_path, max_queued=1.5)


def test_the_borrowed_session(tiny_generator, decoder_expected, tmp_path):
    prompt, want, n = first_case(decoder_expected)
    session = tiny_generator.session
    assert session is tiny_generator.session and session.num_stages == 2
    assert session.check() is None
    before = [s["microbatches"] for s in session.stats()]
    session.trace_start()
    assert tiny_generator.generate(prompt, max_new_tokens=n).wait() == want
    session.trace_stop(tmp_path / "trace.json")
    after = [s["microbatches"] for s in session.stats()]
    # Every token of the sequence came from a step that ran in both stages.
    assert all(a - b >= n for a, b in zip(after, before)), (before, after)
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    with pytest.raises(libpipe.UnsupportedError):
        session.run(np.zeros((1, 1), dtype=np.int64))
    with pytest.raises(libpipe.UnsupportedError):
        session.submit(np.zeros((1, 1), dtype=np.int64))
    session.close()  # borrowed: closing it does nothing
    assert not session.closed
    assert tiny_generator.generate(prompt, max_new_tokens=n).wait() == want


def test_a_trace_with_operators_holds_the_engines_steps(decoder_path, decoder_expected, tmp_path):
    """trace_start(operators=True) on a generator's session: the engine's track holds one "launch
    step" slice per step, whose tokens are every token the sequences fed in (each prompt, then each
    generated token but the last), and each stage one slice per launched step, with the tiny
    decoder's linear layers (decoder_models.py: hidden 64, 4 query and 2 key-value heads of 16, MLP
    128, vocabulary 128). A generator of its own, so that no other test's step is in the trace."""
    prompts, greedy, n = decoder_expected["prompts"], decoder_expected["greedy"], decoder_expected["max_new_tokens"]
    with libpipe.Generator(decoder_path, split_at=DECODER_SPLIT) as generator:
        generator.session.trace_start(operators=True)
        generations = [generator.generate(p, max_new_tokens=n) for p in prompts]  # at once: their steps batch
        outputs = [g.wait() for g in generations]
        generator.session.trace_stop(tmp_path / "trace.json")
    assert outputs == greedy
    tracks = read_trace(tmp_path / "trace.json")
    launches = [e for e in tracks["engine"] if e["name"].startswith("launch step ")]
    assert launches
    assert sum(e["args"]["tokens"] for e in launches) == sum(map(len, prompts)) + sum(len(o) - 1 for o in outputs)
    # q and o, k and v, gate and up, down; stage 1's LM head is 128x64 like gate and up.
    layer = {"64x64", "32x64", "128x64", "64x128"}
    for stage in ("stage 0", "stage 1"):
        assert sorted(e["args"]["request"] for e in tracks[stage]) == sorted(e["args"]["request"] for e in launches)
        assert timed_linear_shapes(stage, tracks[stage]) == layer


def test_dropping_a_generation_mid_way_frees_it(tiny_generator, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    for token in tiny_generator.generate(prompt, max_new_tokens=n):
        assert token == want[0]
        break  # the generation is dropped: cancelled if it goes on, and freed
    wait_until(lambda: tiny_generator.stats()["slots_in_use"] == 0, "the slot back")
    assert tiny_generator.generate(prompt, max_new_tokens=n).wait() == want


# ---- held sequences (the gated decoder) -------------------------------------------------------------


def test_cancel_a_held_sequence(gated_decoder_plan, decoder_gate, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        key = decoder_gate.new_key()
        generation = generator.generate(decoder_gate.prompt(key), max_new_tokens=n)
        outcome = []

        def iterate():
            try:
                outcome.append(list(generation))
            except libpipe.Error as e:
                outcome.append(e)

        reader = threading.Thread(target=iterate)
        reader.start()
        decoder_gate.wait(key)
        wait_until(lambda: inside(reader, libpipe.Generation.__next__), "iterating")
        assert generation.finish_reason is None and not generation.done()
        generation.cancel()
        decoder_gate.open(key)
        reader.join(WAIT_LIMIT_S)
        assert not reader.is_alive()
        # The gate was shut when the sequence was cancelled: its one step's token is dropped.
        assert len(outcome) == 1 and isinstance(outcome[0], libpipe.CancelledError), outcome
        assert outcome[0].status is Status.CANCELLED
        assert generation.tokens == [] and generation.finish_reason == "cancelled"
        with pytest.raises(libpipe.CancelledError):
            generation.wait()  # the outcome stays
        # The slot came back and the generator goes on.
        assert generator.generate(prompt, max_new_tokens=n).wait(WAIT_LIMIT_S) == want
        wait_until(lambda: generator.stats()["slots_in_use"] == 0, "every slot free")


def test_closing_a_held_generation_cancels_it(gated_decoder_plan, decoder_gate, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        key = decoder_gate.new_key()
        with generator.generate(decoder_gate.prompt(key), max_new_tokens=n) as generation:
            decoder_gate.wait(key)
        assert generation.closed
        with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
            generation.wait()
        decoder_gate.open(key)
        wait_until(
            lambda: generator.stats()["sequences_finished"] == 1 and generator.stats()["slots_in_use"] == 0,
            "the closed generation's slot back",
        )
        assert generator.generate(prompt, max_new_tokens=n).wait(WAIT_LIMIT_S) == want


def test_deadline_of_a_held_sequence(gated_decoder_plan, decoder_gate, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        key = decoder_gate.new_key()
        generation = generator.generate(decoder_gate.prompt(key), max_new_tokens=n, timeout=0.2)
        submitted = time.monotonic()
        decoder_gate.wait(key)
        # libpipe's deadline (from its submit, before `submitted`) has passed, with the gate shut.
        wait_until(lambda: time.monotonic() > submitted + 0.2, "past the deadline")
        decoder_gate.open(key)
        with pytest.raises(libpipe.DeadlineExceededError) as e:
            generation.wait(WAIT_LIMIT_S)
        assert e.value.status is Status.DEADLINE_EXCEEDED
        assert generation.finish_reason == "deadline" and generation.tokens == []
        assert generator.generate(prompt, max_new_tokens=n).wait(WAIT_LIMIT_S) == want


def test_a_full_queue_is_busy(gated_decoder_plan, decoder_gate, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    work = cases(decoder_expected)
    with gated_generator(gated_decoder_plan, decoder_gate, max_queued=1) as generator:
        slots = generator.info.slots
        key = decoder_gate.new_key()
        held = generator.generate(decoder_gate.prompt(key), max_new_tokens=n)
        decoder_gate.wait(key)
        # Every step after the held one waits behind it in stage 1, so no sequence can end: the
        # slots fill up, one at a time (each admitted before the next comes, so that none of them
        # is refused while it waits for the scheduler to give it its slot).
        running = []
        for i in range(slots - 1):
            running.append((generator.generate(work[i % len(work)][0], max_new_tokens=n), work[i % len(work)][1]))
            wait_until(lambda: generator.stats()["slots_in_use"] == i + 2, f"{i + 2} slots taken")
        queued = generator.generate(work[0][0], max_new_tokens=n)
        wait_until(lambda: generator.stats()["queued"] == 1, "one sequence queued")
        with pytest.raises(libpipe.BusyError) as e:
            generator.generate(work[0][0], max_new_tokens=n)
        assert e.value.status is Status.BUSY and isinstance(e.value, libpipe.Error)
        assert generator.stats()["queued"] == 1  # the refused one was not started
        decoder_gate.open(key)
        assert len(held.wait(WAIT_LIMIT_S)) == n
        for generation, want in running:
            assert generation.wait(WAIT_LIMIT_S) == want
        assert queued.wait(WAIT_LIMIT_S) == work[0][1]
        # Room again.
        assert generator.generate(work[0][0], max_new_tokens=n).wait(WAIT_LIMIT_S) == work[0][1]


def test_a_failing_step_fails_its_sequence_only(gated_decoder_plan, decoder_gate, decoder_expected):
    prompt, want, n = first_case(decoder_expected)
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        # A prompt starting with 119 makes the decoder raise in its prefill step.
        failing = generator.generate([GATED_FIRST_ID, 5, 6], max_new_tokens=n)
        with pytest.raises(libpipe.ExecutionError) as e:
            list(failing)
        assert e.value.status is Status.EXECUTION and e.value.message
        assert failing.finish_reason == "error" and failing.tokens == []
        assert generator.generate(prompt, max_new_tokens=n).wait(WAIT_LIMIT_S) == want
        assert generator.session.check() is None


def test_closing_the_generator_cancels_its_generations(gated_decoder_plan, decoder_gate, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    work = cases(decoder_expected)
    generator = gated_decoder_plan.generator()
    try:
        slots = generator.info.slots
        key = decoder_gate.new_key()
        generations = [generator.generate(decoder_gate.prompt(key), max_new_tokens=n)]
        decoder_gate.wait(key)
        for i in range(slots - 1):
            generations.append(generator.generate(work[i % len(work)][0], max_new_tokens=n))
            wait_until(lambda: generator.stats()["slots_in_use"] == i + 2, f"{i + 2} slots taken")
        # One more waits for a slot: closing cancels it at once (it is in no step), which the test
        # sees; the others are in steps held behind the gate.
        queued = generator.generate(work[0][0], max_new_tokens=n)
        closer = threading.Thread(target=generator.close)
        closer.start()
        wait_until(queued.done, "the queued sequence cancelled")
        decoder_gate.open(key)
        closer.join(WAIT_LIMIT_S)
        assert not closer.is_alive() and generator.closed
        for generation in [*generations, queued]:
            with pytest.raises(libpipe.CancelledError):
                generation.wait(WAIT_LIMIT_S)
            assert generation.finish_reason == "cancelled"
        with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
            generator.generate(work[0][0])
    finally:
        decoder_gate.open_all()
        generator.close()


def test_fileno_says_when_tokens_came(gated_decoder_plan, decoder_gate, decoder_expected):
    n = decoder_expected["max_new_tokens"]
    with gated_generator(gated_decoder_plan, decoder_gate) as generator:
        key = decoder_gate.new_key()
        generation = generator.generate(decoder_gate.prompt(key), max_new_tokens=n)
        fd = generation.fileno()
        assert generation.fileno() == fd  # one descriptor per generation
        decoder_gate.wait(key)
        assert select.select([fd], [], [], 0)[0] == []  # held: no token yet
        decoder_gate.open(key)
        assert select.select([fd], [], [], WAIT_LIMIT_S)[0] == [fd]
        assert len(generation.wait(WAIT_LIMIT_S)) == n
        with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
            generation.fileno()  # its end was read: the generation and its descriptor are freed
        assert generation.info.generated_tokens == n  # what it gave stays
