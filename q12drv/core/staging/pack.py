"""Packing a validated batch into pinned memory, field by field at the layout's offsets, and the one copy.

The token fields (positions, slots) take a fixed number of vector passes whatever the stream count; the
per-stream tail is one ``struct.pack_into``. Pads are zeroed. The pinned rings live on the arena
(:func:`staging_ring`): a slot is rewritten only after the copy that read it has run.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..arena import RING_KEYS, ScratchArena
from ..errors import CapacityError
from ..layout import StackedLayout
from ..pinned import PinnedRing
from .metadata import host_copies
from .validate import _Batch

_STAGING_RING_SLOTS = 3


_H_STATE_RING_SLOTS = 16


_IOTA32 = np.arange(1 << 12, dtype=np.uint32)


_IOTA64 = np.arange(1 << 12, dtype=np.int64)


def _iota(n: int, dtype) -> np.ndarray:
    """``arange(n)`` as a view of a cached, grown-on-demand array (never written)."""
    global _IOTA32, _IOTA64
    cache = _IOTA32 if dtype == np.uint32 else _IOTA64
    if cache.size < n:
        cache = np.arange(1 << max(int(n) - 1, 1).bit_length(), dtype=dtype)
        cache.setflags(write=False)
        if dtype == np.uint32:
            _IOTA32 = cache
        else:
            _IOTA64 = cache
    return cache[:n]


class _Views:
    """Typed views of one layout over one pinned buffer, and its pad ranges (built once per pair)."""

    __slots__ = ("fields", "positions3", "pads", "out", "tail_at", "tail")

    def __init__(self, out: np.ndarray, layout: StackedLayout, base: int = 0):
        # ``out`` holds the layout's bytes from offset ``base`` on (0: all of it)
        fields = [f for f in layout.fields if f.offset >= base]
        self.fields = {f.name: out[f.offset - base:f.offset - base + f.nbytes].view(f.dtype) for f in fields}
        # the per-stream tail is written whole, pads included, by one struct.pack_into (_write_tail)
        self.out = out
        self.tail_at = layout.tail_offset - base
        self.tail = _tail_struct(layout)
        self.pads = [(f.offset - base + f.nbytes, f.end - base) for f in fields
                     if f.padded > f.nbytes and f.offset < self.tail_at + base]
        self.positions3 = None
        if layout.mrope and base == 0:  # T, H and W rows, one a8(4T) stride apart: one strided [3, T] view
            f = layout.field("positions_stacked")
            rows = [layout.field(n).offset for n in ("positions_stacked", "positions_h_stacked", "positions_w_stacked")]
            if rows != [f.offset + i * f.padded for i in range(3)]:  # the layout's offsets, not an assumption
                raise AssertionError(f"the T, H and W position rows are not one stride apart in the layout: {rows}")
            self.positions3 = out[f.offset:f.offset + 3 * f.padded].view(np.uint32).reshape(3, f.padded // 4)[:, :f.count]


_VIEW_CACHE: dict = {}


_VIEW_CACHE_MAX = 64


def _views(out: np.ndarray, layout: StackedLayout, base: int = 0) -> _Views:
    key = (id(out), layout.n, layout.total_tokens, layout.mrope, base)
    hit = _VIEW_CACHE.get(key)
    if hit is not None and hit[0] is out:  # the entry holds ``out``, so its id cannot be reused meanwhile
        return hit[1]
    if len(_VIEW_CACHE) >= _VIEW_CACHE_MAX:
        _VIEW_CACHE.clear()
    views = _Views(out, layout, base)
    _VIEW_CACHE[key] = (out, views)
    return views


def pack_metadata(batch: _Batch, layout: StackedLayout, block_size: int, dummy_kv_block: int, out: np.ndarray) -> tuple:
    """Write every field of ``layout`` into ``out`` (uint8, >= staged_bytes), pads zeroed.

    A fixed number of vector passes over the packed tokens, whatever n (no per-stream loop):

    * packed token t of stream b sits at position ``p = t + (proc_start_b - cu_seqlens_b)``: one
      ``repeat`` of the n shifts plus ``arange(T)``, in uint32 (modular, so negative shifts are
      fine and every result is a valid u32 position);
    * its slot is ``table[p // bs] * bs + p % bs = t + d`` where ``d`` is constant over the tokens
      a stream has in one block: one value per touched (stream, block), repeated as many times
      as the stream has tokens in that block, plus ``arange(T)``.

    Returns ``(cu_seqlens, kv_lens)`` as int32 host arrays.
    """
    views = _views(out, layout)
    for lo, hi in views.pads:
        out[lo:hi] = 0
    _pack_tokens(batch, layout, block_size, dummy_kv_block, views, batch.cu_list)
    return _pack_tail(batch, views)


def pack_tail(batch: _Batch, layout: StackedLayout, out: np.ndarray) -> tuple:
    """Write only the per-stream fields (``block_table_ptrs`` .. ``kv_lens``, from ``layout.tail_offset``)
    into ``out``, pads zeroed; the per-token fields are left to the device.

    Returns ``(cu_seqlens, kv_lens)`` as int32 host arrays.
    """
    views = _views(out, layout, layout.tail_offset)
    for lo, hi in views.pads:
        out[lo:hi] = 0
    return _pack_tail(batch, views)


def host_tail(batch: _Batch) -> tuple:
    """``(cu_seqlens, kv_lens)`` of ``batch`` as int32 host arrays, without packing anything."""
    return host_copies(batch.cu_list, batch.kv_list)


def _pack_tail(batch: _Batch, views: _Views) -> tuple:
    return _write_tail(views, batch.table_ptr_list, batch.seq_len_ptr_list, batch.cu_list, batch.kv_list)


def _write_tail(views: _Views, table_ptrs: list, seq_len_ptrs: list, cu: list, kv: list) -> tuple:
    # one struct.pack_into writes the whole tail (u64 pointers, then the i32 prefix sums and kv
    # lengths, zero pads included)
    views.tail.pack_into(views.out, views.tail_at, *table_ptrs, *seq_len_ptrs, *cu, *kv)
    return host_copies(cu, kv)


_TAIL_STRUCTS: dict = {}


_STRUCT_CODES = {"<u8": "Q", "<i4": "i"}


def _tail_struct(layout: StackedLayout) -> struct.Struct:
    """The :class:`struct.Struct` of ``layout``'s per-stream tail (``layout.tail_offset`` to
    ``staged_bytes``), built from the layout's own fields: values in field order, pads as ``x``."""
    st = _TAIL_STRUCTS.get(layout.n)
    if st is None:
        at, parts = layout.tail_offset, ["<"]
        for f in layout.fields:
            if f.offset >= at:
                if f.offset != at:
                    raise AssertionError(f"layout field {f.name} at {f.offset} does not follow the previous one ({at})")
                parts.append(f"{f.count}{_STRUCT_CODES[f.dtype]}{f.padded - f.nbytes}x")
                at = f.end
        if at != layout.staged_bytes:
            raise AssertionError(f"the tail ends at {at}, not at staged_bytes {layout.staged_bytes}")
        st = _TAIL_STRUCTS[layout.n] = struct.Struct("".join(parts))
    return st


