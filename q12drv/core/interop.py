"""Memory and streams that belong to other libraries: what their objects say, checked against what an op needs.

q12drv takes device memory as a raw address, or as any object that describes its memory through the CUDA Array
Interface (``__cuda_array_interface__``, versions 2 and 3: CuPy, Numba, torch) or DLPack (``__dlpack__`` /
``__dlpack_device__``: torch, JAX, CuPy, cuda.core). Streams come as a raw handle, a q12drv
:class:`~q12drv.core.device.Stream`, an object with the CUDA stream protocol (``__cuda_stream__()`` returning
``(version, handle)``, as cuda.core defines it), or torch's ``.cuda_stream``.

:func:`describe` reads an object's memory (address, dtype, shape, strides in elements, device, the stream its
bytes are pending on); :func:`device_pointer` returns the address after checking the description against what the
caller needs, with an error that names the argument and the mismatch. A plain ``int`` passes through its fast path
untouched: what it addresses is the caller's word.

dtype names are short and canonical: ``bf16 f16 f32 f64 i8 u8 i16 u16 i32 u32 i64 u64 bool f8e4m3 f8e5m2``.
CAI's ``"<V2"`` (how torch and ml_dtypes spell bfloat16) reads as ``bf16``.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .ptr import DevicePtr, device_ptr

__all__ = ["ArrayInfo", "describe", "device_pointer", "check_array", "host_owner", "caller_memory", "stream_handle",
           "DTYPE_BYTES", "dtype_name"]

#: Bytes per element of every dtype name q12drv knows.
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4,
               "i64": 8, "u64": 8, "bool": 1, "f8e4m3": 1, "f8e5m2": 1}

_TYPESTR = {"<V2": "bf16", "<f2": "f16", "<f4": "f32", "<f8": "f64", "|i1": "i8", "|u1": "u8", "<i2": "i16",
            "<u2": "u16", "<i4": "i32", "<u4": "u32", "<i8": "i64", "<u8": "u64", "|b1": "bool"}
# DLPack's (type code, bits) -> name: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6, kDLFloat8_e4m3fn 10,
# kDLFloat8_e5m2 12
_DLPACK = {(0, 8): "i8", (0, 16): "i16", (0, 32): "i32", (0, 64): "i64", (1, 8): "u8", (1, 16): "u16",
           (1, 32): "u32", (1, 64): "u64", (2, 16): "f16", (2, 32): "f32", (2, 64): "f64", (4, 16): "bf16",
           (6, 8): "bool", (10, 8): "f8e4m3", (12, 8): "f8e5m2"}
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_U64_MAX = (1 << 64) - 1


def dtype_name(dtype: Any) -> str:
    """The canonical name of ``dtype``: one of :data:`DTYPE_BYTES`' keys, a numpy dtype, or ml_dtypes' bfloat16.

    Raises
    ------
    TypeError
        A dtype q12drv has no name for.
    """
    if isinstance(dtype, str) and dtype in DTYPE_BYTES:
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"unknown dtype {dtype!r}; q12drv knows {', '.join(DTYPE_BYTES)}") from None
    if dt.name == "bfloat16":
        return "bf16"
    name = _TYPESTR.get(dt.str) if dt.kind != "V" else None
    if name is None:
        raise TypeError(f"dtype {dt} has no q12drv name; q12drv knows {', '.join(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class ArrayInfo:
    """What an object says about its memory.

    Attributes
    ----------
    ptr : int
        Address of element 0.
    dtype : str
        Canonical dtype name (:data:`DTYPE_BYTES`).
    shape : tuple of int
    strides : tuple of int or None
        In elements; None when C-contiguous.
    device : tuple of (str, int)
        ``("cuda", ordinal)`` or ``("cpu", 0)`` (host memory, pinned or not).
    stream : int or None
        The stream the bytes are pending on (CAI version 3), or None.
    source : str
        ``"cai"`` or ``"dlpack"``.
    """

    ptr: int
    dtype: str
    shape: tuple
    strides: tuple | None
    device: tuple
    stream: int | None
    source: str

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes from element 0 to one past the last element (the extent a kernel may touch)."""
        if self.size == 0:
            return 0
        if self.strides is None:
            return self.size * self.itemsize
        return (1 + sum((d - 1) * s for d, s in zip(self.shape, self.strides) if d > 0)) * self.itemsize

    @property
    def contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != expected:
                return False
            expected *= d
        return True


