"""Tensors cross without copies: outputs are libpipe's own buffers, adopted through DLPack;
inputs are handed to libpipe as the producer's memory."""
import gc

import numpy as np
import pytest
import torch
from conftest import assert_close

import libpipe
from libpipe import _native
from libpipe.runtime import _export


def test_numpy_output_adopts_libpipe_buffer(demo_plan, demo_x, demo_expected):
    with demo_plan.session(microbatches=4) as session:
        raw = session.run(demo_x, output_type="dlpack")["output"]
        assert isinstance(raw, libpipe.DLPackTensor)
        assert raw.shape == (32, 10) and raw.dtype == (2, 32, 1) and raw.__dlpack_device__() == (1, 0)
        array = np.from_dlpack(raw)
        assert array.ctypes.data == raw.data_ptr  # the same memory, not a copy
        assert not array.flags.owndata
        with pytest.raises(BufferError, match="already handed over"):
            raw.__dlpack__()  # ownership moved to the array
    # The array owns libpipe's buffer now: it outlives the session, and the memory stays valid
    # while other work allocates and frees.
    del session
    gc.collect()
    with demo_plan.session(microbatches=2) as other:
        for _ in range(3):
            other.run(demo_x)
    assert_close(array, demo_expected)


def test_torch_output_adopts_libpipe_buffer(demo_session, demo_x, demo_expected):
    raw = demo_session.run(torch.from_numpy(demo_x), output_type="dlpack")["output"]
    tensor = torch.from_dlpack(raw)
    assert tensor.data_ptr() == raw.data_ptr
    del raw
    gc.collect()
    assert_close(tensor.numpy(), demo_expected)


def test_default_outputs_are_views_of_libpipe_memory(demo_session, demo_x):
    out = demo_session.run(demo_x)["output"]
    assert not out.flags.owndata and out.base is not None  # backed by the DLPack capsule
    out += 1  # and writable: the caller owns it


def test_unconsumed_outputs_are_freed(demo_session, demo_x):
    # A DLPackTensor dropped without being consumed frees the tensor through its deleter; doing
    # it many times must neither crash nor keep memory.
    for _ in range(50):
        raw = demo_session.run(demo_x, output_type="dlpack")
        del raw
    gc.collect()


def test_numpy_input_is_passed_without_copy(demo_x):
    capsule = _export(demo_x, "x")
    info = _native.libpipe_dlpack_info(capsule)
    assert info["data"] == demo_x.ctypes.data
    assert info["shape"] == demo_x.shape
    # Strided arrays travel with their strides, not as contiguous copies.
    fortran = np.asfortranarray(demo_x)
    info = _native.libpipe_dlpack_info(_export(fortran, "x"))
    assert info["data"] == fortran.ctypes.data
    assert info["strides"] == (1, 32)


def test_torch_input_is_passed_without_copy(demo_x):
    tensor = torch.from_numpy(demo_x.copy()).requires_grad_()
    info = _native.libpipe_dlpack_info(_export(tensor, "x"))
    assert info["data"] == tensor.data_ptr()


def test_read_only_input_is_copied(demo_x):
    frozen = demo_x.copy()
    frozen.flags.writeable = False
    info = _native.libpipe_dlpack_info(_export(frozen, "x"))
    assert info["data"] != frozen.ctypes.data  # the one case that copies (DLPack 0.x has no read-only flag)


def test_capsules_are_accepted_directly(demo_session, demo_x, demo_expected):
    # The native layer takes raw "dltensor" capsules and borrows them: the capsule stays
    # unconsumed, so the producer's deleter still runs when it is collected.
    capsule = demo_x.__dlpack__()
    entries = _native.pipe_session_run(demo_session._handle._ptr, [capsule], None)
    assert _native.libpipe_dlpack_info(capsule)["data"] == demo_x.ctypes.data
    (name, out), = entries
    assert name == "output"
    assert_close(np.from_dlpack(libpipe.DLPackTensor(out)), demo_expected)
