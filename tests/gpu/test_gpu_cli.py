"""`pipe run` / `pipe bench` with stages on a GPU: every model with all its stages on cuda:0 (each
stage on a stream of its own), mixed CPU/GPU pipelines in either order, in one process and over
two processes, weights from a checkpoint straight to the GPU, and the errors for GPUs that are not
there. Results equal PyTorch's eager run of the same module on the GPU."""

import json

import pytest
import torch
from conftest import assert_close_outputs, model, run_pipe
from gpu_models import MODELS, alternating
from safetensors.torch import load_file, save_file

TOL = 1e-4


def run_case(tmp_path, case, *extra):
    inputs = tmp_path / "in.safetensors"
    save_file(case.inputs, inputs)
    out = tmp_path / "out.safetensors"
    result = run_pipe("run", case.path, *case.split_args(), "--input", inputs, "--output", out, *map(str, extra))
    assert result.returncode == 0, result.stderr
    return load_file(out)


def placements(stages):
    return {
        "all-gpu": "cuda:0",
        "auto": "auto",
        "cpu-first": alternating(stages, "cpu"),
        "gpu-first": alternating(stages, "cuda:0"),
    }


CASES = [(name, where) for name in MODELS for where in ("all-gpu", "auto", "cpu-first", "gpu-first")]


@pytest.mark.parametrize("name,where", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_run_on_gpu_matches_eager_on_gpu(tmp_path, name, where):
    case = model(name)
    devices = placements(case.stages)[where]
    got = run_case(tmp_path, case, "--devices", devices, "--microbatches", 2)
    assert_close_outputs(got, case.eager_on_gpu(), TOL)


@pytest.mark.parametrize("name", ["multi_mlp.traced", "tiny_llama", "hf_llama"])
@pytest.mark.parametrize("first", ["cpu", "cuda:0"])
def test_mixed_pipeline_over_two_processes(tmp_path, name, first):
    case = model(name)
    got = run_case(tmp_path, case, "--devices", alternating(case.stages, first), "--microbatches", 2, "--processes", 2)
    assert_close_outputs(got, case.eager_on_gpu(), TOL)


def test_skeleton_weights_go_to_the_gpu(tmp_path):
    import libpipe

    case = model("hf_llama")
    ts = torch.jit.load(case.path)
    index = libpipe.save_checkpoint(ts, str(tmp_path / "model.safetensors"), max_shard_bytes=64 << 10)
    skeleton = tmp_path / "skeleton.pt"
    libpipe.save_skeleton(ts, str(skeleton))
    inputs = tmp_path / "in.safetensors"
    save_file(case.inputs, inputs)
    out = tmp_path / "out.safetensors"
    result = run_pipe(
        "run",
        skeleton,
        *case.split_args(),
        "--weights",
        index,
        "--devices",
        "cpu,cuda:0",
        "--input",
        inputs,
        "--output",
        out,
    )
    assert result.returncode == 0, result.stderr
    assert_close_outputs(load_file(out), case.eager_on_gpu(), TOL)


def test_a_gpu_that_is_not_there_is_named(tmp_path):
    case = model("param_alias.scripted")
    missing = f"cuda:{torch.cuda.device_count()}"
    inputs = tmp_path / "in.safetensors"
    save_file(case.inputs, inputs)
    result = run_pipe(
        "run", case.path, "--devices", f"cpu,{missing}", "--input", inputs, "--output", tmp_path / "out.safetensors"
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "PIPE_ERR_UNSUPPORTED" in lines[0] and "stage 1" in lines[0] and missing in lines[0]


def test_bench_on_the_gpu_reports_throughput(tmp_path):
    case = model("tiny_llama")
    inputs = tmp_path / "in.safetensors"
    save_file(case.inputs, inputs)
    result = run_pipe(
        "bench",
        case.path,
        *case.split_args(),
        "--input",
        inputs,
        "--devices",
        "cuda:0",
        "--microbatches",
        2,
        "--requests",
        20,
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["samples_per_s"] > 0


def test_a_model_traced_on_the_gpu_runs_anywhere_it_is_placed(tmp_path):
    # Its tensors load onto the CPU and go to their stages' devices; the device constants the
    # trace recorded (cuda:0) follow each stage's device, the CPU included.
    case = model("hf_llama")
    module = case.module.to("cuda:0")
    with torch.no_grad():
        ts = torch.jit.trace(module, tuple(v.to("cuda:0") for v in case.inputs.values()))
    case.module.to("cpu")
    path = tmp_path / "traced_on_gpu.pt"
    ts.save(str(path))
    inputs = tmp_path / "in.safetensors"
    save_file(case.inputs, inputs)
    want = case.eager_on_gpu()
    for devices in ("cuda:0", "cpu,cuda:0", "cuda:0,cpu"):
        out = tmp_path / f"out-{devices}.safetensors"
        result = run_pipe("run", path, *case.split_args(), "--devices", devices, "--input", inputs, "--output", out)
        assert result.returncode == 0, result.stderr
        assert_close_outputs(load_file(out), want, TOL)
