"""The libpipe runtime from Python: Model -> Plan -> Session -> run / submit.

    import libpipe, numpy as np
    with libpipe.Model.load("model.pt") as model:
        plan = model.split(split_at=["blocks.2:begin"])        # or split(), split(stages=2, policy="params")
        with plan.session(microbatches=4) as session:          # microbatching="adaptive" (default) | "fixed"
            out = session.run(x)                               # {"output": array}, x numpy or torch

Tensors cross through DLPack without copies: inputs (numpy arrays, torch tensors, anything with
__dlpack__) are borrowed for the call; outputs come back in the flavour of the inputs (torch in,
torch out; otherwise numpy) and own the memory libpipe produced.

Every call that can block (load, split, session creation, run, wait) releases the GIL, so other
Python threads keep running, and one Session may be used from many threads at once.

asyncio (libpipe >= 0.7): `await session.run_async(x)` gives what run(x) gives, and a Request is
awaitable. The event loop watches the request's file descriptor (Request.fileno()), so no thread
is created or parked per call; cancelling the awaiting task cancels the call.

    async def main(session, xs):
        outs = await asyncio.gather(*(session.run_async(x, timeout=5.0) for x in xs))

Stages may also run in other processes (libpipe >= 0.4): the driver creates the session with
`plan.session(transport="tcp", world_size=2, store="HOST:PORT")` and hosts the rendezvous store
there; each other process calls `libpipe.run_worker(rank, 2, "HOST:PORT")`, which serves its
stages until the driver closes the session. A worker that dies or stops answering fails the
calls with CommunicationError, and the session stays broken (`session.check()` raises it).

The native module is imported on first use, so `import libpipe` (for pipe_split and the export
helpers) works where it was never built.
"""

import asyncio
import atexit
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
import weakref
from collections import namedtuple

from ._header import constants as _constants
from .errors import Error, InputError, InvalidArgumentError, Status, WaitTimeoutError

__all__ = [
    "DLPackTensor",
    "Model",
    "ModuleInfo",
    "Plan",
    "Request",
    "Session",
    "load_safetensors",
    "run_worker",
    "set_log_level",
    "version",
    "LOG_DEBUG",
    "LOG_INFO",
    "LOG_WARNING",
    "LOG_ERROR",
    "MICROBATCHING_MODES",
    "MODEL_FORMATS",
    "OUTPUT_PLACEMENTS",
    "TRANSPORTS",
]

# The tables below come from pipe.h (libpipe._header); only the Python spelling is chosen here.
LOG_DEBUG, LOG_INFO, LOG_WARNING, LOG_ERROR = (_constants.LOG[n] for n in ("DEBUG", "INFO", "WARNING", "ERROR"))

# PIPE_CHUNK_*, by lower-case name; which of them suit inputs and which outputs is pipe.h's prose.
_CHUNK_KINDS = {name.lower(): value for name, value in _constants.CHUNK.items()}
_INPUT_KINDS = ("default", "split", "replicate")
_OUTPUT_KINDS = ("default", "concat", "sum", "equal")
# PIPE_DTYPE_*, by lower-case name; None keeps the dtypes as PIPE_DTYPE_KEEP does.
_DTYPES = {None: _constants.DTYPE["KEEP"], **{name.lower(): value for name, value in _constants.DTYPE.items()}}
_OUTPUT_TYPES = (None, "numpy", "torch", "dlpack")
# Session(microbatching=...): how calls are cut, pipe.h's PIPE_MICROBATCHING_* by lower-case name.
MICROBATCHING_MODES = tuple(name.lower() for name in _constants.MICROBATCHING)
# Session(transport=...): how stages talk, pipe.h's PIPE_TRANSPORT_* by lower-case name. "local":
# every stage in this process; "tcp": CPU stages spread over processes (libpipe's authenticated
# connections; "gloo", its name before 0.12, is taken too); "nccl": GPU stages spread over
# processes, one GPU each.
TRANSPORTS = tuple(name.lower() for name in _constants.TRANSPORT)
_TRANSPORT_ALIASES = {"gloo": "tcp"}
# Session(outputs=...): where results come back, pipe.h's PIPE_OUTPUTS_ON_* by the word after ON_.
# "cpu": CPU memory; "device": the last stage's device (a GPU).
OUTPUT_PLACEMENTS = {name.lower().removeprefix("on_"): name for name in _constants.OUTPUTS}
# Model.format: what a model file was, pipe.h's PIPE_MODEL_* by lower-case name. "torchscript": a
# TorchScript archive (its stages save as .pt); "exported": a torch.export program (stages as .pt2).
_MODEL_FORMATS = {value: name.lower() for name, value in _constants.MODEL.items()}
MODEL_FORMATS = tuple(_MODEL_FORMATS.values())
_NAMES_PARAMETERS, _NAMES_BUFFERS = _constants.NAMES["PARAMETERS"], _constants.NAMES["BUFFERS"]
# The defaults of Plan.session and run_worker: PIPE_SESSION_OPTIONS_INIT's and PIPE_WORKER_OPTIONS_INIT's.
_SESSION_DEFAULTS = _constants.DEFAULTS["pipe_session_options"]
_WORKER_DEFAULTS = _constants.DEFAULTS["pipe_worker_options"]


def _name_of(table, value):
    """The name of the member of a PIPE_<GROUP>_* table with this value ("ADAPTIVE", "ON_CPU")."""
    return next(name for name, v in table.items() if v == value)


_INT32_MAX = 2**31 - 1
# DLPack type codes numpy holds: int, uint, float, complex, bool (not bfloat16, code 4).
_NUMPY_DLPACK_CODES = (0, 1, 2, 5, 6)
_DLPACK_CPU = 1  # kDLCPU

_native = None


