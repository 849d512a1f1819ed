"""A pass's tensor arguments: raw addresses, or objects that describe their memory (torch, CuPy, cuda.core: CUDA
Array Interface or DLPack), checked against what the op reads before anything is enqueued.

A raw ``int`` is the caller's word for what it addresses (range and alignment are checked); a described object is
checked for dtype, shape, contiguity and device, and on the emulated driver its host memory becomes the emulator's
device memory (a dry run of a torch runtime on a machine without a GPU).
"""

from __future__ import annotations

from typing import Any

from ..core.device import Device
from ..core.interop import check_array, describe
from ..core.ptr import DevicePtr, device_ptr

__all__ = ["row_view", "count_of"]


def row_view(device: Device, obj: Any, name: str, *, columns: int, dtype: str, align: int = 16) -> tuple:
    """``(address, row stride in elements)`` of a ``[rows, >= columns]`` operand whose rows may be a strided slice
    of a wider buffer (each row's elements contiguous): a raw address means rows ``columns`` apart."""
    info = None if type(obj) is int or type(obj) is DevicePtr else describe(obj, name)
    if info is None:
        return device_ptr(name, obj, align), columns
    if info.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got a {info.dtype} array of shape {info.shape}")
    if len(info.shape) != 2 or info.shape[1] != columns:
        raise ValueError(f"{name} must have shape (*, {columns}), got {info.shape}")
    row_stride = columns if info.strides is None else info.strides[0]
    if info.strides is not None and info.strides[1] != 1:
        raise ValueError(f"{name}'s elements within a row must be contiguous, got strides {info.strides} (elements)")
    packed = type(info)(info.ptr, info.dtype, (info.shape[0] * row_stride,), None, info.device, info.stream,
                        info.source)
    ptr = check_array(packed, name, align=align, ordinal=device.ordinal, host_ok=device.emulated)
    if info.device[0] == "cpu":
        device.adopt(obj, ptr, info.nbytes, name=name)
    return ptr, row_stride


def count_of(obj: Any, axis: int) -> int | None:
    """Extent ``axis`` of a described object (e.g. a KV pool's block count), or None for a raw address."""
    if type(obj) is int or type(obj) is DevicePtr:
        return None
    info = describe(obj)
    return None if info is None or len(info.shape) <= axis else info.shape[axis]
