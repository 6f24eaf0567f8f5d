"""The GPU suite runs where PyTorch sees a CUDA device; anywhere else the whole suite reports
SKIPPED to ctest (exit status 77) instead of failing, unless LIBPIPE_GPU_TEST_DEVICE names another
device to try test_gpu_generate.py's checks on (a dry run of that file on the CPU)."""

import os
import shutil
import subprocess
import tempfile

import pytest
import torch

import gpu_models

PIPE = os.environ["PIPE_CLI"]


def pytest_sessionstart(session):
    if not torch.cuda.is_available() and not os.environ.get("LIBPIPE_GPU_TEST_DEVICE"):
        pytest.exit("SKIPPED: PyTorch sees no CUDA device here", returncode=77)


_built = {}
_dir = tempfile.mkdtemp(prefix="libpipe-gpu-models-")


def pytest_unconfigure(config):
    shutil.rmtree(_dir, ignore_errors=True)


def model(name):
    """gpu_models.build(name), once per session."""
    if name not in _built:
        _built[name] = gpu_models.build(name, _dir)
    return _built[name]


def run_pipe(*args, timeout=600):
    return subprocess.run([PIPE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def assert_close_outputs(got, want, tol):
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name].cpu(), want[name].cpu(), rtol=tol, atol=tol)