def _lib():
    """The SWIG module, imported on first use."""
    global _native
    if _native is None:
        try:
            from . import _native as module
        except ImportError as e:
            raise ImportError(
                "libpipe's native module (libpipe._native) is not available: install the package "
                "with `pip install bindings/python` while pkg-config finds libpipe "
                "(PKG_CONFIG_PATH=<prefix>/lib/pkgconfig). Only pipe_split, save_skeleton and "
                f"save_checkpoint work without it. ({e})"
            ) from e
        _native = module
    return _native


def version():
    """The loaded libpipe's version, "MAJOR.MINOR.PATCH"."""
    return _lib().pipe_version()


def set_log_level(level):
    """Drop libpipe's log messages below `level` (LOG_DEBUG .. LOG_ERROR); they go to stderr."""
    _lib().pipe_set_log_callback(None, None, int(level))


# ---- handles --------------------------------------------------------------------------------

_live = weakref.WeakSet()


class _Handle:
    """An owned C handle. Any number of calls may use it at once (`use()`); close() stops new
    uses, waits for the running ones, then destroys it exactly once. This is what makes closing a
    session while other threads run on it safe: the C ABI forbids destroying it under them."""

    __slots__ = ("_ptr", "_destroy", "_cond", "_users", "_what", "_rank", "__weakref__")

    def __init__(self, ptr, destroy, what, rank):
        self._ptr = ptr
        self._destroy = destroy
        self._cond = threading.Condition(threading.Lock())
        self._users = 0
        self._what = what
        self._rank = rank  # the order of destruction at exit: requests, sessions, plans, models
        _live.add(self)

    @contextlib.contextmanager
    def use(self):
        with self._cond:
            if self._ptr is None:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"this {self._what} is closed")
            self._users += 1
            ptr = self._ptr
        try:
            yield ptr
        finally:
            with self._cond:
                self._users -= 1
                if self._users == 0:
                    self._cond.notify_all()

    @property
    def closed(self):
        return self._ptr is None

    def close(self, block=True):
        with self._cond:
            if self._ptr is None:
                return
            if not block and self._users:
                return
            ptr, self._ptr = self._ptr, None
            self._cond.wait_for(lambda: self._users == 0)
        self._destroy(ptr)


@atexit.register
def _close_all():
    # Stop worker threads while the interpreter is still whole. Handles a daemon thread is still
    # using are left alone rather than waited for.
    for handle in sorted(list(_live), key=lambda h: h._rank):
        try:
            handle.close(block=False)
        except Exception:
            pass


class _Closeable:
    _handle = None

    def close(self):
        """Free the handle (waits for calls still running on it). Further use raises."""
        if self._handle is not None:
            self._handle.close()

    @property
    def closed(self):
        return self._handle is None or self._handle.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ---- tensors --------------------------------------------------------------------------------


def _is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _export(x, what):
    """A "dltensor" capsule over x's memory (no copy), which libpipe borrows for the call. The
    capsule keeps x's memory alive until it is collected."""
    if isinstance(x, DLPackTensor):
        return x.__dlpack__()
    if _is_torch(x):
        t = x.detach() if x.requires_grad else x  # a view: DLPack refuses tensors needing grad
        try:
            return t.__dlpack__()
        except (BufferError, RuntimeError) as e:
            # Lazily conjugated / negated views cannot be exported as they are.
            try:
                return t.resolve_conj().resolve_neg().__dlpack__()
            except Exception:
                raise InputError(Status.INPUT, f"{what}: the tensor cannot be passed as DLPack: {e}") from e
    import numpy as np

    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        return x.__dlpack__()
    try:
        a = np.asarray(x)  # numbers and lists become arrays; an ndarray stays itself
        if a.flags.writeable and a.dtype.isnative:
            return a.__dlpack__()
        # Read-only or byte-swapped arrays cannot be exported as they are (legacy DLPack has no
        # read-only flag): these, and only these, are copied.
        return np.array(a, dtype=a.dtype.newbyteorder("="), copy=True).__dlpack__()
    except (BufferError, TypeError, ValueError) as e:
        raise InputError(
            Status.INPUT, f"{what}: a {type(x).__name__} cannot be passed to libpipe as a tensor: {e}"
        ) from e


class DLPackTensor:
    """One tensor libpipe produced, not yet handed to an array library. `torch.from_dlpack(t)` or
    `numpy.from_dlpack(t)` adopt its memory without a copy (once: the consumer then owns it).
    Dropped unconsumed, it frees the memory itself."""

    __slots__ = ("_capsule", "device", "data_ptr", "shape", "strides", "dtype")

    def __init__(self, capsule):
        info = _lib().libpipe_dlpack_info(capsule)
        self._capsule = capsule
        self.device = (info["device_type"], info["device_id"])
        self.data_ptr = info["data"]  # the first element's address
        self.shape = info["shape"]
        self.strides = info["strides"]  # in elements; None when compact row-major
        self.dtype = info["dtype"]  # DLPack (code, bits, lanes)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("libpipe hands its outputs over without copying (copy=True was asked)")
        if dl_device is not None and tuple(dl_device) != self.device:
            raise BufferError(f"the tensor is on DLPack device {self.device}, not {tuple(dl_device)}")
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this tensor was already handed over by __dlpack__")
        if max_version is not None and tuple(max_version) >= (1, 0):
            # A DLPack 1.x consumer: the versioned capsule, which numpy imports as writable.
            return _lib().libpipe_dlpack_versioned(capsule)
        return capsule

    def __dlpack_device__(self):
        return self.device

    def __repr__(self):
        state = "consumed" if self._capsule is None else f"data=0x{self.data_ptr:x}"
        return f"DLPackTensor(shape={self.shape}, dtype={self.dtype}, device={self.device}, {state})"


