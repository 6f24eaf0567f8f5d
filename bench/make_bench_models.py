"""Writes the models the pipeline benchmarks run, traced to TorchScript:

  mlp.pt      4 residual blocks Linear(1024→4096)-GELU-Linear(4096→1024), a pipe_split() marker
              between blocks 2 and 3 (the 2-stage MLP of the scheduler benchmark)
  trivial.pt  4 stages of x + 1 on a 1-element tensor (scheduling overhead per hop)
and their inputs: mlp.inputs.safetensors (x: 256 x 1024), trivial.inputs.safetensors (x: 8 x 1).

    python bench/make_bench_models.py OUT_DIR
"""

import os
import sys

import torch
from safetensors.torch import save_file

from libpipe import pipe_split


class Block(torch.nn.Module):
    def __init__(self, width=1024, hidden=4096):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLP(torch.nn.Module):
    def __init__(self, split=True):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
        self.split = split

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        if self.split:
            pipe_split()
        x = self.blocks[2](x)
        return self.blocks[3](x)


class Trivial(torch.nn.Module):
    def forward(self, x):
        x = x + 1
        pipe_split()
        x = x + 1
        pipe_split()
        x = x + 1
        pipe_split()
        return x + 1


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(256, 1024)
    torch.jit.trace(MLP().eval(), (x,)).save(os.path.join(out, "mlp.pt"))
    save_file({"x": x}, os.path.join(out, "mlp.inputs.safetensors"))
    t = torch.zeros(8, 1)
    torch.jit.trace(Trivial().eval(), (t,)).save(os.path.join(out, "trivial.pt"))
    save_file({"x": t}, os.path.join(out, "trivial.inputs.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
