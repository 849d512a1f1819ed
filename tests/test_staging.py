"""Staging: bytes decode back to the inputs, pads zero, exact cursor, JIT slot, bad input, races."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from q12drv import (
    CapacityError,
    HostRaceError,
    ScratchArena,
    StreamStageInfo,
    make_scratch_plan,
    open_device,
    place_h_state_slot,
    stage_batched_attn_metadata,
    stage_stream_metadata,
)
from q12drv.core.staging import verify_readback
from q12drv.core.pinned import PinnedRing
from tests.helpers import make_streams


def run_pass(dev, arena, streams, *, mrope, policy="exact", top_k=8, block_size=16, stream=None):
    plan = make_scratch_plan([s.proc_count for s in streams], top_k, mrope, policy)
    arena.reset()
    for r in (plan.moe, *plan.stream_blocks):
        arena.reserve(r.name, r.nbytes, offset=r.offset)
    meta = stage_batched_attn_metadata(arena, streams, block_size=block_size, use_mrope=mrope,
                                       scratch_offset_bytes=arena.cursor, dummy_kv_block=0, stream=stream)
    return plan, meta


def test_stage_decodes_back_and_advances_cursor_exactly(emu):
    streams, _ = make_streams(emu, [935, 1, 17, 64], starts=[0, 5, 100, 4096], mrope_vision=(2,))
    plan = make_scratch_plan([s.proc_count for s in streams], 8, True, "exact")
    with ScratchArena(emu, plan.total_bytes) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=True)
        assert meta.scratch_offset_bytes == plan.stacked.offset
        assert arena.cursor == meta.scratch_offset_bytes + meta.staged_bytes == plan.jit_slot.offset
        raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
        assert verify_readback(raw, meta, streams) == []
        assert meta.total_tokens == 935 + 1 + 17 + 64 and meta.chunk_len == 935 and meta.batch_size == 4
        assert list(meta.cu_seqlens_host) == [0, 935, 936, 953, 1017]
        assert list(meta.kv_lens_host) == [935, 6, 117, 4160]
        slot = place_h_state_slot(arena, meta)
        assert slot.offset == plan.jit_slot.offset and arena.cursor == plan.total_bytes
        assert arena.guard_intact()


def test_metadata_at_one_address_from_two_arenas_carries_each_its_own_offset(emu):
    """Two arenas over one buffer, 256 bytes apart, stage the same batch at the same address (offsets 512 and 256):
    each metadata names its own arena's offset (the memoised fields were once keyed by the address alone, and
    the second pass got the first one's offset: a flaky per-stream readback, arenas landing where others were)."""
    streams, _ = make_streams(emu, [20, 30])
    buf = emu.alloc(1 << 16)
    first, second = ScratchArena.over(emu, buf.ptr, 1 << 15), ScratchArena.over(emu, int(buf.ptr) + 256, 1 << 15)
    metas = []
    for arena, offset in ((first, 512), (second, 256)):
        arena.reserve("before", offset)
        metas.append(stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False,
                                                 scratch_offset_bytes=offset, dummy_kv_block=0))
    assert [m.scratch_offset_bytes for m in metas] == [512, 256]
    assert metas[0].positions_stacked == metas[1].positions_stacked  # the same address, seen from both
    assert place_h_state_slot(second, metas[1]).offset == 256 + metas[1].staged_bytes
    first.close()
    second.close()
    buf.free()


def test_verify_readback_catches_a_wrong_byte(emu):
    streams, _ = make_streams(emu, [20, 30])
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=False)
        raw = bytearray(arena.read(meta.scratch_offset_bytes, meta.staged_bytes))
        f = meta.layout.field("slot_stacked")
        raw[f.offset + 8 * 7] ^= 1
        problems = verify_readback(bytes(raw), meta, streams)
        assert len(problems) == 1 and problems[0].startswith("slot_stacked[7]")


def test_without_mrope_h_and_w_alias_t(emu):
    streams, _ = make_streams(emu, [3, 4])
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=False)
        assert meta.positions_h_stacked == meta.positions_stacked == meta.positions_w_stacked


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_any_batch_decodes_back(data):
    n = data.draw(st.integers(1, 64))
    counts = data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    starts = data.draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    mrope = data.draw(st.booleans())
    bs = data.draw(st.sampled_from([1, 16, 64]))
    with open_device("emu") as dev:
        streams, _ = make_streams(dev, counts, starts, block_size=bs, rng=np.random.default_rng(n))
        plan = make_scratch_plan(counts, 4, mrope, "exact")
        with ScratchArena(dev, plan.total_bytes) as arena:
            _, meta = run_pass(dev, arena, streams, mrope=mrope, top_k=4, block_size=bs)
            raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
            assert verify_readback(raw, meta, streams) == []
            slot = place_h_state_slot(arena, meta)
            assert slot.offset == meta.scratch_offset_bytes + meta.staged_bytes
            assert slot.offset + 8 * n == plan.total_bytes <= arena.capacity


