"""`--devices` of `pipe run` / `pipe bench` where the machine may have no GPU: an explicit CPU
placement computes exactly what the default one does, and a device that is not there, a
malformed list or one of the wrong length is one clear error line naming it. (The GPU placements
themselves are tested by the GPU suite, tests/gpu.)"""

import os

import pytest
import torch
from conftest import MODELS, assert_one_line_error
from conftest import run_pipe as pipe
from safetensors.torch import load_file

MODEL = os.path.join(MODELS, "example_code.traced.pt")  # 4 stages
INPUTS = os.path.join(MODELS, "example_code.inputs.safetensors")


def run(tmp_path, *args):
    out = tmp_path / "out.safetensors"
    result = pipe("run", MODEL, "--input", INPUTS, "--output", out, "--microbatches", 2, *args)
    assert result.returncode == 0, result.stderr
    return load_file(out)["output"]


@pytest.mark.parametrize("devices", ["cpu,cpu,cpu,cpu", "cpu"])
def test_cpu_placement_equals_the_default(tmp_path, devices):
    default = run(tmp_path)
    placed = run(tmp_path, "--devices", devices)
    assert torch.equal(placed, default)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: 'auto' puts the stages there")
def test_auto_without_a_gpu_runs_on_the_cpu(tmp_path):
    assert torch.equal(run(tmp_path, "--devices", "auto"), run(tmp_path))


def absent_gpu():
    """A CUDA device this machine does not have, and what the error says about it."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"cuda:{n}", "visible"
    if torch.version.cuda is None:  # a CPU-only LibTorch
        return "cuda:0", "CUDA library could not be loaded"
    return "cuda:0", "no CUDA device"


@pytest.mark.parametrize("command", ["run", "bench"])
def test_a_gpu_that_is_not_there_is_refused_naming_it(tmp_path, command):
    device, why = absent_gpu()
    args = ["--output", tmp_path / "out.safetensors"] if command == "run" else ["--requests", 1]
    result = pipe(command, MODEL, "--input", INPUTS, "--devices", f"cpu,{device},cpu,cpu", *args)
    assert result.returncode == 1
    assert_one_line_error(result, "PIPE_ERR_UNSUPPORTED", f"stage 1 is on {device}", why)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    "devices,needle",
    [
        ("cpu,gpu0,cpu,cpu", "'gpu0' in the device list"),
        ("cpu,cpu", "names 2 devices but the plan has 4 stages"),
        ("cpu,,cpu,cpu", "empty entry"),
        ("cuda:x", "'cuda:x'"),
    ],
)
def test_malformed_device_lists(tmp_path, devices, needle):
    result = pipe("run", MODEL, "--input", INPUTS, "--output", tmp_path / "out.safetensors", "--devices", devices)
    assert result.returncode == 1
    assert_one_line_error(result, "PIPE_ERR_INVALID_ARGUMENT", needle)


def test_devices_needs_a_value():
    result = pipe("run", MODEL, "--input", INPUTS, "--output", "x.safetensors", "--devices")
    assert result.returncode == 2
    assert_one_line_error(result, "--devices needs a value")
