"""Shared fixtures. The tests run against the installed package (run-tests.sh runs them with
PYTHONPATH unset, from a directory outside the source tree) on the fixture files in
$LIBPIPE_FIXTURES."""
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import libpipe

SOURCE = Path(__file__).resolve().parents[1]  # bindings/python

# slow_loop repeats a 64x64 matmul n times per stage; with SLOW_N a call takes several seconds,
# and one micro-batch of one stage well over a second.
SLOW_N = 50_000
QUICK_N = 3  # what slow_loop.expected.safetensors was computed with


def pytest_configure(config):
    where = Path(libpipe.__file__).resolve()
    if SOURCE in where.parents:
        raise pytest.UsageError(f"libpipe was imported from the source tree ({where}); run the tests through run-tests.sh")


@pytest.fixture(scope="session")
def fixtures_dir():
    path = os.environ.get("LIBPIPE_FIXTURES")
    if not path:
        raise pytest.UsageError("set LIBPIPE_FIXTURES to the fixture directory (run-tests.sh does)")
    return Path(path)


@pytest.fixture(scope="session")
def demo_path(fixtures_dir):
    return fixtures_dir / "demo.pt"


@pytest.fixture(scope="session")
def demo_x(fixtures_dir):
    return load_file(fixtures_dir / "demo.inputs.safetensors")["x"]


@pytest.fixture(scope="session")
def demo_expected(fixtures_dir):
    return load_file(fixtures_dir / "demo.expected.safetensors")["output"]


@pytest.fixture(scope="module")
def demo_model(demo_path):
    with libpipe.Model.load(demo_path) as model:
        yield model


@pytest.fixture(scope="module")
def demo_plan(demo_model):
    with demo_model.split(split_at=["blocks.2:begin"]) as plan:
        yield plan


@pytest.fixture(scope="module")
def demo_session(demo_plan):
    with demo_plan.session(microbatches=4) as session:
        yield session


@pytest.fixture(scope="session")
def slow_inputs(fixtures_dir):
    return load_file(fixtures_dir / "slow_loop.inputs.safetensors")


@pytest.fixture(scope="session")
def slow_expected(fixtures_dir):
    return load_file(fixtures_dir / "slow_loop.expected.safetensors")["output"]


@pytest.fixture(scope="module")
def slow_plan(fixtures_dir):
    with libpipe.Model.load(fixtures_dir / "slow_loop.scripted.pt") as model:
        assert model.input_names == ("x", "n")
        with model.split() as plan:
            assert plan.num_stages == 2
            yield plan


@pytest.fixture
def slow_session(slow_plan):
    # A fresh session per test: closing it waits for the micro-batch a cancelled call left
    # running, so tests do not slow each other down or see each other's statistics.
    with slow_plan.session(microbatches=2, input_specs={"n": "replicate"}) as session:
        yield session


def assert_close(got, want):
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
