"""``ScratchArena``: one device buffer carved into named regions by a cursor.

The arena knows names, offsets and sizes; what the bytes mean belongs to the layers above
(:mod:`q12drv.core.layout` decides the sizes, :mod:`q12drv.core.staging` writes the bytes).
Every reservation is bounds-checked before anything is written.

The buffer is either the arena's own allocation (``ScratchArena(device, nbytes)``) or memory the caller
owns (:meth:`ScratchArena.over`: a torch tensor, a pointer and a size), which the arena never frees. Its
pinned staging rings may likewise run over the caller's page-locked memory (:meth:`ScratchArena.use_pinned`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .device import Device, DeviceArray, DeviceBuffer
from .errors import CapacityError, Q12Error
from .interop import caller_memory
from .layout import align_up
from .pinned import PinnedRing
from .ptr import DevicePtr

__all__ = ["ScratchArena", "ArenaRegion", "GUARD_BYTES", "GUARD_PATTERN", "MAX_CAPACITY", "OVER_ALIGN", "RINGS",
           "RING_KEYS"]

#: Bytes past the capacity filled with :data:`GUARD_PATTERN` and checked by :meth:`ScratchArena.guard_intact`.
GUARD_BYTES = 256
GUARD_PATTERN = 0x5A
#: Largest arena capacity accepted (1 TiB): anything larger is a wrapped or mistyped size, not a plan.
MAX_CAPACITY = 1 << 40
_BASE_ALIGN = 256
#: Alignment the caller's buffer must have (:meth:`ScratchArena.over`): the layout's regions are 64-byte aligned,
#: and what torch allocates (on the GPU and on the host) is at least that.
OVER_ALIGN = 64
#: The arena's pinned staging rings: the stacked metadata's and the ``h_state_ptrs`` uploads'.
RINGS = ("staging", "h_state")
#: Each ring's attachment key (:meth:`ScratchArena.attachment`).
RING_KEYS = {name: f"ring:{name}" for name in RINGS}
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


class _Borrowed:
    """The caller's device memory an arena runs over: its address and size, and the object that owns it (kept
    alive while the arena is open). ``free()`` forgets it: the arena never frees what it did not allocate."""

    __slots__ = ("ptr", "nbytes", "owner")

    def __init__(self, ptr: int, nbytes: int, owner: Any):
        self.ptr, self.nbytes, self.owner = DevicePtr(ptr), int(nbytes), owner

    def free(self) -> None:
        self.owner = None


def _capacity(nbytes) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"arena capacity nbytes must be an int, got {type(nbytes).__name__} {nbytes!r:.60}")
    if not 0 < int(nbytes) <= MAX_CAPACITY:
        raise ValueError(f"arena capacity nbytes must be in [1, {MAX_CAPACITY}], got {int(nbytes)}")
    return int(nbytes)


def _require_device(device) -> None:
    if not isinstance(device, Device):
        raise TypeError(f"device must be a q12drv Device (q12drv.open_device()), got {type(device).__name__}")
    device._require_open()


class ScratchArena:
    """A bump-cursor arena over one device buffer: its own ``cuMemAlloc`` allocation, or the caller's memory
    (:meth:`over`).

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
        _require_device(device)
        self._start(device, _capacity(nbytes))
        buf = device.alloc(self.capacity + GUARD_BYTES, "q12 scratch arena")
        try:
            if int(buf.ptr) % _BASE_ALIGN:
                raise Q12Error(f"cuMemAlloc returned {buf.ptr!r}, not {_BASE_ALIGN}-aligned")
        except BaseException:
            buf.free()
            raise
        self._place(buf)

    @staticmethod
    def buffer_bytes(capacity: int) -> int:
        """Bytes a caller's buffer needs for an arena of ``capacity`` (:meth:`over`): the capacity plus the
        :data:`GUARD_BYTES` guard band, which lives inside the given buffer."""
        return _capacity(capacity) + GUARD_BYTES

    @classmethod
    def over(cls, device: Device, buffer: Any, nbytes: int | None = None) -> "ScratchArena":
        """An arena over device memory the caller owns; nothing is allocated, nothing is ever freed.

        Parameters
        ----------
        device : Device
        buffer : int, DevicePtr, DeviceBuffer, or an object with ``__cuda_array_interface__`` or ``__dlpack__``
            The memory: a raw device address (then ``nbytes`` is required: its size is the caller's word), a
            q12drv :class:`~q12drv.core.device.DeviceBuffer`, or a tensor/array (torch, CuPy, cuda.core; any dtype,
            contiguous). On the emulated driver a host array or tensor (numpy, torch on the CPU) is adopted as
            the device's memory for as long as it lives (:meth:`Device.adopt <q12drv.core.device.Device.adopt>`).
        nbytes : int, optional
            Bytes of ``buffer`` the arena may use, from its start; default: all of it. The last
            :data:`GUARD_BYTES` of them are the guard band (:meth:`guard_intact`), so the capacity is
            ``nbytes - GUARD_BYTES``; size a buffer for a capacity with :meth:`buffer_bytes`.

        Returns
        -------
        ScratchArena
            Open while ``buffer`` is kept alive by it; :meth:`close` only forgets the buffer. Its guard band is
            written once here (the only bytes written before the first reservation).

        Raises
        ------
        TypeError
            ``buffer`` is neither an address nor an object that describes memory, or ``nbytes`` is not an int.
        ValueError
            Refused before anything is written: ``buffer`` holds fewer than ``nbytes`` bytes, ``nbytes`` leaves no
            capacity past the guard band, the address is not 256-byte aligned, the memory is not contiguous, belongs
            to another device, or is host memory on a GPU (or memory the driver does not know).

        Notes
        -----
        The buffer must start :data:`OVER_ALIGN`-byte aligned (an arena's own allocation is 256-byte aligned).
        Reservations are aligned as addresses, so ``reserve(..., align=256)`` on a less aligned base still gets a
        256-aligned address (or a clear error at a fixed ``offset``).
        """
        _require_device(device)
        ptr, nbytes, owner = _resolve_buffer(device, buffer, nbytes)
        if nbytes <= GUARD_BYTES:
            raise ValueError(f"ScratchArena.over: {nbytes:,} bytes leave no capacity: the last {GUARD_BYTES} bytes of "
                             f"the buffer are the guard band; give ScratchArena.buffer_bytes(capacity) bytes")
        capacity = _capacity(nbytes - GUARD_BYTES)
        if ptr % OVER_ALIGN:
            raise ValueError(f"ScratchArena.over: the buffer starts at {ptr:#x}, not {OVER_ALIGN}-byte aligned (the "
                             f"layout's regions are {OVER_ALIGN}-byte aligned); pass an aligned buffer or slice")
        _check_memory(device, ptr, nbytes)
        arena = cls.__new__(cls)
        arena._start(device, capacity)
        arena._place(_Borrowed(ptr, nbytes, owner))
        return arena

    def _start(self, device: Device, capacity: int) -> None:
        self.device = device
        device._dependents.add(self)  # closed with the device (_device_closed)
        self.capacity = capacity
        self.cursor = 0
        #: Bumped by :meth:`reset`: what was placed before is no longer valid
        #: (a JIT slot or a pass from an earlier generation refuses to write).
        self.generation = 0
        self._regions: list[ArenaRegion] = []
        self._adopted: tuple | None = None  # (regions, first offset, end): the tuple reserve_all checked last
        self._attachments: dict[str, Any] = {}
        self._buffer = None

    def _place(self, buf) -> None:
        """Run over ``buf`` (a DeviceBuffer or a _Borrowed): write the guard band; on failure let ``buf`` go."""
        device = self.device
        self._buffer = buf
        try:
            self.base = buf.ptr
            self._base = int(self.base)  # for the hot paths' pointer checks
            device.memset(int(self.base) + self.capacity, GUARD_PATTERN, GUARD_BYTES)
            device.synchronize()
        except BaseException:
            self._buffer = None  # a failed arena frees its allocation (forgets the caller's)
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

    def grow(self, nbytes: int, buffer: Any = None, buffer_bytes: int | None = None) -> bool:
        """Make the capacity at least ``nbytes``, in place: for a batch larger than the arena was sized for.

        Nothing happens when the capacity is already enough (returns False). Otherwise the arena waits for the
        device (queued work may still read the old memory), moves to new memory, forgets every reservation and
        bumps :attr:`generation`, so a :class:`~q12drv.prefill.Q12Pass`, JIT slot, ``ExpandPlan`` or ``PassGraph``
        made on the old memory refuses to run; stage the next pass as usual. Its pinned rings are kept.

        Parameters
        ----------
        nbytes : int
            The capacity needed (e.g. ``Q12Pass.arena_bytes(counts, ...)``). An arena of its own allocates
            ``max(nbytes, 1.5 x capacity)``, so a batch that keeps growing reallocates O(log) times.
        buffer, buffer_bytes : optional
            For an arena over the caller's memory (:meth:`over`), which never allocates: the new memory, as
            :meth:`over` takes it (``buffer_bytes``: its ``nbytes``), at least :meth:`buffer_bytes` ``(nbytes)``.
            The old buffer is forgotten, not freed. Not given to an arena of its own.

        Returns
        -------
        bool
            Whether the arena moved.

        Raises
        ------
        ValueError
            ``nbytes`` out of range; an arena over the caller's memory given no (or too small a) ``buffer``; a
            ``buffer`` given to an arena of its own. Nothing changes then, nor when the allocation fails.
        """
        self._require_open()
        need = _capacity(nbytes)
        owned = self.owns_memory
        if buffer is not None and owned:
            raise ValueError("ScratchArena.grow: this arena allocates its own memory; leave buffer out")
        if need <= self.capacity:
            return False
        device = self.device
        if owned:
            capacity = min(max(need, self.capacity * 3 // 2), MAX_CAPACITY)
            new = ScratchArena(device, capacity)
            buf = new._buffer
        else:
            if buffer is None:
                raise ValueError(f"ScratchArena.grow: the arena is over your memory ({self.capacity:,} bytes) and "
                                 f"never allocates; pass a buffer of at least ScratchArena.buffer_bytes({need}) = "
                                 f"{self.buffer_bytes(need):,} bytes")
            size = buffer_bytes if buffer_bytes is not None else buffer.nbytes if isinstance(buffer, DeviceBuffer) \
                else caller_memory(buffer, None, "ScratchArena.grow")[1]
            if type(size) is int and size - GUARD_BYTES < need:  # refused before over() writes its guard band
                raise ValueError(f"ScratchArena.grow: the new buffer holds a {max(size - GUARD_BYTES, 0):,}-byte "
                                 f"arena, {need:,} bytes are needed; pass ScratchArena.buffer_bytes({need}) = "
                                 f"{self.buffer_bytes(need):,} bytes")
            new = ScratchArena.over(device, buffer, buffer_bytes)
            capacity, buf = new.capacity, new._buffer
        device._dependents.discard(new)
        new._buffer = None  # the new memory is this arena's now
        device.synchronize()  # queued work may still read the old memory
        old, self._buffer = self._buffer, buf
        self.base, self._base, self.capacity = buf.ptr, int(buf.ptr), capacity
        self._adopted = None
        self.reset()
        if owned:
            old.free()
        return True

    @property
    def owns_memory(self) -> bool:
        """Whether the arena allocated its buffer (and frees it at :meth:`close`); False for :meth:`over`."""
        return isinstance(self._buffer, DeviceBuffer)

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
                and not (self._base + offset) % align and offset + nbytes <= self.capacity):  # the stager's call
            region = ArenaRegion(name, offset, nbytes, _ptr(DevicePtr, self._base + offset))  # in range: checked
            self._regions.append(region)
            self.cursor = offset + nbytes
            return region
        start = self.check_reserve(name, nbytes, align=align, offset=offset)
        nbytes = int(nbytes)
        region = ArenaRegion(name, start, nbytes, DevicePtr(int(self.base) + start))
        self._regions.append(region)
        self.cursor = start + nbytes
        return region

    def check_reserve(self, name: str, nbytes: int, *, align: int = 8, offset: int | None = None) -> int:
        """Where :meth:`reserve` would place the region, changing nothing: for a caller that must know every
        arena can take its region before it writes to any (one batch staged into several arenas).

        Raises
        ------
        CapacityError, ValueError, TypeError
            As :meth:`reserve`.
        """
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
        base = self._base  # regions are aligned as addresses (a caller's buffer may be less aligned than 256)
        if offset is None:
            start = align_up(base + self.cursor, align) - base
        else:
            start = int(offset)
            if start < self.cursor:
                raise ValueError(f"region {name!r} at offset {start:,} would overlap what is reserved up to the cursor {self.cursor:,}")
            if (base + start) % align:
                raise ValueError(f"region {name!r}: offset {start:,} (address {base + start:#x}) is not {align}-aligned")
        if start + nbytes > self.capacity:
            raise CapacityError(name, start + nbytes, self.capacity,
                                f"the arena is {self.capacity:,} bytes (cursor at {self.cursor:,}); size it with q12drv.core.layout")
        return start

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

    def view(self, offset: int, dtype, shape, stream: Any = None) -> DeviceArray:
        """A zero-copy :class:`~q12drv.core.device.DeviceArray` (``__cuda_array_interface__``) over arena bytes
        (:class:`~q12drv.core.errors.Q12Error` once closed: the memory is freed). ``stream``: the stream the work
        that writes them was enqueued on (as :meth:`Device.as_stream <q12drv.core.device.Device.as_stream>` takes
        it; None: the device's stream), which the view exports for its consumer to wait on."""
        self._require_open()
        arr = DeviceArray(int(self.base) + int(offset), dtype, shape, owner=self,
                          stream=self.device.stream_handle_of(stream))
        self.check_range("view", offset, arr.nbytes)
        return arr

    def guard_intact(self) -> bool:
        """Whether the guard band past the capacity still holds its pattern (synchronizing)."""
        self._require_open()
        band = self.device.download(int(self.base) + self.capacity, GUARD_BYTES)
        return band == bytes([GUARD_PATTERN]) * GUARD_BYTES

    # attachments (e.g. the stager's pinned rings), released with the arena ---------------
    def use_pinned(self, buffer: Any, nbytes: int | None = None, *, ring: str = "staging",
                   nslots: int = 2) -> PinnedRing:
        """Make the arena's pinned ``ring`` (one of :data:`RINGS`) run over page-locked host memory the caller owns,
        split into ``nslots`` slots, instead of allocating its own (the default, which needs no call).

        ``buffer``: a raw host address (then ``nbytes`` is required) or an object with ``__array_interface__`` /
        DLPack host memory (a pinned torch tensor, a numpy array over ``cuMemHostAlloc`` memory); ``nbytes``
        defaults to all of it. The ring never grows and never frees it: an upload larger than a slot is refused
        with a :class:`~q12drv.core.errors.CapacityError`. Call it before the first staging of that ring.

        Raises
        ------
        ValueError
            An unknown ``ring``, one the arena already made, or what :meth:`PinnedRing.over
            <q12drv.core.pinned.PinnedRing.over>` refuses (too small, not page-locked on a GPU, device memory).
        """
        self._require_open()
        if ring not in RINGS:
            raise ValueError(f"ring must be one of {', '.join(RINGS)}, got {ring!r}")
        key = RING_KEYS[ring]
        if key in self._attachments:
            raise ValueError(f"the arena's {ring!r} ring exists already (made by an earlier staging or use_pinned); "
                             f"call use_pinned right after making the arena")
        made = PinnedRing.over(self.device, buffer, nbytes, nslots=nslots, name=ring)
        self._attachments[key] = made
        return made

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
        mem = "" if self._buffer is None or self.owns_memory else ", caller's memory"
        return f"ScratchArena({state}, capacity={self.capacity:,}, cursor={self.cursor:,}{mem})"


def _resolve_buffer(device: Device, buffer: Any, nbytes: Any) -> tuple:
    """``(address, bytes to use, owner)`` of the memory ``buffer`` stands for (checked for its device)."""
    if isinstance(buffer, DeviceBuffer):
        if buffer.device is not device and not device._same_context(buffer.device):
            raise ValueError(f"ScratchArena.over: the DeviceBuffer is memory of device {buffer.device.ordinal}, the "
                             f"arena's device is {device.ordinal}")
        if not buffer.alive:
            raise ValueError("ScratchArena.over: that DeviceBuffer has been freed")
        buffer = buffer.view(np.uint8, (buffer.nbytes,))  # described like any other device array, kept alive by it
    ptr, nbytes, info = caller_memory(buffer, nbytes, "ScratchArena.over")
    if info is None:
        return ptr, nbytes, None
    return device.pointer(buffer, "buffer"), nbytes, buffer  # contiguous, this device's; host memory adopted (emu)


def _check_memory(device: Device, ptr: int, nbytes: int) -> None:
    """Refuse ``[ptr, ptr + nbytes)`` unless the driver knows it as memory of ``device`` in one allocation."""
    device.use()
    where = device.driver.pointer_info(ptr)
    if where is None:
        hint = ("adopt host memory first (Device.adopt, or pass the array itself)" if device.emulated else
                "host memory that is not page-locked, or no memory at all")
        raise ValueError(f"ScratchArena.over: {ptr:#x} is no device memory the {device.driver.name} driver knows "
                         f"({hint})")
    if where.kind != "device":
        raise ValueError(f"ScratchArena.over: {ptr:#x} is page-locked host memory; the arena must be device memory "
                         f"of device {device.ordinal}")
    if where.ordinal != device.ordinal:
        raise ValueError(f"ScratchArena.over: {ptr:#x} is memory of device {where.ordinal}, the arena's device is "
                         f"{device.ordinal}")
    if where.nbytes and ptr + nbytes > where.start + where.nbytes:
        raise ValueError(f"ScratchArena.over: {nbytes:,} bytes from {ptr:#x} run past the end of its allocation "
                         f"({where.start + where.nbytes - ptr:,} bytes from there)")
