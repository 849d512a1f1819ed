"""Device-side expansion (``cuda_src/expand_meta.cu``): compiles, and on the emulated driver leaves the
arena byte for byte as the host stager does, from the per-stream fields alone: as launch parameters up
to ``TAIL_STREAMS`` streams, as one small copy past that."""

import ctypes
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from q12drv import ScratchArena, StreamStageInfo, open_device, stage_batched_attn_metadata
from q12drv.kernels import expand
from q12drv.kernels.meta import TAIL_STREAMS, Q12TailC, meta_defines
from tests.helpers import make_streams, spill_free


def test_compiles_without_spills(kernel_build):
    img = kernel_build(expand.SOURCE, "sm_90")
    assert img.image
    spill_free(img, expand.ENTRIES)


def test_entries_match_source():
    from q12drv.core.nvrtc import cuda_src_dir

    src = (cuda_src_dir() / expand.SOURCE).read_text()
    decl = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src)
    assert tuple(name for name, _ in decl) == expand.ENTRIES
    assert [p.split()[-1] for p in decl[0][1].split(",")] == ["m", "block_shift", "dummy_kv_block", "use_mrope"]
    assert [p.split()[-1] for p in decl[1][1].split(",")] == ["m", "block_shift", "dummy_kv_block", "use_mrope", "tail"]
    assert set(expand.EMULATORS) == set(expand.ENTRIES)


def test_tail_mirror_size_is_checked_at_compile_time():
    from q12drv.core.nvrtc import NvrtcError, compile_source

    bad = [d if not d.startswith("Q12_TAIL_SIZE=") else "Q12_TAIL_SIZE=1536" for d in meta_defines()]
    with pytest.raises(NvrtcError, match="Q12Tail"):
        compile_source(expand.SOURCE, arch="sm_90", defines=bad, use_cache=False)
    for name in ("Q12_TAIL_STREAMS", "Q12_TAIL_SIZE"):  # a contract has no default
        missing = [d for d in meta_defines() if not d.startswith(name + "=")]
        with pytest.raises(NvrtcError, match="compile through q12drv"):
            compile_source(expand.SOURCE, arch="sm_90", defines=missing, use_cache=False)


@pytest.mark.parametrize("n", [1, 2, 7, TAIL_STREAMS])
def test_tail_writer_fills_the_mirror_and_zeroes_the_rest(n):
    tail = Q12TailC()
    ctypes.memset(ctypes.addressof(tail), 0xAB, ctypes.sizeof(tail))
    ptrs = [0x7F00_0000_0000 + 64 * b for b in range(n)]
    lens = [0x7E00_0000_0000 + 8 * b for b in range(n)]
    cu = list(range(0, 3 * (n + 1), 3))
    kv = [5 + b for b in range(n)]
    st, at = expand._tail_writer(n)
    assert at == 0
    st.pack_into(tail, 0, *ptrs, *lens, *cu, *kv)
    assert list(tail.block_table_ptrs) == ptrs + [0] * (TAIL_STREAMS - n)
    assert list(tail.seq_len_ptrs) == lens + [0] * (TAIL_STREAMS - n)
    assert list(tail.cu_seqlens) == cu + [0] * (TAIL_STREAMS - n)
    assert list(tail.kv_lens) == kv + [0] * (TAIL_STREAMS - n)
    assert st.size <= ctypes.sizeof(tail)
    ints, at = expand._tail_writer(n, "cu_seqlens")
    assert at == Q12TailC.cu_seqlens.offset and at + ints.size <= ctypes.sizeof(tail)


def _both(dev, streams, *, mrope, bs, dummy, offset=64):
    with ScratchArena(dev, 1 << 21) as a1, ScratchArena(dev, 1 << 21) as a2:
        dev.memset(int(a2.base), 0xA5, 1 << 21)  # poison: every byte of the block, pads too, must be written
        m1 = stage_batched_attn_metadata(a1, streams, block_size=bs, use_mrope=mrope, scratch_offset_bytes=offset,
                                         dummy_kv_block=dummy)
        m2 = expand.stage_on_device(a2, streams, block_size=bs, use_mrope=mrope, scratch_offset_bytes=offset,
                                    dummy_kv_block=dummy)
        assert a2.cursor == offset + m2.staged_bytes == a1.cursor
        for name in ("batch_size", "chunk_len", "total_tokens", "max_blocks_per_seq", "staged_bytes", "use_mrope"):
            assert getattr(m1, name) == getattr(m2, name), name
        assert list(m1.cu_seqlens_host) == list(m2.cu_seqlens_host) and list(m1.kv_lens_host) == list(m2.kv_lens_host)
        return a1.read(offset, m1.staged_bytes), a2.read(offset, m2.staged_bytes)


