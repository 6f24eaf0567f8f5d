"""quantize="int8" (libpipe >= 0.13): the option reaches pipe_stage_options, a split model runs with 8-bit
linear weights and equals eager PyTorch with those weights dequantized and each layer's rows rounded to int8
per block of 32 as the kernel rounds them; a value pipe.h does not define is
refused before libpipe sees it. quantize="int4:64" (libpipe >= 0.14) the same way, with its group size, against
the weights dequantized as Q4_0 and the rows rounded to int8 per block of 32 as the int4 kernel rounds them.
quantize_head= (libpipe >= 0.16) reaches pipe_stage_options: the exported program's head follows it as the
TorchScript model's does, and a value pipe.h does not define, or one without quantize, is refused."""

import pytest
import torch

import libpipe


class Mlp(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def dequantized(weight):
    scale = weight.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(weight / scale).clamp(-127, 127) * scale


def test_int8_weights_equal_the_dequantized_model(tmp_path):
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(6, 64)
    with torch.no_grad():
        torch.jit.trace(model, (x,)).save(str(tmp_path / "mlp.pt"))
        # The int8 kernel rounds each layer's rows to int8 per block of 32 too (int8_rows, below).
        h = torch.relu(torch.nn.functional.linear(int8_rows(x), dequantized(model.up.weight), model.up.bias))
        want = torch.nn.functional.linear(int8_rows(h), dequantized(model.down.weight), model.down.bias)
    with libpipe.Model.load(tmp_path / "mlp.pt") as m, m.split(split_at=["down:begin"]) as plan:
        with plan.session(quantize="int8") as session:
            got = session.run(x, output_type="torch")["output"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def int4_dequantized(weight, group):
    n, k = weight.shape
    w = weight.view(n, k // group, group)
    scale = (w.gather(2, w.abs().argmax(2, keepdim=True)) / -8).half().float()
    return (torch.where(scale != 0, torch.round(w / scale), torch.zeros_like(w)).clamp(-8, 7) * scale).view(n, k)


def int8_rows(x):
    v = x.view(x.shape[0], -1, 32)
    scale = v.abs().amax(2, keepdim=True) / 127
    return (torch.where(scale > 0, torch.round(v / scale), torch.zeros_like(v)) * scale).view(x.shape)


def test_int4_weights_equal_the_dequantized_model(tmp_path):
    # `down` gives the model's output: under int4 such a layer is 8-bit unless quantize_head="int4" (as llama.cpp
    # keeps a model's output layer in 8 bits; tests/unit/test_panel_linear_int4.cpp tests the rule).
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(6, 64)
    with torch.no_grad():
        torch.jit.trace(model, (x,)).save(str(tmp_path / "mlp.pt"))
        h = torch.relu(torch.nn.functional.linear(int8_rows(x), int4_dequantized(model.up.weight, 64), model.up.bias))
        want = torch.nn.functional.linear(int8_rows(h), int4_dequantized(model.down.weight, 64), model.down.bias)
    with libpipe.Model.load(tmp_path / "mlp.pt") as m, m.split(split_at=["down:begin"]) as plan:
        with plan.session(quantize="int4:64", quantize_head="int4") as session:
            got = session.run(x, output_type="torch")["output"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unknown_quantization_is_refused(demo_plan):
    with pytest.raises(libpipe.InvalidArgumentError, match="quantize must be one of"):
        demo_plan.session(quantize="int3")
    with pytest.raises(libpipe.InvalidArgumentError, match="quantize must be one of"):
        demo_plan.session(quantize="int4:48")


@pytest.mark.parametrize("suffix", ["pt", "pt2"])
def test_the_output_head_follows_quantize_head(tmp_path, suffix):
    # Under int4 `down`, whose result the forward returns, is 8-bit by default, 4-bit with quantize_head="int4",
    # float with "none": in a TorchScript model and in an exported program alike.
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(6, 64)
    path = tmp_path / f"mlp.{suffix}"
    with torch.no_grad():
        if suffix == "pt":
            torch.jit.trace(model, (x,)).save(str(path))
        else:
            torch.export.save(torch.export.export(model, (x,)), str(path))
        h = torch.relu(torch.nn.functional.linear(int8_rows(x), int4_dequantized(model.up.weight, 32), model.up.bias))
        want = {
            None: torch.nn.functional.linear(int8_rows(h), dequantized(model.down.weight), model.down.bias),
            "int4": torch.nn.functional.linear(int8_rows(h), int4_dequantized(model.down.weight, 32), model.down.bias),
            "none": torch.nn.functional.linear(h, model.down.weight, model.down.bias),
        }
    with libpipe.Model.load(path) as m, m.split(split_at=["down:begin"]) as plan:
        for head in want:
            with plan.session(quantize="int4", quantize_head=head) as session:
                got = session.run(x, output_type="torch")["output"]
            # Its own reference is the nearest, by far: float32 summation order is left, and where that rounds an
            # int8 code of down's input (per block of 32, in the kernel) the other way, a few 1e-4; another storage
            # of the head moves the results by 5e-3 or more.
            distance = {k: (got - reference).abs().max().item() for k, reference in want.items()}
            assert distance[head] < 1e-3, (head, distance)
            assert all(d > 4 * distance[head] for k, d in distance.items() if k != head), (head, distance)


def test_a_head_choice_is_checked(demo_plan):
    with pytest.raises(libpipe.InvalidArgumentError, match="quantize_head must be one of"):
        demo_plan.session(quantize="int4", quantize_head="int2")
    # libpipe's own refusal: a head choice without quantized weights.
    with pytest.raises(libpipe.InvalidArgumentError, match="set quantize to PIPE_QUANTIZE_INT8 or PIPE_QUANTIZE_INT4"):
        demo_plan.session(quantize_head="int8")


def test_stage_weight_bytes_follow_the_layers_shapes(tmp_path):
    # Mlp's layers (64 -> 128 -> 64) as the CPU stages store them: panels of 64 outputs; int8 a byte per weight and
    # a float32 scale per output; int4 half a byte per weight and a float16 scale per group of 32 inputs and output.
    # The head (`down`) is int8 under int4 by default.
    torch.manual_seed(0)
    x = torch.randn(6, 64)
    with torch.no_grad():
        torch.jit.trace(Mlp().eval(), (x,)).save(str(tmp_path / "mlp.pt"))

    def linear(n, k, as_):
        return {"none": n * k * 4, "int8": n * k + n * 4, "int4": n * k // 2 + n * (k // 32) * 2}[as_] + n * 4

    with libpipe.Model.load(tmp_path / "mlp.pt") as m, m.split(split_at=["down:begin"]) as plan:
        assert [plan.stage_weight_bytes(s) for s in range(2)] == [linear(128, 64, "none"), linear(64, 128, "none")]
        assert [plan.stage_weight_bytes(s, quantize="int4") for s in range(2)] == [
            linear(128, 64, "int4"),
            linear(64, 128, "int8"),
        ]
        assert plan.stage_weight_bytes(1, quantize="int4", quantize_head="int4") == linear(64, 128, "int4")
        assert plan.stage_weight_bytes(1, quantize="int8", quantize_head="none") == linear(64, 128, "none")
        with pytest.raises(libpipe.InvalidArgumentError, match="needs quantized weights"):
            plan.stage_weight_bytes(0, quantize_head="int8")


def test_an_int8_embedding_equals_the_dequantized_table(tmp_path):
    # quantize_embedding="int8" (libpipe >= 0.17), without quantize: the table as int8 codes with a float32 scale per
    # row, the rest as it is; against the model with its table dequantized in float64.
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50, bias=False)
    model = torch.nn.Sequential(embed, head).eval()
    ids = torch.randint(0, 50, (2, 9))
    path = tmp_path / "embed.pt"
    with torch.no_grad():
        torch.jit.trace(model, (ids,)).save(str(path))
        w = embed.weight.double()
        scale = w.abs().amax(1, keepdim=True) / 127
        want = torch.nn.functional.linear(torch.nn.functional.embedding(ids, (torch.round(w / scale) * scale).float()),
                                          head.weight)  # fmt: skip
    with libpipe.Model.load(path) as m, m.split(split_at=["1:begin"]) as plan:
        with plan.session(quantize_embedding="int8") as session:
            got = session.run(ids, output_type="torch")["output"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(libpipe.InvalidArgumentError, match="quantize_embedding must be one of"):
            plan.session(quantize_embedding="int4")
