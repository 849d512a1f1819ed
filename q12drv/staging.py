"""Staging: pack the metadata of N prefill streams into pinned memory and upload it with one copy.

* :func:`stage_batched_attn_metadata` writes the stacked :class:`BatchedAttnMetadata` at the
  arena's cursor with ONE ``cuMemcpyHtoDAsync`` of exactly ``staged_bytes`` and advances the
  cursor by exactly that.
* :func:`place_h_state_slot` reserves the per-SSM-layer ``h_state_ptrs`` slot right there, and
  :meth:`HStateSlot.upload` rewrites it before each SSM layer (stream-ordered, event-guarded).
* :func:`stage_stream_metadata` writes one stream's own (n = 1) metadata into its per-stream
  block, for the per-stream fallback.

Everything is validated before the first byte is written: bad input raises and leaves the
arena, the pinned ring and the cursor as they were. Offsets come from :mod:`q12drv.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .arena import ScratchArena
from .errors import CapacityError
from .layout import StackedLayout, ScratchPlan, stacked_layout
from .pinned import PinnedRing
from .ptr import DevicePtr

__all__ = [
    "StreamStageInfo",
    "BatchedAttnMetadata",
    "HStateSlot",
    "stage_batched_attn_metadata",
    "stage_stream_metadata",
    "place_h_state_slot",
    "reserve_h_state_slot",
    "pack_metadata",
    "staging_ring",
    "unpack_metadata",
]

_U32_MAX = (1 << 32) - 1
_I32_MAX = (1 << 31) - 1
_U64_MAX = (1 << 64) - 1
_STAGING_RING_SLOTS = 3
_H_STATE_RING_SLOTS = 16


def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


@dataclass(frozen=True, eq=False)
class StreamStageInfo:
    """What the stager needs of one prefill stream.

    Parameters
    ----------
    proc_start : int
        Absolute position of the first token this pass processes (tokens already in the KV cache).
    proc_count : int
        Tokens this pass processes (>= 1).
    block_table : array_like of int
        Host copy of the stream's int32 physical block ids, logical block i -> physical id; it must
        cover every position up to ``proc_start + proc_count - 1``. A negative entry means "no
        block" (evicted): that position's KV write goes to the dummy block.
    block_table_dev : int
        Device address of the same table (int32), read by the attention kernel.
    seq_len_dev : int
        Device address of the stream's u32 seq_len.
    mrope_positions : array_like, optional
        ``[3, proc_count]`` T/H/W positions (vision tokens); default: all three equal the
        token positions (text).
    """

    proc_start: int
    proc_count: int
    block_table: Any
    block_table_dev: int
    seq_len_dev: int
    mrope_positions: Any = None


@dataclass(frozen=True)
class BatchedAttnMetadata:
    """Device-side metadata of one batched (or single-stream) prefill pass, fields as the seed names them.

    Device fields are absolute :class:`~q12drv.ptr.DevicePtr` addresses inside the arena.
    ``staged_bytes`` is the exact footprint from ``scratch_offset_bytes``: the cursor advance.
    """

    positions_stacked: DevicePtr
    positions_h_stacked: DevicePtr
    positions_w_stacked: DevicePtr
    slot_stacked: DevicePtr
    block_table_ptrs: DevicePtr
    seq_len_ptrs: DevicePtr
    batch_size: int
    chunk_len: int
    total_tokens: int
    cu_seqlens: DevicePtr
    cu_seqlens_host: np.ndarray
    kv_lens: DevicePtr
    kv_lens_host: np.ndarray
    max_blocks_per_seq: int
    staged_bytes: int
    scratch_offset_bytes: int = 0
    use_mrope: bool = False
    block_size: int = 0
    dummy_kv_block: int = 0
    layout: StackedLayout | None = field(default=None, repr=False)

    @property
    def counts(self) -> np.ndarray:
        """Per-stream token counts (``diff(cu_seqlens_host)``)."""
        return np.diff(self.cu_seqlens_host)


@dataclass(frozen=True)
class _Batch:
    """Validated, normalised inputs."""

    counts: np.ndarray
    starts: np.ndarray
    tables: list
    table_ptrs: np.ndarray
    seq_len_ptrs: np.ndarray
    mrope: list
    max_blocks: int


def _validate(streams: Sequence[StreamStageInfo], block_size, use_mrope, dummy_kv_block) -> _Batch:
    if isinstance(streams, StreamStageInfo) or not isinstance(streams, Sequence):
        raise TypeError(f"streams must be a sequence of StreamStageInfo, got {type(streams).__name__}")
    n = len(streams)
    if n == 0:
        raise ValueError("streams is empty: a pass stages at least one stream")
    block_size = _int("block_size", block_size, 1, 1 << 20)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if not isinstance(use_mrope, (bool, np.bool_)):
        raise TypeError(f"use_mrope must be a bool, got {use_mrope!r}")
    _int("dummy_kv_block", dummy_kv_block, 0, _I32_MAX)
    counts = np.empty(n, np.int64)
    starts = np.empty(n, np.int64)
    table_ptrs = np.empty(n, np.uint64)
    seq_len_ptrs = np.empty(n, np.uint64)
    tables, mrope = [], []
    for b, s in enumerate(streams):
        if not isinstance(s, StreamStageInfo):
            raise TypeError(f"streams[{b}] must be a StreamStageInfo, got {type(s).__name__}")
        starts[b] = _int(f"streams[{b}].proc_start", s.proc_start, 0, _I32_MAX)
        counts[b] = _int(f"streams[{b}].proc_count", s.proc_count, 0, _I32_MAX)
        if counts[b] == 0:
            raise ValueError(f"streams[{b}].proc_count is 0: a fully cached chunk has nothing to stage "
                             f"(upstream bug B7); leave the stream out of the pass")
        kv_len = int(starts[b] + counts[b])
        if kv_len > _I32_MAX:
            raise ValueError(f"streams[{b}]: proc_start + proc_count = {kv_len} overflows the i32 kv_lens entry")
        table_ptrs[b] = _int(f"streams[{b}].block_table_dev", s.block_table_dev, 1, _U64_MAX)
        seq_len_ptrs[b] = _int(f"streams[{b}].seq_len_dev", s.seq_len_dev, 1, _U64_MAX)
        table = np.asarray(s.block_table)
        if table.ndim != 1 or not (np.issubdtype(table.dtype, np.integer) or table.size == 0):
            raise TypeError(f"streams[{b}].block_table must be a 1-D integer array, got shape {table.shape} dtype {table.dtype}")
        needed = -(-kv_len // block_size)
        if table.size < needed:
            raise ValueError(f"streams[{b}].block_table has {table.size} entries but kv_len {kv_len} at block_size "
                             f"{block_size} needs {needed}")
        table = table.astype(np.int64, copy=False)
        if table.size and (table.max() > _I32_MAX or table.min() < -_I32_MAX - 1):
            raise ValueError(f"streams[{b}].block_table has entries outside int32 (min {table.min()}, max {table.max()})")
        tables.append(table)
        mp = s.mrope_positions
        if mp is not None:
            if not use_mrope:
                raise ValueError(f"streams[{b}].mrope_positions given but use_mrope is False")
            mp = np.asarray(mp)
            if mp.shape != (3, counts[b]) or not np.issubdtype(mp.dtype, np.integer):
                raise ValueError(f"streams[{b}].mrope_positions must be an integer array of shape (3, {counts[b]}), "
                                 f"got {mp.dtype} {mp.shape}")
            if mp.size and (mp.min() < 0 or mp.max() > _U32_MAX):
                raise ValueError(f"streams[{b}].mrope_positions must be in [0, {_U32_MAX}] (u32), got "
                                 f"[{mp.min()}, {mp.max()}]")
        mrope.append(mp)
    total = int(counts.sum())
    if total > _I32_MAX:
        raise ValueError(f"total tokens {total} overflow the i32 cu_seqlens prefix sum")
    return _Batch(counts, starts, tables, table_ptrs, seq_len_ptrs, mrope, max(t.size for t in tables))


def pack_metadata(batch: _Batch, layout: StackedLayout, block_size: int, dummy_kv_block: int, out: np.ndarray) -> tuple:
    """Write every field of ``layout`` into ``out`` (uint8, >= staged_bytes), pads zeroed.

    Works stream by stream on views of ``out`` (n is small, tokens are many): positions are one
    ``arange`` per stream, slots one outer sum over the stream's blocks, so each token byte is
    written once with no token-sized temporaries.

    Returns ``(cu_seqlens, kv_lens)`` as int32 host arrays.
    """
    counts, starts = batch.counts, batch.starts
    n = counts.size
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=cu[1:])
    kv_lens = (starts + counts).astype(np.int32)
    cu32 = cu.astype(np.int32)
    views = {}
    for f in layout.fields:
        views[f.name] = out[f.offset:f.offset + f.nbytes].view(f.dtype)
        if f.padded > f.nbytes:
            out[f.offset + f.nbytes:f.end] = 0
    pos_t, slot_v = views["positions_stacked"], views["slot_stacked"]
    within = np.arange(block_size, dtype=np.int64)
    for b in range(n):
        lo, hi, p0 = int(cu[b]), int(cu[b + 1]), int(starts[b])
        pos_t[lo:hi] = np.arange(p0, p0 + hi - lo, dtype=np.uint32)
        first, last = p0 // block_size, (p0 + hi - lo - 1) // block_size
        blocks = batch.tables[b][first:last + 1]
        if blocks.min() < 0:
            blocks = np.where(blocks < 0, dummy_kv_block, blocks)
        slots = (blocks[:, None] * block_size + within).ravel()
        off = p0 - first * block_size
        slot_v[lo:hi] = slots[off:off + hi - lo]
    if layout.mrope:
        pos_h, pos_w = views["positions_h_stacked"], views["positions_w_stacked"]
        pos_h[:] = pos_t
        pos_w[:] = pos_t
        for b, mp in enumerate(batch.mrope):
            if mp is not None:
                lo, hi = int(cu[b]), int(cu[b + 1])
                pos_t[lo:hi], pos_h[lo:hi], pos_w[lo:hi] = mp[0], mp[1], mp[2]
    views["block_table_ptrs"][:] = batch.table_ptrs
    views["seq_len_ptrs"][:] = batch.seq_len_ptrs
    views["cu_seqlens"][:] = cu32
    views["kv_lens"][:] = kv_lens
    return cu32, kv_lens


def staging_ring(arena: ScratchArena, kind: str = "staging") -> PinnedRing:
    """The arena's pinned ring for metadata (``"staging"``) or ``h_state_ptrs`` uploads (``"h_state"``)."""
    slots = _STAGING_RING_SLOTS if kind == "staging" else _H_STATE_RING_SLOTS
    return arena.attachment(f"ring:{kind}", lambda: PinnedRing(arena.device, slots, kind))