def _draw_settings(data) -> tuple:
    """``(block_size, use_mrope, dummy_kv_block, deferred)`` for one hypothesis example."""
    return (data.draw(st.sampled_from([1, 16, 64])), data.draw(st.booleans()), data.draw(st.integers(0, 3)),
            data.draw(st.booleans()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_device_path_writes_the_host_path_bytes(data):
    n = data.draw(st.integers(1, 10))
    counts = data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    starts = data.draw(st.lists(st.integers(0, 400), min_size=n, max_size=n))
    bs, mrope, dummy, deferred = _draw_settings(data)
    with open_device("emu", deferred=deferred) as dev:
        rng = np.random.default_rng(n)
        streams, _ = make_streams(dev, counts, starts, block_size=bs, rng=rng)
        if data.draw(st.booleans()):  # an evicted block: the host table and the device table agree on -1
            s = streams[0]
            t = s.block_table.copy()
            t[0] = -1
            dev.upload(s.block_table_dev, t)
            streams[0] = StreamStageInfo(s.proc_start, s.proc_count, t, s.block_table_dev, s.seq_len_dev)
        host, device = _both(dev, streams, mrope=mrope, bs=bs, dummy=dummy)
        assert host == device


def _counted(emu, monkeypatch):
    copies, launches = [], []
    real_copy, real_launch = emu.driver.memcpy_htod_async, emu.driver.launch
    monkeypatch.setattr(emu.driver, "memcpy_htod_async", lambda *a: (copies.append(a[2]), real_copy(*a)))
    monkeypatch.setattr(emu.driver, "launch", lambda *a: (launches.append(a[0].name), real_launch(*a)))
    return copies, launches


def test_up_to_tail_streams_one_launch_and_no_copy(emu, monkeypatch):
    streams, _ = make_streams(emu, [700, 5, 64], starts=[0, 3, 100])
    copies, launches = _counted(emu, monkeypatch)
    with ScratchArena(emu, 1 << 20) as arena:
        expand.stage_on_device(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=0, dummy_kv_block=0)
        assert copies == [] and launches == ["q12_expand_meta_tail"]


def test_past_tail_streams_one_small_copy_and_one_launch(emu, monkeypatch):
    n = TAIL_STREAMS + 1
    rng = np.random.default_rng(3)
    streams, _ = make_streams(emu, list(rng.integers(1, 40, n)), starts=list(rng.integers(0, 50, n)), rng=rng)
    with ScratchArena(emu, 1 << 20) as ref:  # the host stager's bytes, before counting
        want = stage_batched_attn_metadata(ref, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                           dummy_kv_block=0)
        want_bytes = ref.read(0, want.staged_bytes)
    copies, launches = _counted(emu, monkeypatch)
    with ScratchArena(emu, 1 << 20) as arena:
        meta = expand.stage_on_device(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                      dummy_kv_block=0)
        assert copies == [expand.device_bytes(meta.layout)] == [16 * n + 4 * (n + 1) + 4 * n + 4]
        assert launches == ["q12_expand_meta"]
        emu.synchronize()
        assert arena.read(0, meta.staged_bytes) == want_bytes


def test_vision_positions_and_bad_input_are_refused_before_anything_is_written(emu):
    streams, _ = make_streams(emu, [9, 12], mrope_vision=(1,))
    with ScratchArena(emu, 1 << 16) as arena:
        arena.reserve("moe", 64)
        before = arena.read(0, arena.capacity)
        with pytest.raises(ValueError, match="mrope_positions"):
            expand.stage_on_device(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=64,
                                   dummy_kv_block=0)
        with pytest.raises(ValueError, match="power of two"):
            expand.stage_on_device(arena, streams[:1], block_size=24, use_mrope=True, scratch_offset_bytes=64,
                                   dummy_kv_block=0)
        assert arena.read(0, arena.capacity) == before and arena.cursor == 64


def test_emulator_refuses_a_grid_that_does_not_cover_the_streams(emu):
    streams, _ = make_streams(emu, [9, 12])
    with ScratchArena(emu, 1 << 16) as arena:
        meta = expand.stage_on_device(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                      dummy_kv_block=0)
        from q12drv.kernels import ops
        from q12drv.kernels.meta import meta_from_staged

        for entry in expand.ENTRIES:
            launch = ops.prepared(emu, entry)
            launch.args.m = meta_from_staged(meta)
            with pytest.raises(ValueError, match="grid"):
                launch.launch((1, 1, 1), (256, 1, 1))


def test_geometry():
    assert expand.geometry(8, 2048) == ((8, 8, 1), (256, 1, 1), 0)
    assert expand.geometry(1, 1) == ((1, 1, 1), (256, 1, 1), 0)
    assert expand.geometry(64, 1 << 20)[0] == (32, 64, 1)
    with pytest.raises(ValueError):
        expand.geometry(0, 5)
    with pytest.raises(ValueError):
        expand.geometry(70000, 5)


def test_stage_stacked_upload_none_reserves_and_describes_without_copying(emu, monkeypatch):
    from q12drv.core.staging import stage_stacked

    streams, _ = make_streams(emu, [9, 12], starts=[0, 5])
    with ScratchArena(emu, 1 << 16) as arena:
        copies, launches = _counted(emu, monkeypatch)
        meta, _ = stage_stacked(arena, streams, 16, False, 64, 0, None, upload="none")
        assert copies == [] and launches == [] and arena.cursor == 64 + meta.staged_bytes
        assert list(meta.cu_seqlens_host) == [0, 9, 21] and list(meta.kv_lens_host) == [9, 17]
        assert not meta.cu_seqlens_host.flags.writeable and not meta.kv_lens_host.flags.writeable
        with pytest.raises(ValueError, match="upload must be one of"):
            stage_stacked(arena, streams, 16, False, arena.cursor, 0, None, upload="some")
        assert arena.cursor == 64 + meta.staged_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plan_stages_every_pass_as_the_host_stager_does(data):
    n = data.draw(st.integers(1, 9))
    bs, mrope, dummy, deferred = _draw_settings(data)
    with open_device("emu", deferred=deferred) as dev:
        rng = np.random.default_rng(n)
        # tables long enough for 600 positions; the first pass is what the plan is made from
        streams, _ = make_streams(dev, [600] * n, [0] * n, block_size=bs, rng=rng)
        first = [StreamStageInfo(0, data.draw(st.integers(1, 300)), s.block_table, s.block_table_dev, s.seq_len_dev)
                 for s in streams]
        with ScratchArena(dev, 1 << 21) as a1, ScratchArena(dev, 1 << 21) as a2:
            plan = expand.ExpandPlan(a2, first, block_size=bs, use_mrope=mrope, scratch_offset_bytes=64,
                                     dummy_kv_block=dummy)
            for _ in range(3):
                counts = data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
                starts = [data.draw(st.integers(0, 600 - c)) for c in counts]
                a1.reset()
                a2.reset()
                a1.reserve("moe", 64)
                a2.reserve("moe", 64)
                dev.memset(int(a2.base) + 64, 0xA5, (1 << 21) - 64)  # poison: every byte must be written
                pass_streams = [StreamStageInfo(p, c, s.block_table, s.block_table_dev, s.seq_len_dev)
                                for p, c, s in zip(starts, counts, streams)]
                m1 = stage_batched_attn_metadata(a1, pass_streams, block_size=bs, use_mrope=mrope,
                                                 scratch_offset_bytes=64, dummy_kv_block=dummy)
                m2 = plan.stage(starts, counts)
                assert a1.cursor == a2.cursor == 64 + m1.staged_bytes
                for name in ("batch_size", "chunk_len", "total_tokens", "max_blocks_per_seq", "staged_bytes",
                             "use_mrope", "block_table_ptrs", "cu_seqlens"):
                    assert getattr(m1, name) - (a1.base if name in ("block_table_ptrs", "cu_seqlens") else 0) == \
                        getattr(m2, name) - (a2.base if name in ("block_table_ptrs", "cu_seqlens") else 0), name
                assert list(m1.cu_seqlens_host) == list(m2.cu_seqlens_host)
                assert list(m1.kv_lens_host) == list(m2.kv_lens_host)
                assert a1.read(64, m1.staged_bytes) == a2.read(64, m2.staged_bytes)


def test_plan_pass_is_one_launch_and_bad_passes_write_nothing(emu, monkeypatch):
    streams, _ = make_streams(emu, [40, 7], starts=[0, 16])
    cover = [s.block_table.size * 16 for s in streams]  # positions each table covers (block 16)
    with ScratchArena(emu, 1 << 16) as arena:
        plan = expand.ExpandPlan(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=0,
                                 dummy_kv_block=0)
        copies, launches = _counted(emu, monkeypatch)
        plan.stage([8, 16], [32, 7])
        assert copies == [] and launches == ["q12_expand_meta_tail"]
        arena.reset()
        cases = [
            (([0], [1]), ValueError, "the plan has 2 streams"),
            (([0, 0], [1, 0]), ValueError, "stream 1: start 0 must be >= 0 and count 0 >= 1"),
            (([-1, 0], [1, 1]), ValueError, "stream 0: start -1"),
            (([cover[0] - 31, 16], [32, 7]), ValueError,
             f"stream 0: start \\+ count = {cover[0] + 1} positions, but its block table covers {cover[0]}"),
            (([0, 0], [1.0, 1]), TypeError, "starts\\[0\\] and counts\\[0\\] must be ints"),
            (([True, 0], [1, 1]), TypeError, "must be ints"),
        ]
        for (starts, counts), exc, match in cases:
            with pytest.raises(exc, match=match):
                plan.stage(starts, counts)
            assert arena.cursor == 0 and arena.regions == ()
        assert launches == ["q12_expand_meta_tail"]  # none of the bad passes launched
        m = plan.stage(np.array([0, 1]), np.array([3, 2]))  # numpy ints are ints
        assert list(m.cu_seqlens_host) == [0, 3, 5] and list(m.kv_lens_host) == [3, 3] and m.chunk_len == 3


def test_plan_refuses_vision_positions_and_too_many_streams(emu):
    streams, _ = make_streams(emu, [9, 12], mrope_vision=(1,))
    with ScratchArena(emu, 1 << 16) as arena:
        with pytest.raises(ValueError, match="mrope_positions"):
            expand.ExpandPlan(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=0, dummy_kv_block=0)
        with pytest.raises(ValueError, match="scratch_offset_bytes"):
            expand.ExpandPlan(arena, streams[:1], block_size=16, use_mrope=True, scratch_offset_bytes=-8,
                              dummy_kv_block=0)
        with pytest.raises(TypeError, match="arena must be a ScratchArena"):
            expand.ExpandPlan(None, streams[:1], block_size=16, use_mrope=True, scratch_offset_bytes=0,
                              dummy_kv_block=0)
        many, _ = make_streams(emu, [1] * (TAIL_STREAMS + 1))
        with pytest.raises(ValueError, match=f"at most {TAIL_STREAMS} streams"):
            expand.ExpandPlan(arena, many, block_size=16, use_mrope=False, scratch_offset_bytes=0, dummy_kv_block=0)
        assert arena.cursor == 0


def _expected(starts, counts) -> dict:
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    return dict(cu=cu, kv=[s + c for s, c in zip(starts, counts)], chunk_len=max(counts), total_tokens=cu[-1])


def test_a_plan_pass_keeps_describing_its_own_pass_after_later_passes(emu):
    from q12drv.kernels.meta import meta_from_staged, meta_struct

    streams, _ = make_streams(emu, [300, 300, 300], [0] * 3)
    passes = [([0, 0, 0], [100, 50, 7]),      # a first total (157)
              ([100, 50, 7], [7, 100, 50]),   # the same total, another chunk_len and other prefix sums
              ([107, 150, 57], [1, 2, 3]),    # another total
              ([0, 10, 20], [50, 7, 100])]    # the first total again
    with ScratchArena(emu, 1 << 20) as arena, ScratchArena(emu, 1 << 20) as ref:
        plan = expand.ExpandPlan(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=64,
                                 dummy_kv_block=0)
        metas = []
        for i, (starts, counts) in enumerate(passes):
            arena.reset()
            ref.reset()
            starts_in, counts_in = list(starts), list(counts)
            meta = plan.stage(starts_in, counts_in, None if i % 2 else emu.stream)  # a bound launch, or on a stream
            starts_in[0], counts_in[0] = 99, 99  # the caller's lists are its own again
            # the launch's argument block holds this pass's Q12Meta and integers, whatever came before
            assert bytes(plan._launch.args.m) == bytes(meta_from_staged(meta))
            want = _expected(starts, counts)
            assert list(plan._launch.args.tail.cu_seqlens)[:4] == want["cu"]
            assert list(plan._launch.args.tail.kv_lens)[:3] == want["kv"]
            pass_streams = [StreamStageInfo(p, c, s.block_table, s.block_table_dev, s.seq_len_dev)
                            for p, c, s in zip(starts, counts, streams)]
            m1 = stage_batched_attn_metadata(ref, pass_streams, block_size=16, use_mrope=True, scratch_offset_bytes=64,
                                             dummy_kv_block=0)
            emu.synchronize()
            assert arena.read(64, meta.staged_bytes) == ref.read(64, m1.staged_bytes)
            if i == 1:
                meta.cu_seqlens_host  # read before the next pass: kept as it is
            metas.append(meta)
        assert metas[0] is not metas[3] and metas[0].slot_stacked == metas[3].slot_stacked  # same shape, own objects
        for meta, (starts, counts) in zip(metas, passes):
            want = _expected(starts, counts)
            assert type(meta) is expand.BatchedAttnMetadata
            assert meta.cu_seqlens_host.tolist() == want["cu"] and meta.kv_lens_host.tolist() == want["kv"]
            assert meta.cu_seqlens_host.dtype == np.int32 == meta.kv_lens_host.dtype
            assert not meta.cu_seqlens_host.flags.writeable and not meta.kv_lens_host.flags.writeable
            assert meta.counts.tolist() == counts
            assert (meta.chunk_len, meta.total_tokens) == (want["chunk_len"], want["total_tokens"])
            assert (meta.batch_size, meta.max_blocks_per_seq, meta.scratch_offset_bytes) == (3, 19, 64)
            assert bytes(meta_struct(meta)) == bytes(meta_from_staged(meta))


def test_a_plan_pass_metadata_is_an_ordinary_dataclass(emu):
    import copy
    import dataclasses

    streams, _ = make_streams(emu, [40, 7])
    with ScratchArena(emu, 1 << 16) as arena:
        plan = expand.ExpandPlan(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                 dummy_kv_block=0)
        meta = plan.stage([0, 0], [40, 7])
        with pytest.raises(dataclasses.FrozenInstanceError):
            meta.chunk_len = 3
        with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
            meta.nonsense
        assert not hasattr(meta, "nonsense")
        assert copy.copy(meta).kv_lens_host.tolist() == [40, 7]
        shorter = dataclasses.replace(meta, staged_bytes=meta.staged_bytes - 8)
        assert shorter.cu_seqlens_host.tolist() == [0, 40, 47] and shorter.staged_bytes == meta.staged_bytes - 8
        assert "cu_seqlens_host=array([ 0, 40, 47]" in repr(meta)


_pass_ints = st.one_of(st.integers(-2, 700), st.sampled_from([0, 1, 599, 600, 601, (1 << 31) - 1, 1 << 31]))
_pass_values = st.one_of(_pass_ints, _pass_ints, _pass_ints, _pass_ints.map(np.int64),
                         _pass_ints.filter(lambda x: x < 1 << 31).map(np.int32),  # an int32 holds up to 2**31 - 1
                         st.booleans(), st.just(2.0), st.none())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plan_pass_checks_accept_and_refuse_exactly_what_the_named_checks_do(emu, data):
    n = data.draw(st.integers(1, 4))
    streams, _ = make_streams(emu, [600] * n, [0] * n)  # every table covers 608 positions (block 16)
    size = data.draw(st.sampled_from([n, n, n, n - 1, n + 1]))
    # a valid pass (exact ints in range) with at most one entry replaced by anything
    counts = data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    starts = [data.draw(st.integers(0, 608 - c)) for c in counts] + [0] * (size - n)
    starts = starts[:size]
    if data.draw(st.booleans()):
        which, b = data.draw(st.sampled_from([starts, counts])), data.draw(st.integers(0, n - 1))
        if b < len(which):
            which[b] = data.draw(_pass_values)
    event("fast path" if size == n and all(type(x) is int for x in starts + counts) else "other")
    box = data.draw(st.sampled_from([list, tuple, list]))
    starts, counts = box(starts), box(counts)
    with ScratchArena(emu, 1 << 20) as arena:
        plan = expand.ExpandPlan(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                 dummy_kv_block=0)
        try:
            want = plan._checked(starts, counts)  # the named, per-stream checks alone
        except (TypeError, ValueError) as exc:
            with pytest.raises(type(exc)) as got:
                plan.stage(starts, counts)
            assert str(got.value) == str(exc)
            assert arena.cursor == 0 and arena.regions == ()
            return
        if want[1][-1] > (1 << 31) - 1:
            with pytest.raises(ValueError, match="overflow the i32 cu_seqlens prefix sum"):
                plan.stage(starts, counts)
            return
        meta = plan.stage(starts, counts)
        counts_i, cu, kv = want
        assert meta.cu_seqlens_host.tolist() == cu and meta.kv_lens_host.tolist() == kv
        assert type(meta.chunk_len) is int and meta.chunk_len == max(counts_i)
        assert arena.cursor == meta.staged_bytes


def test_plan_refuses_i32_overflows_and_what_does_not_fit_before_writing(emu, monkeypatch):
    from q12drv import CapacityError

    big = 1 << 20  # block size: 2049 blocks cover more positions than an i32 holds
    streams = [StreamStageInfo(0, 1, np.zeros(2049, np.int32), 0x1000 + 8192 * b, 0x100 + 8 * b) for b in range(3)]
    copies, launches = _counted(emu, monkeypatch)
    with ScratchArena(emu, 1 << 16) as arena:
        plan = expand.ExpandPlan(arena, streams, block_size=big, use_mrope=False, scratch_offset_bytes=0,
                                 dummy_kv_block=0)
        i32 = (1 << 31) - 1
        with pytest.raises(ValueError, match=f"stream 1: start \\+ count = {i32 + 3} overflows the i32 kv_lens"):
            plan.stage([0, i32 - 2, 0], [1, 5, 1])
        with pytest.raises(ValueError, match=f"total tokens {3 << 30} overflow the i32 cu_seqlens prefix sum"):
            plan.stage([0, 0, 0], [1 << 30] * 3)
        with pytest.raises(CapacityError):  # 3 streams x 2**20 tokens: far more than the arena holds
            plan.stage([0, 0, 0], [1 << 20] * 3)
        assert arena.cursor == 0 and arena.regions == () and copies == launches == []


def test_plan_reuses_its_region_and_still_refuses_a_cursor_past_it(emu):
    from q12drv.core.errors import Q12Error

    streams, _ = make_streams(emu, [40, 7])
    arena = ScratchArena(emu, 1 << 16)
    with arena:
        plan = expand.ExpandPlan(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=64,
                                 dummy_kv_block=0)
        first = plan.stage([0, 0], [40, 7])
        region = arena.regions[-1]
        arena.reset()
        again = plan.stage([8, 1], [32, 15])  # same total: the same region, handed out again
        assert arena.regions == (region,) and arena.regions[0] is region and again.slot_stacked == first.slot_stacked
        arena.reset()
        arena.reserve("moe", 128)
        for starts, counts in (([8, 1], [32, 15]), ([0, 0], [1, 1])):  # a shape the plan has, and a new one
            with pytest.raises(ValueError, match="overlap"):
                plan.stage(starts, counts)
            assert arena.cursor == 128 and len(arena.regions) == 1
    with pytest.raises(Q12Error, match="closed"):
        plan.stage([0, 0], [40, 7])


def _layers(dev, q12, host, num_blocks) -> dict:
    from tests.test_prefill import FUSED, GSHAPE, SHAPE, gdn_tensors

    bufs = {k: dev.alloc(v.nbytes, k) for k, v in host.items()}
    try:
        for k, v in host.items():
            dev.upload(bufs[k].ptr, v)
        p = {k: int(b.ptr) for k, b in bufs.items()}
        q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
        q12.gdn_layer([p["st"] + b * host["st"][0].nbytes for b in range(len(q12.streams))], gdn_tensors(p), GSHAPE,
                      config=FUSED)
        return {k: dev.download(bufs[k].ptr, bufs[k].nbytes) for k in ("o", "kp", "vp", "go", "st")}
    finally:
        for b in bufs.values():
            b.free()


def test_q12pass_stages_through_an_expand_plan_as_without_it(emu):
    from q12drv.prefill import Q12Pass
    from tests.test_prefill import inputs

    rng = np.random.default_rng(5)
    prompts = [60, 40, 90]  # two chunked passes over three prompts
    streams, _ = make_streams(emu, prompts, [0] * 3, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    with ScratchArena(emu, 1 << 20) as arena:
        plan = None
        for starts, counts in (([0, 0, 0], [32, 32, 32]), ([32, 32, 32], [28, 8, 58])):
            pass_streams = [StreamStageInfo(p, c, s.block_table, s.block_table_dev, s.seq_len_dev)
                            for p, c, s in zip(starts, counts, streams)]
            plan = plan or expand.ExpandPlan(arena, pass_streams, block_size=16, use_mrope=False,
                                             scratch_offset_bytes=0, dummy_kv_block=0)
            host = inputs(rng, counts, num_blocks)
            got = {}
            for use in (None, plan):
                q12 = Q12Pass(arena, pass_streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4,
                              head_dim=64, mode="batched", expand_plan=use)
                assert q12.expand == ("plan" if use else "device")
                emu.synchronize()
                meta = q12.meta
                staged = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
                got[use is None] = (staged, [(r.name, r.offset, r.nbytes) for r in arena.regions], meta.counts.tolist(),
                                    meta.chunk_len, meta.scratch_offset_bytes, _layers(emu, q12, host, num_blocks))
            assert got[True] == got[False]
            assert got[True][4] > 0 and got[True][2] == counts  # at the pass's own stacked offset, past the MoE area


def test_q12pass_refuses_an_expand_plan_for_another_batch_before_touching_the_arena(emu):
    from q12drv.prefill import Q12Pass

    streams, _ = make_streams(emu, [40, 7])
    vision, _ = make_streams(emu, [5, 9], mrope_vision=(1,))
    with ScratchArena(emu, 1 << 18) as arena, ScratchArena(emu, 1 << 18) as other:
        plan = expand.ExpandPlan(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=0,
                                 dummy_kv_block=0)
        elsewhere = expand.ExpandPlan(other, streams, block_size=16, use_mrope=True, scratch_offset_bytes=0,
                                      dummy_kv_block=0)
        longer = [StreamStageInfo(0, 50, np.tile(s.block_table, 4), s.block_table_dev, s.seq_len_dev) for s in streams]
        common = dict(block_size=16, use_mrope=True, dummy_kv_block=0)
        arena.reserve("moe", 64)
        before = (arena.cursor, arena.generation, arena.regions)
        cases = [
            (dict(streams=streams, expand_plan=plan, expand="host"), ValueError, "expand='host'"),
            (dict(streams=streams, expand_plan=elsewhere), ValueError, "another arena"),
            (dict(streams=streams[::-1], expand_plan=plan), ValueError, "streams\\[0\\] is not the plan's stream 0"),
            (dict(streams=streams[:1], expand_plan=plan), ValueError, "holds 2 streams, the pass has 1"),
            (dict(streams=longer, expand_plan=plan), ValueError, "streams\\[0\\]: proc_start \\+ proc_count = 50"),
            (dict(streams=vision, expand_plan=plan), ValueError, "writes text positions only"),
            (dict(streams=streams, expand_plan=object()), TypeError, "expand_plan must be an ExpandPlan"),
        ]
        for kw, exc, match in cases:
            with pytest.raises(exc, match=match):
                Q12Pass(arena, **common, **kw)
            assert (arena.cursor, arena.generation, arena.regions) == before
        with pytest.raises(ValueError, match="block_size, use_mrope, dummy_kv_block = \\(16, True, 0\\)"):
            Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, expand_plan=plan)
        assert Q12Pass(arena, streams, **common, mode="per_stream", expand_plan=plan).expand == ""
