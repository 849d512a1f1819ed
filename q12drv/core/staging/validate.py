"""Every staging input checked before anything is written: the one place a batch's streams are validated.

:func:`validate_streams` returns the normalised batch (:class:`_Batch`: Python ints and the tables as given) that
packing, the device expansion and :class:`~q12drv.prefill.Q12Pass` read; bad input raises, naming the stream, the
field and the bound.
"""

from __future__ import annotations

from functools import reduce
from itertools import accumulate
from operator import add, or_
from typing import Sequence

import numpy as np

from ..arena import ScratchArena
from ..ints import checked_int as _int
from ..ptr import DevicePtr, device_ptr
from .metadata import StreamStageInfo

_U32_MAX = (1 << 32) - 1
_I32_MAX = (1 << 31) - 1


_U64_MAX = (1 << 64) - 1

#: Byte alignment of ``StreamStageInfo.block_table_dev``: the attention kernel reads the int32 table there.
TABLE_ALIGN = 4
#: Byte alignment of ``StreamStageInfo.seq_len_dev``: a u32.
SEQ_LEN_ALIGN = 4
#: Byte alignment of a Gated DeltaNet state pointer (an ``h_state_ptrs`` entry): the kernels read and write
#: the fp32 ``[Hv, D, D]`` state one float at a time. ``HStateSlot.upload`` and ``Q12Pass.gdn_layer`` check it.
STATE_ALIGN = 4


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


def _int_range(a: np.ndarray) -> tuple:
    """``(min, max)`` of a non-empty integer array as exact Python ints, taken in the array's own dtype (before
    any cast could wrap an unsigned 2**64 - 1 to -1)."""
    return int(a.min()), int(a.max())


def _checked_table(b: int, table, block_size: int, kv_len: int) -> np.ndarray:
    table = np.asarray(table)
    if table.ndim != 1 or not (np.issubdtype(table.dtype, np.integer) or table.size == 0):
        raise TypeError(f"streams[{b}].block_table must be a 1-D integer array, got shape {table.shape} dtype {table.dtype}")
    needed = -(-kv_len // block_size)
    if table.size < needed:
        raise ValueError(f"streams[{b}].block_table has {table.size} entries but kv_len {kv_len} at block_size "
                         f"{block_size} needs {needed}")
    if table.size:
        lo, hi = _int_range(table)  # in the table's own dtype: a uint64 near 2**64 must not become -1
        if hi > _I32_MAX or lo < -_I32_MAX - 1:
            raise ValueError(f"streams[{b}].block_table has entries outside int32 (min {lo}, max {hi})")
    return table.astype(np.int64, copy=False)  # every entry is within int32 now: the cast is exact


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
        table_ptrs.append(device_ptr(f"streams[{b}].block_table_dev", s.block_table_dev, TABLE_ALIGN,
                                          "the attention kernel reads the int32 block table there"))
        sl = s.seq_len_dev
        none = isinstance(sl, (int, np.integer)) and not isinstance(sl, bool) and sl == 0  # 0, q12drv.NULL, np 0
        seq_len_ptrs.append(0 if none else  # none given: nothing of q12drv's reads it
                            device_ptr(f"streams[{b}].seq_len_dev", sl, SEQ_LEN_ALIGN, "a u32 seq_len"))
        tables.append(_checked_table(b, s.block_table, block_size, kv_len))
        mp = s.mrope_positions
        if mp is not None:
            if not use_mrope:
                raise ValueError(f"streams[{b}].mrope_positions given but use_mrope is False")
            mp = np.asarray(mp)
            if mp.shape != (3, count) or not np.issubdtype(mp.dtype, np.integer):
                raise ValueError(f"streams[{b}].mrope_positions must be an integer array of shape (3, {count}), "
                                 f"got {mp.dtype} {mp.shape}")
            if mp.size:
                lo, hi = _int_range(mp)  # in the array's own dtype, before the copy into u32 rows
                if lo < 0 or hi > _U32_MAX:
                    raise ValueError(f"streams[{b}].mrope_positions must be in [0, {_U32_MAX}] (u32), got [{lo}, {hi}]")
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


_TABLE_MASK = TABLE_ALIGN - 1


_SEQ_LEN_MASK = SEQ_LEN_ALIGN - 1


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
                and (type(tp) is int or type(tp) is DevicePtr) and 0 < tp <= _U64_MAX and not tp & _TABLE_MASK
                and (type(sp) is int or type(sp) is DevicePtr) and 0 <= sp <= _U64_MAX and not sp & _SEQ_LEN_MASK
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


_PTR_TYPES = frozenset((int, DevicePtr))


def plain_pointers(values, align: int = 1) -> bool:
    """Whether ``values`` (a list or tuple) are all exact ``int``/``DevicePtr`` addresses in (0, 2**64),
    multiples of ``align``: the common case, checked in bulk (callers name the bad entry otherwise)."""
    if not (type(values) in (list, tuple) and len(values) > 0 and set(map(type, values)) <= _PTR_TYPES
            and all(values)):
        return False
    if align & (align - 1) == 0:  # a power of two: every address's bits at once (negative, >= 2**64, below align)
        bits = reduce(or_, values)
        return 0 <= bits <= _U64_MAX and not bits & (align - 1)
    return 0 < min(values) and max(values) <= _U64_MAX and not any(p % align for p in values)


def plain_table(rows, n: int, align: int = 1) -> np.ndarray | None:
    """``rows`` as a uint64 ``[len(rows), n]`` array when every entry is a plain address (an exact int or
    ``DevicePtr``, or an element of an integer array) in (0, 2**64), a multiple of ``align`` (a power of two), every
    row ``n`` long: the common case of a table of pointers, checked at once. None otherwise (the caller names what is
    wrong, or reads the tensors)."""
    if isinstance(rows, np.ndarray):
        if rows.ndim != 2 or rows.shape[1] != n or rows.dtype.kind not in "iu" or rows.dtype.itemsize > 8:
            return None
        if rows.dtype.kind == "i" and (rows <= 0).any():
            return None
        table = np.ascontiguousarray(rows, np.uint64)
    else:
        if not all(type(row) in (list, tuple) and len(row) == n for row in rows):
            return None
        flat = [p for row in rows for p in row]
        if not set(map(type, flat)) <= _PTR_TYPES:
            return None
        try:
            table = np.array(flat, np.uint64).reshape(len(rows), n)
        except OverflowError:  # negative, or 2**64 and above
            return None
    if not table.all() or int(np.bitwise_or.reduce(table, axis=None)) & (align - 1):
        return None
    return table


def require_arena(arena) -> None:
    if not isinstance(arena, ScratchArena):
        raise TypeError(f"arena must be a ScratchArena, got {type(arena).__name__}")