def test_negative_table_entry_goes_to_dummy_block(emu):
    streams, _ = make_streams(emu, [40])
    table = streams[0].block_table.copy()
    table[1] = -1
    s = StreamStageInfo(0, 40, table, streams[0].block_table_dev, streams[0].seq_len_dev)
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, [s], mrope=False)
        slots = np.frombuffer(arena.read(meta.slot_stacked - arena.base, 8 * 40), np.int64)
        assert list(slots[16:32]) == list(range(0, 16))  # dummy block 0
        assert slots[0] == table[0] * 16


def test_h_state_slot_upload(emu):
    streams, _ = make_streams(emu, [5, 6, 7])
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=False)
        slot = place_h_state_slot(arena, meta)
        for layer in range(5):
            ptrs = [0x1000 * (layer + 1) + 16 * b for b in range(3)]
            slot.upload(ptrs)
            got = np.frombuffer(arena.read(slot.offset, 24), np.uint64)
            assert list(got) == ptrs
        assert slot.entry(2) == slot.ptr + 16
        with pytest.raises(ValueError, match="exactly 3"):
            slot.upload([1, 2])
        with pytest.raises(ValueError, match=r"state_ptrs\[1\]"):
            slot.upload([16, 0, 32])


def test_h_state_slot_refuses_a_moved_cursor(emu):
    streams, _ = make_streams(emu, [5, 6])
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=False)
        arena.reserve("intruder", 8)
        with pytest.raises(ValueError, match="staged_bytes"):
            place_h_state_slot(arena, meta)


def test_stream_block_staging(emu):
    streams, _ = make_streams(emu, [300, 20], starts=[16, 0])
    plan = make_scratch_plan([300, 20], 8, True, "seed")
    with ScratchArena(emu, plan.total_bytes) as arena:
        with pytest.raises(CapacityError, match=r"stream_block\[0\]"):
            stage_stream_metadata(arena, plan, 0, streams[0], block_size=16, use_mrope=True, dummy_kv_block=0)
        meta = stage_stream_metadata(arena, plan, 1, streams[1], block_size=16, use_mrope=True, dummy_kv_block=0)
        assert meta.scratch_offset_bytes == plan.stream_blocks[1].offset and meta.batch_size == 1
        raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
        assert verify_readback(raw, meta, [streams[1]]) == []
    exact = make_scratch_plan([300, 20], 8, True, "exact")
    with ScratchArena(emu, exact.total_bytes) as arena:
        meta = stage_stream_metadata(arena, exact, 0, streams[0], block_size=16, use_mrope=True, dummy_kv_block=0)
        assert verify_readback(arena.read(meta.scratch_offset_bytes, meta.staged_bytes), meta, [streams[0]]) == []


def _bad_cases(streams):
    s0 = streams[0]
    good = dict(proc_start=s0.proc_start, proc_count=s0.proc_count, block_table=s0.block_table,
                block_table_dev=s0.block_table_dev, seq_len_dev=s0.seq_len_dev)

    def with_(**kw):
        return [StreamStageInfo(**{**good, **kw})] + list(streams[1:])

    return {
        "empty batch": ([], {}),
        "zero-length stream": (with_(proc_count=0), {}),
        "negative start": (with_(proc_start=-1), {}),
        "i32 kv_len overflow": (with_(proc_start=(1 << 31) - 2), {}),
        "float count": (with_(proc_count=3.0), {}),
        "NULL block table": (with_(block_table_dev=0), {}),
        "misaligned seq_len": (with_(seq_len_dev=int(s0.block_table_dev) + 2), {}),
        "short block table": (with_(block_table=s0.block_table[:1]), {}),
        "2-D block table": (with_(block_table=np.zeros((2, 2), np.int32)), {}),
        "table entry over i32": (with_(block_table=np.full(8, 1 << 33)), {}),
        "mrope positions without mrope": (with_(mrope_positions=np.zeros((3, s0.proc_count), np.int64)), {}),
        "mrope wrong shape": (with_(mrope_positions=np.zeros((2, s0.proc_count), np.int64)), {"use_mrope": True}),
        "mrope u32 overflow": (with_(mrope_positions=np.full((3, s0.proc_count), 1 << 32)), {"use_mrope": True}),
        "block size not pow2": (list(streams), {"block_size": 24}),
        "block size zero": (list(streams), {"block_size": 0}),
        "negative dummy": (list(streams), {"dummy_kv_block": -1}),
        "offset behind cursor": (list(streams), {"scratch_offset_bytes": 0}),
        "misaligned offset": (list(streams), {"scratch_offset_bytes": "cursor+4"}),
        "not a sequence": (streams[0], {}),
    }