def _convert(entries, output_type):
    """[(name, capsule)] -> {name: array} in the requested flavour."""
    out = {}
    for name, capsule in entries:
        t = DLPackTensor(capsule)
        if output_type == "dlpack":
            out[name] = t
        elif output_type == "torch":
            import torch

            out[name] = torch.from_dlpack(t)
        else:
            import numpy as np

            code, bits, lanes = t.dtype
            if code in _NUMPY_DLPACK_CODES and lanes == 1 and t.device[0] == _DLPACK_CPU:
                out[name] = np.from_dlpack(t)
            else:
                # A dtype numpy cannot hold (bfloat16), or GPU memory: torch.from_dlpack takes it.
                out[name] = t
    return out


def _flavour(args, output_type):
    if output_type not in _OUTPUT_TYPES:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"output_type must be one of {_OUTPUT_TYPES}, not {output_type!r}"
        )
    if output_type is not None:
        return output_type
    return "torch" if any(_is_torch(a) for a in args) else "numpy"


def _timeout_ms(timeout, what):
    """Seconds (None: no limit) -> the C ABI's milliseconds, rounded up."""
    if timeout is None:
        return None
    if not timeout > 0:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"{what} must be a positive number of seconds or None, not {timeout!r}"
        )
    return max(1, math.ceil(timeout * 1000))


def _comm_timeout_ms(comm_timeout):
    """comm_timeout in seconds (None: libpipe's default, one minute) -> comm_timeout_ms (0 is
    libpipe's default)."""
    if comm_timeout is None:
        return 0
    ms = _timeout_ms(comm_timeout, "comm_timeout")
    if ms > _INT32_MAX:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"comm_timeout must be at most {_INT32_MAX / 1000:g} seconds, not {comm_timeout!r}"
        )
    return ms


def _token(token):
    """The session's secret as the native module takes it (a str; libpipe checks its length)."""
    if isinstance(token, bytes):
        token = token.decode()
    if not isinstance(token, str):
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"token must be a str or bytes, not {type(token).__name__}")
    return token


def _store(store):
    """The rendezvous store's "HOST:PORT" (libpipe parses and checks it)."""
    if not isinstance(store, str):
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f'store must be a "HOST:PORT" string, not {store!r}')
    return store


def _arguments(input_names, inputs, named):
    """Positional inputs, then the remaining forward arguments by name, in forward's order."""
    if not named:
        return list(inputs)
    names = list(input_names)
    unknown = [n for n in named if n not in names]
    if unknown:
        raise InputError(Status.INPUT, f"unknown input(s) {unknown}: the model's inputs are {names}")
    twice = [n for n in names[: len(inputs)] if n in named]
    if twice:
        raise InputError(Status.INPUT, f"input(s) {twice} given both by position and by name")
    args = list(inputs)
    for name in names[len(inputs) :]:
        if name not in named:
            missing = [n for n in names[len(args) :] if n not in named]
            raise InputError(Status.INPUT, f"missing input(s) {missing}: the model's inputs are {names}")
        args.append(named[name])
    return args


# ---- model, plan, session -----------------------------------------------------------------------

ModuleInfo = namedtuple("ModuleInfo", "path type_name depth num_params param_bytes")


class Model(_Closeable):
    """A loaded model: a TorchScript archive or a torch.export program (`format` says which).
    `Model.load(path)`; then `split(...)` makes a Plan. Plans and sessions made from it stay valid
    after the model is closed."""

    def __init__(self, ptr, path):
        lib = _lib()
        self._handle = _Handle(ptr, lib.pipe_model_destroy, "model", 3)
        self.path = path
        count = lib.pipe_model_num_inputs(ptr)
        self._input_names = tuple(lib.pipe_model_input_name(ptr, i) for i in range(count))
        raw = lib.pipe_model_format(ptr)
        self._format = _MODEL_FORMATS.get(raw, raw)

    @classmethod
    def load(cls, path):
        """Load a TorchScript archive (torch.jit.trace / torch.jit.script output, saved with
        .save()) or a torch.export program (torch.export.save output, a .pt2); the file's content
        decides which, never its name. A model file is code: load only models you trust.
        NotFoundError; InvalidFormatError if it is neither; UnsupportedError for an exported
        program libpipe cannot run (the message says what to export instead)."""
        path = os.fsdecode(os.fspath(path))
        return cls(_lib().pipe_model_load(path), path)

    @property
    def input_names(self):
        """Names of forward's arguments, in order (x, input_ids, ...)."""
        return self._input_names

    @property
    def format(self):
        """What the file was (pipe_model_format, libpipe >= 0.10), one of MODEL_FORMATS:
        "torchscript" (a TorchScript archive; its plan's stages save as TorchScript .pt files) or
        "exported" (a torch.export program; its stages save as .pt2 programs). A value this
        binding does not know (a newer libpipe) is given as the int."""
        return self._format

    def modules(self):
        """The module tree in pre-order, as ModuleInfo(path, type_name, depth, num_params,
        param_bytes); the root's path is ""."""
        lib = _lib()
        with self._handle.use() as h:
            return [ModuleInfo(*lib.pipe_model_module(h, i)) for i in range(lib.pipe_model_num_modules(h))]

    def split(self, split_at=None, *, stages=None, policy="uniform", example_inputs=None):
        """Cut the model into stages.

        - split(): at the pipe::split() markers of the model code (none: one stage);
        - split(split_at=["blocks.2:begin", "head:end"]): at module boundaries ("FQN:begin" /
          "FQN:end", "FQN@K:end" for the K-th call of a module called several times);
        - split(stages=N, policy="uniform" | "params" | "time"): N balanced stages; "time" needs
          example_inputs (forward's arguments, a sequence or a dict by name), which with any split
          make describe() report each stage's measured time.
        SplitError names an unknown module and the nearest existing ones."""
        lib = _lib()
        if isinstance(split_at, str):
            split_at = [split_at]
        if split_at is not None and stages is not None:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT, "give split_at or stages, not both")
        with self._handle.use() as h:
            if split_at is None and stages is None and example_inputs is None:
                return Plan(lib.pipe_plan_create(h, None), self._input_names)
            options = lib.pipe_plan_options_create()
            try:
                for point in split_at or ():
                    lib.pipe_plan_options_add_split_point(options, point)
                if stages is not None:
                    lib.pipe_plan_options_set_stages(options, int(stages), policy)
                if example_inputs is not None:
                    if isinstance(example_inputs, dict):
                        args = _arguments(self._input_names, (), example_inputs)
                    else:
                        args = list(example_inputs)
                    capsules = [_export(a, f"example input {i}") for i, a in enumerate(args)]
                    lib.pipe_plan_options_set_example_inputs(options, capsules)
                return Plan(lib.pipe_plan_create(h, options), self._input_names)
            finally:
                lib.pipe_plan_options_destroy(options)

    def __repr__(self):
        closed = " closed" if self.closed else ""
        return f"<libpipe.Model {self.path!r} {self._format} inputs={list(self._input_names)}{closed}>"


