"""Shared fixtures. The tests run against the installed package (run-tests.sh runs them with
PYTHONPATH unset, from a directory outside the source tree) on the fixture files in
$LIBPIPE_FIXTURES.

Tests about calls that are still running (cancelling, timeouts, deadlines, threads) use the gated
model: a call with input n = key is held in each stage until the test opens gate `key` (the
fixtures' gate.py), so that "still running" is a state the test brings about and observes, never
a guess about how long some work takes on a loaded machine."""

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import libpipe

SOURCE = Path(__file__).resolve().parents[1]  # bindings/python

# slow_loop repeats a 64x64 matmul n times per stage: its output depends on the replicated 0-d
# input n. No test relies on how long it takes (tests that must hold a stage use the gate).
QUICK_N = 3  # what slow_loop.expected.safetensors was computed with

WAIT_LIMIT_S = 300  # ends a hung test; never decides a verdict


def pytest_configure(config):
    where = Path(libpipe.__file__).resolve()
    if SOURCE in where.parents:
        raise pytest.UsageError(
            f"libpipe was imported from the source tree ({where}); run the tests through run-tests.sh"
        )


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
    # A fresh session per test, so that tests do not see each other's statistics.
    with slow_plan.session(microbatches=2, input_specs={"n": "replicate"}) as session:
        yield session


@pytest.fixture(scope="session")
def gate(fixtures_dir):
    """The test gate. Creating it loads the gate operator, which the gated model calls: it comes
    before the model is loaded (gated_plan depends on this fixture)."""
    sys.path.insert(0, str(fixtures_dir))
    from gate import Gate

    ours = "LIBPIPE_TEST_GATE_DIR" not in os.environ
    g = Gate()
    yield g
    if ours:
        shutil.rmtree(g.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def gated_inputs(fixtures_dir):
    return load_file(fixtures_dir / "gated.inputs.safetensors")


@pytest.fixture(scope="session")
def gated_expected(fixtures_dir):
    # Computed with n = 0; the gate passes its input through, so any key gives this output.
    return load_file(fixtures_dir / "gated.expected.safetensors")["output"]


@pytest.fixture(scope="module")
def gated_plan(fixtures_dir, gate):
    with libpipe.Model.load(fixtures_dir / "gated.scripted.pt") as model:
        assert model.input_names == ("x", "n")
        with model.split() as plan:
            assert plan.num_stages == 2
            yield plan


def open_every_gate(gate):
    """Opens every gate issued so far (keys count up from 1)."""
    for key in range(1, gate.new_key()):
        gate.open(key)


@contextlib.contextmanager
def held_session(plan, gate, microbatches=2, **options):
    """A session on the gated model (n replicated to every micro-batch). Before it closes, which
    waits for the stages, every gate is opened: a test that failed while holding a stage then
    ends at once instead of at the gate's own limit."""
    session = plan.session(microbatches=microbatches, input_specs={"n": "replicate"}, **options)
    try:
        yield session
    finally:
        open_every_gate(gate)
        session.close()


@pytest.fixture
def gated_session(gated_plan, gate):
    # A fresh session per test, so that tests do not see each other's statistics.
    with held_session(gated_plan, gate) as session:
        yield session


def wait_until(condition, what):
    """Waits until condition() is true: for a state the test brought about. The bound only ends
    a hung test."""
    give_up = time.monotonic() + WAIT_LIMIT_S
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"not {what} after {WAIT_LIMIT_S} s")
        time.sleep(0.002)


def inside(thread, function):
    """True while `thread` is running `function` (anywhere on its Python stack)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is function.__code__:
            return True
        frame = frame.f_back
    return False


def assert_close(got, want):
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def read_trace(path):
    """The complete events ("ph": "X") of a Chrome trace (Session.trace_stop), by track name
    ("stage 0", "engine")."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault(names[e["tid"]], []).append(e)
    return tracks


