"""The stager: validate, reserve at the cursor, pack and copy once, describe what was staged.

* :func:`stage_batched_attn_metadata` writes the stacked :class:`~.metadata.BatchedAttnMetadata` at the arena's
  cursor with ONE ``cuMemcpyHtoDAsync`` of exactly ``staged_bytes`` and advances the cursor by exactly that;
* :func:`stage_stream_metadata` writes one stream's own (n = 1) metadata into its per-stream block, for the
  per-stream fallback;
* :func:`stage_replicated` stages one batch into one arena per device (tensor parallelism): packed once on the
  host, one copy per device.

Bad input raises and leaves the arena, the pinned ring and the cursor as they were. Offsets come from
:mod:`q12drv.core.layout`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..arena import ScratchArena
from ..errors import CapacityError
from ..ints import checked_int as _int
from ..layout import ScratchPlan, stacked_layout
from .metadata import BatchedAttnMetadata, StreamStageInfo, metadata_at
from .pack import _upload, host_tail, pack_metadata, upload_packed
from .validate import _Batch, require_arena, validate_streams

def _metadata(arena, offset, layout, batch, cu, kv, block_size, use_mrope, dummy_kv_block) -> BatchedAttnMetadata:
    return metadata_at(arena, offset, layout, cu, kv, chunk_len=batch.chunk, max_blocks_per_seq=batch.max_blocks,
                       block_size=block_size, use_mrope=use_mrope, dummy_kv_block=dummy_kv_block)


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
    require_arena(arena)
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
    require_arena(arena)
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


def stage_replicated(arenas: Sequence[ScratchArena], streams: Sequence[Sequence[StreamStageInfo]], *, block_size: int,
                     use_mrope: bool, scratch_offset_bytes: int, dummy_kv_block: int,
                     stream: Sequence[Any] | None = None) -> list:
    """Stage one batch into several arenas, one per device (tensor parallelism: every rank runs the same tokens over
    its own share of the heads, with its own copy of the block tables): packed once on the host, then one copy per
    device, each with its device's block-table and ``seq_len`` pointers.

    Parameters
    ----------
    arenas : sequence of ScratchArena
        One per device (rank), in rank order; the cursor of each at or before ``scratch_offset_bytes``.
    streams : sequence of sequences of StreamStageInfo
        ``streams[r]``: the batch as rank ``r`` sees it. The ranks must agree on everything but the device pointers
        (``block_table_dev``, ``seq_len_dev``: each rank's copy of the tables on its device): the same starts,
        counts, host block tables and MRoPE positions.
    block_size, use_mrope, scratch_offset_bytes, dummy_kv_block
        As for :func:`stage_batched_attn_metadata`, the same for every rank.
    stream : sequence, optional
        One stream per rank (as :meth:`~q12drv.core.device.Device.as_stream` takes it); default each device's.

    Returns
    -------
    list of BatchedAttnMetadata
        One per rank: the same fields at each arena's own addresses.

    Raises
    ------
    ValueError
        Counts that differ, ranks that disagree (naming the stream and what differs), or anything
        :func:`stage_batched_attn_metadata` refuses; checked for every rank before anything is written.
    """
    if isinstance(arenas, ScratchArena) or not isinstance(arenas, Sequence) or not arenas:
        raise TypeError("arenas must be a non-empty sequence of ScratchArena (one per device)")
    if len(streams) != len(arenas) or (stream is not None and len(stream) != len(arenas)):
        raise ValueError(f"stage_replicated needs one streams list (and one stream, if given) per arena: "
                         f"{len(arenas)} arenas, {len(streams)} streams lists"
                         + ("" if stream is None else f", {len(stream)} streams"))
    for arena in arenas:
        require_arena(arena)
    batches = [validate_streams(s, block_size, use_mrope, dummy_kv_block) for s in streams]
    first = batches[0]
    for r, batch in enumerate(batches[1:], 1):
        _same_batch(r, first, batch)
    layout = stacked_layout(len(first.count_list), first.total, bool(use_mrope))
    offset = _int("scratch_offset_bytes", scratch_offset_bytes, 0, min(a.capacity for a in arenas))
    for r, arena in enumerate(arenas):  # every rank's place checked before the first is written
        arena.check_reserve(f"arenas[{r}] stacked_metadata", layout.staged_bytes, offset=offset, align=8)
    packed = np.empty(layout.staged_bytes, np.uint8)
    cu, kv = pack_metadata(first, layout, int(block_size), dummy_kv_block, packed)  # the host's work, once
    metas = []
    for r, (arena, batch) in enumerate(zip(arenas, batches)):
        region = arena.reserve("stacked_metadata", layout.staged_bytes, offset=offset, align=8)
        try:
            upload_packed(arena, region.offset, packed, batch, layout, None if stream is None else stream[r])
        except BaseException:
            arena.unreserve(region)
            raise
        metas.append(_metadata(arena, region.offset, layout, batch, cu, kv, int(block_size), use_mrope,
                               dummy_kv_block))  # (the host copies are read-only: the ranks share them)
    return metas


def _same_batch(r: int, first: _Batch, batch: _Batch) -> None:
    """Raise unless rank ``r``'s validated batch is rank 0's but for the device pointers."""
    if batch.count_list != first.count_list or batch.start_list != first.start_list:
        raise ValueError(f"streams[{r}] has starts {batch.start_list} and counts {batch.count_list}, rank 0 has "
                         f"{first.start_list} and {first.count_list}: every rank stages the same batch")
    for b, (t, t0) in enumerate(zip(batch.raw_tables, first.raw_tables)):
        if t is not t0 and not np.array_equal(t, t0):
            raise ValueError(f"streams[{r}][{b}].block_table differs from rank 0's: the ranks share one KV layout "
                             f"(their own copies of the same tables)")
    for b, (m, m0) in enumerate(zip(batch.mrope, first.mrope)):
        if m is not m0 and not (m is not None and m0 is not None and np.array_equal(m, m0)):
            raise ValueError(f"streams[{r}][{b}].mrope_positions differ from rank 0's")