def _specs(specs, allowed, what, input_names=None):
    """Chunk specs ("split", ("split", 1), "replicate", None ...) -> [(kind, dim)]. A dict maps
    forward argument names to specs (inputs only)."""
    if specs is None:
        return None
    if isinstance(specs, dict):
        if input_names is None:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} must be a sequence")
        unknown = [n for n in specs if n not in input_names]
        if unknown:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT,
                f"{what}: unknown input(s) {unknown}; the model's inputs are {list(input_names)}",
            )
        specs = [specs.get(n) for n in input_names]
    result = []
    for i, spec in enumerate(specs):
        kind, dim = (spec, 0) if spec is None or isinstance(spec, str) else tuple(spec)
        kind = "default" if kind is None else kind
        if kind not in allowed:
            raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what}[{i}]: {kind!r} is not one of {allowed}")
        result.append((_CHUNK_KINDS[kind], int(dim)))
    return result


class Plan(_Closeable):
    """A model cut into stages. `num_stages`, `describe()`, `session(...)`. Sessions made from it
    stay valid after it is closed."""

    def __init__(self, ptr, input_names):
        lib = _lib()
        self._handle = _Handle(ptr, lib.pipe_plan_destroy, "plan", 2)
        self.input_names = input_names
        self.num_stages = lib.pipe_plan_num_stages(ptr)

    def describe(self):
        """The plan as a dict: num_stages, method, balance, boundaries, and per stage its
        parameters, buffers, param_bytes, estimated_ms, inputs and outputs (see pipe.h)."""
        with self._handle.use() as h:
            return json.loads(_lib().pipe_plan_describe(h))

    def stage_parameters(self, stage):
        """Original dotted names of the parameters stage `stage` reads."""
        lib = _lib()
        with self._handle.use() as h:
            n = lib.pipe_plan_stage_count_names(h, stage, _NAMES_PARAMETERS)
            return [lib.pipe_plan_stage_name(h, stage, _NAMES_PARAMETERS, i) for i in range(n)]

    def stage_weight_bytes(self, stage, *, dtype=None, quantize=None, quantize_head=None, quantize_embedding=None):
        """Bytes stage `stage`'s parameters and buffers would take as a CPU stage built with these options (as
        Plan.session takes them; libpipe >= 0.16): linear layers' weights as panels or codes, worked out from the
        shapes with nothing loaded; an int8 embedding (libpipe >= 0.17) as its codes and scales. UnsupportedError
        for quantized weights where the CPU has no kernels for them."""
        with self._handle.use() as h:
            return _lib().pipe_plan_stage_weight_bytes(
                h, stage, _stage_options(dtype, None, quantize, quantize_head, quantize_embedding)
            )

    def save_stage(self, stage, path, *, dtype=None, weights=None):
        """Save stage `stage` as a standalone model of the plan's format, holding only its own weights:
        a TorchScript file (torch.jit.load reloads it) or, for an exported program, a .pt2 with one
        program named "model" (torch.export.load reloads it)."""
        with self._handle.use() as h:
            _lib().pipe_plan_save_stage(h, stage, _stage_options(dtype, weights), os.fsdecode(os.fspath(path)))

    def session(
        self,
        microbatches=_SESSION_DEFAULTS["num_microbatches"],
        threads_per_stage=_SESSION_DEFAULTS["threads_per_stage"],
        max_inflight=_SESSION_DEFAULTS["max_inflight"],
        input_specs=None,
        output_specs=None,
        *,
        microbatching=_name_of(_constants.MICROBATCHING, _SESSION_DEFAULTS["microbatching"]).lower(),
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
        token=None,
    ):
        """Build the stages and start one worker thread per stage. The defaults are pipe.h's
        (PIPE_SESSION_OPTIONS_INIT), as in C, the CLI and the Go and Rust bindings.

        microbatches: micro-batches per call (default 1; see microbatching). threads_per_stage:
        intra-op threads per stage (0: cores / stages). max_inflight: micro-batches in the pipeline
        at once over all calls (0: max(2 x microbatches, 4 x stages)). microbatching: "adaptive"
        (default): a call that finds the pipeline empty is cut into `microbatches`, one that
        arrives while other calls are in flight into only as many as bring the pipeline to one
        micro-batch per stage (at least 1); "fixed": every call into `microbatches` (e.g. to bound
        one micro-batch's activation memory). Results are the same either way; only the number of
        micro-batches run (stats()) differs. input_specs: per forward argument (a sequence, or a
        dict by name) "default" | "split" | ("split", dim) | "replicate"; output_specs: per
        output "concat" | ("concat", dim) | "sum" | "equal". dtype: "float32" | "float16" |
        "bfloat16" for floating weights and inputs. weights: a safetensors checkpoint or index.
        quantize (libpipe >= 0.13): "int8" stores CPU stages' linear layers' weights as 8-bit codes with
        a scale per output feature (activations stay in dtype); "int4" (libpipe >= 0.14) as 4-bit codes
        with a float16 scale per group of 32 inputs and output feature (llama.cpp's Q4_0), "int4:64" and
        "int4:128" in groups of 64 or 128; None: as they are. quantize_head (libpipe >= 0.16), with
        quantize: how the output head (the linear layer whose result the model returns, a decoder's
        lm_head) is stored: "int8", "int4" (in quantize's groups) or "none" (unquantized); None: as the
        other weights under int8, "int8" under int4. quantize_embedding (libpipe >= 0.17), with or without
        quantize (it saves memory, not time): "int8" stores CPU stages' embedding tables as 8-bit codes with a
        float32 scale per row (a table tied to a linear layer of its stage keeps its dtype; TorchScript models
        only); None or "none": as they are.

        Devices (libpipe >= 0.5): devices places the stages: "cpu,cuda:0" (one per stage), "cuda:0"
        (every stage), "auto" (the visible GPUs in order, else the CPU), or None (every stage on
        the CPU); each stage's weights go only to its device and each GPU stage runs on a CUDA
        stream of its own. Inputs may be CUDA torch tensors (read after the work queued on
        torch.cuda.current_stream()). outputs: "cpu" (default) or "device": results stay on the
        last stage's device and come back as CUDA torch tensors without a copy, ready on the
        current stream. UnsupportedError names the stage whose device this machine lacks.

        Stages in other processes (libpipe >= 0.4): transport "local" (default: every stage in
        this process) | "gloo" (CPU stages over `world_size` processes) | "nccl" (GPU stages,
        one GPU per process). This process is rank 0 and gets the first stages; ranks 1 ..
        world_size-1 are workers running `libpipe.run_worker(rank, world_size, store)`, each
        given a contiguous group of the following stages. store: "HOST:PORT" of the rendezvous
        store, which this process hosts (it listens on PORT; HOST is this machine's address as
        the workers reach it); required unless the transport is "local". Creating the session
        waits for the workers to join and load their stages. comm_timeout: seconds joining and
        loading may take, and a worker may send no heartbeat, before the session breaks and the
        calls its workers hold fail with CommunicationError naming the rank (None: libpipe's
        default, one minute). Workers send heartbeats from a thread of their own whatever their
        stages do, so a stage may take longer than comm_timeout per micro-batch; only a worker
        that was killed or stopped, or whose host hangs, stops them (idle or not). A worker that
        dies is noticed at once. CommunicationError also when the workers do not come or the
        address is unusable; InvalidArgumentError for a malformed address, world_size > 1 with
        "local", or fewer stages than processes; UnsupportedError for "nccl" where NCCL is
        missing."""
        if not isinstance(microbatching, str) or microbatching not in MICROBATCHING_MODES:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT,
                f"microbatching must be one of {MICROBATCHING_MODES}, not {microbatching!r}",
            )
        options = _session_options(
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
        options.update(
            {
                "num_microbatches": int(microbatches),
                "microbatching": _constants.MICROBATCHING[microbatching.upper()],
                "input_specs": _specs(input_specs, _INPUT_KINDS, "input_specs", self.input_names),
                "output_specs": _specs(output_specs, _OUTPUT_KINDS, "output_specs"),
            }
        )
        with self._handle.use() as h:
            session = Session(_lib().pipe_session_create(h, options), self.input_names)
        session.transport, session.world_size, session.store = transport, int(world_size), store
        return session

    def generator(self, **options):
        """A Generator of this plan's decoder: Generator(plan, **options) (see Generator)."""
        from .generation import Generator

        return Generator(self, **options)

    def __repr__(self):
        return f"<libpipe.Plan {self.num_stages} stages{' closed' if self.closed else ''}>"


def _session_options(
    *,
    threads_per_stage,
    max_inflight,
    dtype,
    weights,
    transport,
    world_size,
    store,
    comm_timeout,
    devices,
    outputs,
    token=None,
    quantize=None,
    quantize_head=None,
    quantize_embedding=None,
):
    """The options of pipe_session_create that Plan.session and Generator share, checked, as the
    dict the native module takes (Plan.session adds the micro-batching ones)."""
    if not isinstance(outputs, str) or outputs not in OUTPUT_PLACEMENTS:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"outputs must be one of {tuple(OUTPUT_PLACEMENTS)}, not {outputs!r}"
        )
    if devices is not None and not isinstance(devices, str):
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"devices must be a str such as 'cpu,cuda:0' or 'auto', not {devices!r}"
        )
    if isinstance(transport, str):
        transport = _TRANSPORT_ALIASES.get(transport, transport)
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"transport must be one of {TRANSPORTS}, not {transport!r}")
    options = {
        "threads_per_stage": int(threads_per_stage),
        "max_inflight": int(max_inflight),
        "transport": _constants.TRANSPORT[transport.upper()],
        "world_size": int(world_size),
        "comm_timeout_ms": _comm_timeout_ms(comm_timeout),
        "outputs": _constants.OUTPUTS[OUTPUT_PLACEMENTS[outputs]],
    }
    if devices is not None:
        options["devices"] = devices
    if store is not None:
        options["store"] = _store(store)
    if token is not None:
        options["token"] = _token(token)
    options.update(_stage_options(dtype, weights, quantize, quantize_head, quantize_embedding) or {})
    return options


