"""``DevicePtr``: a raw ``CUdeviceptr`` that is an ``int`` everywhere an int is accepted."""

from __future__ import annotations

import operator

__all__ = ["DevicePtr", "NULL", "device_ptr"]

_U64_MAX = (1 << 64) - 1


class DevicePtr(int):
    """A device address. Subclasses ``int``, so it passes to any driver call or ctypes field.

    Examples
    --------
    >>> p = DevicePtr(0x7F0000001000)
    >>> p.offset(256)
    DevicePtr(0x7f0000001100)
    >>> bool(NULL)
    False
    """

    __slots__ = ()

    def __new__(cls, value: int = 0):
        if value is True or value is False:  # an int subclass, but never an address
            raise TypeError(f"a device pointer must be an int, got bool {value!r}")
        try:
            v = operator.index(value)  # ints, numpy ints, other DevicePtrs; never a float or a string
        except TypeError:
            raise TypeError(f"a device pointer must be an int, got {type(value).__name__} {value!r:.60}") from None
        if v < 0 or v >= 1 << 64:
            raise ValueError(f"a device pointer must be in [0, 2**64), got {v}")
        return super().__new__(cls, v)

    def offset(self, nbytes: int) -> "DevicePtr":
        """The address ``nbytes`` further on (negative moves back); stays a ``DevicePtr``."""
        return DevicePtr(int(self) + int(nbytes))

    @property
    def is_null(self) -> bool:
        return int(self) == 0

    def __repr__(self) -> str:
        return f"DevicePtr({int(self):#x})"

    def __str__(self) -> str:
        return f"{int(self):#x}"


#: The null device pointer.
NULL = DevicePtr(0)


def device_ptr(name: str, value, align: int = 1, why: str = "the kernel's accesses need it") -> int:
    """``value`` as a device address: an int in ``(0, 2**64)``, a multiple of ``align`` (``why``: what needs the
    alignment, for the message). The one check of a raw address: the launchers', staging's (block-table,
    ``seq_len`` and state pointers) and :meth:`Device.pointer <q12drv.core.device.Device.pointer>`'s for an int.

    Raises
    ------
    TypeError
        Not an int (a float, a string, None, a bool...).
    ValueError
        NULL, negative, past 64 bits, or misaligned; the message names ``name``, the bound and the value.
    """
    if (type(value) is int or type(value) is DevicePtr) and 0 < value <= _U64_MAX and not value % align:
        return int(value)  # the common case
    if value is True or value is False:
        raise TypeError(f"{name} must be a device pointer (int), got bool {value!r}")
    try:
        v = operator.index(value)  # ints, numpy ints, DevicePtrs; never a float or a string
    except TypeError:
        raise TypeError(f"{name} must be a device pointer (int), got {type(value).__name__} {value!r:.60}") from None
    if v <= 0 or v > _U64_MAX:
        raise ValueError(f"{name} must be a non-NULL device pointer in (0, 2**64), got {v:#x}" if v >= 0 else
                         f"{name} must be a non-NULL device pointer in (0, 2**64), got {v}")
    if v % align:
        raise ValueError(f"{name} must be {align}-byte aligned ({why}), got {v:#x}")
    return v
