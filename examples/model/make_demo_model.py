"""Exports the demo model every example runs: a small residual MLP cut into 4 stages with
pipe_split() markers, traced to TorchScript.

    python make_demo_model.py OUT_DIR

writes OUT_DIR/demo.pt, OUT_DIR/demo.inputs.safetensors ("x": 32 x 256) and
OUT_DIR/demo.expected.safetensors ("output": eager PyTorch's result).
"""

import os
import sys

import torch
from safetensors.torch import save_file

from libpipe import pipe_split


class Block(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class DemoNet(torch.nn.Module):
    def __init__(self, width=256, hidden=1024, classes=10):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, hidden) for _ in range(4))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        x = self.blocks[0](x)
        pipe_split()
        x = self.blocks[1](x)
        pipe_split()
        x = self.blocks[2](x)
        pipe_split()
        x = self.blocks[3](x)
        return self.head(x)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    model = DemoNet().eval()
    x = torch.randn(32, 256)
    with torch.no_grad():
        expected = model(x)
    torch.jit.trace(model, (x,)).save(os.path.join(out_dir, "demo.pt"))
    save_file({"x": x}, os.path.join(out_dir, "demo.inputs.safetensors"))
    save_file({"output": expected}, os.path.join(out_dir, "demo.expected.safetensors"))
    print(
        f"wrote {out_dir}/demo.pt: DemoNet, 4 residual blocks with 3 pipe_split() markers, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_demo_model.py OUT_DIR")
    main(sys.argv[1])