# quantize=: pipe.h's PIPE_QUANTIZE_* by lower-case name ("int8"); None: "none"; "int4:G" for int4's groups.
_QUANTIZATIONS = {None: _constants.QUANTIZE["NONE"], **{n.lower(): v for n, v in _constants.QUANTIZE.items()}}
if "int4" in _QUANTIZATIONS:
    _QUANTIZATIONS.update({f"int4:{g}": _QUANTIZATIONS["int4"] for g in (32, 64, 128)})


# quantize_head=: pipe.h's PIPE_QUANTIZE_HEAD_* by lower-case name ("int4"); None: the default.
_HEAD_QUANTIZATIONS = {n.lower(): v for n, v in _constants.QUANTIZE_HEAD.items() if n != "DEFAULT"}


# quantize_embedding=: pipe.h's PIPE_QUANTIZE_EMBEDDING_* by lower-case name ("int8"); None: "none".
_EMBEDDING_QUANTIZATIONS = {n.lower(): v for n, v in _constants.QUANTIZE_EMBEDDING.items()}


def _stage_options(dtype, weights, quantize=None, quantize_head=None, quantize_embedding=None):
    if dtype is None and weights is None and quantize is None and quantize_head is None and quantize_embedding is None:
        return None
    if dtype not in _DTYPES:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"dtype must be one of {sorted(k for k in _DTYPES if k)}, not {dtype!r}"
        )
    if quantize not in _QUANTIZATIONS:
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT,
            f"quantize must be one of {sorted(k for k in _QUANTIZATIONS if k)} or None, not {quantize!r}",
        )
    options = {"dtype": _DTYPES[dtype], "quantize": _QUANTIZATIONS[quantize]}
    if quantize is not None and quantize.startswith("int4:"):
        options["quantize_group"] = int(quantize[len("int4:") :])
    if quantize_head is not None:
        if quantize_head not in _HEAD_QUANTIZATIONS:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT,
                f"quantize_head must be one of {sorted(_HEAD_QUANTIZATIONS)} or None, not {quantize_head!r}",
            )
        # libpipe refuses a head choice without quantized weights, saying what to do.
        options["quantize_head"] = _HEAD_QUANTIZATIONS[quantize_head]
    if quantize_embedding is not None:
        if quantize_embedding not in _EMBEDDING_QUANTIZATIONS:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT,
                f"quantize_embedding must be one of {sorted(_EMBEDDING_QUANTIZATIONS)} or None, "
                f"not {quantize_embedding!r}",
            )
        options["quantize_embedding"] = _EMBEDDING_QUANTIZATIONS[quantize_embedding]
    if weights is not None:
        options["weights"] = os.fsdecode(os.fspath(weights))
    return options


