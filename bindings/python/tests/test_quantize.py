"""quantize="int8" (libpipe >= 0.13): the option reaches pipe_stage_options, a split model runs with 8-bit
linear weights and equals eager PyTorch with those weights dequantized; a value pipe.h does not define is
refused before libpipe sees it."""

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
        for layer in (model.up, model.down):
            layer.weight.copy_(dequantized(layer.weight))
        want = model(x)
    with libpipe.Model.load(tmp_path / "mlp.pt") as m, m.split(split_at=["down:begin"]) as plan:
        with plan.session(quantize="int8") as session:
            got = session.run(x, output_type="torch")["output"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unknown_quantization_is_refused(demo_plan):
    with pytest.raises(libpipe.InvalidArgumentError, match="quantize must be one of"):
        demo_plan.session(quantize="int4")
