"""Failures surface as libpipe.Error subclasses carrying the C status and libpipe's message."""

import pickle

import numpy as np
import pytest

import libpipe
from libpipe import Status, _native


def test_missing_model_file(tmp_path):
    missing = tmp_path / "no-such-model.pt"
    with pytest.raises(libpipe.NotFoundError) as info:
        libpipe.Model.load(missing)
    e = info.value
    assert isinstance(e, libpipe.Error)
    assert e.status is Status.NOT_FOUND
    assert str(missing) in e.message
    assert str(e).endswith("[PIPE_ERR_NOT_FOUND]")


def test_file_that_is_not_torchscript(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a TorchScript archive")
    with pytest.raises(libpipe.InvalidFormatError) as info:
        libpipe.Model.load(junk)
    assert info.value.status is Status.INVALID_FORMAT


def test_wrong_input_count(demo_session, demo_x):
    with pytest.raises(libpipe.InputError) as info:
        demo_session.run(demo_x, demo_x)
    assert info.value.status is Status.INPUT
    assert "takes 1 input" in info.value.message
    with pytest.raises(libpipe.InputError):
        demo_session.run()


def test_wrong_shape_is_an_error_not_a_crash(demo_session, demo_x):
    # libpipe learns the expected shape only when the first stage runs, so today this is an
    # EXECUTION error naming the stage (pipe.h files wrong shapes under INPUT).
    with pytest.raises((libpipe.ExecutionError, libpipe.InputError)) as info:
        demo_session.run(demo_x[:, :100])
    assert "256" in info.value.message  # what the model expected
    demo_session.run(demo_x)  # the session stays usable


def test_unknown_split_point_suggests_the_nearest_module(demo_model):
    with pytest.raises(libpipe.SplitError) as info:
        demo_model.split(split_at=["blok.2:begin"])
    e = info.value
    assert e.status is Status.SPLIT
    assert "blok.2" in e.message
    assert "blocks.2" in e.message  # the suggestion


def test_bad_split_arguments(demo_model):
    with pytest.raises(libpipe.InvalidArgumentError):
        demo_model.split(split_at="blocks.2", stages=2)  # Python-side check
    with pytest.raises(libpipe.InvalidArgumentError, match="bogus"):
        demo_model.split(stages=2, policy="bogus")  # libpipe's check
    with pytest.raises(libpipe.InvalidArgumentError):
        demo_model.split(split_at="blocks.2:middle")
    with pytest.raises(libpipe.SplitError):
        demo_model.split(stages=50)  # more stages than places to cut


def test_bad_session_options(demo_plan):
    with pytest.raises(libpipe.InvalidArgumentError, match="num_microbatches"):
        demo_plan.session(microbatches=0)
    with pytest.raises(libpipe.InvalidArgumentError, match="threads_per_stage"):
        demo_plan.session(threads_per_stage=-1)
    with pytest.raises(libpipe.InvalidArgumentError, match="input_specs"):
        demo_plan.session(input_specs=["sum"])
    with pytest.raises(libpipe.InvalidArgumentError, match="unknown input"):
        demo_plan.session(input_specs={"y": "split"})
    with pytest.raises(libpipe.InvalidArgumentError, match="dtype"):
        demo_plan.session(dtype="float8")
    for bad in ("dynamic", "Fixed", 1, None):
        with pytest.raises(libpipe.InvalidArgumentError) as info:
            demo_plan.session(microbatching=bad)
        assert info.value.status is Status.INVALID_ARGUMENT
        assert f"microbatching must be one of ('adaptive', 'fixed'), not {bad!r}" in info.value.message


def test_libpipe_checks_the_microbatching_field(demo_plan):
    # The option reaches pipe_session_options.microbatching: a value pipe.h does not define,
    # passed below the Python check, is refused by libpipe itself.
    with demo_plan._handle.use() as plan:
        with pytest.raises(libpipe.InvalidArgumentError) as info:
            _native.pipe_session_create(plan, {"microbatching": 7})
    assert "microbatching is 7" in info.value.message
    assert "PIPE_MICROBATCHING_FIXED" in info.value.message


def test_bad_inputs(demo_session, demo_x):
    with pytest.raises(libpipe.InputError, match="unknown input"):
        demo_session.run(y=demo_x)
    with pytest.raises(libpipe.InputError, match="both by position and by name"):
        demo_session.run(demo_x, x=demo_x)
    with pytest.raises(libpipe.InputError, match="cannot be passed"):
        demo_session.run("not a tensor")
    with pytest.raises(libpipe.InputError, match="cannot be passed"):
        demo_session.run(np.array([object()]))
    with pytest.raises(libpipe.InvalidArgumentError, match="timeout"):
        demo_session.run(demo_x, timeout=0)
    with pytest.raises(libpipe.InvalidArgumentError, match="output_type"):
        demo_session.run(demo_x, output_type="pandas")


def test_weights_file_missing(demo_plan, tmp_path):
    with pytest.raises(libpipe.NotFoundError):
        demo_plan.session(weights=tmp_path / "missing.safetensors")


def test_errors_pickle_and_subclass_builtins():
    e = libpipe.errors.from_status(int(Status.INPUT), "bad input")
    assert isinstance(e, libpipe.InputError) and isinstance(e, ValueError)
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is libpipe.InputError and again.status is Status.INPUT and again.message == "bad input"
    unknown = libpipe.errors.from_status(99, "from the future")
    assert type(unknown) is libpipe.Error and unknown.status == 99


def test_device_placement_options(demo_plan, demo_x, demo_expected):
    # The device list and the output placement reach libpipe: an all-CPU placement runs as the
    # default does, a GPU this machine lacks is named, malformed values are refused.
    with demo_plan.session(microbatches=2, devices="cpu,cpu", outputs="device") as session:
        np.testing.assert_allclose(session.run(demo_x)["output"], demo_expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(libpipe.UnsupportedError, match="stage 1 is on cuda:64"):
        demo_plan.session(devices="cpu,cuda:64")
    with pytest.raises(libpipe.InvalidArgumentError, match="'gpu' in the device list"):
        demo_plan.session(devices="gpu")
    with pytest.raises(libpipe.InvalidArgumentError, match="outputs must be one of"):
        demo_plan.session(outputs="gpu")
    with pytest.raises(libpipe.InvalidArgumentError, match="devices must be a str"):
        demo_plan.session(devices=["cpu"])
    with demo_plan._handle.use() as plan:
        with pytest.raises(libpipe.InvalidArgumentError, match="PIPE_OUTPUTS_ON_CPU"):
            _native.pipe_session_create(plan, {"outputs": 9})
