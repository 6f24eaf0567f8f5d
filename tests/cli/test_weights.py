"""Stage weights from safetensors checkpoints, end to end through `pipe`: a skeleton model (weights
on the meta device) split in 3 stages gets its weights from a 2-shard checkpoint whose tied head
is stored once, and equals eager PyTorch, also after --save-stages and reload; every checkpoint
error names the tensor, the stage or the file."""

import os

import pytest
import torch
from conftest import MODELS, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file

SPLIT = ["--split-at", "layers.0:end", "--split-at", "layers.1:end"]


def fixture(name):
    return os.path.join(MODELS, "weights", name)


def run(tmp_path, model, *extra, microbatches=2):
    out = tmp_path / "out.safetensors"
    result = pipe(
        "run",
        fixture(model),
        *SPLIT,
        *extra,
        "--input",
        fixture("llama.inputs.safetensors"),
        "--output",
        out,
        "--microbatches",
        microbatches,
    )
    return result, out


def expected():
    return load_file(fixture("llama.expected.safetensors"))["output"]


@pytest.mark.parametrize("weights", ["sharded/llama.safetensors.index.json", "prefixed.safetensors"])
def test_skeleton_with_checkpoint_equals_eager(tmp_path, weights):
    result, out = run(tmp_path, "llama.skeleton.pt", "--weights", fixture(weights))
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(load_file(out)["output"], expected(), rtol=1e-5, atol=1e-5)


def test_checkpoint_overrides_a_full_models_weights(tmp_path):
    result, out = run(tmp_path, "llama.full.pt", "--weights", fixture("sharded/llama.safetensors.index.json"))
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(load_file(out)["output"], expected(), rtol=1e-5, atol=1e-5)


def test_saved_stages_of_a_skeleton_reload_and_run(tmp_path):
    result = pipe(
        "split",
        fixture("llama.skeleton.pt"),
        *SPLIT,
        "--weights",
        fixture("sharded/llama.safetensors.index.json"),
        "--save-stages",
        tmp_path,
        "--json",
    )
    assert result.returncode == 0, result.stderr
    import json

    plan = json.loads(result.stdout)
    values = {"input_ids": load_file(fixture("llama.inputs.safetensors"))["input_ids"]}
    out = None
    for stage in plan["stages"]:
        module = torch.jit.load(str(tmp_path / f"stage{stage['index']}.pt"))
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            assert t.device.type == "cpu", name
        out = module(*[values[i["name"]] for i in stage["inputs"]])
        if stage["index"] + 1 < plan["num_stages"]:
            for o, v in zip(stage["outputs"], out):
                values[o["name"]] = v
    torch.testing.assert_close(out, expected(), rtol=1e-5, atol=1e-5)
    # The last stage holds the tied head although the checkpoint stores it once, as embed.weight.
    last = torch.jit.load(str(tmp_path / "stage2.pt"))
    names = dict(last.named_parameters())
    assert "lm_head.weight" in names or "embed.weight" in names


def test_only_one_stage_is_built_and_saved(tmp_path):
    result = pipe(
        "split",
        fixture("llama.skeleton.pt"),
        *SPLIT,
        "--weights",
        fixture("sharded/llama.safetensors.index.json"),
        "--save-stages",
        tmp_path,
        "--stage",
        1,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["stage1.pt"]


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_converts_floating_weights_and_inputs(tmp_path, dtype, torch_dtype):
    result, out = run(
        tmp_path, "llama.skeleton.pt", "--weights", fixture("sharded/llama.safetensors.index.json"), "--dtype", dtype
    )
    assert result.returncode == 0, result.stderr
    got = load_file(out)["output"]
    assert got.dtype == torch_dtype
    # The reference is PyTorch running the same model converted to the same dtype, on the same two
    # micro-batches: reduced-precision matmuls round differently for different batch sizes. libpipe's
    # CPU linear layers accumulate in float32 and round once (runtime/cpu/panel_gemm.h), PyTorch's
    # float16 ones may not, so the two differ by the dtype's own rounding (float16: 2^-10 relative):
    # both are held to float32 arithmetic on the same rounded weights, and libpipe must be as close.
    reference = torch.jit.load(fixture("llama.full.pt")).to(torch_dtype)
    exact = torch.jit.load(fixture("llama.full.pt")).to(torch_dtype).float()
    ids = load_file(fixture("llama.inputs.safetensors"))["input_ids"]
    with torch.no_grad():
        want = torch.cat([reference(part) for part in ids.tensor_split(2)])
        truth = torch.cat([exact(part) for part in ids.tensor_split(2)])
    scale = truth.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3 * scale)
    ours, theirs = (got.float() - truth).abs().max().item(), (want.float() - truth).abs().max().item()
    assert ours <= 1.25 * theirs + 1e-3 * scale, (ours, theirs)
    # A float16 checkpoint tensor is fine once a dtype is asked for.
    result, _ = run(tmp_path, "llama.skeleton.pt", "--weights", fixture("dtype.safetensors"), "--dtype", dtype)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "weights,needles",
    [
        (None, ["tensor 'embed.weight' (stage 0) has no data", "meta device", "PIPE_ERR_INVALID_ARGUMENT"]),
        (
            "missing/llama.safetensors.index.json",
            ["tensor 'layers.1.mlp.up_proj.weight' (stage 1) is not in checkpoint", "PIPE_ERR_NOT_FOUND"],
        ),
        (
            "shape.safetensors",
            ["tensor 'norm.weight' (stage 2)", "expects shape [64]", "has shape [65]", "PIPE_ERR_INPUT"],
        ),
        ("dtype.safetensors", ["tensor 'norm.weight' (stage 2)", "expects dtype Float", "has Half", "PIPE_ERR_INPUT"]),
        (
            "lost_shard/llama.safetensors.index.json",
            ["llama-00009-of-00009.safetensors' is missing", "PIPE_ERR_NOT_FOUND"],
        ),
        (
            "corrupt/llama.safetensors.index.json",
            ["malformed safetensors", "llama-00002-of-00002.safetensors", "PIPE_ERR_INVALID_FORMAT"],
        ),
        ("nope.safetensors", ["nope.safetensors", "PIPE_ERR_NOT_FOUND"]),
    ],
)
def test_checkpoint_errors_name_what_is_wrong(tmp_path, weights, needles):
    extra = ["--weights", fixture(weights)] if weights else []
    result, out = run(tmp_path, "llama.skeleton.pt", *extra)
    assert_one_line_error(result, *needles)
    assert not out.exists()


def test_bad_dtype_is_a_usage_error(tmp_path):
    result, _ = run(tmp_path, "llama.skeleton.pt", "--dtype", "int8")
    assert result.returncode == 2 and "--dtype takes fp32, fp16 or bf16" in result.stderr


def test_timing_a_skeleton_is_refused_with_a_way_out():
    result = pipe(
        "split",
        fixture("llama.skeleton.pt"),
        "--stages",
        2,
        "--policy",
        "time",
        "--input",
        fixture("llama.inputs.safetensors"),
    )
    assert_one_line_error(result, "meta device", "use policy params or uniform", "PIPE_ERR_INVALID_ARGUMENT")
    plan = pipe("split", fixture("llama.skeleton.pt"), "--stages", 2, "--policy", "params")
    assert plan.returncode == 0, plan.stderr
