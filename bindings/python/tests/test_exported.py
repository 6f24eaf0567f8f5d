"""libpipe.export_program alone (pure Python over torch, no libpipe native calls): the programs it
makes are the ones libpipe's torch.export front-end can split and run (markers kept as
pipe.split.default nodes, in-place writes kept in place, one dynamic batch dimension from 1 up),
and what libpipe cannot run is refused with a message that says what to do."""

import os

import pytest
import torch
from torch.export import Dim

import libpipe

WIDTH = 8


class Marked(torch.nn.Module):
    """Three stages by markers; two inputs that share the batch dimension."""

    def __init__(self):
        super().__init__()
        self.lin0 = torch.nn.Linear(WIDTH, WIDTH)
        self.lin1 = torch.nn.Linear(WIDTH, WIDTH)
        self.lin2 = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        x = torch.relu(self.lin0(x))
        libpipe.pipe_split()
        x = self.lin1(x) + y
        libpipe.pipe_split()
        return self.lin2(x)


def example(batch=4):
    torch.manual_seed(0)
    return torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)


def call_targets(program):
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def test_markers_survive_as_pipe_split_nodes():
    program = libpipe.export_program(Marked(), example())
    targets = call_targets(program)
    assert targets.count("pipe.split.default") == 2, targets
    # Where the model put them: after lin0's relu, and after lin1's add.
    first, second = (i for i, t in enumerate(targets) if t == "pipe.split.default")
    assert targets[first - 1] == "aten.relu.default" and targets[first + 1] == "aten.linear.default", targets
    assert targets[second - 1] == "aten.add.Tensor" and targets[second + 1] == "aten.linear.default", targets


def test_batch_is_dynamic_from_1_and_runs_like_eager(tmp_path):
    model = Marked()
    program = libpipe.export_program(model, example(4))
    # One symbol for both inputs' dim 0, from 1 up.
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    symbols = {placeholders[name].meta["val"].shape[0].node.expr for name in program.graph_signature.user_inputs}
    assert len(symbols) == 1, symbols
    (symbol,) = symbols
    assert program.range_constraints[symbol].lower == 1, program.range_constraints

    path = tmp_path / "marked.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    for batch in (1, 5):
        x, y = example(batch)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x, y), model(x, y), rtol=0, atol=0)


def test_more_dynamic_dims_are_merged_with_the_batch():
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, WIDTH)

        def forward(self, ids):
            h = self.embed(ids)
            return h * torch.arange(ids.shape[1], dtype=h.dtype)[None, :, None]

    model = Tokens()
    program = libpipe.export_program(model, (torch.randint(0, 16, (3, 5)),), dynamic_shapes={"ids": {1: Dim.DYNAMIC}})
    assert len(program.range_constraints) == 2, program.range_constraints
    for shape in ((1, 7), (4, 2)):
        ids = torch.randint(0, 16, shape)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids), model(ids))


def test_an_argument_given_as_none_keeps_its_size():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale):
            return x * scale

    program = libpipe.export_program(
        Scaled(), (torch.randn(4, WIDTH), torch.randn(WIDTH)), dynamic_shapes={"scale": None}
    )
    assert len(program.range_constraints) == 1, program.range_constraints


def test_in_place_writes_stay_in_place():
    """Not decomposed: a buffer written with copy_ stays a copy_ (a KV cache must), not a
    functional copy returned as a buffer mutation."""

    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(8, WIDTH), persistent=False)

        def forward(self, x):
            self.cache.narrow(0, 0, x.shape[0]).copy_(x)
            return x + 1

    program = libpipe.export_program(
        Cache(), (torch.randn(4, WIDTH),), dynamic_shapes={"x": {0: Dim("batch", min=1, max=8)}}
    )
    assert "aten.copy_.default" in call_targets(program)
    assert [s.kind.name for s in program.graph_signature.output_specs] == ["USER_OUTPUT"]


def test_a_hugging_face_model_output_is_refused():
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class HF(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return outputs.CausalLMOutput(logits=self.lin(x))

    with pytest.raises(ValueError, match=r"return \.logits or a tuple/dict of tensors"):
        libpipe.export_program(HF(), (torch.randn(4, WIDTH),))


def test_a_non_tensor_output_is_refused():
    class WithCount(torch.nn.Module):
        def forward(self, x):
            return x * 2, x.shape[1]

    with pytest.raises(ValueError, match="outputs are all tensors"):
        libpipe.export_program(WithCount(), (torch.randn(4, WIDTH),))


def test_a_batch_of_1_is_refused():
    with pytest.raises(ValueError, match="example batch of at least 2"):
        libpipe.export_program(Marked(), example(1))
    # Without a dynamic batch, 1 is a size like any other.
    program = libpipe.export_program(Marked(), example(1), dynamic_batch=False)
    assert not program.range_constraints


def test_different_batch_sizes_are_refused():
    x, _ = example(4)
    _, y = example(3)
    with pytest.raises(ValueError, match=r"x: 4, y: 3"):
        libpipe.export_program(Marked(), (x, y))


def test_path_writes_a_program_torch_export_load_reads(tmp_path):
    model = Marked()
    path = tmp_path / "model.pt2"
    program = libpipe.export_program(model, example(), path=path)
    assert os.listdir(tmp_path) == ["model.pt2"]  # nothing left of the temporary file
    loaded = torch.export.load(path)
    assert call_targets(loaded) == call_targets(program)
    x, y = example(3)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module()(x, y), model(x, y), rtol=0, atol=0)