class _Prefix:
    """The token fields of a padded block cut to its first ``real`` tokens (what :func:`_pack_tokens` writes)."""

    __slots__ = ("fields", "positions3")

    def __init__(self, views: _Views, real: int):
        self.fields = {name: views.fields[name][:real] for name in ("positions_stacked", "slot_stacked")}
        self.positions3 = None if views.positions3 is None else views.positions3[:, :real]


def pack_padded(batch: _Batch, layout: StackedLayout, block_size: int, dummy_kv_block: int, out: np.ndarray, *,
                tail_only: bool = False) -> tuple:
    """Pack ``batch`` into ``layout`` made for fixed maxima (CUDA graphs): at most ``layout.n`` streams
    and ``layout.total_tokens`` tokens, the rest padding with the sentinels every kernel skips.

    Streams past the batch get ``cu_seqlens`` = the real token count (no tokens), ``kv_lens`` 0 and
    the first stream's table and seq_len pointers as stand-ins (never read: no tokens); tokens past
    the real ones get position 0 and slot -1. ``tail_only``: write only the per-stream fields
    (``out`` then starts at ``layout.tail_offset``; the device expansion writes the rest).

    Returns ``(cu_seqlens, kv_lens)`` (int32, ``layout.n + 1`` and ``layout.n`` entries).

    Raises
    ------
    CapacityError
        More streams or tokens than the layout holds; nothing written.
    """
    k, n, real = len(batch.count_list), layout.n, batch.total
    if k > n:
        raise CapacityError("stacked_metadata streams", k, n, "the pass was sized for fewer streams")
    if real > layout.total_tokens:
        raise CapacityError("stacked_metadata tokens", real, layout.total_tokens, "the pass was sized for fewer tokens")
    views = _views(out, layout, layout.tail_offset if tail_only else 0)
    for lo, hi in views.pads:
        out[lo:hi] = 0
    cu = batch.cu_list
    if not tail_only:
        _pack_tokens(batch, layout, block_size, dummy_kv_block, _Prefix(views, real), cu)
        if real < layout.total_tokens:
            views.fields["slot_stacked"][real:] = -1
            views.fields["positions_stacked"][real:] = 0
            if views.positions3 is not None:
                views.positions3[:, real:] = 0
    extra = n - k
    return _write_tail(views, batch.table_ptr_list + batch.table_ptr_list[:1] * extra,
                       batch.seq_len_ptr_list + batch.seq_len_ptr_list[:1] * extra, cu + [real] * extra,
                       batch.kv_list + [0] * extra)