@pytest.mark.parametrize("case", list(_bad_cases([StreamStageInfo(0, 1, np.zeros(1, np.int32), 1, 1)]).keys()))
def test_bad_input_raises_and_writes_nothing(emu, case):
    streams, _ = make_streams(emu, [33, 40], starts=[16, 0])
    with ScratchArena(emu, 1 << 16) as arena:
        arena.reserve("moe", 64)
        before = arena.read(0, arena.capacity)
        cursor = arena.cursor
        ring_uses = None
        batch, kw = _bad_cases(streams)[case]
        args = dict(block_size=16, use_mrope=False, scratch_offset_bytes=arena.cursor, dummy_kv_block=0)
        args.update(kw)
        if args["scratch_offset_bytes"] == "cursor+4":
            args["scratch_offset_bytes"] = arena.cursor + 4
        with pytest.raises((TypeError, ValueError, OverflowError)) as info:
            stage_batched_attn_metadata(arena, batch, **args)
        assert str(info.value)  # names what was wrong
        assert arena.read(0, arena.capacity) == before
        assert arena.cursor == cursor
        assert ring_uses is None


def test_capacity_error_names_region_and_numbers(emu):
    streams, _ = make_streams(emu, [1000, 1000])
    with ScratchArena(emu, 4096) as arena:
        before = arena.read(0, 4096)
        with pytest.raises(CapacityError) as info:
            stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0, dummy_kv_block=0)
        e = info.value
        assert e.region == "stacked_metadata" and e.available == 4096 and e.needed > 4096
        assert "stacked_metadata" in str(e) and "4,096" in str(e)
        assert arena.read(0, 4096) == before and arena.cursor == 0


def test_one_copy_per_pass(emu, monkeypatch):
    streams, _ = make_streams(emu, [100, 7, 300], starts=[0, 16, 32])
    calls = []
    real = emu.driver.memcpy_htod_async
    monkeypatch.setattr(emu.driver, "memcpy_htod_async", lambda *a: (calls.append(a[2]), real(*a)))
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=True)
        assert calls == [meta.staged_bytes]


def test_deferred_back_to_back_passes_are_race_free():
    with open_device("emu", deferred=True) as dev:
        streams_a, _ = make_streams(dev, [50, 60])
        streams_b, _ = make_streams(dev, [70, 10], starts=[16, 32])
        with ScratchArena(dev, 1 << 16) as arena:
            metas = []
            for i in range(7):  # more passes than ring slots, no host sync in between
                streams = streams_a if i % 2 == 0 else streams_b
                _, meta = run_pass(dev, arena, streams, mrope=True)
                slot = place_h_state_slot(arena, meta)
                for layer in range(20):
                    slot.upload([0x10000 + 64 * layer + 8 * b for b in range(2)])
                metas.append((meta, streams))
            dev.synchronize()
            meta, streams = metas[-1]
            assert verify_readback(arena.read(meta.scratch_offset_bytes, meta.staged_bytes), meta, streams) == []
            assert list(np.frombuffer(arena.read(slot.offset, 16), np.uint64)) == [0x10000 + 64 * 19, 0x10000 + 64 * 19 + 8]


def test_deferred_mode_catches_a_rewritten_pinned_slot(monkeypatch):
    # The same back-to-back passes with the ring's guard removed must be caught.
    monkeypatch.setattr(PinnedRing, "_wait", lambda self, slot: None)
    with open_device("emu", deferred=True) as dev:
        streams, _ = make_streams(dev, [50, 60])
        with ScratchArena(dev, 1 << 16) as arena:
            with pytest.raises(HostRaceError, match="rewritten"):
                for i in range(4):
                    _, meta = run_pass(dev, arena, streams[::-1] if i % 2 else streams, mrope=False)
                dev.synchronize()
            dev.driver._drain(dev.stream.raw)  # leave the queue empty for close()


def test_staging_on_a_foreign_stream_handle(emu):
    other = emu.new_stream()
    streams, _ = make_streams(emu, [9, 9])

    class TorchLike:
        cuda_stream = other.handle

    with ScratchArena(emu, 1 << 16) as arena:
        for s in (other, other.handle, TorchLike()):
            _, meta = run_pass(emu, arena, streams, mrope=False, stream=s)
        with pytest.raises(TypeError, match="stream must be"):
            run_pass(emu, arena, streams, mrope=False, stream="default")


