"""libpipe for Python model authors.

`pipe_split()` marks a stage boundary in a model's forward; libpipe cuts the exported
TorchScript model there. It is pure Python over torch and needs no compiled libpipe.
"""
from .marker import pipe_split

__all__ = ["pipe_split"]
