"""quantize="int8" (libpipe >= 0.13): the option reaches pipe_stage_options, a split model runs with 8-bit
linear weights and equals eager PyTorch with those weights dequantized and each layer's rows rounded to int8
per block of 32 as the kernel rounds them; a value pipe.h does not define is
refused before libpipe sees it. quantize="int4:64" (libpipe >= 0.14) the same way, with its group size, against
the weights dequantized as Q4_0 and the rows rounded to int8 per block of 32 as the int4 kernel rounds them."""

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


def test_int4_weights_equal_the_dequantized_model(tmp_path, monkeypatch):
    # `down` gives the model's output: under int4 such a layer is 8-bit unless LIBPIPE_QUANTIZE_HEAD=int4 (as
    # llama.cpp keeps a model's output layer in 8 bits; tests/unit/test_panel_linear_int4.cpp tests the rule).
    monkeypatch.setenv("LIBPIPE_QUANTIZE_HEAD", "int4")
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(6, 64)
    with torch.no_grad():
        torch.jit.trace(model, (x,)).save(str(tmp_path / "mlp.pt"))
        h = torch.relu(torch.nn.functional.linear(int8_rows(x), int4_dequantized(model.up.weight, 64), model.up.bias))
        want = torch.nn.functional.linear(int8_rows(h), int4_dequantized(model.down.weight, 64), model.down.bias)
    with libpipe.Model.load(tmp_path / "mlp.pt") as m, m.split(split_at=["down:begin"]) as plan:
        with plan.session(quantize="int4:64") as session:
            got = session.run(x, output_type="torch")["output"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unknown_quantization_is_refused(demo_plan):
    with pytest.raises(libpipe.InvalidArgumentError, match="quantize must be one of"):
        demo_plan.session(quantize="int3")
    with pytest.raises(libpipe.InvalidArgumentError, match="quantize must be one of"):
        demo_plan.session(quantize="int4:48")
