"""The pipe::split() marker for model code.

Registers the op `pipe::split() -> ()` with the same schema libpipe registers in C++ (alias
analysis CONSERVATIVE, so TorchScript keeps it as a side effect), and exposes pipe_split() to
call between the parts of forward that should become separate stages. Works under
torch.jit.trace and torch.jit.script; in eager mode it does nothing.
"""

import torch

_lib = torch.library.Library("pipe", "DEF")
_lib.define("split() -> ()", alias_analysis="CONSERVATIVE")
_lib.impl("split", lambda: None, "CompositeExplicitAutograd")


def pipe_split():
    """Cut the pipeline here. Call it at the top level of forward, not inside if/for blocks."""
    torch.ops.pipe.split()