def _pack_tokens(batch: _Batch, layout: StackedLayout, block_size: int, dummy_kv_block: int, views: _Views,
                 cu: list) -> None:
    counts, starts = batch.count_list, batch.start_list
    n, total = len(counts), batch.total
    shift = block_size.bit_length() - 1
    fields = views.fields
    pos_t, slot_v = fields["positions_stacked"], fields["slot_stacked"]
    if n == 1:
        np.add(_iota(total, np.uint32), starts[0], out=pos_t)
    else:
        token_shift = np.array([(starts[b] - cu[b]) & 0xFFFFFFFF for b in range(n)], np.uint32)
        np.add(np.repeat(token_shift, batch.counts), _iota(total, np.uint32), out=pos_t)
    # d for the touched blocks of every stream: (table[j] - j) * bs + proc_start_b - cu_b, with
    # j = first_b + (u - block_offsets[b]) for the u-th touched block
    used, first, boff, head_skip, tail_len = batch.touched_blocks()
    if used.min() < 0:
        used = np.where(used < 0, dummy_kv_block, used)
    d = used - _iota(used.size, np.int64)
    d <<= shift
    per_stream = [((boff[b] - first[b]) << shift) + starts[b] - cu[b] for b in range(n)]
    if n == 1:
        d += per_stream[0]
    else:
        d += np.repeat(np.array(per_stream, np.int64), np.diff(np.array(boff, np.int64)))
    # tokens per touched block: a full block, except a stream's first and last ones
    runs = np.full(used.size, block_size, np.int64)
    if n == 1:
        runs[-1] = tail_len[0]
        runs[0] -= head_skip[0]
    else:
        runs[np.array(boff[1:], np.intp) - 1] = tail_len
        runs[boff[:n]] -= head_skip
    np.add(np.repeat(d, runs), _iota(total, np.int64), out=slot_v)
    if layout.mrope:
        pos3 = views.positions3
        pos3[1:] = pos_t
        for b, mp in enumerate(batch.mrope):
            if mp is not None:
                pos3[:, cu[b]:cu[b + 1]] = mp


def staging_ring(arena: ScratchArena, kind: str = "staging") -> PinnedRing:
    """The arena's pinned ring for metadata (``"staging"``) or ``h_state_ptrs`` uploads (``"h_state"``)."""
    ring = arena.find_attachment(RING_KEYS.get(kind)) if type(arena) is ScratchArena else None
    if ring is not None:  # the common case: made before
        return ring
    slots = _STAGING_RING_SLOTS if kind == "staging" else _H_STATE_RING_SLOTS
    return arena.attachment(RING_KEYS[kind], lambda: PinnedRing(arena.device, slots, kind))


def upload_packed(arena: ScratchArena, offset: int, packed: np.ndarray, batch: _Batch, layout: StackedLayout,
                  stream: Any) -> None:
    """Copy metadata packed before (``packed``: ``layout.staged_bytes`` bytes, :func:`pack_metadata`'s) to ``offset``
    with ``batch``'s own per-stream tail (its device's block-table and ``seq_len`` pointers): through the arena's
    pinned ring, one copy. What each device of a tensor-parallel group gets of one batch packed once."""
    ring = staging_ring(arena)
    slot = ring.acquire(layout.staged_bytes)
    out = slot.array
    out[:layout.staged_bytes] = packed[:layout.staged_bytes]
    _pack_tail(batch, _views(out, layout))
    ring.copy_htod(int(arena.base) + offset, slot, layout.staged_bytes, arena.device.as_stream(stream),
                   "the pass's metadata")


def _upload(arena: ScratchArena, offset: int, batch: _Batch, layout: StackedLayout, block_size: int,
            dummy_kv_block: int, stream: Any, tail_only: bool = False) -> tuple:
    ring = staging_ring(arena)
    start = layout.tail_offset if tail_only else 0
    nbytes = layout.staged_bytes - start
    slot = ring.acquire(nbytes)
    if tail_only:
        cu, kv = pack_tail(batch, layout, slot.array)
    else:
        cu, kv = pack_metadata(batch, layout, block_size, dummy_kv_block, slot.array)
    ring.copy_htod(int(arena.base) + offset + start, slot, nbytes, arena.device.as_stream(stream),
                   "the pass's metadata")
    return cu, kv
