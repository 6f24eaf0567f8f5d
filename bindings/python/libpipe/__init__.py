"""libpipe for Python model authors.

`pipe_split()` marks a stage boundary in a model's forward; libpipe cuts the exported
TorchScript model there. `save_skeleton()` and `save_checkpoint()` export a model as code plus
safetensors weights, so that each pipeline stage loads only its own weights. All of it is pure
Python over torch and needs no compiled libpipe.
"""
from .export import save_checkpoint, save_skeleton
from .marker import pipe_split

__all__ = ["pipe_split", "save_checkpoint", "save_skeleton"]