def _upload(arena: ScratchArena, offset: int, batch: _Batch, layout: StackedLayout, block_size: int,
            dummy_kv_block: int, stream: Any) -> tuple:
    ring = staging_ring(arena)
    slot = ring.acquire(layout.staged_bytes)
    cu, kv = pack_metadata(batch, layout, block_size, dummy_kv_block, slot.array)
    s = arena.device.as_stream(stream)
    arena.device.driver.memcpy_htod_async(int(arena.base) + offset, slot.addr, layout.staged_bytes, s)
    ring.commit(slot, s)
    return cu, kv


def _metadata(arena, offset, layout, batch, cu, kv, block_size, use_mrope, dummy_kv_block) -> BatchedAttnMetadata:
    base = int(arena.base) + offset
    ptr = {f.name: DevicePtr(base + f.offset) for f in layout.fields}
    positions = ptr["positions_stacked"]
    cu.setflags(write=False)
    kv.setflags(write=False)
    return BatchedAttnMetadata(
        positions_stacked=positions,
        positions_h_stacked=ptr.get("positions_h_stacked", positions),
        positions_w_stacked=ptr.get("positions_w_stacked", positions),
        slot_stacked=ptr["slot_stacked"],
        block_table_ptrs=ptr["block_table_ptrs"],
        seq_len_ptrs=ptr["seq_len_ptrs"],
        batch_size=int(batch.counts.size),
        chunk_len=int(batch.counts.max()),
        total_tokens=int(batch.counts.sum()),
        cu_seqlens=ptr["cu_seqlens"],
        cu_seqlens_host=cu,
        kv_lens=ptr["kv_lens"],
        kv_lens_host=kv,
        max_blocks_per_seq=int(batch.max_blocks),
        staged_bytes=layout.staged_bytes,
        scratch_offset_bytes=offset,
        use_mrope=bool(use_mrope),
        block_size=block_size,
        dummy_kv_block=int(dummy_kv_block),
        layout=layout,
    )


