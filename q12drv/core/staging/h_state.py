"""The per-SSM-layer ``h_state_ptrs`` slot: ``n`` u64 right after the stacked metadata, rewritten before every
SSM layer with one stream-ordered, event-guarded pinned copy; or a pass's state-pointer tables staged all at once
after it (:class:`StateRow`: one copy for every layer, none per layer)."""

from __future__ import annotations

import struct
from itertools import repeat
from typing import Any, Sequence

import numpy as np

from ..arena import ScratchArena
from ..errors import Q12Error
from ..ints import checked_int as _int
from ..layout import h_state_entry_offset, h_state_slot_bytes, h_state_slot_offset, state_tables_bytes
from ..ptr import DevicePtr, device_ptr
from .metadata import BatchedAttnMetadata
from .pack import staging_ring
from .validate import STATE_ALIGN, plain_pointers, require_arena

class HStateSlot:
    """The per-layer state pointer slot (``h_state_ptrs``): ``n`` u64 at ``offset`` (= staging offset +
    staged_bytes), one state pointer per stream, rewritten before every layer that reads one (Gated DeltaNet's fp32
    states; the short convolution's bf16 states).

    Attributes
    ----------
    offset : int
        Arena offset.
    n : int
        Streams.
    ptr : DevicePtr
        Device address of entry 0 (what the GDN kernel takes).
    uploads : int
        How many layers' pointer tables were uploaded.
    """

    def __init__(self, arena: ScratchArena, offset: int, n: int, ptr: DevicePtr):
        # ptr: the address of ``offset`` (the region the caller reserved there)
        self.arena = arena
        self.offset = offset
        self.n = n
        self.ptr = ptr
        self.uploads = 0
        self._packer = _PACKERS.get(n) or _packer(n)
        self._nbytes, self._addr = h_state_slot_bytes(n), int(ptr)
        self._generation = arena.generation  # the pass this slot belongs to (see ScratchArena.generation)

    def entry(self, b: int) -> DevicePtr:
        """Address of stream ``b``'s entry (the per-stream fallback's one-entry table)."""
        if not 0 <= b < self.n:
            raise IndexError(f"stream {b} out of range for an h_state slot of {self.n} entries")
        return DevicePtr(int(self.ptr) + h_state_entry_offset(b))

    def upload(self, state_ptrs: Sequence[int], stream: Any = None) -> None:
        """Write one SSM layer's n state pointers into the slot (stream-ordered, one pinned copy).

        Raises
        ------
        TypeError
            Not a sequence, or an entry that is not an int.
        ValueError
            Not exactly n pointers, or a NULL, out-of-range or misaligned pointer (each state is fp32:
            :data:`~q12drv.core.staging.validate.STATE_ALIGN` bytes, as ``Q12Pass.gdn_layer`` requires);
            nothing written.
        Q12Error
            The arena was reset since the slot was placed (the slot belongs to an earlier pass) or closed; or
            ``stream`` is capturing a CUDA graph (the copy's pinned source is reused: use ``PassGraph``).
        """
        self.arena._require_open()
        if self.arena.generation != self._generation:
            raise Q12Error(f"this h_state_ptrs slot belongs to an earlier pass: the arena was reset since, and "
                           f"offset {self.offset:,} may now hold another pass's metadata; use the new pass's slot")
        if isinstance(state_ptrs, (str, bytes)) or not isinstance(state_ptrs, (Sequence, np.ndarray)):
            raise TypeError(f"state_ptrs must be a sequence of {self.n} device pointers, got {type(state_ptrs).__name__}")
        if len(state_ptrs) != self.n:
            raise ValueError(f"h_state_ptrs needs exactly {self.n} pointers (one per stream), got {len(state_ptrs)}")
        values = state_ptrs if type(state_ptrs) is list else list(state_ptrs)
        if not plain_pointers(values, STATE_ALIGN):  # the precise, named checks
            values = [device_ptr(f"state_ptrs[{b}]", p, STATE_ALIGN, "an fp32 state") for b, p in enumerate(values)]
        self.write_checked(values, stream)

    def write_checked(self, values: Sequence[int], stream: Any) -> None:
        """:meth:`upload` for a caller that has checked ``values`` already: exactly n ints in (0, 2**64), aligned as
        the layer's kernel needs (``Q12Pass.gdn_layer``, ``Q12Pass.conv1d``), for this slot's current pass."""
        nbytes = self._nbytes
        self.arena.check_range("h_state_ptrs", self.offset, nbytes)
        s = self.arena.device.as_stream(stream)
        ring = staging_ring(self.arena, "h_state")
        slot = ring.acquire(nbytes)
        self._packer.pack_into(slot.array, 0, *values)
        ring.copy_htod(self._addr, slot, nbytes, s, "this layer's state-pointer table (conv1d, Gated DeltaNet)")
        self.uploads += 1


_PACKERS: dict = {}


def _packer(n: int) -> struct.Struct:
    """The :class:`struct.Struct` of ``n`` u64 (one per slot size, kept)."""
    if len(_PACKERS) >= 256:
        _PACKERS.clear()
    st = _PACKERS[n] = struct.Struct(f"<{n}Q")
    return st


def reserve_h_state_slot(arena: ScratchArena, n: int) -> HStateSlot:
    """Reserve an ``h_state_ptrs`` slot of ``n`` entries at the cursor (the per-stream path's slot)."""
    region = arena.reserve("h_state_ptrs", h_state_slot_bytes(_int("n", n, 1, 1 << 20)), align=8)
    return HStateSlot(arena, region.offset, int(n), region.ptr)


