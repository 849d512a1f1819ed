"""The sizing SSOT against the seed, upstream's regression numbers, and the plan's invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from q12drv.core.layout import (
    Q12_SIZING_STREAMS,
    RING_SLOT_ALIGN,
    a8,
    align_up,
    h_state_entry_offset,
    make_scratch_plan,
    q12_batched_scratch_bytes,
    q12_batched_scratch_bytes_varlen,
    ring_slots,
    scratch_bytes_bound,
    single_stream_payload,
    stacked_layout,
    staged_bytes,
)


def seed_varlen(n, total_tokens, max_chunk_len, top_k, mrope):
    # sizes_q12.rs transcribed term by term (the spec), independent of q12drv.core.layout.
    moe = ((total_tokens * top_k * 4 * 2) + 63) & ~63
    per_stream_meta = max((max_chunk_len * 16) + 64, 4096)
    pos = (total_tokens * 4 + 7) & ~7
    pos_streams = 3 if mrope else 1
    slot = (total_tokens * 8 + 7) & ~7
    ptrs = ((n * 8) + 7) & ~7
    cu_seqlens = (((n + 1) * 4) + 7) & ~7
    kv_lens = ((n * 4) + 7) & ~7
    stage_meta = pos_streams * pos + slot + 2 * ptrs + cu_seqlens + kv_lens
    return moe + n * per_stream_meta + stage_meta + n * 8


def test_sizing_streams_constant():
    assert Q12_SIZING_STREAMS == 8


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 64])
@pytest.mark.parametrize("chunk", [0, 1, 7, 204, 205, 935, 2048, 8192])
@pytest.mark.parametrize("top_k", [0, 1, 8, 10])
@pytest.mark.parametrize("mrope", [False, True])
def test_seed_sweep(n, chunk, top_k, mrope):
    assert q12_batched_scratch_bytes(n, chunk, top_k, mrope) == seed_varlen(n, n * chunk, chunk, top_k, mrope)
    assert q12_batched_scratch_bytes_varlen(n, n * chunk + 3, chunk, top_k, mrope) == seed_varlen(n, n * chunk + 3, chunk, top_k, mrope)


def test_upstream_regression_numbers():
    assert q12_batched_scratch_bytes(4, 935, 8, True) == 374_392
    # the v1 formula (no cu_seqlens, no kv_lens terms) was 374,352; the two terms add 24 + 16
    assert staged_bytes(4, 3740, True) == 74_904
    assert make_scratch_plan([935] * 4, 8, True, "exact").total_bytes == 389_304


def test_seed_functions_refuse_zero_streams():
    # 0 streams is no batch: the seed's formula would size 8 bytes of metadata for it (cu_seqlens[0])
    with pytest.raises(ValueError, match="n must be in|n must be >= 1"):
        q12_batched_scratch_bytes(0, 16, 8, False)
    with pytest.raises(ValueError, match="n must be >= 1"):
        q12_batched_scratch_bytes_varlen(0, 0, 16, 8, False)
    with pytest.raises(ValueError, match="n must be >= 1"):
        staged_bytes(0, 0, False)
    with pytest.raises(TypeError, match="mrope must be a bool"):
        staged_bytes(1, 0, 1)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_seed_functions_reject_bad_numbers(bad):
    with pytest.raises((TypeError, ValueError)):
        q12_batched_scratch_bytes(bad, 16, 8, False)
    with pytest.raises((TypeError, ValueError)):
        q12_batched_scratch_bytes_varlen(4, bad, 16, 8, False)


def test_stacked_layout_matches_design_formula():
    for n, t, mrope in [(1, 1, False), (4, 3740, True), (8, 16384, True), (3, 5, False)]:
        s = 3 if mrope else 1
        layout = stacked_layout(n, t, mrope)
        assert layout.staged_bytes == s * a8(4 * t) + 8 * t + 16 * n + a8(4 * n + 4) + a8(4 * n)
        assert all(f.offset % 8 == 0 for f in layout.fields)
        names = [f.name for f in layout.fields]
        expected = ["positions_stacked"] + (["positions_h_stacked", "positions_w_stacked"] if mrope else []) + [
            "slot_stacked", "block_table_ptrs", "seq_len_ptrs", "cu_seqlens", "kv_lens"]
        assert names == expected


def test_mrope_seed_stride_holds_202_tokens():
    assert single_stream_payload(202, True) <= 4096 < single_stream_payload(203, True)
    assert make_scratch_plan([202, 202], 8, True).first_unfit_stream() is None
    assert make_scratch_plan([100, 203], 8, True).first_unfit_stream() == 1
    assert make_scratch_plan([5000, 5000], 8, False).first_unfit_stream() is None


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(1, 5000), min_size=1, max_size=64),
    top_k=st.integers(0, 16),
    mrope=st.booleans(),
    policy=st.sampled_from(["seed", "exact"]),
)
def test_plan_invariants(counts, top_k, mrope, policy):
    plan = make_scratch_plan(counts, top_k, mrope, policy)
    regions = plan.regions
    # contiguous, ordered, disjoint, starting at 0
    assert regions[0].offset == 0
    for a, b in zip(regions, regions[1:]):
        assert a.end == b.offset
    assert plan.jit_slot.offset == plan.stacked.offset + plan.staged_bytes
    assert plan.jit_slot.nbytes == 8 * len(counts)
    assert plan.total_bytes == plan.jit_slot.end
    # fields tile the stacked region exactly
    fields = plan.fields
    assert fields[0].offset == plan.stacked.offset and fields[-1].end == plan.stacked.end
    for a, b in zip(fields, fields[1:]):
        assert a.end == b.offset
    # run stream by stream, the slot follows the last per-stream block
    assert plan.per_stream_jit_slot.offset == plan.stream_blocks[-1].end
    assert plan.per_stream_jit_slot.offset % 8 == 0 and plan.per_stream_jit_slot.nbytes == 8 * len(counts)
    if policy == "seed":
        assert plan.total_bytes == seed_varlen(len(counts), sum(counts), max(counts), top_k, mrope)
    else:
        assert plan.first_unfit_stream() is None
        assert all(r.offset % 64 == 0 for r in plan.stream_blocks)


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(1, 3000), min_size=1, max_size=32),
    more_streams=st.integers(0, 8),
    more_tokens=st.integers(0, 500),
    top_k=st.integers(0, 16),
    mrope=st.booleans(),
    policy=st.sampled_from(["seed", "exact"]),
)
def test_the_bound_holds_every_batch_within_the_maxima(counts, more_streams, more_tokens, top_k, mrope, policy):
    n, t = len(counts) + more_streams, sum(counts) + more_tokens
    bound = scratch_bytes_bound(n, t, top_k, mrope, policy, max_chunk_len=max(counts) + more_tokens)
    assert make_scratch_plan(counts, top_k, mrope, policy).total_bytes <= bound


def test_the_bound_covers_a_batch_a_worst_looking_one_does_not():
    # 1 + 5 + 3 tokens need more than 1 + 1 + 7 (each exact per-stream block rounds up to 64 bytes)
    assert make_scratch_plan([1, 5, 3], 0, False, "exact").total_bytes > make_scratch_plan([1, 1, 7], 0, False,
                                                                                            "exact").total_bytes
    assert make_scratch_plan([1, 5, 3], 0, False, "exact").total_bytes <= scratch_bytes_bound(3, 9, 0, False)
    assert scratch_bytes_bound(4, 100, 8, True, "seed", 40) == q12_batched_scratch_bytes_varlen(4, 100, 40, 8, True)
    with pytest.raises(ValueError, match="policy"):
        scratch_bytes_bound(1, 1, 0, False, "guess")


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError):
        make_scratch_plan([], 8, False)
    with pytest.raises(ValueError):
        make_scratch_plan([4, 0], 8, False)
    with pytest.raises(ValueError):
        make_scratch_plan([4], 8, False, policy="loose")
    with pytest.raises(ValueError):
        stacked_layout(1, 1 << 31, False)


@given(x=st.integers(0, 1 << 48), log2=st.integers(0, 12))
def test_align_up(x, log2):
    a = 1 << log2
    y = align_up(x, a)
    assert y % a == 0 and x <= y < x + a


@given(addr=st.integers(1, 1 << 48), nbytes=st.integers(0, 1 << 20), nslots=st.integers(2, 16))
def test_ring_slots_tile_the_memory_aligned(addr, nbytes, nslots):
    offsets, size = ring_slots(addr, nbytes, nslots)
    assert len(offsets) == nslots and size % RING_SLOT_ALIGN == 0
    if size:
        assert all((addr + off) % RING_SLOT_ALIGN == 0 for off in offsets)
        assert offsets[-1] + size <= nbytes and nbytes - offsets[0] < nslots * (size + RING_SLOT_ALIGN)
    else:  # too small: the bytes the message asks for would do
        assert ring_slots(addr, nslots * RING_SLOT_ALIGN + offsets[0], nslots)[1] == RING_SLOT_ALIGN


def test_element_offsets_and_slot_entries():
    layout = stacked_layout(3, 10, False)
    f = layout.field("slot_stacked")
    assert f.element_offset(4) == f.offset + 32 and type(f.element_offset(np.int64(4))) is int
    assert list(f.element_offset(np.array([0, 2]))) == [f.offset, f.offset + 16]
    assert h_state_entry_offset(5) == 40