def describe(obj: Any, name: str = "argument") -> ArrayInfo | None:
    """The memory ``obj`` describes, or None when it describes none (a plain address).

    ``__cuda_array_interface__`` is read first, then DLPack.

    Raises
    ------
    TypeError
        An interface that is malformed or names a dtype q12drv does not know.
    """
    if getattr(type(obj), "__cuda_array_interface__", None) is not None:
        try:
            cai = obj.__cuda_array_interface__
        except AttributeError:  # torch's property on a host tensor
            cai = None
        if cai is not None:
            return _from_cai(cai, name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, name)
    return None


def _from_cai(cai: dict, name: str) -> ArrayInfo:
    try:
        ptr, _readonly = cai["data"]
        shape = tuple(int(s) for s in cai["shape"])
        typestr = cai["typestr"]
    except (KeyError, TypeError, ValueError):
        raise TypeError(f"{name}: malformed __cuda_array_interface__ {cai!r:.200}") from None
    dtype = _TYPESTR.get(typestr)
    if dtype is None:
        raise TypeError(f"{name}: __cuda_array_interface__ typestr {typestr!r} is not a dtype q12drv knows "
                        f"({', '.join(sorted(_TYPESTR))})")
    strides = cai.get("strides")
    item = DTYPE_BYTES[dtype]
    if strides is not None:
        if any(int(s) % item for s in strides):
            raise TypeError(f"{name}: strides {tuple(strides)} (bytes) are not multiples of the item size {item}")
        strides = tuple(int(s) // item for s in strides)
    stream = cai.get("stream") if cai.get("version", 2) >= 3 else None
    return ArrayInfo(int(ptr or 0), dtype, shape, strides, ("cuda", -1), None if stream is None else int(stream),
                     "cai")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any, name: str) -> ArrayInfo:
    dev_type, dev_id = (int(x) for x in obj.__dlpack_device__())
    # stream=-1: the producer must not synchronize (q12drv orders work on the stream it is given); a host array
    # takes no stream argument at all
    try:
        try:
            capsule = obj.__dlpack__(stream=-1) if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED) else obj.__dlpack__()
        except TypeError:
            capsule = obj.__dlpack__()
    except BufferError as exc:  # e.g. numpy's read-only arrays: DLPack 0.x cannot say read-only
        raise TypeError(f"{name}: {type(obj).__name__} refuses to export itself through DLPack: {exc}") from None
    # an unversioned capsule is a DLManagedTensor whose first member is the DLTensor; the capsule keeps
    # ownership (its destructor calls the producer's deleter, since nothing consumed it)
    try:
        addr = _capsule_pointer(capsule, b"dltensor")
    except ValueError:
        raise TypeError(f"{name}: __dlpack__ returned no unversioned 'dltensor' capsule") from None
    t = _DLTensor.from_address(addr)
    dtype = _DLPACK.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if dtype is None:
        raise TypeError(f"{name}: DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, {t.dtype.lanes} lanes) is "
                        f"not one q12drv knows ({', '.join(DTYPE_BYTES)})")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) for i in range(t.ndim))
    ptr = (t.data or 0) + int(t.byte_offset)
    device = ("cuda", dev_id) if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED) else ("cpu", 0)
    if dev_type not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED):
        raise TypeError(f"{name}: DLPack device type {dev_type} is neither CUDA nor host memory")
    del capsule
    return ArrayInfo(ptr, dtype, shape, strides, device, None, "dlpack")


