"""Device-side expansion of the per-token metadata (``cuda_src/expand_meta.cu``): the host side.

The stacked block's per-token fields (positions, H and W under MRoPE, slots: ``(4S + 8)·T`` bytes)
follow from its per-stream fields (``block_table_ptrs``, ``seq_len_ptrs``, ``cu_seqlens``,
``kv_lens``: ``O(n)`` bytes) and the device-resident block tables. :func:`stage_on_device` launches
one kernel that writes the rest from them, so the host work and the bytes crossing PCIe no longer
grow with the token count. Up to :data:`~q12drv.kernels.meta.TAIL_STREAMS` streams the per-stream
fields travel in the launch's own parameter block (``q12_expand_meta_tail``, which also writes them
into the arena): no pinned slot, no copy, no event, one launch. Past that they take one small pinned
copy into the arena, which ``q12_expand_meta`` reads (as CUDA graphs do: :mod:`q12drv.prefill.graphs`
replays that copy with new bytes). Tokens past the last stream (a pass padded to fixed maxima for a
CUDA graph) get position 0 and slot -1. Either way the arena ends up holding exactly the bytes
:func:`~q12drv.core.staging.stage_batched_attn_metadata` would have copied (pads included), at the same
offsets: everything downstream (kernels, dumps, ``inspect``) is unchanged.

It needs ``block_table_dev`` to hold the same table as ``block_table`` (the stager's contract
anyway: the host copy is what is validated, the device copy what is read). Text positions only:
a batch with per-stream MRoPE ``mrope_positions`` (vision tokens) is refused; stage it on the host.

Entries::

    q12_expand_meta(Q12Meta m, int block_shift, int dummy_kv_block, int use_mrope)
    q12_expand_meta_tail(Q12Meta m, int block_shift, int dummy_kv_block, int use_mrope, Q12Tail tail)

grid ``(gx, n, 1)``: stream b is ``blockIdx.y``; block ``(THREADS, 1, 1)``.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from functools import lru_cache
from itertools import accumulate
from typing import Any, Sequence

import numpy as np

from ..core.arena import ScratchArena
from ..core.errors import Q12Error
from ..core.ints import checked_int
from ..core.layout import stacked_layout
from ..core.staging import BatchedAttnMetadata, metadata_of_pass, pass_fields, stage_stacked, validate_streams
from .meta import TAIL_STREAMS, Q12MetaC, Q12TailC, meta_struct
from . import registry

__all__ = ["SOURCE", "ENTRIES", "THREADS", "MAX_STREAMS", "geometry", "reference", "emulate_expand_meta",
           "emulate_expand_meta_tail", "EMULATORS", "stage_on_device", "ExpandPlan", "enqueue_expand", "device_bytes"]

SOURCE = "expand_meta.cu"
ENTRIES = ("q12_expand_meta", "q12_expand_meta_tail")
#: Threads per CTA.
THREADS = 256
#: CTAs per stream at most (each walks the stream's tokens with a grid stride).
_MAX_CTAS_PER_STREAM = 32
#: grid.y limit of a launch: streams per pass the kernel handles.
MAX_STREAMS = 65535


def _moved() -> Q12Error:
    return Q12Error("the arena moved (ScratchArena.grow) since this ExpandPlan was made: its metadata addresses "
                    "point into freed memory; make a new ExpandPlan on the arena")


def geometry(n: int, chunk_len: int) -> tuple:
    """``(grid, block, smem)`` of ``q12_expand_meta`` for ``n`` streams of at most ``chunk_len`` tokens."""
    if not 1 <= n <= MAX_STREAMS:
        raise ValueError(f"q12_expand_meta handles 1..{MAX_STREAMS} streams (grid.y), got {n}")
    gx = max(1, min(-(-int(chunk_len) // THREADS), _MAX_CTAS_PER_STREAM))
    return (gx, int(n), 1), (THREADS, 1, 1), 0


#: :func:`geometry` per distinct input (only results are kept: a bad input raises every time).
_geometry = lru_cache(maxsize=1024, typed=True)(geometry)


def device_bytes(layout) -> int:
    """Bytes the device path uploads for ``layout`` (as launch parameters or one copy): the per-stream
    tail; the rest is written on the device."""
    return layout.staged_bytes - layout.tail_offset


def reference(cu_seqlens, kv_lens, tables, block_size: int, dummy_kv_block: int) -> tuple:
    """Positions (u32) and slots (i64) of the packed tokens ``0 .. cu_seqlens[n]``, from the per-stream
    fields and tables."""
    cu = np.asarray(cu_seqlens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    pos, slots = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for b in range(kv.size):
        count = int(cu[b + 1] - cu[b])
        p = np.arange(int(kv[b]) - count, int(kv[b]), dtype=np.int64)
        blocks = np.asarray(tables[b], np.int64)[p // block_size]
        blocks = np.where(blocks < 0, dummy_kv_block, blocks)
        pos.append(p)
        slots.append(blocks * block_size + p % block_size)
    return (np.concatenate(pos).astype(np.uint32), np.concatenate(slots))


def emulate_expand_meta(args: dict, mem, grid, block) -> None:
    """Emulated-driver stand-in for ``q12_expand_meta``: reads the per-stream fields and tables through ``mem``."""
    grid = tuple(int(x) for x in grid)
    block = tuple(int(x) for x in block)
    m: Q12MetaC = args["m"]
    n, total = int(m.batch_size), int(m.total_tokens)
    if grid[1] != n or grid[2] != 1 or grid[0] < 1:
        raise ValueError(f"q12_expand_meta needs grid (x, n={n}, 1), got {grid}")
    if block[1:] != (1, 1) or block[0] < 1:
        raise ValueError(f"q12_expand_meta needs a 1-D block, got {block}")
    shift = int(args["block_shift"])
    if not 0 <= shift <= 30:
        raise ValueError(f"block_shift must be in [0, 30], got {shift}")
    bs = 1 << shift
    cu = np.array(mem.array(m.cu_seqlens, np.int32, (n + 1,)), np.int64)
    kv = np.array(mem.array(m.kv_lens, np.int32, (n,)), np.int64)
    table_ptrs = np.array(mem.array(m.block_table_ptrs, np.uint64, (n,)))
    tables = []
    for b in range(n):
        needed = -(-int(kv[b]) // bs)
        tables.append(np.array(mem.array(int(table_ptrs[b]), np.int32, (needed,))) if needed else np.zeros(0, np.int32))
    pos, slots = reference(cu, kv, tables, bs, int(args["dummy_kv_block"]))
    real = int(cu[n])
    if not 0 <= real <= total:
        raise ValueError(f"cu_seqlens[n] = {real} is not within total_tokens {total}")
    rows = [m.positions] + ([m.positions_h, m.positions_w] if int(args["use_mrope"]) else [])
    pad = total & 1
    for ptr in rows:
        out = mem.array(ptr, np.uint32, (total + pad,))
        out[:real] = pos
        out[real:] = 0  # padding tokens past the last stream, and the row's pad word
    slot_out = mem.array(m.slots, np.int64, (total,))
    slot_out[:real] = slots
    slot_out[real:] = -1


def emulate_expand_meta_tail(args: dict, mem, grid, block) -> None:
    """Emulated-driver stand-in for ``q12_expand_meta_tail``: the tail parameter into the arena (each
    field's pad bytes zeroed, as the layout pads it), then :func:`emulate_expand_meta`."""
    m: Q12MetaC = args["m"]
    tail: Q12TailC = args["tail"]
    n = int(m.batch_size)
    if not 1 <= n <= TAIL_STREAMS:
        raise ValueError(f"q12_expand_meta_tail holds 1..{TAIL_STREAMS} streams, got batch_size {n}")
    layout = stacked_layout(n, int(m.total_tokens), bool(int(args["use_mrope"])))
    for name, _ in Q12TailC._fields_:  # the tail's fields, named as the layout names them
        f = layout.field(name)
        out = mem.array(getattr(m, name), np.uint8, (f.padded,))
        out[:f.nbytes] = np.frombuffer(getattr(tail, name), np.uint8, f.nbytes)
        out[f.nbytes:] = 0
    emulate_expand_meta(args, mem, grid, block)


EMULATORS = {"q12_expand_meta": emulate_expand_meta, "q12_expand_meta_tail": emulate_expand_meta_tail}


def stage_on_device(arena, streams: Sequence, *, block_size: int, use_mrope: bool, scratch_offset_bytes: int,
                    dummy_kv_block: int, stream: Any = None, batch=None) -> BatchedAttnMetadata:
    """:func:`~q12drv.core.staging.stage_batched_attn_metadata`, with the per-token fields written on the device.

    Same arguments, same checks, same result and the same bytes in the arena. Up to
    :data:`~q12drv.kernels.meta.TAIL_STREAMS` streams: one ``q12_expand_meta_tail`` launch on
    ``stream`` carrying the per-stream fields as its parameters, nothing else; more streams: one
    pinned copy of the per-stream fields (:func:`device_bytes`), then one ``q12_expand_meta``
    launch. ``batch``: what :func:`~q12drv.core.staging.validate_streams` returned for exactly these
    arguments, just before (the caller validated already); None validates here.

    Raises
    ------
    ValueError
        A stream carries ``mrope_positions`` (vision tokens: use the host stager), or more than
        :data:`MAX_STREAMS` streams; plus everything the host stager raises. Nothing is written.
    """
    if batch is None:
        batch = validate_streams(streams, block_size, use_mrope, dummy_kv_block)
    n = len(batch.count_list)
    for b, mp in enumerate(batch.mrope):  # the kernel writes text positions only
        if mp is not None:
            raise ValueError(f"streams[{b}] carries mrope_positions (vision tokens): the device path writes text "
                             f"positions only; stage this batch with stage_batched_attn_metadata")
    if n > MAX_STREAMS:
        raise ValueError(f"the device path handles at most {MAX_STREAMS} streams per pass, got {n}")
    in_params = n <= TAIL_STREAMS
    # loaded (compiled) before anything is written
    launch = registry.prepared(arena.device, "q12_expand_meta_tail" if in_params else "q12_expand_meta")
    if not in_params:
        meta, _ = stage_stacked(arena, streams, block_size, use_mrope, scratch_offset_bytes, dummy_kv_block, stream,
                                upload="tail", batch=batch)
        try:
            enqueue_expand(launch, meta, stream)
        except BaseException:
            arena.unreserve(arena.regions[-1])
            raise
        return meta
    # the per-stream fields travel as launch parameters: nothing is packed on the host; the metadata is
    # stage_stacked(upload="none")'s, from the fields every pass staged at this place shares (its host copies
    # made on first access, as an ExpandPlan pass's)
    if not isinstance(arena, ScratchArena):
        raise TypeError(f"arena must be a ScratchArena, got {type(arena).__name__}")
    layout = stacked_layout(n, batch.total, bool(use_mrope))
    offset = checked_int("scratch_offset_bytes", scratch_offset_bytes, 0, arena.capacity)
    region = arena.reserve("stacked_metadata", layout.staged_bytes, offset=offset, align=8)  # bounds-checked there
    try:
        fields = pass_fields(arena, region.offset, layout, max_blocks_per_seq=batch.max_blocks,
                             block_size=int(block_size), use_mrope=bool(use_mrope), dummy_kv_block=int(dummy_kv_block))
        meta = metadata_of_pass(fields, batch.chunk, batch.cu_list, batch.kv_list)
        _pack_tail_params(launch, batch)
        enqueue_expand(launch, meta, stream)
    except BaseException:
        arena.unreserve(region)
        raise
    return meta


_I32_MAX = (1 << 31) - 1
_BLOCK = (THREADS, 1, 1)
#: Shapes (pass totals) and grids (chunk lengths) an :class:`ExpandPlan` keeps at most before starting over.
_PLAN_CACHE_MAX = 256


class ExpandPlan:
    """The device expansion for a fixed set of streams, planned once and staged per pass from each
    stream's start and count alone (FlashInfer's plan/run split).

    A runtime keeps one plan while a batch's streams and their block tables stay the same (chunk after
    chunk of the same prompts) and calls :meth:`stage` for every pass. Each call leaves in the arena
    exactly the bytes :func:`~q12drv.core.staging.stage_batched_attn_metadata` would leave for these streams
    with those starts and counts, with one ``q12_expand_meta_tail`` launch: the streams' pointers,
    table sizes and dtypes were validated here, so a pass checks only its integers.

    Parameters
    ----------
    arena, streams, block_size, use_mrope, scratch_offset_bytes, dummy_kv_block
        As :func:`stage_on_device`. Each stream's ``block_table`` (host copy), ``block_table_dev`` and
        ``seq_len_dev`` are validated and kept: the tables must not shrink or change dtype while the
        plan is used (write new block ids into them in place; a longer table needs a new plan).
        ``proc_start`` / ``proc_count`` are checked as the stager checks them, then not kept.

    Raises
    ------
    ValueError
        Vision ``mrope_positions``, or more than :data:`~q12drv.kernels.meta.TAIL_STREAMS` streams (use
        :func:`stage_on_device`); plus everything the stager raises for ``streams``.

    Notes
    -----
    What a pass reuses, and what the caller may rely on:

    * every :meth:`stage` returns a new :class:`~q12drv.core.staging.BatchedAttnMetadata` that describes
      its own pass for good: later passes never change it. Its ``cu_seqlens_host`` and ``kv_lens_host``
      are made on first access, from that pass's integers (kept in the object), as read-only int32
      arrays; its by-value struct (:func:`~q12drv.kernels.meta.meta_struct`) on first use;
    * the plan keeps, per token total (and offset), the arena region (same offset and size: the arena
      hands it out again, :meth:`~q12drv.core.arena.ScratchArena.reserve_again`) and the metadata fields, and
      per chunk length the launch grid (bound to the device's stream, for ``stream=None``); at most 256
      of each, then it starts over;
    * the launch's argument block is the plan's own: a pass rewrites the integers that changed in it
      (``cu_seqlens``, ``kv_lens``, ``chunk_len``; the whole ``Q12Meta`` when the total changed).
      The launch is enqueued with the values of its own pass, so passes may follow each other without
      waiting; the arena bytes a pass's kernel writes are the next pass's to overwrite, as with the stager.

    Examples
    --------
    >>> plan = ExpandPlan(arena, streams, block_size=16, use_mrope=True,            # doctest: +SKIP
    ...                   scratch_offset_bytes=plan_offset, dummy_kv_block=0)
    >>> meta = plan.stage([0, 0], [2048, 1500])   # first chunk of two prompts  # doctest: +SKIP
    >>> meta = plan.stage([2048, 1500], [2048, 12])  # their next chunk          # doctest: +SKIP
    """

    def __init__(self, arena, streams: Sequence, *, block_size: int, use_mrope: bool, scratch_offset_bytes: int,
                 dummy_kv_block: int):
        if not isinstance(arena, ScratchArena):
            raise TypeError(f"arena must be a ScratchArena, got {type(arena).__name__}")
        batch = validate_streams(streams, block_size, use_mrope, dummy_kv_block)
        for b, mp in enumerate(batch.mrope):
            if mp is not None:
                raise ValueError(f"streams[{b}] carries mrope_positions (vision tokens): the device path writes text "
                                 f"positions only; stage this batch with stage_batched_attn_metadata")
        offset = checked_int("scratch_offset_bytes", scratch_offset_bytes, 0, arena.capacity)
        n = len(batch.count_list)
        if n > TAIL_STREAMS:
            raise ValueError(f"an ExpandPlan holds at most {TAIL_STREAMS} streams (the launch-parameter tail), got {n}; "
                             f"stage_on_device takes more")
        self.arena = arena
        self._base = arena._base  # its cached fields hold absolute addresses: refused once the arena moves
        self.n = n
        self.block_size = int(block_size)
        self.use_mrope = bool(use_mrope)
        self.dummy_kv_block = int(dummy_kv_block)
        self.scratch_offset_bytes = offset
        shift = self.block_size.bit_length() - 1
        self._capacity = [t.size << shift for t in batch.raw_tables]  # positions each table covers
        # the bound of a pass's kv_len per stream: the table's cover and the i32 entry in one comparison
        self._limits = [min(c, _I32_MAX) for c in self._capacity]
        self._max_blocks = batch.max_blocks
        self._pointers = (list(batch.table_ptr_list), list(batch.seq_len_ptr_list))
        # a Launch of its own: the streams' pointers are written into its tail parameter once
        self._launch = registry.prepared(arena.device, "q12_expand_meta_tail").kernel.prepare(
            block_shift=shift, dummy_kv_block=self.dummy_kv_block, use_mrope=int(self.use_mrope))
        _pack_tail_params(self._launch, batch)
        args = self._launch.args
        ints, at = _tail_writer(n, "cu_seqlens")  # per pass: cu_seqlens, then kv_lens
        ints_at = type(args).tail.offset + at
        chunk_at = type(args).m.offset + Q12MetaC.chunk_len.offset
        self._shapes: dict = {}  # token total -> (its region, its metadata fields: pass_fields)
        self._grids: dict = {}  # chunk_len -> grid
        self._fires: dict = {}  # chunk_len -> the launch bound to its grid on the device's stream
        self._written = None  # the shape whose Q12Meta the argument block holds (but for its chunk_len)
        # what a pass reads, in one tuple (one attribute load)
        self._hot = (n, self._limits, self._shapes, arena, self._fires, args, ints.pack_into, ints_at, chunk_at)

    def stage(self, starts: Sequence[int], counts: Sequence[int], stream: Any = None, *,
              scratch_offset_bytes: int | None = None) -> BatchedAttnMetadata:
        """Stage one pass: stream b processes ``counts[b]`` tokens from position ``starts[b]``.

        Reserves the stacked block at the plan's offset, or at ``scratch_offset_bytes`` when given (the
        arena's cursor must be at or before it; afterwards it is right behind the block, where
        :func:`~q12drv.core.staging.place_h_state_slot` puts the slot) and enqueues one launch on ``stream``.

        Returns
        -------
        BatchedAttnMetadata
            This pass's, for good (see the class notes).

        Raises
        ------
        TypeError, ValueError
            A start or count that is not an int, negative, a count of 0, or a stream whose table does
            not cover ``start + count`` positions; named, with the numbers. A cursor past the block's
            offset. Nothing is written.
        CapacityError
            The block does not fit the arena; nothing is written.
        """
        n, limits, shapes, arena, fires, args, pack_ints, ints_at, chunk_at = self._hot
        if arena._base != self._base:
            raise _moved()
        # the common case in one plain loop (exact ints in range); anything unusual or wrong: the named checks
        kv = None
        if len(starts) == n == len(counts):
            kv, cu, total = [], [0], 0
            for s, c, limit in zip(starts, counts, limits):
                if type(s) is int is type(c) and 0 <= s < (k := s + c) <= limit:
                    total += c
                    cu.append(total)
                    kv.append(k)
                else:
                    kv = None
                    break
        if kv is None:
            counts, cu, kv = self._checked(starts, counts)
            total = cu[-1]
        key = total if scratch_offset_bytes is None else (total, scratch_offset_bytes)
        shape = shapes.get(key)
        if shape is None:
            shape = self._new_shape(key, total, scratch_offset_bytes)  # reserves its region
        else:
            arena.reserve_again(shape[0])
        try:
            chunk = max(counts)
            meta = metadata_of_pass(shape[1], chunk, cu, kv)
            pack_ints(args, ints_at, *cu, *kv)
            if shape is self._written:
                _pack_u32(args, chunk_at, chunk)
            else:
                args.m = meta_struct(meta)
                self._written = shape
            if stream is None:
                (fires.get(chunk) or self._fire(chunk))()
            else:
                self._launch.launch(self._grids.get(chunk) or self._grid(chunk), _BLOCK, 0, stream)
        except BaseException:
            arena.unreserve(shape[0])
            raise
        return meta

    def _checked(self, starts, counts) -> tuple:
        """``(counts, cu_seqlens, kv_lens)`` of a pass as lists of Python ints, after the named checks (which raise)."""
        n = self.n
        if len(starts) != n or len(counts) != n:
            raise ValueError(f"the plan has {n} streams; got {len(starts)} starts and {len(counts)} counts")
        kv = list(map(_check_pass_stream, range(n), starts, counts, self._capacity))
        counts = [operator.index(c) for c in counts]
        return counts, list(accumulate(counts, initial=0)), kv

    def _new_shape(self, key, total: int, offset: int | None) -> tuple:
        """The shape of a first pass with ``total`` tokens at ``offset`` (None: the plan's), its region
        reserved (else it raises, reserving nothing), kept under ``key``."""
        if total > _I32_MAX:
            raise ValueError(f"total tokens {total} overflow the i32 cu_seqlens prefix sum")
        arena = self.arena
        offset = self.scratch_offset_bytes if offset is None else checked_int("scratch_offset_bytes", offset, 0,
                                                                              arena.capacity)
        layout = stacked_layout(self.n, total, self.use_mrope)
        region = arena.reserve("stacked_metadata", layout.staged_bytes, offset=offset, align=8)
        try:
            fields = pass_fields(arena, region.offset, layout, max_blocks_per_seq=self._max_blocks,
                                 block_size=self.block_size, use_mrope=self.use_mrope,
                                 dummy_kv_block=self.dummy_kv_block)
        except BaseException:
            arena.unreserve(region)
            raise
        if len(self._shapes) >= _PLAN_CACHE_MAX:
            self._shapes.clear()
        shape = self._shapes[key] = (region, fields)
        return shape

    def check_batch(self, arena, batch, block_size: int, use_mrope: bool, dummy_kv_block: int) -> None:
        """Check that a pass over ``batch`` (validated: :func:`~q12drv.core.staging.validate_streams`) on ``arena``
        with these settings is one this plan stages (``Q12Pass(expand_plan=...)`` calls it before it touches
        the arena).

        Raises
        ------
        ValueError
            Another arena, other settings, another number of streams, a stream whose device pointers are not
            the plan's stream's, or a table the plan recorded as too short for the pass; named, with the
            numbers.
        """
        if arena is not self.arena:
            raise ValueError("expand_plan was made on another arena; make the plan on the pass's arena")
        if arena._base != self._base:
            raise _moved()
        mine = (self.block_size, self.use_mrope, self.dummy_kv_block)
        if (int(block_size), bool(use_mrope), int(dummy_kv_block)) != mine:
            raise ValueError(f"expand_plan was made with block_size, use_mrope, dummy_kv_block = {mine}, the pass has "
                             f"{(int(block_size), bool(use_mrope), int(dummy_kv_block))}; make a plan for these settings")
        if len(batch.count_list) != self.n:
            raise ValueError(f"expand_plan holds {self.n} streams, the pass has {len(batch.count_list)}")
        for b, (tp, sp, kv, cap) in enumerate(zip(batch.table_ptr_list, batch.seq_len_ptr_list, batch.kv_list,
                                                  self._capacity)):
            if tp != self._pointers[0][b] or sp != self._pointers[1][b]:
                raise ValueError(f"streams[{b}] is not the plan's stream {b}: block_table_dev {int(tp):#x} and "
                                 f"seq_len_dev {int(sp):#x}, the plan has {int(self._pointers[0][b]):#x} and "
                                 f"{int(self._pointers[1][b]):#x}; make a plan for these streams")
            if kv > cap:
                raise ValueError(f"streams[{b}]: proc_start + proc_count = {kv} positions, but the plan recorded a "
                                 f"block table covering {cap}; make a new plan with the longer table")

    def _grid(self, chunk: int) -> tuple:
        if len(self._grids) >= _PLAN_CACHE_MAX:
            self._grids.clear()
        grid = self._grids[chunk] = geometry(self.n, chunk)[0]
        return grid

    def _fire(self, chunk: int):
        """The plan's launch for passes of ``chunk_len`` ``chunk`` on the device's stream, bound (it reads the
        argument block as it is when called)."""
        if len(self._fires) >= _PLAN_CACHE_MAX:
            self._fires.clear()
        fire = self._fires[chunk] = self._launch.bind(self._grids.get(chunk) or self._grid(chunk), _BLOCK)
        return fire


_pack_u32 = struct.Struct("<I").pack_into


def _check_pass_stream(b: int, start, count, capacity: int) -> int:
    """Stream b's kv_len for one pass of an :class:`ExpandPlan`, after the stager's checks."""
    if type(start) is not int or type(count) is not int:
        try:
            if isinstance(start, bool) or isinstance(count, bool):
                raise TypeError
            start, count = operator.index(start), operator.index(count)
        except TypeError:
            raise TypeError(f"starts[{b}] and counts[{b}] must be ints, got {start!r} and {count!r}") from None
    if start < 0 or count < 1:
        raise ValueError(f"stream {b}: start {start} must be >= 0 and count {count} >= 1 (a fully cached chunk has "
                         f"nothing to stage: leave the stream out, with a new plan)")
    kv = start + count
    if kv > capacity:
        raise ValueError(f"stream {b}: start + count = {kv} positions, but its block table covers {capacity}; "
                         f"make a new plan with the longer table")
    if kv > _I32_MAX:
        raise ValueError(f"stream {b}: start + count = {kv} overflows the i32 kv_lens entry")
    return kv


def enqueue_expand(launch, meta, stream: Any) -> None:
    """One expansion launch over staged ``meta`` (``launch``: the entry's prepared
    :class:`~q12drv.core.launch.Launch`): every argument comes from the metadata the stager validated,
    straight into the argument block; the grid covers ``meta.batch_size`` streams of ``meta.chunk_len``.
    ``q12_expand_meta_tail`` also takes its ``tail`` parameter, written before (:func:`stage_on_device`)."""
    args = launch.args
    args.block_shift = meta.block_size.bit_length() - 1
    args.dummy_kv_block = meta.dummy_kv_block
    args.use_mrope = meta.use_mrope
    args.m = meta_struct(meta)  # built once per pass: the pass's layers take the same one
    launch.launch(*_geometry(meta.batch_size, meta.chunk_len), stream)


def _tail_writer(n: int, first: str = "block_table_ptrs") -> tuple:
    """``(struct, offset)``: the :class:`struct.Struct` writing ``n`` streams' values of the
    :class:`Q12TailC` fields from ``first`` to the last (each array's entries past ``n`` zeroed), and
    the byte offset of ``first`` in the mirror; built from the mirror's own fields."""
    key = (n, first)
    hit = _TAIL_WRITERS.get(key)
    if hit is None:
        names = [name for name, _ in Q12TailC._fields_]
        start = getattr(Q12TailC, first).offset
        parts = ["<"]
        for name, ctype in Q12TailC._fields_[names.index(first):]:
            cap, size = ctype._length_, ctypes.sizeof(ctype._type_)
            code = {8: "Q", 4: "i"}[size]
            used = n + 1 if cap == TAIL_STREAMS + 1 else n
            at = start + struct.calcsize("".join(parts))
            if getattr(Q12TailC, name).offset != at:
                raise AssertionError(f"Q12TailC.{name} at {getattr(Q12TailC, name).offset}, the writer is at {at}")
            parts.append(f"{used}{code}{(cap - used) * size}x")
        hit = _TAIL_WRITERS[key] = (struct.Struct("".join(parts)), start)
    return hit


def _pack_tail_params(launch, batch) -> None:
    """``batch``'s per-stream fields into ``launch``'s ``tail`` parameter."""
    args = launch.args
    st, at = _tail_writer(len(batch.count_list))
    st.pack_into(args, type(args).tail.offset + at, *batch.table_ptr_list, *batch.seq_len_ptr_list, *batch.cu_list,
                 *batch.kv_list)


_TAIL_WRITERS: dict = {}

registry.register(SOURCE, ENTRIES, EMULATORS)
