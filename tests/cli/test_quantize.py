"""8-bit weights (`--quantize int8`), end to end through `pipe`: a model split in stages, in float32 and
bfloat16, in one process and over two, computes what eager PyTorch computes with each linear layer's weight
replaced by its dequantized int8 value (a float32 scale per output feature, the largest magnitude at 127, codes
rounded to the nearest) and its input rounded as the int8 kernel rounds it (int8 per block of 32, as for int4
below), TorchScript models and exported programs alike; a weight that something besides linear
layers reads keeps its dtype; an unknown quantization is refused.

4-bit weights (`--quantize int4[:G]`) the same way, against eager PyTorch with each such weight dequantized as
llama.cpp's Q4_0 does (per output feature and group of G inputs, the value of largest magnitude is code -8, the
scale rounded to float16) and each such layer's input rounded as the int4 kernel rounds it (int8 per block of 32,
the block's largest magnitude at 127): what is left is float32 summation order.

The output head (`--quantize-head int8|int4|none`): the linear layer whose result the model returns is stored as
the option says, int8 under `--quantize int4` by default, in TorchScript models and exported programs alike, each
against its own dequantized reference; the option without `--quantize`, or with an unknown value, is refused.

8-bit embeddings (`--quantize-embedding int8`), with or without `--quantize`: the table as int8 codes with a float32
scale per row, against eager PyTorch with the embedding dequantized the same way; a table tied to the head keeps its
dtype in one stage and is quantized in the embedding's stage of a split; exported programs and unknown values are
refused."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import SANITIZED, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file, save_file

WIDTH = 96


class Layers(torch.nn.Module):
    """Three linear layers and a weight also read by another operator (which must keep its dtype)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = torch.relu(self.up(x))
        h = self.down(h)
        return self.out(h) + self.out.weight.sum(0)


def dequantized(weight):
    """What libpipe's int8 weights hold, in float32: symmetric per row, scale = max |w| / 127."""
    w = weight.float()
    scale = w.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


def model_and_reference(tmp_path, dtype):
    torch.manual_seed(0)
    model = Layers().eval()
    x = torch.randn(5, WIDTH)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
    traced.save(str(tmp_path / "model.pt"))
    save_file({"x": x}, str(tmp_path / "in.safetensors"))
    reference = Layers().eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        reference = reference.to(dtype)

        # up and down are read by linear layers only: their weights dequantized, their inputs rounded as the int8
        # kernel rounds its rows (int8_rows); out's weight is read by sum() too: it stays as it is.
        def linear(layer, h):
            bias = None if layer.bias is None else layer.bias.float()
            return F.linear(int8_rows(h), dequantized(layer.weight.to(dtype)), bias).to(dtype)

        h = linear(reference.down, torch.relu(linear(reference.up, x.to(dtype))))
        want = (reference.out(h) + reference.out.weight.sum(0)).float()
        plain = model.to(dtype)(x.to(dtype)).float()
    return want, plain


@pytest.mark.parametrize(
    "dtype,split,processes",
    [(torch.float32, ["--split-at", "down:begin"], 1), (torch.bfloat16, ["--split-at", "down:begin"], 1)]
    + ([] if SANITIZED else [(torch.float32, ["--split-at", "down:begin"], 2), (torch.float32, [], 1)]),
)
def test_int8_weights_compute_the_dequantized_model(tmp_path, dtype, split, processes):
    want, plain = model_and_reference(tmp_path, dtype)
    out = tmp_path / "out.safetensors"
    args = ["run", tmp_path / "model.pt", *split, "--input", tmp_path / "in.safetensors", "--output", out]
    args += ["--dtype", "bf16" if dtype == torch.bfloat16 else "fp32", "--quantize", "int8"]
    if processes > 1:
        args += ["--processes", processes]
    result = pipe(*args)
    assert result.returncode == 0, result.stderr
    got = load_file(out)["output"].float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype == torch.float32:
        # And not the unquantized model: the codes are what ran (int8 rounding moves results by about 1e-2 here;
        # in bfloat16 the dtype's own rounding is as large, so only the tolerance above tells).
        assert (got - want).abs().mean() < 0.25 * (plain - want).abs().mean()


def test_an_exported_program_with_int8_weights_computes_the_dequantized_model(tmp_path):
    # The program's linear layers quantize their weights on first use (nativert keeps the originals).
    want, plain = model_and_reference(tmp_path, torch.float32)
    torch.manual_seed(0)
    model = Layers().eval()
    x = load_file(tmp_path / "in.safetensors")["x"]
    with torch.no_grad():
        torch.export.save(torch.export.export(model, (x,)), str(tmp_path / "model.pt2"))
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run", tmp_path / "model.pt2", "--split-at", "down:begin", "--input", tmp_path / "in.safetensors",
        "--output", out, "--quantize", "int8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = load_file(out)["output"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - want).abs().mean() < 0.25 * (plain - want).abs().mean()


