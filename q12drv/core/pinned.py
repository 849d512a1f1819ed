"""``PinnedRing``: page-locked staging slots, each guarded by an event recorded after its copy.

A slot is handed out again only after the copy that last read it has run, so the host never
rewrites pinned bytes an enqueued ``cuMemcpyHtoDAsync`` has yet to read (the race vLLM's
``UvaBufferPool`` and TensorRT-LLM's double-buffered staging guard against).

A ring allocates its slots (``cuMemHostAlloc``, grown on demand), or runs over page-locked memory the
caller owns (:meth:`PinnedRing.over`: fixed slots, never grown, never freed).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .device import Device, Event, PinnedBuffer
from .errors import CapacityError, Q12Error
from .interop import caller_memory
from .layout import RING_SLOT_ALIGN, ring_slots

__all__ = ["PinnedRing", "PinnedSlot"]

_MIN_SLOT = 4096


class _HostSlice:
    """One slot's share of the caller's page-locked memory (what a :class:`PinnedBuffer` is to an own ring);
    ``free()`` does nothing: the memory is the caller's."""

    __slots__ = ("addr", "nbytes", "array")

    def __init__(self, addr: int, nbytes: int):
        self.addr, self.nbytes = addr, nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))

    def free(self) -> None:
        pass


class PinnedSlot:
    """One ring slot: ``array`` (uint8 view of its pinned bytes), ``addr``, and its guard event."""

    __slots__ = ("buffer", "event", "pending", "index")

    def __init__(self, index: int, event: Event):
        self.index = index
        self.buffer: PinnedBuffer | None = None
        self.event = event
        self.pending = False

    @property
    def array(self) -> np.ndarray:
        return self.buffer.array

    @property
    def addr(self) -> int:
        return self.buffer.addr