class Session(_Closeable):
    """Stage workers running a plan. run() and submit() are safe from many threads at once;
    close() waits for the runs in progress, and fails submitted requests still running with
    CancelledError. Closing a session whose stages run in worker processes tells them to finish
    (their run_worker returns); it waits until they have finished what they hold, as long as
    their heartbeats go on (comm_timeout)."""

    transport = "local"
    world_size = 1
    store = None

    def __init__(self, ptr, input_names):
        lib = _lib()
        self._handle = _Handle(ptr, lib.pipe_session_destroy, "session", 1)
        self.input_names = input_names
        self.num_stages = lib.pipe_session_num_stages(ptr)

    def check(self):
        """None while the session works. CommunicationError (with the reason) once a transport
        failure broke it (a worker died or stayed silent too long): every later call then fails
        at once with that error; close the session, restart its workers and create a new one."""
        with self._handle.use() as h:
            _lib().pipe_session_check(h)

    def run(self, *inputs, timeout=None, output_type=None, **named):
        """Run one call and return {output name: tensor} ("output" for a tensor result,
        "output.0", ... for a tuple, "output.<key>" for a dict). Inputs are forward's arguments,
        by position or by name: numpy arrays, torch tensors, numbers, or objects with __dlpack__;
        they are borrowed, not copied. Outputs are torch tensors when an input is one, numpy
        arrays otherwise (output_type="numpy" | "torch" | "dlpack" to choose). timeout: seconds
        until DeadlineExceededError."""
        args = _arguments(self.input_names, inputs, named)
        flavour = _flavour(args, output_type)
        capsules = [_export(a, f"input {i}") for i, a in enumerate(args)]
        ms = _timeout_ms(timeout, "timeout")
        with self._handle.use() as h:
            entries = _lib().pipe_session_run(h, capsules, ms)
        return _convert(entries, flavour)

    def submit(self, *inputs, timeout=None, output_type=None, **named):
        """Start one call and return a Request at once (it may wait for room in the pipeline).
        The inputs are copied, so they may change as soon as this returns."""
        args = _arguments(self.input_names, inputs, named)
        flavour = _flavour(args, output_type)
        capsules = [_export(a, f"input {i}") for i, a in enumerate(args)]
        ms = _timeout_ms(timeout, "timeout")
        with self._handle.use() as h:
            return Request(_lib().pipe_session_submit(h, capsules, ms), flavour, self)

    async def run_async(self, *inputs, timeout=None, output_type=None, **named):
        """run() as a coroutine, for asyncio: `out = await session.run_async(x, timeout=5.0)`
        gives what run(x, timeout=5.0) gives and raises the same errors (those in the inputs at
        once, when the coroutine starts). No thread waits for the call: the event loop watches
        the request's file descriptor (Request.fileno()), so any number of calls may be in
        flight on one loop. Cancelling the awaiting task (task.cancel(), asyncio.wait_for's
        timeout) cancels the call, and the request is freed either way. timeout: seconds until
        DeadlineExceededError, which fires on its own.

        The call is submitted on the event loop's thread, like submit(): when max_inflight
        micro-batches are already in the pipeline, submitting waits there for room and the loop
        stalls meanwhile, so give the session a max_inflight that covers the calls the loop
        keeps in flight (or bound them, e.g. with an asyncio.Semaphore)."""
        request = self.submit(*inputs, timeout=timeout, output_type=output_type, **named)
        try:
            return await request
        finally:
            request.close()

    def stats(self):
        """Per stage, since the session started: microbatches, failures, busy_ms, idle_ms,
        queue_depth."""
        lib = _lib()
        with self._handle.use() as h:
            return [lib.pipe_session_stage_stats(h, i) for i in range(self.num_stages)]

    def trace_start(self, operators=False):
        """Record a timeline of every micro-batch from now on. With operators=True each stage's
        slice also carries its time per operator ("operators_us", pipe_session_trace_start_with_operators)."""
        with self._handle.use() as h:
            if operators:
                _lib().pipe_session_trace_start_with_operators(h)
            else:
                _lib().pipe_session_trace_start(h)

    def trace_stop(self, path=None):
        """Stop recording; write the timeline as Chrome trace JSON to `path` (None discards it)."""
        with self._handle.use() as h:
            _lib().pipe_session_trace_stop(h, None if path is None else os.fsdecode(os.fspath(path)))

    def __repr__(self):
        where = (
            "" if self.transport == "local" else f" {self.transport} world_size={self.world_size} store={self.store!r}"
        )
        return f"<libpipe.Session {self.num_stages} stages{where}{' closed' if self.closed else ''}>"


