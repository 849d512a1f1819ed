"""Staging: pack the metadata of N prefill streams into pinned memory and upload it with one copy.

* :func:`stage_batched_attn_metadata` writes the stacked :class:`BatchedAttnMetadata` at the
  arena's cursor with ONE ``cuMemcpyHtoDAsync`` of exactly ``staged_bytes`` and advances the
  cursor by exactly that.
* :func:`place_h_state_slot` reserves the per-SSM-layer ``h_state_ptrs`` slot right there, and
  :meth:`HStateSlot.upload` rewrites it before each SSM layer (stream-ordered, event-guarded).
* :func:`stage_stream_metadata` writes one stream's own (n = 1) metadata into its per-stream
  block, for the per-stream fallback.

Everything is validated before the first byte is written: bad input raises and leaves the
arena, the pinned ring and the cursor as they were. Offsets come from :mod:`q12drv.core.layout`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from itertools import accumulate
from operator import add
from typing import Any, Sequence

import numpy as np

from .arena import ScratchArena
from .errors import CapacityError, Q12Error
from .ints import checked_int as _int
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
    "validate_streams",
    "stage_stacked",
    "host_copies",
    "pass_fields",
    "metadata_of_pass",
]

_U32_MAX = (1 << 32) - 1
_I32_MAX = (1 << 31) - 1
_U64_MAX = (1 << 64) - 1
_STAGING_RING_SLOTS = 3
_H_STATE_RING_SLOTS = 16


def _require_arena(arena) -> None:
    if not isinstance(arena, ScratchArena):
        raise TypeError(f"arena must be a ScratchArena, got {type(arena).__name__}")


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

    Device fields are absolute :class:`~q12drv.core.ptr.DevicePtr` addresses inside the arena.
    ``staged_bytes`` is the exact footprint from ``scratch_offset_bytes``: the cursor advance.
    ``cu_seqlens_host`` and ``kv_lens_host`` are read-only int32 arrays; in an object made by
    :func:`metadata_of_pass` (an :class:`~q12drv.kernels.expand.ExpandPlan` pass) they are made on first
    access, from the integers of that pass the object keeps.
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

    def __getattr__(self, name: str):
        # only reached for an attribute the instance lacks: the host copies of a metadata object built
        # by metadata_of_pass, made on first access from the pass's own integers (kept in the object)
        d = self.__dict__
        ints = d.get("_host_ints") if name in _HOST_COPIES else None
        if ints is not None:
            d["cu_seqlens_host"], d["kv_lens_host"] = host_copies(*ints)
            return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_HOST_COPIES = ("cu_seqlens_host", "kv_lens_host")


class _Batch:
    """Validated, normalised inputs (built by :func:`validate_streams`): Python ints and the tables as given."""

    __slots__ = ("table_ptr_list", "seq_len_ptr_list", "mrope", "max_blocks", "count_list", "start_list", "total",
                 "chunk", "raw_tables", "block_size", "_blocks", "cu_list", "kv_list")

    def __init__(self, starts: list, counts: list, table_ptrs: list, seq_len_ptrs: list, tables: list, mrope: list,
                 block_size: int):
        self.start_list = starts
        self.count_list = counts
        self.cu_list = list(accumulate(counts, initial=0))  # cu_seqlens
        self.kv_list = list(map(add, starts, counts))  # kv_lens
        self.total = self.cu_list[-1]
        self.chunk = max(counts)
        self.table_ptr_list = table_ptrs
        self.seq_len_ptr_list = seq_len_ptrs
        self.mrope = mrope
        self.raw_tables = tables
        self.max_blocks = max(map(len, tables))
        self.block_size = block_size
        self._blocks = None

    @property
    def counts(self) -> np.ndarray:
        return np.array(self.count_list, np.int64)

    def touched_blocks(self) -> tuple:
        """``(used, first, block_offsets, head_skip, tail_len)`` for the blocks the pass touches (memoised).

        ``used``: int64 table entries of blocks ``first[b] ..`` of each stream, stream after stream,
        stream b's from ``block_offsets[b]``; ``head_skip[b]``: positions of b's first block before
        ``proc_start``; ``tail_len[b]``: positions of its last block up to the end.
        """
        if self._blocks is not None:
            return self._blocks
        shift = self.block_size.bit_length() - 1
        firsts, offsets, pieces, head_skip, tail_len, at = [], [], [], [], [], 0
        for p0, c, t in zip(self.start_list, self.count_list, self.raw_tables):
            first = p0 >> shift
            last = (p0 + c - 1) >> shift
            firsts.append(first)
            offsets.append(at)
            pieces.append(t[first:last + 1])
            head_skip.append(p0 - (first << shift))  # positions of the first block before proc_start
            tail_len.append(p0 + c - (last << shift))  # positions of the last block up to the end
            at += last - first + 1
        offsets.append(at)
        used = np.concatenate(pieces, dtype=np.int64, casting="unsafe") if len(pieces) > 1 else pieces[0].astype(np.int64)
        self._blocks = (used, firsts, offsets, head_skip, tail_len)
        return self._blocks



def _checked_table(b: int, table, block_size: int, kv_len: int) -> np.ndarray:
    table = np.asarray(table)
    if table.ndim != 1 or not (np.issubdtype(table.dtype, np.integer) or table.size == 0):
        raise TypeError(f"streams[{b}].block_table must be a 1-D integer array, got shape {table.shape} dtype {table.dtype}")
    needed = -(-kv_len // block_size)
    if table.size < needed:
        raise ValueError(f"streams[{b}].block_table has {table.size} entries but kv_len {kv_len} at block_size "
                         f"{block_size} needs {needed}")
    table = table.astype(np.int64, copy=False)
    if table.size and (table.max() > _I32_MAX or table.min() < -_I32_MAX - 1):
        raise ValueError(f"streams[{b}].block_table has entries outside int32 (min {table.min()}, max {table.max()})")
    return table


def validate_streams(streams: Sequence[StreamStageInfo], block_size, use_mrope, dummy_kv_block) -> _Batch:
    """Check every staging input; raise naming the first bad one; return the normalised batch.

    Callers that must refuse bad input before touching the arena (``Q12Pass``) validate first and
    hand the result to :func:`stage_stacked` so the hot path does not check twice. The common case
    takes :func:`_validate_fast`.
    """
    batch = _validate_fast(streams, block_size, use_mrope, dummy_kv_block)
    if batch is not None:
        return batch
    return _validate_checked(streams, block_size, use_mrope, dummy_kv_block)


def _validate_checked(streams: Sequence[StreamStageInfo], block_size, use_mrope, dummy_kv_block) -> _Batch:
    """The precise checks, one input at a time (any int or array type the stager accepts)."""
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
    starts, counts, table_ptrs, seq_len_ptrs, tables, mrope = [], [], [], [], [], []
    for b, s in enumerate(streams):
        if not isinstance(s, StreamStageInfo):
            raise TypeError(f"streams[{b}] must be a StreamStageInfo, got {type(s).__name__}")
        start = _int(f"streams[{b}].proc_start", s.proc_start, 0, _I32_MAX)
        count = _int(f"streams[{b}].proc_count", s.proc_count, 0, _I32_MAX)
        if count == 0:
            raise ValueError(f"streams[{b}].proc_count is 0: a fully cached chunk has nothing to stage "
                             f"(upstream bug B7); leave the stream out of the pass")
        kv_len = start + count
        if kv_len > _I32_MAX:
            raise ValueError(f"streams[{b}]: proc_start + proc_count = {kv_len} overflows the i32 kv_lens entry")
        starts.append(start)
        counts.append(count)
        table_ptrs.append(_int(f"streams[{b}].block_table_dev", s.block_table_dev, 1, _U64_MAX))
        seq_len_ptrs.append(_int(f"streams[{b}].seq_len_dev", s.seq_len_dev, 1, _U64_MAX))
        tables.append(_checked_table(b, s.block_table, block_size, kv_len))
        mp = s.mrope_positions
        if mp is not None:
            if not use_mrope:
                raise ValueError(f"streams[{b}].mrope_positions given but use_mrope is False")
            mp = np.asarray(mp)
            if mp.shape != (3, count) or not np.issubdtype(mp.dtype, np.integer):
                raise ValueError(f"streams[{b}].mrope_positions must be an integer array of shape (3, {count}), "
                                 f"got {mp.dtype} {mp.shape}")
            if mp.size and (mp.min() < 0 or mp.max() > _U32_MAX):
                raise ValueError(f"streams[{b}].mrope_positions must be in [0, {_U32_MAX}] (u32), got "
                                 f"[{mp.min()}, {mp.max()}]")
        mrope.append(mp)
    total = sum(counts)
    if total > _I32_MAX:
        raise ValueError(f"total tokens {total} overflow the i32 cu_seqlens prefix sum")
    return _Batch(starts, counts, table_ptrs, seq_len_ptrs, tables, mrope, block_size)


#: Block-table dtypes whose every value fits int32 (no range check needed).
_NARROW_TABLE_DTYPES = frozenset(np.dtype(t) for t in (np.int32, np.int16, np.int8, np.uint16, np.uint8))
#: Block-table dtypes that need a range check against int32.
_WIDE_TABLE_DTYPES = frozenset(np.dtype(t) for t in (np.int64, np.uint32))
_I32 = np.dtype(np.int32)


def _validate_fast(streams, block_size, use_mrope, dummy_kv_block) -> _Batch | None:
    """The same checks as :func:`validate_streams` for the common input types, in one tight loop.

    Returns None whenever anything is unusual or wrong (other int or array types, a value out of
    range, ...): :func:`validate_streams` then runs the precise checks, which raise the named error or
    accept the input. It never accepts what the precise path would refuse.
    """
    if type(streams) not in (list, tuple) or not streams:
        return None
    if (type(block_size) is not int or not 1 <= block_size <= 1 << 20 or block_size & (block_size - 1)
            or type(use_mrope) is not bool or type(dummy_kv_block) is not int or not 0 <= dummy_kv_block <= _I32_MAX):
        return None
    shift = block_size.bit_length() - 1
    starts, counts, table_ptrs, seq_len_ptrs, tables, mrope = [], [], [], [], [], []
    for s in streams:
        if type(s) is not StreamStageInfo:
            return None
        p0, c, tp, sp, table = s.proc_start, s.proc_count, s.block_table_dev, s.seq_len_dev, s.block_table
        if not (type(p0) is int and type(c) is int and 0 <= p0 and 0 < c and p0 + c <= _I32_MAX
                and (type(tp) is int or type(tp) is DevicePtr) and 0 < tp <= _U64_MAX
                and (type(sp) is int or type(sp) is DevicePtr) and 0 < sp <= _U64_MAX
                and type(table) is np.ndarray and table.ndim == 1 and table.size << shift >= p0 + c):
            return None
        dt = table.dtype
        if dt is not _I32 and dt not in _NARROW_TABLE_DTYPES:
            if dt not in _WIDE_TABLE_DTYPES or table.max() > _I32_MAX or table.min() < -_I32_MAX - 1:
                return None
        mp = s.mrope_positions
        if mp is not None:
            if (not use_mrope or type(mp) is not np.ndarray or mp.shape != (3, c) or mp.dtype.kind not in "iu"
                    or mp.min() < 0 or mp.max() > _U32_MAX):
                return None
        starts.append(p0)
        counts.append(c)
        table_ptrs.append(tp)
        seq_len_ptrs.append(sp)
        tables.append(table)
        mrope.append(mp)
    if sum(counts) > _I32_MAX:
        return None
    return _Batch(starts, counts, table_ptrs, seq_len_ptrs, tables, mrope, block_size)

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


def host_copies(cu: list, kv: list) -> tuple:
    """The host copies of ``cu_seqlens`` and ``kv_lens`` (int32 lists): one read-only int32 array cut in two."""
    ints = np.array(cu + kv, np.int32)
    ints.setflags(write=False)
    return ints[:len(cu)], ints[len(cu):]


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
    ring = arena.find_attachment(_RING_KEYS.get(kind)) if type(arena) is ScratchArena else None
    if ring is not None:  # the common case: made before
        return ring
    slots = _STAGING_RING_SLOTS if kind == "staging" else _H_STATE_RING_SLOTS
    return arena.attachment(f"ring:{kind}", lambda: PinnedRing(arena.device, slots, kind))


_RING_KEYS = {"staging": "ring:staging", "h_state": "ring:h_state"}


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
    s = arena.device.as_stream(stream)
    arena.device.driver.memcpy_htod_async(int(arena.base) + offset + start, slot.addr, nbytes, s)
    ring.commit(slot, s)
    return cu, kv


_META_CACHE_MAX = 256
assert not hasattr(BatchedAttnMetadata, "__post_init__"), "metadata_at would skip __post_init__"


def _metadata(arena, offset, layout, batch, cu, kv, block_size, use_mrope, dummy_kv_block) -> BatchedAttnMetadata:
    return metadata_at(arena, offset, layout, cu, kv, chunk_len=batch.chunk, max_blocks_per_seq=batch.max_blocks,
                       block_size=block_size, use_mrope=use_mrope, dummy_kv_block=dummy_kv_block)


def metadata_at(arena, offset: int, layout: StackedLayout, cu: np.ndarray, kv: np.ndarray, *, chunk_len: int,
                max_blocks_per_seq: int, block_size: int, use_mrope: bool, dummy_kv_block: int) -> BatchedAttnMetadata:
    """The :class:`BatchedAttnMetadata` describing ``layout`` at arena ``offset`` (``layout.n`` streams,
    ``layout.total_tokens`` tokens) with host copies ``cu`` and ``kv`` (made read-only)."""
    fields = _template(arena, offset, layout, block_size, use_mrope, dummy_kv_block)
    cu.setflags(write=False)
    kv.setflags(write=False)
    meta = object.__new__(BatchedAttnMetadata)  # the frozen dataclass without its per-field __setattr__
    d = meta.__dict__
    d.update(fields)
    d["cu_seqlens_host"] = cu
    d["kv_lens_host"] = kv
    d["chunk_len"] = int(chunk_len)
    d["max_blocks_per_seq"] = int(max_blocks_per_seq)
    return meta


def _template(arena, offset: int, layout: StackedLayout, block_size: int, use_mrope: bool, dummy_kv_block: int) -> dict:
    """:func:`_metadata_template` for ``layout`` at arena ``offset``, memoised (the dict is shared: never write it)."""
    base = int(arena.base) + offset
    key = (base, layout.n, layout.total_tokens, layout.mrope, block_size, bool(use_mrope), int(dummy_kv_block))
    fields = _META_TEMPLATES.get(key)
    if fields is None:
        if len(_META_TEMPLATES) >= _META_CACHE_MAX:
            _META_TEMPLATES.clear()
        fields = _META_TEMPLATES[key] = _metadata_template(base, offset, layout, block_size, use_mrope, dummy_kv_block)
    return fields


def pass_fields(arena, offset: int, layout: StackedLayout, *, max_blocks_per_seq: int, block_size: int, use_mrope: bool,
                dummy_kv_block: int) -> dict:
    """What every pass staged as ``layout`` at arena ``offset`` shares: each :class:`BatchedAttnMetadata`
    field but ``chunk_len`` and the host copies, for :func:`metadata_of_pass`. Memoised per place and
    settings: the dict is shared, never write it.

    Parameters
    ----------
    arena : ScratchArena
    offset : int
        Arena offset of the stacked block.
    layout : StackedLayout
        ``layout.n`` streams, ``layout.total_tokens`` tokens.
    max_blocks_per_seq, block_size, use_mrope, dummy_kv_block
        As :func:`metadata_at` takes them.
    """
    key = (int(arena.base) + offset, layout.n, layout.total_tokens, layout.mrope, int(max_blocks_per_seq),
           block_size, bool(use_mrope), int(dummy_kv_block))
    fields = _PASS_FIELDS.get(key)
    if fields is None:
        # built compact, with every key metadata_of_pass sets already in: its copy never grows
        fields = {k: v for k, v in _template(arena, offset, layout, block_size, use_mrope, dummy_kv_block).items()
                  if k not in _HOST_COPIES}
        fields["max_blocks_per_seq"] = int(max_blocks_per_seq)
        fields["_host_ints"] = None
        if len(_PASS_FIELDS) >= _META_CACHE_MAX:
            _PASS_FIELDS.clear()
        _PASS_FIELDS[key] = fields
    return fields


#: pass_fields per (absolute address of the block, layout, settings).
_PASS_FIELDS: dict = {}


def metadata_of_pass(fields: dict, chunk_len: int, cu: list, kv: list) -> BatchedAttnMetadata:
    """A new :class:`BatchedAttnMetadata` from :func:`pass_fields` and one pass's integers.

    Parameters
    ----------
    fields : dict
        :func:`pass_fields` of the layout and place the pass was staged at (copied, not kept).
    chunk_len : int
        The pass's longest per-stream count.
    cu, kv : list of int
        The pass's ``cu_seqlens`` (n + 1 entries) and ``kv_lens`` (n), checked by the caller. The object
        keeps them: hand it lists nobody changes afterwards. Its ``cu_seqlens_host`` and ``kv_lens_host``
        are made from them on first access (read-only int32 arrays, as :func:`metadata_at`'s), so a pass
        that never reads them does not pay for them, and they stay this pass's whatever comes after it.

    Returns
    -------
    BatchedAttnMetadata
    """
    d = fields.copy()
    d["chunk_len"] = chunk_len
    d["_host_ints"] = (cu, kv)
    meta = _new_object(BatchedAttnMetadata)  # the frozen dataclass without its __init__ and per-field __setattr__
    _set_dict(meta, d)
    return meta


_new_object = object.__new__
_set_dict = BatchedAttnMetadata.__dict__["__dict__"].__set__  # the instance dict, given whole


_META_TEMPLATES: dict = {}


def _metadata_template(base: int, offset: int, layout: StackedLayout, block_size: int, use_mrope: bool,
                       dummy_kv_block: int) -> dict:
    """Every :class:`BatchedAttnMetadata` field that follows from where the layout sits (all but the
    host copies, ``chunk_len`` and ``max_blocks_per_seq``)."""
    ptr = {f.name: DevicePtr(base + f.offset) for f in layout.fields}
    positions = ptr["positions_stacked"]
    fields = dict(
        positions_stacked=positions,
        positions_h_stacked=ptr.get("positions_h_stacked", positions),
        positions_w_stacked=ptr.get("positions_w_stacked", positions),
        slot_stacked=ptr["slot_stacked"],
        block_table_ptrs=ptr["block_table_ptrs"],
        seq_len_ptrs=ptr["seq_len_ptrs"],
        batch_size=layout.n,
        chunk_len=0,
        total_tokens=layout.total_tokens,
        cu_seqlens=ptr["cu_seqlens"],
        cu_seqlens_host=None,
        kv_lens=ptr["kv_lens"],
        kv_lens_host=None,
        max_blocks_per_seq=0,
        staged_bytes=layout.staged_bytes,
        scratch_offset_bytes=offset,
        use_mrope=bool(use_mrope),
        block_size=block_size,
        dummy_kv_block=int(dummy_kv_block),
        layout=layout,
    )
    if fields.keys() != BatchedAttnMetadata.__dataclass_fields__.keys():
        raise AssertionError(f"metadata template fields {sorted(fields)} != {sorted(BatchedAttnMetadata.__dataclass_fields__)}")
    return fields


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
    return stage_stacked(arena, streams, block_size, use_mrope, scratch_offset_bytes, dummy_kv_block, stream)[0]


#: What :func:`stage_stacked` copies: every field, the per-stream tail only, or nothing.
UPLOADS = ("all", "tail", "none")


def stage_stacked(arena, streams, block_size, use_mrope, scratch_offset_bytes, dummy_kv_block, stream,
                  upload: str = "all", batch: _Batch | None = None) -> tuple:
    """:func:`stage_batched_attn_metadata`, with a choice of what crosses to the device.

    ``upload``: ``"all"`` packs and copies every field; ``"tail"`` only the per-stream fields (the
    per-token ones are then written on the device: :mod:`q12drv.kernels.expand`, which checks what
    that path takes); ``"none"`` reserves the block and describes it, copying nothing: the caller
    writes every byte (and unreserves ``arena.regions[-1]`` if it cannot).

    ``batch``: what :func:`validate_streams` returned for exactly these ``streams`` and settings,
    just before (nothing may change in between); None validates here.

    Returns ``(meta, batch)``.
    """
    _require_arena(arena)
    if upload not in UPLOADS:
        raise ValueError(f"upload must be one of {UPLOADS}, got {upload!r}")
    if batch is None:
        batch = validate_streams(streams, block_size, use_mrope, dummy_kv_block)
    layout = stacked_layout(len(streams), batch.total, bool(use_mrope))
    offset = _int("scratch_offset_bytes", scratch_offset_bytes, 0, arena.capacity)
    region = arena.reserve("stacked_metadata", layout.staged_bytes, offset=offset, align=8)  # bounds-checked there
    if upload == "none":
        cu, kv = host_tail(batch)
    else:
        try:
            cu, kv = _upload(arena, region.offset, batch, layout, int(block_size), dummy_kv_block, stream,
                             upload == "tail")
        except BaseException:
            arena.unreserve(region)
            raise
    return _metadata(arena, region.offset, layout, batch, cu, kv, int(block_size), use_mrope, dummy_kv_block), batch


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
    _require_arena(arena)
    if not isinstance(plan, ScratchPlan):
        raise TypeError(f"plan must be a ScratchPlan (make_scratch_plan), got {type(plan).__name__}")
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
        raise TypeError(f"stream index b must be an int, got {type(b).__name__} {b!r:.60}")
    if not 0 <= b < plan.n:
        raise IndexError(f"stream index {b} out of range for a plan of {plan.n} streams")
    if bool(use_mrope) != plan.mrope:
        raise ValueError(f"use_mrope={use_mrope} but the plan was made with mrope={plan.mrope}")
    batch = validate_streams([info], block_size, use_mrope, dummy_kv_block)
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


_PTR_TYPES = frozenset((int, DevicePtr))


def plain_pointers(values, align: int = 1) -> bool:
    """Whether ``values`` (a list or tuple) are all exact ``int``/``DevicePtr`` addresses in (0, 2**64),
    multiples of ``align``: the common case, checked in bulk (callers name the bad entry otherwise)."""
    return (type(values) in (list, tuple) and len(values) > 0 and set(map(type, values)) <= _PTR_TYPES
            and min(values) > 0 and max(values) <= _U64_MAX and (align == 1 or not any(p % align for p in values)))


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

    def __init__(self, arena: ScratchArena, offset: int, n: int, ptr: DevicePtr | None = None):
        # ptr: the address of ``offset`` when the caller has it already (the region it reserved there)
        self.arena = arena
        self.offset = offset
        self.n = n
        self.ptr = DevicePtr(int(arena.base) + offset) if ptr is None else ptr
        self.uploads = 0
        self._packer = _PACKERS.get(n) or _packer(n)
        self._generation = arena.generation  # the pass this slot belongs to (see ScratchArena.generation)

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
        self.arena._require_open()
        if self.arena.generation != self._generation:
            raise Q12Error(f"this h_state_ptrs slot belongs to an earlier pass: the arena was reset since, and "
                           f"offset {self.offset:,} may now hold another pass's metadata; use the new pass's slot")
        if isinstance(state_ptrs, (str, bytes)) or not isinstance(state_ptrs, (Sequence, np.ndarray)):
            raise TypeError(f"state_ptrs must be a sequence of {self.n} device pointers, got {type(state_ptrs).__name__}")
        if len(state_ptrs) != self.n:
            raise ValueError(f"h_state_ptrs needs exactly {self.n} pointers (one per stream), got {len(state_ptrs)}")
        values = state_ptrs if type(state_ptrs) is list else list(state_ptrs)
        if not plain_pointers(values):  # the precise, named checks
            values = [_int(f"state_ptrs[{b}]", p, 1, _U64_MAX) for b, p in enumerate(values)]
        self._write(values, stream)

    def _write(self, values: Sequence[int], stream: Any) -> None:
        # ``values``: exactly n ints in (0, 2**64), checked by the caller (upload, or Q12Pass.gdn_layer
        # whose own checks are stricter), for this slot's current pass
        nbytes = 8 * self.n
        self.arena.check_range("h_state_ptrs", self.offset, nbytes)
        ring = staging_ring(self.arena, "h_state")
        slot = ring.acquire(nbytes)
        self._packer.pack_into(slot.array, 0, *values)
        s = self.arena.device.as_stream(stream)
        self.arena.device.driver.memcpy_htod_async(int(self.ptr), slot.addr, nbytes, s)
        ring.commit(slot, s)
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
    region = arena.reserve("h_state_ptrs", 8 * _int("n", n, 1, 1 << 20), align=8)
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
    _require_arena(arena)
    if not isinstance(meta, BatchedAttnMetadata):
        raise TypeError(f"meta must be a BatchedAttnMetadata (from the stager), got {type(meta).__name__}")
    offset = meta.scratch_offset_bytes + meta.staged_bytes
    if arena.cursor != offset:
        raise ValueError(f"the arena cursor is at {arena.cursor:,} but the h_state_ptrs slot belongs at "
                         f"scratch_offset_bytes + staged_bytes = {offset:,}; reserve nothing between staging and the slot")
    region = arena.reserve("h_state_ptrs", 8 * meta.batch_size, offset=offset, align=8)
    return HStateSlot(arena, region.offset, meta.batch_size, region.ptr)


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