def stage_batched_attn_metadata(
    arena: ScratchArena,
    streams: Sequence[StreamStageInfo],
    *,
    block_size: int,
    use_mrope: bool,
    scratch_offset_bytes: int,
    dummy_kv_block: int,
    stream: Any = None,
) -> BatchedAttnMetadata:
    """Stage the stacked metadata of ``streams`` at ``scratch_offset_bytes`` with one pinned copy.

    Parameters
    ----------
    arena : ScratchArena
        Its cursor must be at or before ``scratch_offset_bytes``; afterwards it is exactly at
        ``scratch_offset_bytes + staged_bytes`` (where :func:`place_h_state_slot` puts the slot).
    streams : sequence of StreamStageInfo
        In batch order.
    block_size : int
        KV-cache block size in tokens (power of two).
    use_mrope : bool
        Stage the H and W position streams too.
    scratch_offset_bytes : int
        Arena offset of the stacked block (8-aligned), normally ``arena.cursor``.
    dummy_kv_block : int
        Physical block absorbing KV writes of positions whose table entry is negative.
    stream : optional
        CUDA stream for the copy (see ``Device.as_stream``).

    Returns
    -------
    BatchedAttnMetadata

    Raises
    ------
    CapacityError
        The block would not fit the arena; nothing written, cursor unchanged.
    TypeError, ValueError
        Bad input (named, with the bound); nothing written.
    """
    batch = _validate(streams, block_size, use_mrope, dummy_kv_block)
    layout = stacked_layout(len(streams), int(batch.counts.sum()), bool(use_mrope))
    offset = _int("scratch_offset_bytes", scratch_offset_bytes, 0, arena.capacity)
    arena.check_range("stacked_metadata", offset, layout.staged_bytes)
    region = arena.reserve("stacked_metadata", layout.staged_bytes, offset=offset, align=8)
    try:
        cu, kv = _upload(arena, region.offset, batch, layout, int(block_size), dummy_kv_block, stream)
    except BaseException:
        arena.unreserve(region)
        raise
    return _metadata(arena, region.offset, layout, batch, cu, kv, int(block_size), use_mrope, dummy_kv_block)