class Request(_Closeable):
    """A call started by Session.submit(). wait() gives its outputs (or raises its error);
    cancel() asks it to stop; close() cancels it if it still runs. In a coroutine,
    `await request` gives what wait() gives without blocking the event loop; fileno() is the
    descriptor that says the call finished, for select and selectors."""

    _POLL_S = 0.25  # an unbounded wait is cut into slices so that Ctrl-C gets through
    # The event loop that watches the descriptor, while one does: (loop, fd, future). Only that
    # loop's thread adds and removes the reader; _watch_lock orders it with _finish and close,
    # which may run on any thread.
    _watch = None
    _awaiters = 0  # tasks awaiting the watch's future (touched on the loop's thread only)
    _close_deferred = False  # close once the loop has stopped watching (it still uses the fd)
    _closing = False  # close() has begun: no loop may start watching the fd it is about to close

    def __init__(self, ptr, flavour, session):
        self._watch_lock = threading.Lock()
        self._handle = _Handle(ptr, _lib().pipe_request_destroy, "request", 0)
        self._flavour = flavour
        self._session = session  # the session stays alive while the call may still run
        self._wait_lock = threading.Lock()  # pipe_request_wait is exclusive per request
        self._result = None
        self._error = None

    def wait(self, timeout=None):
        """The call's outputs, as Session.run gives them. timeout: seconds to wait (None: as
        long as it takes; 0: only check); WaitTimeoutError if it is still running then (it goes
        on). Errors of the call (CancelledError, DeadlineExceededError, ...) are raised, again on
        every later wait."""
        if timeout is not None and not timeout >= 0:
            raise InvalidArgumentError(
                Status.INVALID_ARGUMENT, f"timeout must be >= 0 seconds or None, not {timeout!r}"
            )
        with self._wait_lock:
            if self._result is None and self._error is None:
                self._wait_locked(timeout)
            if self._error is not None:
                raise self._error
            return self._result

    def _wait_locked(self, timeout):
        lib = _lib()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self._POLL_S if deadline is None else max(0.0, min(self._POLL_S, deadline - time.monotonic()))
            entries = error = None
            still_running = False
            with self._handle.use() as h:  # raises if the request was closed
                try:
                    entries = lib.pipe_request_wait(h, math.ceil(left * 1000))
                except WaitTimeoutError:
                    still_running = True
                except Error as e:
                    error = e
            if still_running:
                if deadline is None or time.monotonic() < deadline:
                    continue
                # The call goes on; nothing is kept.
                raise WaitTimeoutError(
                    Status.TIMEOUT, f"the call is still running after {timeout:g} s; wait again, or cancel it"
                )
            # Outside use(): _finish closes the handle, which waits for its users.
            if error is not None:
                self._finish(error=error)
                raise error
            self._finish(result=_convert(entries, self._flavour))
            return

    def _finish(self, result=None, error=None):
        with self._watch_lock:
            self._result, self._error = result, error
            # The outcome is kept here, so the C request can go now, unless an event loop still
            # watches its descriptor: closing it first would leave the loop a dead (or reused)
            # number and its awaiters no wake-up. The loop closes it once it has stopped.
            deferred = self._watch is not None
            self._close_deferred = self._close_deferred or deferred
        self._session = None
        if not deferred:
            self._handle.close()

    def done(self):
        """True once the call has finished (successfully or not). Never blocks: while another
        thread is inside wait(), this says False until that wait has the outcome."""
        if self._result is not None or self._error is not None:
            return True
        if not self._wait_lock.acquire(blocking=False):
            return False
        try:
            if self._result is None and self._error is None:
                self._wait_locked(0)
        except WaitTimeoutError:
            return False
        except Error:
            pass  # finished with an error (kept for wait), or closed
        finally:
            self._wait_lock.release()
        return True

    def cancel(self):
        """Ask the call to stop: micro-batches not yet run are dropped and wait() raises
        CancelledError. A finished call keeps its result."""
        with contextlib.suppress(InvalidArgumentError):
            with self._handle.use() as h:
                _lib().pipe_request_cancel(h)

    def fileno(self):
        """A file descriptor that becomes readable when the call finishes (succeeds, fails, is
        cancelled or passes its deadline) and stays readable: register it for reading with
        select, selectors, poll or an event loop, then wait(0) gives the outcome at once. The
        same descriptor every time; it belongs to the request, so never read, write or close
        it. Getting the outcome (wait, done) frees the request, which closes the descriptor:
        stop watching it first. InvalidArgumentError once the request is closed. In a
        coroutine, `await request` does all of this."""
        with self._handle.use() as h:
            return _lib().pipe_request_fd(h)

    def __await__(self):
        """`await request`: the outcome as wait() gives it, without blocking the event loop (it
        watches fileno(); no thread waits). Cancelling the awaiting task cancels the call, as
        for an asyncio future (asyncio.shield(request) keeps it running); the request is still
        the caller's to close. Several tasks of one loop may await one request."""
        return self._outcome().__await__()

    async def _outcome(self):
        future = self._watched(asyncio.get_running_loop())
        if future is not None:
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
        return self.wait(0)  # finished: does not block (the GIL is released as in any wait)

    def _watched(self, loop):
        """The future of `loop` that is resolved when the call finishes (shared by the loop's
        awaiters); None if the outcome is already kept."""
        with self._watch_lock:
            if self._result is not None or self._error is not None:
                return None
            if self._closing:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, "this request is closed")
            if self._watch is not None:
                watcher, _, future = self._watch
                if watcher is not loop:
                    raise InvalidArgumentError(
                        Status.INVALID_ARGUMENT, "this request is already awaited on another event loop"
                    )
                return future
            with self._handle.use() as h:  # raises if the request was closed
                fd = _lib().pipe_request_fd(h)
            future = loop.create_future()
            # Level-triggered: a call that finished before this line wakes the loop at once.
            loop.add_reader(fd, self._unwatch, future, True)
            self._watch = (loop, fd, future)
            return future

    def _unwatch(self, future, finished):
        """On the watching loop's thread: stop watching for `future` (nothing if it is no longer
        the watch), resolve it if the call `finished`, and close the request if that was put
        off while the loop watched."""
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
            self._session = None

    def close(self):
        if self._handle is not None and not self._handle.closed:
            self.cancel()
        with self._watch_lock:
            if self._watch is not None:
                # An event loop watches the descriptor: the cancelled call finishes at once, and
                # the loop closes the request when it wakes (its awaiters then find it closed).
                self._close_deferred = True
                return
            # Decided under the lock: a loop that comes after this finds the request closed
            # instead of watching a descriptor that the close below may free and the system reuse.
            self._closing = True
        super().close()
        self._session = None

    def __repr__(self):
        state = "done" if (self._result is not None or self._error is not None) else "pending"
        return f"<libpipe.Request {state}>"


