"""The demo model through the Python API equals eager PyTorch's output, whatever the way of
splitting, the flavour of the inputs, or the way of passing them."""

import importlib.metadata
import re

import numpy as np
import pytest
import torch
from conftest import assert_close, read_trace, timed_linear_shapes

import libpipe
from libpipe import _native


def test_version_matches_the_header_constants():
    v = libpipe.version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", v)
    assert v == f"{_native.PIPE_VERSION_MAJOR}.{_native.PIPE_VERSION_MINOR}.{_native.PIPE_VERSION_PATCH}"
    # The package is versioned as the libpipe it was built against (pkg-config --modversion).
    assert importlib.metadata.version("libpipe") == v


def test_numpy_in_numpy_out(demo_session, demo_x, demo_expected):
    out = demo_session.run(demo_x)
    assert list(out) == ["output"]
    assert type(out["output"]) is np.ndarray
    assert_close(out["output"], demo_expected)


def test_torch_in_torch_out(demo_session, demo_x, demo_expected):
    out = demo_session.run(torch.from_numpy(demo_x))
    assert isinstance(out["output"], torch.Tensor)
    assert out["output"].dtype == torch.float32
    assert_close(out["output"].numpy(), demo_expected)


def test_tensor_needing_grad_is_accepted(demo_session, demo_x, demo_expected):
    x = torch.from_numpy(demo_x.copy()).requires_grad_()
    assert_close(demo_session.run(x)["output"].numpy(), demo_expected)


def test_inputs_by_name(demo_session, demo_x, demo_expected):
    assert demo_session.input_names == ("x",)
    assert_close(demo_session.run(x=demo_x)["output"], demo_expected)


def test_output_type_overrides_the_flavour(demo_session, demo_x, demo_expected):
    out = demo_session.run(demo_x, output_type="torch")["output"]
    assert isinstance(out, torch.Tensor)
    assert_close(out.numpy(), demo_expected)
    out = demo_session.run(torch.from_numpy(demo_x), output_type="numpy")["output"]
    assert type(out) is np.ndarray


def test_strided_and_read_only_inputs(demo_session, demo_x, demo_expected):
    fortran = np.asfortranarray(demo_x)  # same values, column-major strides
    assert not fortran.flags.c_contiguous
    assert_close(demo_session.run(fortran)["output"], demo_expected)
    every_other = demo_session.run(demo_x[::2])["output"]  # a strided view over rows
    assert_close(every_other, demo_expected[::2])
    frozen = demo_x.copy()
    frozen.flags.writeable = False
    assert_close(demo_session.run(frozen)["output"], demo_expected)


@pytest.mark.parametrize(
    "how",
    [
        {"split_at": ["blocks.2:begin"]},
        {"split_at": "blocks.1:end"},
        {"stages": 2, "policy": "uniform"},
        {"stages": 2, "policy": "params"},
        {"stages": 2, "policy": "time", "example_inputs": "x"},
    ],
    ids=["split_at", "split_at_end", "uniform", "params", "time"],
)
def test_two_stage_splits(demo_model, demo_x, demo_expected, how):
    how = dict(how)
    if how.get("example_inputs") == "x":
        how["example_inputs"] = [demo_x]
    with demo_model.split(**how) as plan:
        assert plan.num_stages == 2
        described = plan.describe()
        assert described["num_stages"] == 2 and len(described["stages"]) == 2
        if "example_inputs" in how:
            assert all(s["estimated_ms"] > 0 for s in described["stages"])
        with plan.session(microbatches=4) as session:
            assert session.num_stages == 2
            assert_close(session.run(demo_x)["output"], demo_expected)


def test_markers_give_four_stages(demo_model, demo_x, demo_expected):
    with demo_model.split() as plan:
        assert plan.num_stages == 4
        assert plan.describe()["method"] == "pipe::split() markers"
        # Each stage holds only its own block's parameters, under their original names.
        assert all(name.startswith("blocks.0.") for name in plan.stage_parameters(0))
        with plan.session(microbatches=4, threads_per_stage=1, max_inflight=8) as session:
            assert_close(session.run(demo_x)["output"], demo_expected)


def test_describe_matches_the_split(demo_plan):
    d = demo_plan.describe()
    assert d["method"] == "split points"
    assert d["boundaries"][0]["reason"].startswith("blocks.2:begin")
    params0 = set(d["stages"][0]["parameters"])
    assert "blocks.0.up.weight" in params0 and "blocks.2.up.weight" not in params0
    assert d["stages"][1]["outputs"][0]["to"] == "caller"


def test_stats_count_microbatches(demo_plan, demo_x):
    # Default (adaptive) micro-batching: a call that finds the pipeline empty, as each of these
    # sequential calls does, is cut into all 4 micro-batches.
    with demo_plan.session(microbatches=4) as session:
        session.run(demo_x)
        session.run(demo_x)
        stats = session.stats()
        assert len(stats) == 2
        for stage in stats:
            assert stage["microbatches"] == 8
            assert stage["failures"] == 0
            assert stage["busy_ms"] > 0
            assert stage["queue_depth"] == 0