def stage_stream_metadata(
    arena: ScratchArena,
    plan: ScratchPlan,
    b: int,
    info: StreamStageInfo,
    *,
    block_size: int,
    use_mrope: bool,
    dummy_kv_block: int,
    stream: Any = None,
) -> BatchedAttnMetadata:
    """Stage stream ``b``'s own (n = 1) metadata into its per-stream block of ``plan``.

    The result is what the per-stream fallback's kernels take: ``batch_size`` 1, ``cu_seqlens``
    ``[0, proc_count]``. One pinned copy; the cursor does not move (the block is already part
    of the plan).

    Raises
    ------
    CapacityError
        The stream's metadata does not fit its block (the seed stride under MRoPE holds at most
        202 tokens; use ``policy="exact"``), or the block lies outside the arena.
    """
    if not 0 <= b < plan.n:
        raise IndexError(f"stream index {b} out of range for a plan of {plan.n} streams")
    if bool(use_mrope) != plan.mrope:
        raise ValueError(f"use_mrope={use_mrope} but the plan was made with mrope={plan.mrope}")
    batch = _validate([info], block_size, use_mrope, dummy_kv_block)
    if int(batch.counts[0]) != plan.counts[b]:
        raise ValueError(f"stream {b} has proc_count {int(batch.counts[0])} but the plan was made for {plan.counts[b]}")
    block = plan.stream_blocks[b]
    layout = stacked_layout(1, int(batch.counts[0]), bool(use_mrope))
    if layout.staged_bytes > block.nbytes:
        raise CapacityError(block.name, layout.staged_bytes, block.nbytes,
                            f"{plan.counts[b]} tokens{' with MRoPE' if use_mrope else ''} do not fit the "
                            f"'{plan.policy}' per-stream stride; plan with policy='exact'")
    arena.check_range(block.name, block.offset, block.nbytes)
    cu, kv = _upload(arena, block.offset, batch, layout, int(block_size), dummy_kv_block, stream)
    return _metadata(arena, block.offset, layout, batch, cu, kv, int(block_size), use_mrope, dummy_kv_block)