def timed_linear_shapes(stage, slices):
    """Asserts that each of a stage's slices holds its time per operator ("operators_us"), no more
    in all than the slice lasted (+1 us: its bounds are whole microseconds); returns the weight
    shapes ("out x in") its linear layers are keyed by (a group of products of one input, such as
    q, k and v, is one key: "[64x64+32x64+32x64]")."""
    assert slices, f"{stage} has no slices"
    shapes = set()
    for e in slices:
        ops = e["args"].get("operators_us")
        assert ops, f"{stage} slice {e['name']}: no operators_us in {e['args']}"
        assert all(us >= 0 for us in ops.values()), ops
        assert sum(ops.values()) <= e["dur"] + 1, f"{stage} slice {e['name']} of {e['dur']} us: {ops}"
        for key in ops:
            op, _, shape = key.partition(" [")
            if op.endswith(("linear", "linear_group")):
                shapes |= set(shape.removesuffix("]").split("+"))
    return shapes


# ---- generation: the decoder fixtures (tests/models/decoder_models.py) ----------------------------

# The tiny decoders have two layers; a cut before the second makes two stages.
DECODER_SPLIT = ["model.layers.1:begin"]
# gated_decoder.pt holds a prefill row whose first token is 119 + key (key 1 .. 8) at gate `key`
# in stage "stage1", and fails the step of a prefill row whose first token is 119.
GATED_FIRST_ID = 119
GATED_MAX_KEY = 8


@pytest.fixture(scope="session")
def decoder_path(fixtures_dir):
    return fixtures_dir / "tiny_decoder.pt"


@pytest.fixture(scope="session")
def decoder_expected(fixtures_dir):
    """{"prompts": [[ids]], "max_new_tokens": N, "greedy": [[ids]]}: transformers' greedy
    generation on the tiny decoder's weights (the independent reference)."""
    import json

    expected = json.loads((fixtures_dir / "tiny_decoder.expected.json").read_text())
    assert all(p[0] < GATED_FIRST_ID for p in expected["prompts"])  # no prompt would hold the gated one
    return expected


@pytest.fixture(scope="module")
def tiny_generator(decoder_path):
    with libpipe.Generator(decoder_path, split_at=DECODER_SPLIT) as generator:
        yield generator


@pytest.fixture(scope="module")
def gated_decoder_plan(fixtures_dir, gate):
    # `gate` loads the gate operator before the model.
    with libpipe.Model.load(fixtures_dir / "gated_decoder.pt") as model:
        with model.split(split_at=DECODER_SPLIT) as plan:
            yield plan


class DecoderGate:
    """The gate of the gated decoder for one test, in a folder of its own so that keys start at 1
    again (the decoder takes its key from a token id, so only keys 1 .. 8 exist; the session's
    gate has given out many more by now). The gate operator reads the folder from the environment
    each time a gated row comes, and none is held between tests."""

    def __init__(self, gate_class):
        self.gate = gate_class(load=False)
        self._keys = iter(range(1, GATED_MAX_KEY + 1))

    def new_key(self):
        return next(self._keys)

    @staticmethod
    def prompt(key, rest=(5, 6, 7)):
        """A prompt whose prefill is held at gate `key`."""
        return [GATED_FIRST_ID + key, *rest]

    def wait(self, key):
        """Until the prefill of `key` is held in stage 1."""
        self.gate.wait(key, "stage1")

    def open(self, key):
        self.gate.open(key)

    def open_all(self):
        for key in range(1, GATED_MAX_KEY + 1):
            self.open(key)


@pytest.fixture
def decoder_gate(gate):
    before = os.environ.pop("LIBPIPE_TEST_GATE_DIR", None)
    ours = DecoderGate(type(gate))
    try:
        yield ours
    finally:
        ours.open_all()  # a failed test leaves nothing held
        if before is None:
            os.environ.pop("LIBPIPE_TEST_GATE_DIR", None)
        else:
            os.environ["LIBPIPE_TEST_GATE_DIR"] = before
        shutil.rmtree(ours.gate.dir, ignore_errors=True)


@contextlib.contextmanager
def gated_generator(plan, decoder_gate, **options):
    """A generator of the gated decoder. Before it closes, which waits for the steps in flight,
    every gate is opened: a test that failed while holding a step then ends at once instead of at
    the gate's own limit."""
    generator = plan.generator(**options)
    try:
        yield generator
    finally:
        decoder_gate.open_all()
        generator.close()