class PinnedRing:
    """A ring of ``nslots`` pinned staging buffers (grown on demand, each event-guarded).

    Parameters
    ----------
    device : Device
    nslots : int
        At least 2, so that packing the next pass overlaps the previous copy.
    name : str
        For messages and statistics.

    Attributes
    ----------
    waits : int
        How often :meth:`acquire` had to wait for a slot's previous copy.
    """

    def __init__(self, device: Device, nslots: int = 2, name: str = "staging"):
        if nslots < 2:
            raise ValueError(f"a pinned ring needs at least 2 slots, got {nslots}")
        self.device = device
        self.name = name
        self._slots: list = []
        self._quarantine: list = []
        try:
            for i in range(nslots):
                self._slots.append(PinnedSlot(i, device.event()))
        except BaseException:
            for slot in self._slots:  # a ring that failed to build leaves no events behind
                slot.event.destroy()
            raise
        self._next = 0
        self.waits = 0
        self.uses = 0
        self._slices: list | None = None  # the caller's memory, one slice per slot (over())
        self._owner = None

    @classmethod
    def over(cls, device: Device, buffer: Any, nbytes: int | None = None, *, nslots: int = 2,
             name: str = "staging") -> "PinnedRing":
        """A ring over page-locked host memory the caller owns: ``nslots`` equal slots (64-byte aligned), never
        grown and never freed (:meth:`close` only forgets the memory; ``buffer`` is kept alive until then).

        Parameters
        ----------
        device : Device
        buffer : int or an object with DLPack host memory
            A raw host address (then ``nbytes`` is required), or a host array or tensor (a pinned torch tensor,
            a numpy array over page-locked memory).
        nbytes : int, optional
            Bytes to use from its start; default all of it.
        nslots : int
            At least 2.

        Raises
        ------
        TypeError
            ``buffer`` is neither an address nor an object that describes memory.
        ValueError
            Device memory, a non-contiguous or read-only array, fewer than ``nbytes`` bytes, slots under 64 bytes,
            or (on a GPU) memory that is not page-locked or runs past its registered range; nothing is made.
        """
        if isinstance(nslots, bool) or not isinstance(nslots, int) or nslots < 2:
            raise ValueError(f"a pinned ring needs at least 2 slots, got {nslots!r}")
        addr, nbytes, info = caller_memory(buffer, nbytes, "PinnedRing.over")
        if info is not None:
            if info.device[0] != "cpu":
                raise ValueError(f"PinnedRing.over: buffer is device memory ({info.dtype} {info.shape}); the ring "
                                 f"needs page-locked host memory")
            if not info.contiguous:
                raise ValueError(f"PinnedRing.over: buffer must be contiguous, got shape {info.shape} with strides "
                                 f"{info.strides}")
            if isinstance(buffer, np.ndarray) and not buffer.flags.writeable:
                raise ValueError("PinnedRing.over: buffer is a read-only numpy array; the ring packs into it")
        owner = None if info is None else buffer
        offsets, slot_bytes = ring_slots(addr, nbytes, nslots)
        if slot_bytes < RING_SLOT_ALIGN:
            raise ValueError(f"PinnedRing.over: {nbytes:,} bytes make {nslots} slots of {slot_bytes} bytes; "
                             f"give at least {nslots * RING_SLOT_ALIGN + offsets[0]} bytes")
        device.use()
        where = device.driver.pointer_info(addr)
        if where is not None and where.kind == "device":
            raise ValueError(f"PinnedRing.over: {addr:#x} is device memory; the ring needs page-locked host memory")
        if not device.emulated:  # the emulator copies from any host memory; a GPU's async copy needs it pinned
            if where is None:
                raise ValueError(f"PinnedRing.over: {addr:#x} is not page-locked host memory (pin it: cuMemHostAlloc, "
                                 f"cuMemHostRegister, torch's pin_memory())")
            if where.nbytes and addr + nbytes > where.start + where.nbytes:
                raise ValueError(f"PinnedRing.over: {nbytes:,} bytes from {addr:#x} run past its page-locked range "
                                 f"({where.start + where.nbytes - addr:,} bytes from there)")
        ring = cls(device, nslots, name)
        ring._owner = owner
        ring._slices = [_HostSlice(addr + off, slot_bytes) for off in offsets]
        for slot, piece in zip(ring._slots, ring._slices):
            slot.buffer = piece
        return ring

    @property
    def owns_memory(self) -> bool:
        """Whether the ring allocates its slots (False: the caller's memory, :meth:`over`)."""
        return self._slices is None

    @property
    def nslots(self) -> int:
        return len(self._slots)

    @property
    def slots(self) -> tuple:
        """The ring's slots in index order (a slot's ``buffer`` is None until first used)."""
        return tuple(self._slots)

    def _wait(self, slot: PinnedSlot) -> None:
        if not slot.event.query():
            self.waits += 1
            slot.event.synchronize()
        slot.pending = False

    def acquire(self, nbytes: int) -> PinnedSlot:
        """The next slot, at least ``nbytes`` large, once its previous copy has completed.

        If waiting or growing the slot fails (a :class:`~q12drv.core.errors.CudaError`), the ring is
        unchanged apart from that slot possibly losing its buffer (a later acquire allocates a new
        one): no slot ever holds freed memory and the ring does not advance.
        """
        if self._slots == []:
            raise ValueError(f"the pinned ring {self.name!r} is closed")
        slot = self._slots[self._next]
        if slot.pending:
            self._wait(slot)
        if self._slices is not None:
            return self._acquire_fixed(slot, nbytes)
        if slot.buffer is None or slot.buffer.nbytes < nbytes:
            if slot.buffer is not None:
                old, slot.buffer = slot.buffer, None  # never left pointing at freed memory
                old.free()
            size = max(_MIN_SLOT, 1 << (max(int(nbytes), 1) - 1).bit_length())
            slot.buffer = self.device.pinned(size, f"{self.name} ring slot {slot.index}")
        self._next = (self._next + 1) % len(self._slots)
        self.uses += 1
        return slot

    def _acquire_fixed(self, slot: PinnedSlot, nbytes: int) -> PinnedSlot:
        piece = self._slices[slot.index]
        if nbytes > piece.nbytes:
            raise CapacityError(f"{self.name} ring slot", int(nbytes), piece.nbytes,
                                "the ring runs over the caller's pinned memory and cannot grow; give "
                                "use_pinned a buffer of at least nslots times this")
        if slot.buffer is None:  # set aside after a copy that could not be waited for: wait for everything
            self.device.synchronize()
            slot.buffer = piece
        self._next = (self._next + 1) % len(self._slots)
        self.uses += 1
        return slot

    def copy_htod(self, dst: int, slot: PinnedSlot, nbytes: int, stream: Any, what: str) -> None:
        """Copy ``nbytes`` of ``slot`` to device address ``dst`` on the driver stream ``stream``, then
        :meth:`commit` the slot.

        Raises
        ------
        Q12Error
            ``stream`` is capturing a CUDA graph (nothing enqueued): the copy's source is a slot that later uses of
            the ring refill, so a replay would copy whatever it holds then. ``what`` names the copy in the message.
        """
        driver = self.device.driver
        if driver.stream_is_capturing(stream):
            raise Q12Error(f"the stream is capturing a CUDA graph: {what} is copied from a pinned staging slot that "
                           f"later uploads reuse, so a replay would read whatever the slot holds then; capture the "
                           f"pass with q12drv.PassGraph (its metadata and pointer tables stay put), or do this outside "
                           f"the capture")
        driver.memcpy_htod_async(dst, slot.addr, nbytes, stream)
        self.commit(slot, stream)

    def commit(self, slot: PinnedSlot, stream: Any) -> None:
        """Record ``slot``'s guard event on ``stream`` right after the copy that reads it.

        Call it only once the copy was enqueued (a copy that failed to enqueue leaves the slot
        free). If recording the event fails, the copy may still be pending with nothing to wait
        on: the stream is synchronized so the slot can be reused safely; if even that fails the
        slot's buffer is set aside (freed at :meth:`close`, after a device-wide wait) and the
        slot gets a fresh one when next used. Either way the original error is raised.
        """
        try:
            self.device.driver.event_record(slot.event.raw, stream)
        except BaseException:
            try:
                self.device.driver.stream_synchronize(stream)
            except Exception:
                if slot.buffer is not None:
                    self._quarantine.append(slot.buffer)
                    slot.buffer = None
            raise
        slot.pending = True

    def close(self) -> None:
        """Wait for pending copies and free the pinned memory (every slot, even if one fails)."""
        errors = []
        live = not self.device.closed
        for slot in self._slots:
            waited = True
            try:
                if slot.pending and live:
                    slot.event.synchronize()
                    slot.pending = False
            except Exception as exc:
                errors.append(exc)
                waited = False  # its copy may still read the buffer: Device.close frees it
            try:
                if slot.buffer is not None and live and waited:
                    buf, slot.buffer = slot.buffer, None
                    buf.free()
                slot.buffer = None
                if live:
                    slot.event.destroy()
            except Exception as exc:
                errors.append(exc)
        if self._quarantine and live:
            try:
                self.device.driver.stream_synchronize(self.device.stream.raw)
            except Exception as exc:
                errors.append(exc)
            for buf in self._quarantine:
                try:
                    buf.free()
                except Exception as exc:
                    errors.append(exc)
        self._quarantine = []
        self._slots = []
        self._owner = None
        if errors:
            raise errors[0]