class HStateSlot:
    """The per-SSM-layer ``h_state_ptrs`` slot: ``n`` u64 at ``offset`` (= staging offset + staged_bytes).

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

    def __init__(self, arena: ScratchArena, offset: int, n: int):
        self.arena = arena
        self.offset = offset
        self.n = n
        self.ptr = DevicePtr(int(arena.base) + offset)
        self.uploads = 0
        self._values = np.empty(n, np.uint64)

    def entry(self, b: int) -> DevicePtr:
        """Address of stream ``b``'s entry (the per-stream fallback's one-entry table)."""
        if not 0 <= b < self.n:
            raise IndexError(f"stream {b} out of range for an h_state slot of {self.n} entries")
        return DevicePtr(int(self.ptr) + 8 * b)

    def upload(self, state_ptrs: Sequence[int], stream: Any = None) -> None:
        """Write one SSM layer's n state pointers into the slot (stream-ordered, one pinned copy).

        Raises
        ------
        ValueError
            Not exactly n pointers, or a NULL / out-of-range pointer; nothing written.
        """
        if len(state_ptrs) != self.n:
            raise ValueError(f"h_state_ptrs needs exactly {self.n} pointers (one per stream), got {len(state_ptrs)}")
        values = self._values
        for b, p in enumerate(state_ptrs):
            values[b] = _int(f"state_ptrs[{b}]", p, 1, _U64_MAX)
        nbytes = 8 * self.n
        self.arena.check_range("h_state_ptrs", self.offset, nbytes)
        ring = staging_ring(self.arena, "h_state")
        slot = ring.acquire(nbytes)
        slot.array[:nbytes].view(np.uint64)[:] = values
        s = self.arena.device.as_stream(stream)
        self.arena.device.driver.memcpy_htod_async(int(self.ptr), slot.addr, nbytes, s)
        ring.commit(slot, s)
        self.uploads += 1


def reserve_h_state_slot(arena: ScratchArena, n: int) -> HStateSlot:
    """Reserve an ``h_state_ptrs`` slot of ``n`` entries at the cursor (the per-stream path's slot)."""
    region = arena.reserve("h_state_ptrs", 8 * _int("n", n, 1, 1 << 20), align=8)
    return HStateSlot(arena, region.offset, int(n))


def place_h_state_slot(arena: ScratchArena, meta: BatchedAttnMetadata) -> HStateSlot:
    """Reserve the ``h_state_ptrs`` slot at ``meta.scratch_offset_bytes + meta.staged_bytes``.

    Raises
    ------
    CapacityError
        ``8 * n`` bytes do not fit there.
    ValueError
        The cursor is not where staging left it (someone reserved in between).
    """
    offset = meta.scratch_offset_bytes + meta.staged_bytes
    if arena.cursor != offset:
        raise ValueError(f"the arena cursor is at {arena.cursor:,} but the h_state_ptrs slot belongs at "
                         f"scratch_offset_bytes + staged_bytes = {offset:,}; reserve nothing between staging and the slot")
    region = arena.reserve("h_state_ptrs", 8 * meta.batch_size, offset=offset, align=8)
    return HStateSlot(arena, region.offset, meta.batch_size)


def unpack_metadata(raw: bytes | np.ndarray, layout: StackedLayout) -> dict:
    """Decode staged bytes back into arrays, one per field (the inverse of :func:`pack_metadata`).

    Parameters
    ----------
    raw : bytes or uint8 array
        At least ``layout.staged_bytes`` bytes starting at the block's first field.

    Returns
    -------
    dict
        field name -> numpy array (copies), plus ``"_pads"``: the pad bytes of every field
        concatenated (all zero in a correct block).
    """
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray)) else np.asarray(raw, np.uint8)
    if buf.size < layout.staged_bytes:
        raise ValueError(f"{buf.size} bytes given but the layout spans {layout.staged_bytes}")
    out = {f.name: buf[f.offset:f.offset + f.nbytes].view(f.dtype).copy() for f in layout.fields}
    out["_pads"] = np.concatenate([buf[f.offset + f.nbytes:f.end] for f in layout.fields])
    return out
