"""Generates the seed models of the test suite as TorchScript files, with inputs and eager
PyTorch reference outputs, using the project's own PyTorch (so the archive format always matches
the LibTorch that loads it).

The models are the ones PyTorch's own pipelining tests use: ExampleCode (4 stages, a parameter
read by two stages, a skip connection from stage 0 to stage 2), MultiMLP (4 stages, an input read
by the last stage only) and ModelWithParamAlias (2 stages, a parameter and a module aliased
under two names).

    python seed_models.py OUT_DIR

writes, for each model NAME and form (traced / scripted):
    OUT_DIR/NAME.<form>.pt            the TorchScript model
    OUT_DIR/NAME.inputs.safetensors   one tensor per forward argument, named as in forward
    OUT_DIR/NAME.expected.safetensors "output": eager PyTorch's result
    OUT_DIR/NAME.state_dict.txt       the eager model's state_dict keys, one per line
"""

import os
import sys

import torch
from safetensors.torch import save_file

from libpipe import pipe_split

D = 512
BATCH = 16


class ExampleCode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mm_param1 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.mm_param2 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.lin1 = torch.nn.Linear(D, D)
        self.lin2 = torch.nn.Linear(D, D)

    def forward(self, x, y):
        x = torch.mm(x, self.mm_param1)
        skip = x
        x = x + y
        x = torch.relu(x)
        pipe_split()
        x = torch.mm(x, self.mm_param1)
        x = self.lin1(x)
        pipe_split()
        x = torch.relu(x)
        x = x + skip
        x = torch.mm(x, self.mm_param2)
        pipe_split()
        x = self.lin2(x)
        x = torch.relu(x)
        return x


class MLPBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = torch.nn.Linear(D, D)
        self.lin1 = torch.nn.Linear(D, D)

    def forward(self, x):
        return self.lin1(torch.relu(self.lin0(x)))


class MultiMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block0 = MLPBlock()
        self.block1 = MLPBlock()
        self.block2 = MLPBlock()
        self.block3 = MLPBlock()

    def forward(self, x, y):
        x = self.block0(x)
        pipe_split()
        x = self.block1(x)
        pipe_split()
        x = self.block2(x)
        pipe_split()
        x = self.block3(x)
        return x - y


class ModelWithParamAlias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mm_param0 = torch.nn.Parameter(torch.randn(D, D) / D**0.5)
        self.mm_param1 = self.mm_param0
        self.lin0 = torch.nn.Linear(D, D)
        self.lin1 = self.lin0

    def forward(self, x, y):
        x = torch.mm(x, self.mm_param0)
        x = x + y
        x = self.lin0(x)
        x = torch.relu(x)
        pipe_split()
        x = torch.mm(x, self.mm_param1)
        x = self.lin1(x)
        x = torch.relu(x)
        return x


class MarkerInBranch(torch.nn.Module):
    """Invalid: a marker inside an if block cannot be a stage boundary."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x, y):
        x = self.lin(x)
        if bool(x.sum() > 0):
            pipe_split()
            x = x + y
        return x


class RepeatedMarker(torch.nn.Module):
    """Invalid: two markers in a row would leave an empty stage."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x, y):
        x = self.lin(x)
        pipe_split()
        pipe_split()
        return x + y


class TupleOutput(torch.nn.Module):
    """Returns a tuple and a dict entry; y is returned untouched from the last stage."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x, y):
        h = self.lin(x)
        pipe_split()
        return torch.relu(h), h + y


class SlowLoop(torch.nn.Module):
    """Two stages that each repeat a small matmul n times (n is a 0-d tensor input, replicated to
    every micro-batch), so the output shows whether n arrived. Tests that must hold a stage use
    Gated, never a large n: how long work takes depends on the machine's load."""

    def __init__(self):
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x, n):
        for _ in range(int(n)):
            x = torch.tanh(x @ self.w0)
        pipe_split()
        for _ in range(int(n)):
            x = torch.tanh(x @ self.w1)
        return x


class Gated(torch.nn.Module):
    """Two stages, each held at a gate the test opens (tests/gate): a test decides when each
    micro-batch leaves each stage, instead of guessing how long some work takes. n (a 0-d int64
    input, replicated to every micro-batch) is the gate key; n = 0 passes every gate at once."""

    def __init__(self):
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x, n):
        x = torch.ops.libpipe_test.gate(torch.tanh(x @ self.w0), n, "stage0")
        pipe_split()
        return torch.ops.libpipe_test.gate(torch.tanh(x @ self.w1), n, "stage1")


# name -> (class, forms). Tracing refuses modules shared under two names, so the alias model is
# scripted only.
MODELS = {
    "example_code": (ExampleCode, ("traced", "scripted")),
    "multi_mlp": (MultiMLP, ("traced",)),
    "param_alias": (ModelWithParamAlias, ("scripted",)),
    "tuple_output": (TupleOutput, ("traced",)),
    "slow_loop": (SlowLoop, ("scripted",)),
    "gated": (Gated, ("scripted",)),
    "marker_in_branch": (MarkerInBranch, ("scripted",)),
    "repeated_marker": (RepeatedMarker, ("traced",)),
}


def generate(out_dir):
    # The gated model calls the test gate operator (tests/gate), built with the tests.
    torch.ops.load_library(os.environ["LIBPIPE_TEST_GATE_LIB"])
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    for name, (cls, forms) in MODELS.items():
        model = cls().eval()
        if cls is SlowLoop:
            inputs = {"x": torch.randn(BATCH, 64), "n": torch.tensor(3)}
        elif cls is Gated:
            inputs = {"x": torch.randn(BATCH, 64), "n": torch.tensor(0)}
        else:
            inputs = {"x": torch.randn(BATCH, D), "y": torch.randn(BATCH, D)}
        with torch.no_grad():
            expected = model(**inputs)
        for form in forms:
            if form == "traced":
                ts = torch.jit.trace(model, tuple(inputs.values()))
            else:
                ts = torch.jit.script(model)
            ts.save(os.path.join(out_dir, f"{name}.{form}.pt"))
        save_file(inputs, os.path.join(out_dir, f"{name}.inputs.safetensors"))
        if isinstance(expected, tuple):
            expected = {f"output.{i}": t.contiguous() for i, t in enumerate(expected)}
        else:
            expected = {"output": expected.contiguous()}
        save_file(expected, os.path.join(out_dir, f"{name}.expected.safetensors"))
        with open(os.path.join(out_dir, f"{name}.state_dict.txt"), "w") as f:
            f.write("\n".join(model.state_dict().keys()) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: seed_models.py OUT_DIR")
    generate(sys.argv[1])