def test_stage_replicated_packs_once_and_gives_each_device_its_own_table_pointers():
    """Tensor parallelism: one batch into one arena per device; each copy is byte for byte what staging that device's
    streams alone writes (its own block-table and seq_len pointers in the tail)."""
    from q12drv.core.driver import EmuDriver
    from q12drv.core.staging import stage_replicated

    drv = EmuDriver(device_count=2)
    devs = [open_device(drv, r) for r in range(2)]
    try:
        rng = np.random.default_rng(4)
        first, tables0 = make_streams(devs[0], [7, 30, 2], [0, 16, 40], rng=rng, mrope_vision=(1,))
        # rank 1: its own copy of the same tables on its device
        second, tables1 = make_streams(devs[1], [7, 30, 2], [0, 16, 40], rng=np.random.default_rng(4),
                                       mrope_vision=(1,))
        second = [StreamStageInfo(s.proc_start, s.proc_count, f.block_table, s.block_table_dev, s.seq_len_dev,
                                  f.mrope_positions) for s, f in zip(second, first)]
        arenas = [ScratchArena(d, 1 << 15) for d in devs]
        common = dict(block_size=16, use_mrope=True, scratch_offset_bytes=64, dummy_kv_block=0)
        metas = stage_replicated(arenas, [first, second], **common)
        for r, (dev, arena, streams, meta) in enumerate(zip(devs, arenas, (first, second), metas)):
            assert meta.arena is arena and arena.cursor == 64 + meta.staged_bytes
            with ScratchArena(dev, 1 << 15) as alone:
                alone.reserve("skip", 64)
                own = stage_batched_attn_metadata(alone, streams, **common)
                assert arena.read(64, meta.staged_bytes) == alone.read(64, own.staged_bytes)
            assert not verify_readback(arena.read(64, meta.staged_bytes), meta, streams)
        # refusals name the rank and come before anything is written
        for a in arenas:
            a.reset()
        moved = [StreamStageInfo(s.proc_start + 1, s.proc_count - 1, s.block_table, s.block_table_dev,
                                 s.seq_len_dev) for s in second]
        with pytest.raises(ValueError, match=r"streams\[1\] has starts"):
            stage_replicated(arenas, [first, moved], **common)
        other = [StreamStageInfo(s.proc_start, s.proc_count, s.block_table + 1, s.block_table_dev, s.seq_len_dev,
                                 s.mrope_positions) for s in second]
        with pytest.raises(ValueError, match=r"streams\[1\]\[0\].block_table differs"):
            stage_replicated(arenas, [first, other], **common)
        arenas[1].reserve("in the way", 128)
        with pytest.raises(ValueError, match=r"region 'arenas\[1\] stacked_metadata' at offset 64 would overlap what is reserved up to the cursor 128"):
            stage_replicated(arenas, [first, second], **common)
        assert arenas[0].cursor == 0  # rank 0 was not staged either
        with pytest.raises(ValueError, match="one streams list"):
            stage_replicated(arenas, [first], **common)
        for a in arenas:
            a.close()
        tables0.free()
        tables1.free()
    finally:
        for d in devs:
            d.close()


def test_seq_len_pointer_is_optional(emu, tmp_path):
    """No q12drv kernel reads ``seq_len_ptrs``: a stream without ``seq_len_dev`` stores a NULL entry there, the
    readback verifies and a dump of the pass inspects clean; a given pointer is still stored and checked."""
    import dataclasses

    from q12drv.tools.dump import dump_arena, load_dump
    from q12drv.tools.inspect import inspect_dump

    streams, _ = make_streams(emu, [40, 7, 19], [0, 32, 5])
    streams = [dataclasses.replace(s, seq_len_dev=0) if b != 1 else s for b, s in enumerate(streams)]
    assert StreamStageInfo(0, 4, streams[0].block_table, streams[0].block_table_dev).seq_len_dev == 0
    with ScratchArena(emu, 1 << 16) as arena:
        _, meta = run_pass(emu, arena, streams, mrope=False)
        ptrs = np.frombuffer(arena.read(meta.seq_len_ptrs - arena.base, 8 * 3), np.uint64)
        assert ptrs.tolist() == [0, int(streams[1].seq_len_dev), 0]
        path = tmp_path / "pass.npz"
        dump_arena(arena, path, meta=meta, streams=streams)
    report = inspect_dump(load_dump(path))
    assert report.ok, report.format()
    # every spelling of "none" takes either validation path (the fast one for plain ints and q12drv.NULL, the checked
    # one where another field sends the batch there): the same NULL entries
    from q12drv import NULL

    for none in (0, NULL, np.int64(0)):
        for as_list in (False, True):  # a block table as a list: the checked path
            ss = [dataclasses.replace(s, seq_len_dev=none if b != 1 else s.seq_len_dev,
                                      block_table=s.block_table.tolist() if as_list else s.block_table)
                  for b, s in enumerate(streams)]
            with ScratchArena(emu, 1 << 16) as arena:
                _, meta = run_pass(emu, arena, ss, mrope=False)
                assert np.frombuffer(arena.read(meta.seq_len_ptrs - arena.base, 8 * 3), np.uint64)[[0, 2]].tolist() \
                    == [0, 0], (none, as_list)