def test_submit_and_wait(demo_session, demo_x, demo_expected):
    with demo_session.submit(demo_x) as request:
        out = request.wait(timeout=60)
        assert_close(out["output"], demo_expected)
        assert request.done()
        assert request.wait() is out  # a finished call gives the same result again


def test_submitted_inputs_may_change_afterwards(demo_session, demo_x, demo_expected):
    x = demo_x.copy()
    request = demo_session.submit(x)
    x[:] = 0  # submit copied the inputs
    assert_close(request.wait(timeout=60)["output"], demo_expected)


def test_model_tree(demo_model):
    modules = demo_model.modules()
    assert modules[0].path == "" and modules[0].depth == 0
    by_path = {m.path: m for m in modules}
    assert by_path["blocks.2"].type_name == "Block"
    assert by_path["head"].num_params == 256 * 10 + 10
    assert modules[0].num_params == sum(m.num_params for m in modules if m.depth == 1)


def test_load_safetensors(fixtures_dir, demo_x):
    got = libpipe.load_safetensors(fixtures_dir / "demo.inputs.safetensors")
    assert list(got) == ["x"]
    np.testing.assert_array_equal(got["x"], demo_x)
    as_torch = libpipe.load_safetensors(fixtures_dir / "demo.inputs.safetensors", output_type="torch")
    assert torch.equal(as_torch["x"], torch.from_numpy(demo_x))


def test_save_stage_reloads_in_torch(demo_plan, demo_x, tmp_path):
    path = tmp_path / "stage0.pt"
    demo_plan.save_stage(0, path)
    stage = torch.jit.load(str(path))
    names = {name for name, _ in stage.named_parameters()}
    assert names == set(demo_plan.stage_parameters(0))


def test_context_managers_close_handles(demo_path, demo_x):
    with libpipe.Model.load(demo_path) as model:
        with model.split(split_at="blocks.2:begin") as plan:
            with plan.session(microbatches=2) as session:
                session.run(demo_x)
            assert session.closed
            with pytest.raises(libpipe.InvalidArgumentError, match="session is closed"):
                session.run(demo_x)
        assert plan.closed
        with pytest.raises(libpipe.InvalidArgumentError, match="plan is closed"):
            plan.session()
    assert model.closed
    with pytest.raises(libpipe.InvalidArgumentError, match="model is closed"):
        model.split()
    session.close()  # closing twice is harmless


def test_session_outlives_model_and_plan(demo_path, demo_x, demo_expected):
    model = libpipe.Model.load(demo_path)
    plan = model.split(split_at="blocks.2:begin")
    session = plan.session()
    plan.close()
    model.close()
    assert_close(session.run(demo_x)["output"], demo_expected)
    session.close()


def test_status_enum_matches_the_library():
    for status in libpipe.Status:
        assert getattr(_native, status.c_name) == status.value
        assert _native.pipe_status_string(status.value) == status.c_name


def test_trace_is_written(demo_plan, demo_x, tmp_path):
    import json

    path = tmp_path / "trace.json"
    with demo_plan.session(microbatches=4) as session:
        session.trace_start()
        session.run(demo_x)
        session.trace_stop(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert len([e for e in events if e.get("ph") == "X"]) == 2 * 4  # one slice per stage and micro-batch
    with pytest.raises(libpipe.IOFailedError):
        with demo_plan.session() as session:
            session.trace_start()
            session.trace_stop(tmp_path / "no-such-dir" / "t.json")


def test_trace_with_operators_times_each_stage(demo_plan, demo_x, tmp_path):
    """trace_start(operators=True): every stage slice holds its time per operator, with the linear
    layers under the demo's weight shapes (examples/model/make_demo_model.py: blocks of up
    256 -> 1024 and down 1024 -> 256, the head 256 -> 10; cut before blocks.2, so the head is
    stage 1's); a plain trace after it times no operators."""
    path = tmp_path / "trace.json"
    with demo_plan.session(microbatches=4) as session:
        session.trace_start(operators=True)
        session.run(demo_x)
        session.trace_stop(path)
        tracks = read_trace(path)
        assert sorted(tracks) == ["stage 0", "stage 1"]  # no engine track: not a generator's session
        assert [len(tracks[s]) for s in ("stage 0", "stage 1")] == [4, 4]  # one slice per micro-batch
        assert timed_linear_shapes("stage 0", tracks["stage 0"]) == {"1024x256", "256x1024"}
        assert timed_linear_shapes("stage 1", tracks["stage 1"]) == {"1024x256", "256x1024", "10x256"}
        session.trace_start()
        session.run(demo_x)
        session.trace_stop(path)
        assert not [e for slices in read_trace(path).values() for e in slices if "operators_us" in e["args"]]
    with pytest.raises(libpipe.InvalidArgumentError, match="closed"):
        session.trace_start(operators=True)