def device_pointer(obj: Any, name: str, *, dtype: str | Sequence[str] | None = None,
                   shape: Sequence[int | None] | None = None, min_bytes: int | None = None, align: int = 1,
                   ordinal: int | None = None, host_ok: bool = False, device: Any = None,
                   info: ArrayInfo | None = None) -> int:
    """The address ``obj`` stands for, checked against what an op needs.

    Parameters
    ----------
    obj : int, DevicePtr, or an object with ``__cuda_array_interface__`` or ``__dlpack__``
        A plain address is checked for range and alignment only.
    name : str
        The argument's name, for the error.
    dtype : str or sequence of str, optional
        The dtype (or dtypes) the op reads.
    shape : sequence of int or None, optional
        The shape the op reads; None entries match any extent. A described object of another shape is refused.
    min_bytes : int, optional
        Bytes the op touches from the address; a described object smaller than that is refused.
    align : int
        Byte alignment the op's accesses need.
    ordinal : int, optional
        The device the op runs on; memory of another CUDA device is refused.
    host_ok : bool
        Accept host memory (the emulated driver runs on it); refused otherwise.
    device : Device, optional
        The q12drv device the op runs on: sets ``ordinal``; on the emulated driver, host memory is adopted as that
        device's memory for as long as ``obj`` lives (:meth:`Device.adopt_described
        <q12drv.core.device.Device.adopt_described>`), after every other check passed.
    info : ArrayInfo, optional
        What :func:`describe` said of ``obj`` already (a caller that read its dtype first): not described again.

    Returns
    -------
    int

    Raises
    ------
    TypeError
        Not an address or an object that describes memory; a wrong dtype.
    ValueError
        NULL, out of range, misaligned, non-contiguous, too small, of another shape or on another device.
    """
    if (type(obj) is int or type(obj) is DevicePtr) and 0 < obj <= _U64_MAX and not obj % align:
        return int(obj)  # the common case: a caller's raw address
    if info is None and not isinstance(obj, (int, np.integer)):
        info = describe(obj, name)
    if info is None:
        if isinstance(obj, bool):
            raise TypeError(f"{name} must be a device pointer or a CUDA array object, got bool {obj!r}")
        try:
            operator.index(obj)
        except TypeError:
            raise TypeError(f"{name} must be a device pointer (int) or an object with __cuda_array_interface__ or "
                            f"__dlpack__, got {type(obj).__name__} {obj!r:.60}") from None
        return device_ptr(name, obj, align)  # a numpy integer, or another int type
    if device is None:
        return check_array(info, name, dtype=dtype, shape=shape, min_bytes=min_bytes, align=align, ordinal=ordinal,
                           host_ok=host_ok)
    adopt = info.device[0] == "cpu" and device.driver.emulated
    ptr = check_array(info, name, dtype=dtype, shape=shape, min_bytes=min_bytes, align=align, ordinal=device.ordinal,
                      host_ok=host_ok or adopt)
    return device.adopt_described(obj, info, name) if adopt else ptr


def caller_memory(buffer: Any, nbytes: Any, what: str) -> tuple:
    """``(address, nbytes, info)`` of memory a caller hands over to ``what`` (e.g. ``"ScratchArena.over"``): a raw
    address and its size (``info`` None: the size is the caller's word), or an object that describes its memory
    (``info``: its :class:`ArrayInfo`), of which ``nbytes`` bytes from its start are used (default: all).

    Raises
    ------
    TypeError
        Neither an address nor a describing object; an address without ``nbytes``; ``nbytes`` not an int.
    ValueError
        A NULL address, a negative ``nbytes``, an empty object, or one that holds fewer than ``nbytes`` bytes.
    """
    info = None
    if isinstance(buffer, bool):
        raise TypeError(f"{what}: buffer must be an address or a tensor/array, got bool")
    if isinstance(buffer, (int, np.integer)):
        ptr = int(buffer)
        if not 0 < ptr <= _U64_MAX:
            raise ValueError(f"{what}: buffer must be a non-NULL address, got {ptr:#x}")
        if nbytes is None:
            raise TypeError(f"{what}: a raw address needs nbytes= (the size of the memory it addresses)")
    else:
        info = describe(buffer, "buffer")
        if info is None:
            raise TypeError(f"{what}: buffer must be an address (int) or an object with __cuda_array_interface__ or "
                            f"__dlpack__, got {type(buffer).__name__}")
        if info.nbytes == 0:
            raise ValueError(f"{what}: buffer is empty ({info.dtype} {info.shape})")
        ptr = info.ptr
        nbytes = info.nbytes if nbytes is None else nbytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{what}: nbytes must be an int, got {type(nbytes).__name__} {nbytes!r:.60}")
    if nbytes < 0:
        raise ValueError(f"{what}: nbytes must be non-negative, got {nbytes}")
    if info is not None and nbytes > info.nbytes:
        raise ValueError(f"{what}: the buffer holds {info.nbytes:,} bytes, fewer than nbytes={int(nbytes):,}")
    return ptr, int(nbytes), info


def _byte_bounds(a: np.ndarray) -> tuple:
    fn = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or np.byte_bounds
    return fn(a)


