"""The binding's DLPack C exchange path (how torch >= 2.10 tensors arrive) without torch: a small producer of
DLPack 1.3's exchange API written with ctypes describes NumPy arrays, and the operator must give, bit for
bit, what it gives for the same arrays passed as NumPy; byte offsets and strides must be honoured, and a
producer's failure (even one that sets no Python error) must surface as a ValueError naming the argument."""

import ctypes

import numpy as np
import pytest

from deltatrain import _deltatrain
from test_gdn import make_inputs


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLPackExchangeAPIHeader(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("prev_api", ctypes.c_void_p)]


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [("header", DLPackExchangeAPIHeader), ("managed_tensor_allocator", ctypes.c_void_p),
                ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", ctypes.c_void_p), ("current_work_stream", ctypes.c_void_p)]


DL_CPU = 1
DL_CODES = {"f": 2, "i": 0, "u": 1}  # kDLFloat, kDLInt, kDLUInt


class ExchangeTensor:
    """A NumPy array seen through the exchange API only (no __dlpack__, no buffer protocol), optionally
    starting `offset_bytes` into its data through DLTensor.byte_offset."""

    def __init__(self, array, offset_bytes=0, fail=False):
        self.array, self.offset_bytes, self.fail = array, offset_bytes, fail
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self.strides = (ctypes.c_int64 * array.ndim)(*(s // array.itemsize for s in array.strides))


def describe(py_object, out):
    tensor = ctypes.cast(py_object, ctypes.py_object).value
    if tensor.fail:
        return -1  # and, unlike a well-behaved producer, without setting a Python error
    a = tensor.array
    d = out.contents
    d.data = a.ctypes.data - tensor.offset_bytes
    d.byte_offset = tensor.offset_bytes
    d.device = DLDevice(DL_CPU, 0)
    d.ndim = a.ndim
    d.dtype = DLDataType(DL_CODES[a.dtype.kind], a.itemsize * 8, 1)
    d.shape = ctypes.cast(tensor.shape, ctypes.POINTER(ctypes.c_int64))
    d.strides = ctypes.cast(tensor.strides, ctypes.POINTER(ctypes.c_int64))
    return 0


DESCRIBE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(DLTensor))(describe)
API = DLPackExchangeAPI(DLPackExchangeAPIHeader(DLPackVersion(1, 3), None), None, None, None,
                        ctypes.cast(DESCRIBE, ctypes.c_void_p), None)
CAPSULE_NAME = ctypes.create_string_buffer(b"dlpack_exchange_api")  # a capsule keeps the pointer, not a copy
ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
ExchangeTensor.__dlpack_c_exchange_api__ = ctypes.pythonapi.PyCapsule_New(
    ctypes.addressof(API), ctypes.addressof(CAPSULE_NAME), None)


def forward(inputs, wrap):
    o = np.zeros_like(inputs["v"])
    final = np.zeros_like(inputs["initial_state"])
    args = [wrap(inputs[n]) for n in ("q", "k", "v", "g", "beta")] + [wrap(o), wrap(final),
                                                                       wrap(inputs["initial_state"])]
    _deltatrain.gdn.chunk_forward(*args, cu_seqlens=wrap(inputs["cu_seqlens"]), backend="cpu")
    return o, final


def test_exchanged_arrays_give_the_bits_of_numpy_ones(rng):
    inputs = make_inputs(rng, lengths=[45, 80], l2norm=False)
    for got, expected in zip(forward(inputs, ExchangeTensor), forward(inputs, lambda a: a)):
        assert np.array_equal(got, expected)


def test_byte_offsets_and_strides_are_honoured(rng):
    inputs = make_inputs(rng, lengths=[45, 80], l2norm=False)
    expected = forward(inputs, lambda a: a)

    def wrap_with_offset(a):
        # The same array, described as its base pointer moved back by 16 bytes plus a byte_offset of 16.
        return ExchangeTensor(a, offset_bytes=16)

    for got, want in zip(forward(inputs, wrap_with_offset), expected):
        assert np.array_equal(got, want)
    gapped = np.zeros(inputs["v"].shape[:-1] + (inputs["v"].shape[-1] + 4,), inputs["v"].dtype)[..., 4:]
    with pytest.raises(ValueError, match="v.*contiguous"):
        forward({**inputs, "v": gapped}, ExchangeTensor)


def test_a_producer_failure_names_the_argument(rng):
    inputs = make_inputs(rng, lengths=[20], l2norm=False)

    def wrap(a):
        return ExchangeTensor(a, fail=a is inputs["beta"])

    with pytest.raises(ValueError, match="beta.*exchange API reported a failure"):
        forward(inputs, wrap)
