"""libpipe for Python: pipelined inference of TorchScript models, and the tools model authors use.

For model authors (pure Python over torch; no compiled libpipe needed):
  `pipe_split()` marks a stage boundary in a model's forward; libpipe cuts the exported
  TorchScript model there. `save_skeleton()` and `save_checkpoint()` export a model as code plus
  safetensors weights, so that each pipeline stage loads only its own weights.
  `export_program()` exports a model with torch.export as a `.pt2` program libpipe can split and
  run (libpipe.exported).

For running models (the native module `libpipe._native`, a SWIG wrapper of libpipe's C ABI,
imported on first use):
  `Model.load(path)` -> `model.split(...)` -> `plan.session(...)` -> `session.run(*inputs)`;
  `plan.session(transport="tcp", world_size=N, store="HOST:PORT")` spreads the stages over
  processes that serve them with `run_worker(rank, N, "HOST:PORT")`;
  `Generator(decoder_path, ...)` -> `generator.generate(prompt)` generates tokens (or text, with a
  tokenizer) from a language model (libpipe.generation);
  `Tokenizer.load(model_folder)` encodes, decodes, streams text and applies the chat template
  (libpipe.text);
  failures raise `libpipe.Error` subclasses carrying a `Status`. See libpipe.runtime.
"""

from .errors import (
    BusyError,
    CancelledError,
    CommunicationError,
    DeadlineExceededError,
    Error,
    ExecutionError,
    InputError,
    InternalError,
    InvalidArgumentError,
    InvalidFormatError,
    IOFailedError,
    NotFoundError,
    OutOfMemoryError,
    SplitError,
    Status,
    UnsupportedError,
    WaitTimeoutError,
)
from . import generation, runtime, text
from .generation import (
    FINISH_REASONS,
    Generation,
    GenerationInfo,
    Generator,
    GeneratorInfo,
    GeneratorSession,
    TokenLogprobs,
)
from .runtime import (
    LOG_DEBUG,
    LOG_ERROR,
    LOG_INFO,
    LOG_WARNING,
    MICROBATCHING_MODES,
    MODEL_FORMATS,
    OUTPUT_PLACEMENTS,
    TRANSPORTS,
    DLPackTensor,
    Model,
    ModuleInfo,
    Plan,
    Request,
    Session,
    load_safetensors,
    run_worker,
    set_log_level,
    version,
)
from .text import DecodeStream, Tokenizer

try:
    # Importing the marker registers pipe::split in this process's torch before libpipe's native
    # library is loaded (which then finds it and does not register it a second time).
    from .export import save_checkpoint, save_skeleton
    from .exported import export_program
    from .marker import pipe_split
except ModuleNotFoundError as _missing:  # no torch: the runtime still works with numpy
    if _missing.name not in ("torch", "safetensors"):
        raise
    _why = f"{_missing.name} is not installed ({_missing})"

    def _needs_torch(name):
        def unavailable(*args, **kwargs):
            raise ImportError(f"libpipe.{name} needs torch and safetensors: {_why}")

        unavailable.__name__ = name
        return unavailable

    export_program = _needs_torch("export_program")
    pipe_split = _needs_torch("pipe_split")
    save_checkpoint = _needs_torch("save_checkpoint")
    save_skeleton = _needs_torch("save_skeleton")

__all__ = [
    "export_program",
    "pipe_split",
    "save_checkpoint",
    "save_skeleton",
    *runtime.__all__,  # the names imported from .runtime above
    *generation.__all__,
    "Tokenizer",
    "DecodeStream",
    "Status",
    "Error",
    "InvalidArgumentError",
    "NotFoundError",
    "InvalidFormatError",
    "SplitError",
    "InputError",
    "ExecutionError",
    "IOFailedError",
    "OutOfMemoryError",
    "UnsupportedError",
    "InternalError",
    "WaitTimeoutError",
    "CancelledError",
    "DeadlineExceededError",
    "CommunicationError",
    "BusyError",
]
