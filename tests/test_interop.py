"""q12drv.core.interop: other libraries' memory and streams, read and checked (no GPU needed)."""

import ctypes

import numpy as np
import pytest

from q12drv.core.interop import ArrayInfo, describe, device_pointer, dtype_name, stream_handle


class CAI:
    """A minimal CUDA-array-interface object (what CuPy, Numba and torch export)."""

    def __init__(self, ptr, shape, typestr, strides=None, version=3, stream=None):
        self._cai = {"data": (ptr, False), "shape": shape, "typestr": typestr, "strides": strides,
                     "version": version, "stream": stream}

    @property
    def __cuda_array_interface__(self):
        return self._cai


def test_a_plain_address_passes_through_and_is_checked():
    assert device_pointer(0x7F00_0000_1000, "q", align=16) == 0x7F00_0000_1000
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        device_pointer(0x7F00_0000_1008, "q", align=16)
    with pytest.raises(ValueError, match="non-NULL"):
        device_pointer(0, "q")
    with pytest.raises(TypeError, match="q must be a device pointer"):
        device_pointer(True, "q")
    with pytest.raises(TypeError, match="__cuda_array_interface__ or __dlpack__, got str"):
        device_pointer("0x1000", "q")


def test_cai_objects_are_checked_against_what_the_op_reads():
    q = CAI(0x7F00_0000_1000, (8, 4, 128), "<V2")
    assert describe(q).dtype == "bf16" and describe(q).nbytes == 8 * 4 * 128 * 2
    assert device_pointer(q, "q", dtype="bf16", shape=(None, 4, 128), align=16) == 0x7F00_0000_1000
    with pytest.raises(TypeError, match=r"q must be f32, got a bf16 array of shape \(8, 4, 128\)"):
        device_pointer(q, "q", dtype="f32")
    with pytest.raises(ValueError, match=r"q must have shape \(\*, 8, 128\), got \(8, 4, 128\)"):
        device_pointer(q, "q", shape=(None, 8, 128))
    with pytest.raises(ValueError, match="holds 8,192 bytes .* touches 8,194"):
        device_pointer(q, "q", min_bytes=8194)


def test_a_strided_view_is_refused_not_misread():
    # the query half of an interleaved [T, 2, H, D] projection: rows 2*H*D apart
    half = CAI(0x7F00_0000_1000, (8, 4, 128), "<V2", strides=(2 * 4 * 128 * 2, 128 * 2, 2))
    info = describe(half)
    assert info.strides == (1024, 128, 1) and not info.contiguous
    with pytest.raises(ValueError, match="q must be contiguous .* strides \\(1024, 128, 1\\)"):
        device_pointer(half, "q", dtype="bf16")
    # a C-contiguous object that spells its strides out is fine
    dense = CAI(0x7F00_0000_1000, (8, 4, 128), "<V2", strides=(4 * 128 * 2, 128 * 2, 2))
    assert describe(dense).contiguous and device_pointer(dense, "q") == 0x7F00_0000_1000


def test_cai_version_3_carries_its_stream():
    assert describe(CAI(0x1000, (4,), "<f4", version=3, stream=0xABC)).stream == 0xABC
    assert describe(CAI(0x1000, (4,), "<f4", version=2, stream=0xABC)).stream is None


def test_unknown_typestr_and_malformed_interfaces_are_named():
    with pytest.raises(TypeError, match="typestr '<c8' is not a dtype q12drv knows"):
        describe(CAI(0x1000, (4,), "<c8"), "o")
    bad = CAI(0x1000, (4,), "<f4")
    del bad._cai["data"]
    with pytest.raises(TypeError, match="malformed __cuda_array_interface__"):
        describe(bad, "o")


def test_host_arrays_through_dlpack_only_where_host_memory_is_allowed():
    a = np.zeros((16, 32), np.float32)
    info = describe(a)
    assert info.source == "dlpack" and info.device == ("cpu", 0) and info.ptr == a.ctypes.data
    assert info.dtype == "f32" and info.shape == (16, 32) and info.contiguous
    assert device_pointer(a, "g", dtype="f32", host_ok=True) == a.ctypes.data
    with pytest.raises(ValueError, match="g is host memory .* the kernels need device memory"):
        device_pointer(a, "g", dtype="f32")
    # a transposed view: DLPack strides in elements
    t = describe(a.T)
    assert t.strides == (1, 32) and not t.contiguous
    with pytest.raises(ValueError, match="must be contiguous"):
        device_pointer(a.T, "g", host_ok=True)
    # an offset view addresses its first element
    assert describe(a[3:]).ptr == a.ctypes.data + 3 * 32 * 4


def test_torch_tensors_through_dlpack():
    torch = pytest.importorskip("torch")
    x = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    info = describe(x)
    assert (info.dtype, info.shape, info.ptr) == ("bf16", (8, 2, 64), x.data_ptr())
    assert device_pointer(x, "k", dtype="bf16", shape=(8, 2, 64), host_ok=True) == x.data_ptr()
    with pytest.raises(ValueError, match="must be contiguous"):
        device_pointer(x.transpose(0, 1), "k", host_ok=True)
    e = torch.zeros(4, dtype=torch.float8_e4m3fn)
    assert describe(e).dtype == "f8e4m3"


def test_dtype_names():
    assert dtype_name("bf16") == "bf16" and dtype_name(np.float32) == "f32" and dtype_name("<i8") == "i64"
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtype_name(ml_dtypes.bfloat16) == "bf16"
    with pytest.raises(TypeError, match="has no q12drv name"):
        dtype_name(np.complex64)


def test_streams_in_every_form():
    class CoreStream:  # cuda.core's protocol
        def __cuda_stream__(self):
            return (0, 0xDEAD)

    class TorchStream:
        cuda_stream = 0xBEEF

    class Bad:
        def __cuda_stream__(self):
            return 5

    assert stream_handle(None) is None and stream_handle(0) == 0 and stream_handle(np.int64(7)) == 7
    assert stream_handle(CoreStream()) == 0xDEAD and stream_handle(TorchStream()) == 0xBEEF
    with pytest.raises(TypeError, match=r"__cuda_stream__\(\) must return \(version, handle\)"):
        stream_handle(Bad())
    with pytest.raises(TypeError, match="stream must be None, an int handle"):
        stream_handle("default")
    with pytest.raises(TypeError):
        stream_handle(True)


def test_array_info_extent_of_a_strided_view():
    # rows of 4 elements, 6 apart: the extent is what a kernel could touch, not size * itemsize
    info = ArrayInfo(0x1000, "f32", (3, 4), (6, 1), ("cuda", 0), None, "cai")
    assert info.nbytes == (1 + 2 * 6 + 3) * 4
    assert ctypes.sizeof(ctypes.c_float) == info.itemsize


def test_integer_types_other_than_int_are_addresses():
    assert device_pointer(np.uint64(0x7F00_0000_1000), "s", align=16) == 0x7F00_0000_1000
    with pytest.raises(ValueError, match="s must be 16-byte aligned"):
        device_pointer(np.uint64(0x7F00_0000_1004), "s", align=16)