def int4_dequantized(weight, group):
    """What libpipe's int4 weights hold, in float32 (Q4_0 per group; K padded with zeros to the group)."""
    w = weight.float()
    n, k = w.shape
    depth = -(-k // group) * group
    w = F.pad(w, (0, depth - k)).view(n, depth // group, group)
    scale = (w.gather(2, w.abs().argmax(2, keepdim=True)) / -8).half().float()
    codes = torch.where(scale != 0, torch.round(w / scale), torch.zeros_like(w)).clamp(-8, 7)
    return (codes * scale).view(n, depth)[:, :k]


def int8_rows(x):
    """The rows as the int8 and int4 kernels multiply them: int8 per block of 32, the block's largest magnitude at
    127."""
    k = x.shape[-1]
    depth = -(-k // 32) * 32
    v = F.pad(x.float().reshape(-1, k), (0, depth - k)).view(-1, depth // 32, 32)
    scale = v.abs().amax(2, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(v / scale), torch.zeros_like(v))
    return (codes * scale).view(-1, depth)[:, :k].reshape(x.shape)


def int4_reference(tmp_path, dtype, group):
    want_float, plain = model_and_reference(tmp_path, dtype)
    torch.manual_seed(0)
    model = Layers().eval().to(dtype)
    x = load_file(tmp_path / "in.safetensors")["x"].to(dtype)

    def linear(layer, h):
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(int8_rows(h), int4_dequantized(layer.weight, group), bias).to(dtype)

    with torch.no_grad():
        h = linear(model.down, torch.relu(linear(model.up, x)))
        want = (model.out(h) + model.out.weight.sum(0)).float()  # out's weight is read by sum() too: kept
    return want, plain


@pytest.mark.parametrize(
    "dtype,quantize,processes",
    [(torch.float32, "int4", 1), (torch.bfloat16, "int4:64", 1)]
    + ([] if SANITIZED else [(torch.float32, "int4:128", 2)]),
)
def test_int4_weights_compute_the_dequantized_model(tmp_path, dtype, quantize, processes):
    group = int(quantize.split(":")[1]) if ":" in quantize else 32
    want, plain = int4_reference(tmp_path, dtype, group)
    out = tmp_path / "out.safetensors"
    args = ["run", tmp_path / "model.pt", "--split-at", "down:begin", "--input", tmp_path / "in.safetensors"]
    args += ["--output", out, "--dtype", "bf16" if dtype == torch.bfloat16 else "fp32", "--quantize", quantize]
    if processes > 1:
        args += ["--processes", processes]
    result = pipe(*args)
    assert result.returncode == 0, result.stderr
    got = load_file(out)["output"].float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype == torch.float32:
        # Not the unquantized model: 4-bit rounding moves these results by about 5e-2.
        assert (got - want).abs().mean() < 0.05 * (plain - want).abs().mean()


def test_an_exported_program_with_int4_weights_computes_the_dequantized_model(tmp_path):
    want, plain = int4_reference(tmp_path, torch.float32, 32)
    torch.manual_seed(0)
    model = Layers().eval()
    x = load_file(tmp_path / "in.safetensors")["x"]
    with torch.no_grad():
        torch.export.save(torch.export.export(model, (x,)), str(tmp_path / "model.pt2"))
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run", tmp_path / "model.pt2", "--input", tmp_path / "in.safetensors", "--output", out, "--quantize", "int4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = load_file(out)["output"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - want).abs().mean() < 0.05 * (plain - want).abs().mean()


def test_what_cannot_be_quantized_is_refused(tmp_path):
    model_and_reference(tmp_path, torch.float32)
    args = ["--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors"]
    assert_one_line_error(pipe("run", tmp_path / "model.pt", *args, "--quantize", "int3"), "--quantize", "int3")
    assert_one_line_error(pipe("run", tmp_path / "model.pt", *args, "--quantize", "int4:48"), "--quantize", "int4:48")


class Head(torch.nn.Module):
    """A body layer and an output head: the head's result is what forward returns."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.head = torch.nn.Linear(2 * WIDTH, 3 * WIDTH)

    def forward(self, x):
        return self.head(torch.relu(self.up(x)))


def stored(layer, h, as_):
    """The layer as libpipe computes it with its weight stored as `as_` ("int8", "int4", "none")."""
    if as_ == "none":
        return F.linear(h, layer.weight, layer.bias)
    weight = dequantized(layer.weight) if as_ == "int8" else int4_dequantized(layer.weight, 32)
    return F.linear(int8_rows(h), weight, layer.bias)


@pytest.mark.parametrize("suffix", ["pt", "pt2"])
def test_the_output_head_is_stored_as_asked(tmp_path, suffix):
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(5, WIDTH)
    save_file({"x": x}, str(tmp_path / "in.safetensors"))
    with torch.no_grad():
        if suffix == "pt":
            torch.jit.trace(model, (x,)).save(str(tmp_path / "model.pt"))
        else:
            torch.export.save(torch.export.export(model, (x,)), str(tmp_path / "model.pt2"))
    cases = [  # flags, then how up and head are stored
        (["--quantize", "int4"], "int4", "int8"),
        (["--quantize", "int4", "--quantize-head", "int4"], "int4", "int4"),
        (["--quantize", "int4", "--quantize-head", "none"], "int4", "none"),
        (["--quantize", "int8"], "int8", "int8"),
        (["--quantize", "int8", "--quantize-head", "int4"], "int8", "int4"),
    ]
    with torch.no_grad():
        candidates = {
            (up, head): stored(model.head, torch.relu(stored(model.up, x, up)), head)
            for up in ("int8", "int4", "none")
            for head in ("int8", "int4", "none")
        }
    for flags, up, head in cases:
        out = tmp_path / "out.safetensors"
        result = pipe(
            "run", tmp_path / f"model.{suffix}", "--split-at", "head:begin", "--input", tmp_path / "in.safetensors",
            "--output", out, *flags,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        got = load_file(out)["output"]
        # The reference of the storage asked for is the nearest, by far: what is left is float32 summation order, and
        # where that makes an int8 code of the head's input (rounded per block of 32 by the kernel) round the other
        # way, about 5e-4 here; storing any layer otherwise moves the results by 4e-3 or more.
        distance = {k: (got - want).abs().max().item() for k, want in candidates.items()}
        assert distance[(up, head)] < 1e-3, (flags, distance)
        assert all(d > 4 * distance[(up, head)] for k, d in distance.items() if k != (up, head)), (flags, distance)


def test_a_head_choice_needs_quantized_weights(tmp_path):
    model_and_reference(tmp_path, torch.float32)
    args = ["--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors"]
    for command in (["run", tmp_path / "model.pt", *args], ["split", tmp_path / "model.pt"]):
        result = pipe(*command, "--quantize-head", "int4")
        assert result.returncode == 2, result.stderr
        assert "--quantize-head needs --quantize" in result.stderr
    result = pipe("run", tmp_path / "model.pt", *args, "--quantize", "int4", "--quantize-head", "int2")
    assert result.returncode == 2, result.stderr
    assert "--quantize-head takes int8, int4 or none, not 'int2'" in result.stderr


def panel_bytes(n, k, as_, group=32):
    """Bytes of an [n, k] float32 weight as libpipe's CPU stages store it (runtime/cpu/panel_gemm.h): panels of 64
    output features; int8 codes with K padded to 32 and a float32 scale per output feature; int4 codes two to a byte
    with K padded to the group and a float16 scale per group and output feature inside the panels."""
    panels = -(-n // 64)
    if as_ == "none":
        return panels * 64 * k * 4
    if as_ == "int8":
        return panels * 64 * (-(-k // 32) * 32) + n * 4
    depth = -(-k // group) * group
    return panels * (depth // group * 2 * 64 + depth * 64 // 2)


@pytest.mark.parametrize("suffix", ["pt", "pt2"])
def test_split_reports_each_stages_bytes_as_stored(tmp_path, suffix):
    # Worked out here from the layers' shapes, independently of libpipe's arithmetic; an exported program's stage
    # keeps its original weights beside the panels it makes on its first run.
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(5, WIDTH)
    with torch.no_grad():
        if suffix == "pt":
            torch.jit.trace(model, (x,)).save(str(tmp_path / "model.pt"))
        else:
            torch.export.save(torch.export.export(model, (x,)), str(tmp_path / "model.pt2"))
    up, head = model.up, model.head
    originals = [4 * (layer.weight.numel() if suffix == "pt2" else 0) for layer in (up, head)]
    cases = [  # flags, how up and head are stored
        (["--quantize", "int4"], "int4", "int8"),
        (["--quantize", "int4", "--quantize-head", "int4"], "int4", "int4"),
        (["--quantize", "int8", "--quantize-head", "none"], "int8", "none"),
        (["--dtype", "fp32"], "none", "none"),
    ]
    for flags, up_as, head_as in cases:
        result = pipe("split", tmp_path / f"model.{suffix}", "--split-at", "head:begin", "--json", *flags)
        assert result.returncode == 0, result.stderr
        stages = json.loads(result.stdout)["stages"]
        want = [
            panel_bytes(*up.weight.shape, up_as) + 4 * up.bias.numel() + originals[0],
            panel_bytes(*head.weight.shape, head_as) + 4 * head.bias.numel() + originals[1],
        ]
        assert [s["weight_bytes"] for s in stages] == want, flags
        assert [s["param_bytes"] for s in stages] == [4 * sum(p.numel() for p in m.parameters()) for m in (up, head)]
    text = pipe("split", tmp_path / f"model.{suffix}", "--split-at", "head:begin", "--quantize", "int4")
    assert text.returncode == 0, text.stderr
    stored = panel_bytes(*up.weight.shape, "int4") + 4 * up.bias.numel() + originals[0]
    assert f"MiB, {stored / 2**20:.2f} MiB as int4\n" in text.stdout, text.stdout
    plain = pipe("split", tmp_path / f"model.{suffix}", "--split-at", "head:begin", "--json")
    assert "weight_bytes" not in plain.stdout


VOCAB = 80


class Embedder(torch.nn.Module):
    """A token embedding and an output head, tied or not."""

    def __init__(self, tied):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.embed(ids)))


def embedding_model(tmp_path, tied, quantized_head=False):
    """The model saved, and its results with the table dequantized as the issue says and with the float table; with
    quantized_head, the head computed as `--quantize int8` computes it."""
    torch.manual_seed(0)
    model = Embedder(tied).eval()
    ids = torch.randint(0, VOCAB, (3, 7))
    save_file({"ids": ids}, str(tmp_path / "in.safetensors"))
    with torch.no_grad():
        torch.jit.trace(model, (ids,)).save(str(tmp_path / "model.pt"))
        # The rule in float64: per row (token), scale = max |w| / 127, codes = round(w / scale).
        w = model.embed.weight.double()
        scale = w.abs().amax(1, keepdim=True) / 127
        table = (torch.round(w / scale) * scale).float()
        if quantized_head:
            want, plain = (
                F.linear(int8_rows(torch.relu(F.embedding(ids, t))), dequantized(model.head.weight))
                for t in (table, model.embed.weight)
            )
        else:
            want = F.linear(torch.relu(F.embedding(ids, table)), model.head.weight)
            plain = model(ids)
    return want, plain


@pytest.mark.parametrize(
    "tied,flags",
    [(False, []), (False, ["--quantize", "int8"]), (True, ["--split-at", "head:begin"])]
    + ([] if SANITIZED else [(True, ["--split-at", "head:begin", "--processes", "2"])]),
)
def test_an_int8_embedding_computes_the_dequantized_model(tmp_path, tied, flags):
    want, plain = embedding_model(tmp_path, tied, quantized_head="--quantize" in flags)
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run", tmp_path / "model.pt", "--input", tmp_path / "in.safetensors", "--output", out,
        "--quantize-embedding", "int8", *flags,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = load_file(out)["output"]
    if "--quantize" in flags:
        # The head is int8 too: float32 summation order is left, and where it rounds an int8 code of the head's input
        # (per block of 32) the other way, a few 1e-4; the float table's results are 4e-3 or more away.
        assert (got - want).abs().max() < 1e-3, flags
        assert (got - plain).abs().max() > 4 * (got - want).abs().max(), flags
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (plain - want).abs().max() > 1e-3  # not the float table's results


def test_a_table_tied_to_the_head_in_its_stage_keeps_its_dtype(tmp_path):
    want, plain = embedding_model(tmp_path, tied=True)
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run", tmp_path / "model.pt", "--input", tmp_path / "in.safetensors", "--output", out,
        "--quantize-embedding", "int8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(load_file(out)["output"], plain, rtol=1e-5, atol=1e-5)


def test_what_cannot_have_an_int8_embedding_is_refused(tmp_path):
    embedding_model(tmp_path, tied=False)
    args = ["--input", tmp_path / "in.safetensors", "--output", tmp_path / "out.safetensors"]
    result = pipe("run", tmp_path / "model.pt", *args, "--quantize-embedding", "int4")
    assert result.returncode != 0
    assert "--quantize-embedding takes int8 or none, not 'int4'" in result.stderr
    torch.manual_seed(0)
    ids = load_file(tmp_path / "in.safetensors")["ids"]
    with torch.no_grad():
        torch.export.save(torch.export.export(Embedder(False).eval(), (ids,)), str(tmp_path / "model.pt2"))
    assert_one_line_error(
        pipe("run", tmp_path / "model.pt2", *args, "--quantize-embedding", "int8"), "not exported (.pt2) ones"
    )