def load_safetensors(path, output_type="numpy"):
    """Every tensor of a safetensors file, read by libpipe: {name: array} (numpy by default,
    "torch" or "dlpack" on request), in file order."""
    if output_type not in ("numpy", "torch", "dlpack"):
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, f"output_type must be 'numpy', 'torch' or 'dlpack', not {output_type!r}"
        )
    return _convert(_lib().pipe_safetensors_read(os.fsdecode(os.fspath(path))), output_type)


@contextlib.contextmanager
def _interruptible_by_default_sigint():
    """While a C call blocks with the GIL released, Python's own SIGINT handler only sets a flag
    that is looked at when the call returns, so Ctrl-C would do nothing. Where Python's default
    handler is in place (and only in the main thread, where handlers live), SIGINT gets the
    system's default action for the call instead: it ends the process, as it ends `pipe worker`."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_worker(
    rank=None,
    world_size=None,
    store=None,
    *,
    comm_timeout=None,
    threads_per_stage=_WORKER_DEFAULTS["threads_per_stage"],
    token=None,
):
    """Serve as worker `rank` (1 .. world_size-1) of the session whose driver (rank 0) creates it
    with plan.session(transport="tcp" | "nccl", world_size=world_size, store=store): join it
    through the rendezvous store at `store` ("HOST:PORT"), receive this rank's stages and run
    them until the driver closes the session; then return None. Blocks (with the GIL released;
    Ctrl-C ends the process when Python's default SIGINT handler is in place); serves one
    session, so call it again (or start a new process) for the next.

    comm_timeout: seconds to keep trying to reach the store and to wait for the driver's stages
    (None: libpipe's default, one minute); once serving, the worker waits for work as long as the
    driver is alive, and sends heartbeats to the driver's store: when the store fails one or
    does not answer for comm_timeout, the driver is gone. threads_per_stage: intra-op threads
    per stage (0: the driver's setting). CommunicationError when the store cannot be reached in
    time (the message names the address), the rank is taken, the driver's libpipe version
    differs, or the driver goes away (killed, stopped, its host hangs, or its session broke);
    InvalidArgumentError for a rank or world_size out of range.
    Errors in this worker's stages are reported to the driver's calls, not here.

    token: the session's secret (None: the LIBPIPE_TOKEN environment variable), the driver's own.
    rank and world_size None (libpipe >= 0.12): a launcher's environment (torchrun, srun) decides,
    launched rank i serving as rank i + 1 of a driver outside the launch; store None: the
    LIBPIPE_STORE environment variable."""
    if (rank is None) != (world_size is None):
        raise InvalidArgumentError(
            Status.INVALID_ARGUMENT, "give both rank and world_size, or neither (to take them from torchrun or srun)"
        )
    options = {
        "rank": 0 if rank is None else int(rank),
        "world_size": 0 if world_size is None else int(world_size),
        "comm_timeout_ms": _comm_timeout_ms(comm_timeout),
        "threads_per_stage": int(threads_per_stage),
    }
    if store is not None:
        options["store"] = _store(store)
    if token is not None:
        options["token"] = _token(token)
    lib = _lib()
    with _interruptible_by_default_sigint():
        lib.pipe_worker_run(options)
