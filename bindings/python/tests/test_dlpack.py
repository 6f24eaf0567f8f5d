"""Tensors cross without copies: outputs are libpipe's own buffers, adopted through DLPack;
inputs are handed to libpipe as the producer's memory."""

import ctypes
import gc

import numpy as np
import pytest
import torch
from conftest import assert_close

import libpipe
from libpipe import _native
from libpipe.runtime import _export

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


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


class _DLManagedTensor(ctypes.Structure):
    """DLPack 0.x's DLManagedTensor as pipe.h declares it (its DLTensor's fields inline: the same layout),
    what a "dltensor" capsule points to."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_uint8 * 4),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # an address, so that reading it copies it (a _DELETER field is a view)
    ]


def _count_frees(tensor, freed, key):
    """Routes the deleter of an unconsumed DLPackTensor through a hook that appends `key` to
    `freed` and then calls libpipe's own deleter: the test sees when, and how often, libpipe's
    tensor is freed. Returns the hook, which the caller keeps alive until the tensor is gone."""
    managed = _DLManagedTensor.from_address(_capsule_pointer(tensor._capsule, b"dltensor"))
    assert managed.data + managed.byte_offset == tensor.data_ptr  # the layout above is right
    original = _DELETER(managed.deleter)

    def deleter(pointer):
        freed.append(key)
        original(pointer)

    hook = _DELETER(deleter)
    managed.deleter = ctypes.cast(hook, ctypes.c_void_p).value
    return hook


def test_unconsumed_outputs_are_freed(demo_session, demo_x):
    # A DLPackTensor dropped without being consumed frees libpipe's tensor through its deleter:
    # not while it is held, and exactly once after it is dropped.
    freed, hooks, made = [], [], []
    for i in range(10):  # the count is exact, so a few calls do; each gc.collect() costs ~0.1 s
        outputs = demo_session.run(demo_x, output_type="dlpack")
        for name, tensor in outputs.items():
            hooks.append(_count_frees(tensor, freed, (i, name)))
            made.append((i, name))
        gc.collect()
        assert len(freed) == len(made) - len(outputs)  # held outputs are not freed
        del outputs, tensor
    gc.collect()
    assert sorted(freed) == sorted(made)


def test_consumed_outputs_are_freed_once_by_the_consumer(demo_session, demo_x):
    # Handed to numpy, the tensor belongs to the array: dropping the DLPackTensor frees nothing,
    # dropping the array frees it once (through the versioned capsule numpy asks for).
    freed = []
    raw = demo_session.run(demo_x, output_type="dlpack")["output"]
    hook = _count_frees(raw, freed, "output")
    array = np.from_dlpack(raw)
    del raw
    gc.collect()
    assert freed == []
    del array
    gc.collect()
    assert freed == ["output"]
    del hook


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
    ((name, out),) = entries
    assert name == "output"
    assert_close(np.from_dlpack(libpipe.DLPackTensor(out)), demo_expected)