def place_h_state_slot(arena: ScratchArena, meta: BatchedAttnMetadata) -> HStateSlot:
    """Reserve the ``h_state_ptrs`` slot at ``meta.scratch_offset_bytes + meta.staged_bytes``.

    Raises
    ------
    CapacityError
        ``8 * n`` bytes do not fit there.
    ValueError
        The cursor is not where staging left it (someone reserved in between).
    """
    require_arena(arena)
    if not isinstance(meta, BatchedAttnMetadata):
        raise TypeError(f"meta must be a BatchedAttnMetadata (from the stager), got {type(meta).__name__}")
    offset = h_state_slot_offset(meta.scratch_offset_bytes, meta.staged_bytes)
    if arena.cursor != offset:
        raise ValueError(f"the arena cursor is at {arena.cursor:,} but the h_state_ptrs slot belongs at "
                         f"scratch_offset_bytes + staged_bytes = {offset:,}; reserve nothing between staging and the slot")
    region = arena.reserve("h_state_ptrs", h_state_slot_bytes(meta.batch_size), offset=offset, align=8)
    return HStateSlot(arena, region.offset, meta.batch_size, region.ptr)


class StateRow:
    """One state-pointer table staged for a whole pass (:func:`stage_state_rows`): ``n`` u64 in the arena, stream
    b's state pointer at ``ptr + 8 b``. A layer op given a row reads its table where it is, with no copy of its
    own (an op given a list copies it into the pass's ``h_state_ptrs`` slot first).

    Attributes
    ----------
    index : int
        Its row among those staged together.
    ptr : int
        Device address of the table's entry 0.
    n : int
        Streams.
    dtype : str or None
        The dtype of the tensors the row was given (``"f32"``, ``"bf16"``), checked by the op that reads it; None
        for raw addresses.
    """

    __slots__ = ("index", "ptr", "n", "dtype", "arena", "generation", "_bits")

    def __init__(self, index: int, ptr: int, n: int, arena: ScratchArena, generation: int, bits: int,
                 dtype: str | None = None):
        self.index, self.ptr, self.n, self.arena, self.dtype = index, ptr, n, arena, dtype
        self.generation = generation  # the pass it belongs to (see ScratchArena.generation)
        self._bits = bits  # the low bits of every pointer of the row OR-ed: its alignment, for the op that reads it

    def check(self, arena: ScratchArena, generation: int, align: int, dtype: str, what: str) -> int:
        """The table's address for a layer op of the pass of ``arena`` at ``generation`` whose states are ``dtype``
        and need ``align``-byte alignment (``what``: the op's states, for the message).

        Raises
        ------
        Q12Error
            A row of another pass (the arena was reset since it was staged, or it is another arena's).
        ValueError
            A pointer of the row is not ``align``-byte aligned, or the row was given tensors of another dtype.
        """
        if self.arena is not arena or self.generation != generation:
            raise Q12Error(f"state row {self.index} was staged for another pass (the arena was reset since, or it is "
                           f"another arena's); stage the rows of each pass with its own Q12Pass.stage_states")
        if self._bits & (align - 1):
            raise ValueError(f"state row {self.index} holds a pointer that is not {align}-byte aligned, as {what} "
                             f"need")
        if self.dtype is not None and self.dtype != dtype:
            raise ValueError(f"state row {self.index} was staged from {self.dtype} tensors; {what} are {dtype}")
        return self.ptr

    def __repr__(self) -> str:
        return f"StateRow(index={self.index}, ptr={self.ptr:#x}, n={self.n})"


def stage_state_rows(arena: ScratchArena, table: np.ndarray, stream: Any,
                     dtypes: Sequence[str | None] | None = None) -> tuple:
    """Stage ``table`` (uint64 ``[rows, n]``, C-contiguous: checked state pointers, row r's pointer of stream b at
    ``[r, b]``) at the arena's cursor as back-to-back tables, with one copy through the arena's pinned ring; return
    a :class:`StateRow` for each row (``dtypes[r]``: the dtype of row r's tensors, None for addresses).

    Raises
    ------
    CapacityError
        The tables do not fit the arena's capacity (nothing reserved, nothing written).
    Q12Error
        ``stream`` is capturing a CUDA graph (see :meth:`PinnedRing.copy_htod
        <q12drv.core.pinned.PinnedRing.copy_htod>`).
    """
    count, n = table.shape
    nbytes = state_tables_bytes(n, count)
    region = arena.reserve("state_tables", nbytes, align=8)
    ring = staging_ring(arena, "h_state")
    try:
        slot = ring.acquire(nbytes)
        slot.array[:nbytes] = table.reshape(-1).view(np.uint8)
        ring.copy_htod(int(region.ptr), slot, nbytes, arena.device.as_stream(stream),
                       "the pass's state-pointer tables")
    except BaseException:
        arena.unreserve(region)
        raise
    base, generation = int(region.ptr), arena.generation
    bits = (np.bitwise_or.reduce(table, axis=1) & np.uint64(0xFFFF)).tolist()
    dtypes = dtypes or repeat(None)
    return tuple(StateRow(r, base + state_tables_bytes(n, r), n, arena, generation, b, dt)
                 for r, b, dt in zip(range(count), bits, dtypes))