def host_owner(obj: Any, info: ArrayInfo) -> tuple:
    """``(owner, start, nbytes)``: the object that owns the host memory ``obj`` describes, and that memory's extent.

    For a numpy view, the array at the root of its ``.base`` chain and its bytes; for a torch tensor, the tensor at
    the root of its ``._base`` chain and its whole storage; otherwise ``obj`` itself and the bytes ``info``
    describes. The owner lives at least as long as any view of it, so memory tied to the owner's life stays valid
    while a view is in use.
    """
    if isinstance(obj, np.ndarray):
        root = obj
        while isinstance(root.base, np.ndarray):
            root = root.base
        lo, hi = _byte_bounds(root)
        return root, int(lo), int(hi - lo)
    root = obj
    while getattr(root, "_base", None) is not None:  # torch: a view's base tensor
        root = root._base
    storage = getattr(root, "untyped_storage", None)
    if callable(storage):
        try:
            st = storage()
            start, nbytes = int(st.data_ptr()), int(st.nbytes())
        except Exception:  # not torch's storage after all: the object's own extent
            return obj, info.ptr, info.nbytes
        if start <= info.ptr and info.ptr + info.nbytes <= start + nbytes:
            return root, start, nbytes
    return obj, info.ptr, info.nbytes


def check_array(info: ArrayInfo, name: str, *, dtype=None, shape=None, min_bytes=None, align: int = 1,
                ordinal: int | None = None, host_ok: bool = False) -> int:
    """:func:`device_pointer`'s checks of a described object; returns its address."""
    if dtype is not None:
        wanted = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        if info.dtype not in wanted:
            raise TypeError(f"{name} must be {' or '.join(wanted)}, got a {info.dtype} array of shape {info.shape}")
    if not info.contiguous:
        raise ValueError(f"{name} must be contiguous (the kernels take no strides), got shape {info.shape} with "
                         f"strides {info.strides} (elements); pass .contiguous() or a copy")
    if shape is not None:
        shape = tuple(shape)
        if len(shape) != len(info.shape) or any(w is not None and w != g for w, g in zip(shape, info.shape)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {info.shape}")
    if min_bytes is not None and info.nbytes < min_bytes:
        raise ValueError(f"{name} holds {info.nbytes:,} bytes ({info.dtype} {info.shape}) but the op touches "
                         f"{min_bytes:,}")
    kind, dev = info.device
    if kind == "cpu" and not host_ok:
        raise ValueError(f"{name} is host memory ({info.dtype} {info.shape}); the kernels need device memory")
    if kind == "cuda" and ordinal is not None and dev not in (-1, ordinal):
        raise ValueError(f"{name} lives on CUDA device {dev}, the op runs on device {ordinal}")
    ptr = info.ptr
    if not 0 < ptr <= _U64_MAX:
        if info.nbytes == 0:
            raise ValueError(f"{name} is empty ({info.dtype} {info.shape}): there is nothing to address")
        raise ValueError(f"{name} has address {ptr:#x}, not a device pointer in (0, 2**64)")
    if ptr % align:
        raise ValueError(f"{name} must be {align}-byte aligned (the kernel's accesses need it), got {ptr:#x}")
    return ptr


def stream_handle(stream: Any) -> int | None:
    """The raw ``CUstream`` handle ``stream`` stands for, or None when it names no stream of its own.

    Accepts an int handle (0 the legacy default stream), an object with the CUDA stream protocol
    (``__cuda_stream__()`` -> ``(version, handle)``), torch's ``.cuda_stream``, or ``.handle`` / ``.ptr``
    (cuda.core, CuPy). None stays None (the caller's default).

    Raises
    ------
    TypeError
        Anything else.
    """
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        got = proto()
        try:
            version, handle = got
        except (TypeError, ValueError):
            raise TypeError(f"{type(stream).__name__}.__cuda_stream__() must return (version, handle), got "
                            f"{got!r:.60}") from None
        return int(handle)
    for attr in ("cuda_stream", "handle", "ptr"):
        value = getattr(stream, attr, None)
        if value is not None:
            try:
                return int(value)
            except (TypeError, ValueError):
                continue
    raise TypeError(f"stream must be None, an int handle, a q12drv Stream, or an object with __cuda_stream__ (cuda.core), "
                    f".cuda_stream (torch) or .handle; got {type(stream).__name__}")
