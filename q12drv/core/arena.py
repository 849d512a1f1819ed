"""``ScratchArena``: one device allocation carved into named regions by a cursor.

The arena knows names, offsets and sizes; what the bytes mean belongs to the layers above
(:mod:`q12drv.core.layout` decides the sizes, :mod:`q12drv.core.staging` writes the bytes).
Every reservation is bounds-checked before anything is written.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .device import Device, DeviceArray, DeviceBuffer
from .errors import CapacityError, Q12Error
from .ptr import DevicePtr

__all__ = ["ScratchArena", "ArenaRegion", "GUARD_BYTES", "GUARD_PATTERN", "MAX_CAPACITY"]

#: Bytes past the capacity filled with :data:`GUARD_PATTERN` and checked by :meth:`ScratchArena.guard_intact`.
GUARD_BYTES = 256
GUARD_PATTERN = 0x5A
#: Largest arena capacity accepted (1 TiB): anything larger is a wrapped or mistyped size, not a plan.
MAX_CAPACITY = 1 << 40
_BASE_ALIGN = 256
#: A :class:`DevicePtr` of an address known to be in range (base + an offset inside the capacity), without
#: the checks of ``DevicePtr()``.
_ptr = int.__new__


class ArenaRegion(NamedTuple):
    """A reservation: ``name``, byte ``offset`` from the base, ``nbytes``, and its device ``ptr``
    (immutable; a named tuple because a pass makes one per reservation on the host's hot path)."""

    name: str
    offset: int
    nbytes: int
    ptr: DevicePtr

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class ScratchArena:
    """A bump-cursor arena over one ``cuMemAlloc``'d buffer.

    Parameters
    ----------
    device : Device
    nbytes : int
        Capacity. (A guard band of :data:`GUARD_BYTES` is allocated past it.)

    Examples
    --------
    >>> with open_device("emu") as dev, ScratchArena(dev, 1 << 20) as arena:   # doctest: +SKIP
    ...     moe = arena.reserve("moe_topk", 4096, align=64)
    ...     arena.cursor
    4096
    """

    def __init__(self, device: Device, nbytes: int):
        if not isinstance(device, Device):
            raise TypeError(f"device must be a q12drv Device (q12drv.open_device()), got {type(device).__name__}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise TypeError(f"arena capacity nbytes must be an int, got {type(nbytes).__name__} {nbytes!r:.60}")
        if not 0 < int(nbytes) <= MAX_CAPACITY:
            raise ValueError(f"arena capacity nbytes must be in [1, {MAX_CAPACITY}], got {int(nbytes)}")
        device._require_open()
        self.device = device
        device._dependents.add(self)  # closed with the device (_device_closed)
        self.capacity = int(nbytes)
        self.cursor = 0
        #: Bumped by :meth:`reset`: what was placed before is no longer valid
        #: (a JIT slot or a pass from an earlier generation refuses to write).
        self.generation = 0
        self._regions: list[ArenaRegion] = []
        self._adopted: tuple | None = None  # (regions, first offset, end): the tuple reserve_all checked last
        self._attachments: dict[str, Any] = {}
        self._buffer: DeviceBuffer | None = device.alloc(self.capacity + GUARD_BYTES, "q12 scratch arena")
        try:
            if int(self._buffer.ptr) % _BASE_ALIGN:
                raise Q12Error(f"cuMemAlloc returned {self._buffer.ptr!r}, not {_BASE_ALIGN}-aligned")
            self.base = self._buffer.ptr
            self._base = int(self.base)  # for the hot paths' pointer checks
            device.memset(int(self.base) + self.capacity, GUARD_PATTERN, GUARD_BYTES)
            device.synchronize()
        except BaseException:
            buf, self._buffer = self._buffer, None  # a failed arena frees its allocation
            try:
                if not device.closed:
                    device.synchronize()  # the memset may be queued: let it finish before the free
            except Exception:
                pass
            try:
                buf.free()
            except Exception:
                pass  # report the original error
            raise

    # reservations ----------------------------------------------------------------------
    @property
    def regions(self) -> tuple:
        return tuple(self._regions)

    def region(self, name: str) -> ArenaRegion:
        for r in self._regions:
            if r.name == name:
                return r
        raise KeyError(f"the arena has no region {name!r}; it has: {', '.join(r.name for r in self._regions) or 'none'}")

    def reserve(self, name: str, nbytes: int, *, align: int = 8, offset: int | None = None) -> ArenaRegion:
        """Reserve ``nbytes`` at the cursor (or at ``offset`` >= cursor) and advance the cursor past it.

        Raises
        ------
        CapacityError
            The region would end past the capacity; the cursor and the bytes are unchanged.
        ValueError
            Bad sizes, alignment, or an ``offset`` behind the cursor or misaligned.
        """
        if (type(nbytes) is int and type(align) is int and type(offset) is int and type(name) is str and self._buffer is not None
                and nbytes >= 0 and align > 0 and not align & (align - 1) and self.cursor <= offset
                and not offset % align and offset + nbytes <= self.capacity):  # the stager's call, nothing unusual
            region = ArenaRegion(name, offset, nbytes, _ptr(DevicePtr, self._base + offset))  # in range: checked
            self._regions.append(region)
            self.cursor = offset + nbytes
            return region
        self._require_open()
        if not isinstance(name, str):
            raise TypeError(f"region name must be a str, got {type(name).__name__} {name!r:.60}")
        for arg, v in (("nbytes", nbytes), ("align", align), ("offset", 0 if offset is None else offset)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"region {name!r}: {arg} must be an int, got {type(v).__name__} {v!r:.60}")
        if int(nbytes) < 0:
            raise ValueError(f"region {name!r}: size must be a non-negative int, got {nbytes!r}")
        if align < 1 or align & (align - 1):
            raise ValueError(f"region {name!r}: alignment must be a power of two, got {align}")
        nbytes, align = int(nbytes), int(align)
        if offset is None:
            start = (self.cursor + align - 1) // align * align
        else:
            start = int(offset)
            if start < self.cursor:
                raise ValueError(f"region {name!r} at offset {start:,} would overlap what is reserved up to the cursor {self.cursor:,}")
            if start % align:
                raise ValueError(f"region {name!r}: offset {start:,} is not {align}-aligned")
        if start + nbytes > self.capacity:
            raise CapacityError(name, start + nbytes, self.capacity,
                                f"the arena is {self.capacity:,} bytes (cursor at {self.cursor:,}); size it with q12drv.core.layout")
        region = ArenaRegion(name, start, nbytes, DevicePtr(int(self.base) + start))
        self._regions.append(region)
        self.cursor = start + nbytes
        return region

    def reserve_all(self, regions: Sequence[ArenaRegion]) -> None:
        """Reserve regions this arena handed out before, as they were (same names, offsets, sizes and
        pointers): what a pass that lays out the same plan again does, without rebuilding each region.

        Raises
        ------
        ValueError
            A region that is not this arena's (its pointer is not ``base + offset``), regions out of
            order or overlapping, or one behind the cursor; nothing is reserved.
        CapacityError
            The last region ends past the capacity; nothing is reserved.
        """
        self._require_open()
        memo = self._adopted
        if memo is not None and memo[0] is regions and self.cursor <= memo[1]:
            # the same tuple (immutable, of immutable regions) checked before: only the cursor may differ
            self._regions.extend(regions)
            self.cursor = memo[2]
            return
        base, at = int(self.base), self.cursor
        for r in regions:
            if type(r) is not ArenaRegion or r.ptr != base + r.offset or r.nbytes < 0:
                raise ValueError(f"region {getattr(r, 'name', r)!r} was not handed out by this arena (base {base:#x})")
            if r.offset < at:
                raise ValueError(f"region {r.name!r} at offset {r.offset:,} would overlap what is reserved up to {at:,}")
            at = r.offset + r.nbytes
        if at > self.capacity:
            raise CapacityError(regions[-1].name, at, self.capacity, f"the arena is {self.capacity:,} bytes")
        self._regions.extend(regions)
        self.cursor = at
        if type(regions) is tuple and regions:
            self._adopted = (regions, regions[0].offset, at)

    def reserve_again(self, region: ArenaRegion) -> None:
        """Reserve one region this arena handed out before, as it was: :meth:`reserve_all` of
        ``(region,)``, at a fraction of the cost (what a pass staged at a fixed offset does every time).

        Raises
        ------
        ValueError, CapacityError
            As :meth:`reserve_all`; nothing is reserved.
        """
        if type(region) is ArenaRegion:
            name, offset, nbytes, ptr = region
            if (self.cursor <= offset and ptr == self._base + offset and 0 <= nbytes
                    and offset + nbytes <= self.capacity and self._buffer is not None):  # the common case
                self._regions.append(region)
                self.cursor = offset + nbytes
                return
        self.reserve_all((region,))

    def unreserve(self, region: ArenaRegion) -> None:
        """Undo the most recent reservation (used to roll back after a failed upload)."""
        if not self._regions or self._regions[-1] != region:
            raise ValueError(f"only the most recent reservation can be undone, not {region.name!r}")
        self._regions.pop()
        self.cursor = self._regions[-1].end if self._regions else 0

    def check_range(self, what: str, offset: int, nbytes: int) -> None:
        """Raise :class:`CapacityError` unless ``[offset, offset + nbytes)`` lies inside the capacity."""
        if type(offset) is int and type(nbytes) is int and 0 <= offset and 0 <= nbytes and offset + nbytes <= self.capacity:
            return
        for arg, v in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{what}: {arg} must be an int, got {type(v).__name__} {v!r:.60}")
        if offset < 0 or nbytes < 0:
            raise ValueError(f"{what}: negative offset or size ({offset}, {nbytes})")
        if offset + nbytes > self.capacity:
            raise CapacityError(what, offset + nbytes, self.capacity, f"the arena is {self.capacity:,} bytes")

    def reset(self) -> None:
        """Forget every reservation; the cursor goes back to 0 (the bytes are left as they are)."""
        self.cursor = 0
        self._regions.clear()
        self.generation += 1

    def check_consistent(self) -> None:
        """Raise :class:`~q12drv.core.errors.Q12Error` unless the reservations and the cursor agree.

        The regions must lie inside the capacity, in order, without overlapping, and the cursor
        must sit at the end of the last one (0 when there is none).
        """
        end = 0
        for r in self._regions:
            if r.offset < end or r.nbytes < 0 or r.end > self.capacity or r.ptr != int(self.base) + r.offset:
                raise Q12Error(f"arena region {r.name!r} [{r.offset:,}, {r.end:,}) is out of order, overlaps or "
                               f"leaves the {self.capacity:,}-byte arena")
            end = r.end
        if self.cursor != end:
            raise Q12Error(f"arena cursor {self.cursor:,} is not at the end of the last reservation ({end:,})")

    # access ----------------------------------------------------------------------------
    def ptr(self, offset: int) -> DevicePtr:
        """The device address of byte ``offset`` (:class:`~q12drv.core.errors.Q12Error` once closed)."""
        self._require_open()
        self.check_range("pointer", offset, 0)
        return DevicePtr(int(self.base) + int(offset))

    def read(self, offset: int, nbytes: int, stream: Any = None) -> bytes:
        """Copy ``nbytes`` at ``offset`` back to the host, after the work on ``stream`` (synchronizing)."""
        self._require_open()
        self.check_range("read", offset, nbytes)
        return self.device.download(int(self.base) + offset, nbytes, stream)

    def view(self, offset: int, dtype, shape) -> DeviceArray:
        """A zero-copy :class:`~q12drv.core.device.DeviceArray` (``__cuda_array_interface__``) over arena bytes
        (:class:`~q12drv.core.errors.Q12Error` once closed: the memory is freed)."""
        self._require_open()
        arr = DeviceArray(int(self.base) + int(offset), dtype, shape, owner=self)
        self.check_range("view", offset, arr.nbytes)
        return arr

    def guard_intact(self) -> bool:
        """Whether the guard band past the capacity still holds its pattern (synchronizing)."""
        self._require_open()
        band = self.device.download(int(self.base) + self.capacity, GUARD_BYTES)
        return band == bytes([GUARD_PATTERN]) * GUARD_BYTES

    # attachments (e.g. the stager's pinned rings), released with the arena ---------------
    def find_attachment(self, key: str) -> Any:
        """The attachment under ``key``, or None (never creates one)."""
        return self._attachments.get(key)

    def attachment(self, key: str, factory: Callable[[], Any]) -> Any:
        obj = self._attachments.get(key)
        if obj is None:
            self._require_open()
            obj = self._attachments[key] = factory()
        return obj

    # lifetime --------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._buffer is None:
            raise Q12Error("this ScratchArena is closed")

    @property
    def closed(self) -> bool:
        """True after :meth:`close`, or after the device was closed (which frees the arena's memory)."""
        return self._buffer is None

    def _device_closed(self) -> None:
        # Device.close released the allocation, the pinned rings and their events: nothing is left to free
        self._buffer = None
        self._attachments.clear()

    def close(self) -> None:
        """Wait for pending work, release attachments and free the allocation. Idempotent.

        Everything is released even when a step fails (e.g. the wait reports an earlier
        asynchronous error), except the allocation when the wait itself failed: queued work may
        still use it, so it is left to :meth:`Device.close`. The first error is raised afterwards.
        """
        if self._buffer is None:
            return
        errors = []
        waited = True
        if not self.device.closed:
            try:
                self.device.synchronize()
            except Exception as exc:
                errors.append(exc)
                waited = False
        for obj in self._attachments.values():
            try:
                obj.close()
            except Exception as exc:
                errors.append(exc)
        self._attachments.clear()
        buf, self._buffer = self._buffer, None
        if not self.device.closed and waited:
            try:
                buf.free()
            except Exception as exc:
                errors.append(exc)
        # (if the wait failed, queued work may still use the allocation: Device.close frees it)
        if errors:
            raise errors[0]

    def __enter__(self) -> "ScratchArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._buffer is None else f"base={self.base!r}"
        return f"ScratchArena({state}, capacity={self.capacity:,}, cursor={self.cursor:,})"
