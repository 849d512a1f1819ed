"""The host fast paths behave exactly like the careful ones (never timed here; speed lives in bench/).

* staging: the bulk validator accepts only what the precise one accepts, with the same result;
  the vectorised packer writes what the seed defines (dummy blocks, vision rows, odd T, n = 1);
  memoised layouts, views and pointers never leak between layouts or buffers;
* launches: ``Launch.launch`` on every kind of stream, ``Launch.bind``, and the real driver's
  bound launch call raising on a non-zero ``CUresult``.
"""

import ctypes
import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from q12drv import CudaError, DevicePtr, ScratchArena, StreamStageInfo, open_device, stage_batched_attn_metadata
from q12drv.core.staging import expected_fields
from q12drv.core.layout import stacked_layout
from q12drv.core.staging import BatchedAttnMetadata, pack_metadata, pack_padded, unpack_metadata
from q12drv.core.staging.validate import _validate_checked, _validate_fast
from tests.helpers import make_streams

PTR = 0x7F00_0000_1000


def _batch_summary(b):
    return (b.start_list, b.count_list, [int(p) for p in b.table_ptr_list], [int(p) for p in b.seq_len_ptr_list],
            [np.asarray(t, np.int64).tolist() for t in b.raw_tables],
            [None if m is None else np.asarray(m).tolist() for m in b.mrope], b.max_blocks, b.total, b.chunk)


def _outcome(fn, *args):
    try:
        return "ok", _batch_summary(fn(*args))
    except (TypeError, ValueError) as exc:
        return "error", type(exc).__name__


_ints = st.one_of(st.integers(-3, 3000), st.sampled_from([0, 1, (1 << 31) - 1, 1 << 31, -1]))
_scalar = st.one_of(_ints, _ints.map(np.int64), st.booleans(), st.just(3.0))
_table_dtypes = st.sampled_from([np.int32, np.int64, np.int16, np.uint32, np.uint64, np.uint8, np.float32])


@st.composite
def _stream(draw, use_mrope):
    """A valid stream most of the time; otherwise one field drawn from a wide range of bad values."""
    start, count = draw(st.integers(0, 300)), draw(st.integers(1, 100))
    bad = draw(st.sampled_from(["none"] * 6 + ["start", "count", "table", "dtype", "wide", "ptr", "mrope"]))
    if bad == "start":
        start = draw(_scalar)
    if bad == "count":
        count = draw(_scalar)
    needed = -(-(start + count) // 16) if type(start) is int and type(count) is int else 4
    needed = needed if 0 <= needed <= 200 else 4  # huge drawn values: a short table (refused anyway)
    size = needed + draw(st.integers(-2 if bad == "table" else 0, 5))
    values = draw(st.lists(st.integers(-2, 1000) if bad != "table" else st.sampled_from([-2, 5, 1 << 31, 1 << 33]),
                           min_size=max(size, 0), max_size=max(size, 0)))
    dtype = draw(_table_dtypes) if bad == "dtype" else draw(st.sampled_from([np.int32, np.int64]))
    with np.errstate(over="ignore"):
        table = np.array(values, dtype=np.int64).astype(dtype)
    if bad == "wide":  # unsigned and wide tables near the ends of their range: checked before any cast
        dtype = draw(st.sampled_from([np.uint64, np.uint32, np.int64]))
        big = draw(st.sampled_from([(1 << 64) - 1, (1 << 64) - (1 << 31), 1 << 63, (1 << 32) - 1, 1 << 31,
                                    (1 << 31) - 1, -(1 << 31), -(1 << 31) - 1, -(1 << 63)]))
        table = np.array(values, np.int64).astype(dtype)
        if table.size and np.iinfo(dtype).min <= big <= np.iinfo(dtype).max:
            table[draw(st.integers(0, table.size - 1))] = big
    if bad == "table" and draw(st.booleans()):
        table = table.tolist() if draw(st.booleans()) else table.reshape(1, -1)
    ptr = draw(st.sampled_from([PTR, DevicePtr(PTR), np.uint64(PTR), 0, True, PTR + 1, PTR + 2, DevicePtr(PTR + 2),
                                (1 << 64) - 4, (1 << 64) - 2])) if bad == "ptr" else PTR
    seq = draw(st.sampled_from([PTR + 64, PTR + 65, PTR + 66])) if bad == "ptr" else PTR + 64
    mp = None
    if bad == "mrope" and type(count) is int and 0 < count < 200:
        mp = np.full((3, count), draw(st.sampled_from([0, 5, -1, 1 << 32])), np.int64)
        if draw(st.booleans()):
            mp = mp.astype(np.uint32)  # wraps: -1 -> 2**32 - 1, 2**32 -> 0
        elif draw(st.booleans()):
            mp = np.full((3, count), draw(st.sampled_from([(1 << 64) - 1, 1 << 32, 7])), np.uint64)
    elif use_mrope and type(count) is int and 0 < count < 200 and draw(st.integers(0, 5)) == 0:
        mp = np.arange(3 * count).reshape(3, count)
    return StreamStageInfo(start, count, table, ptr, seq, mp)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_bulk_validation_accepts_only_what_the_precise_one_accepts(data):
    odd = data.draw(st.integers(0, 9)) == 0  # one of the call's own arguments is unusual
    use_mrope = data.draw(st.sampled_from([np.bool_(True), 1, True, False])) if odd else data.draw(st.booleans())
    streams = data.draw(st.lists(_stream(use_mrope is True), min_size=0 if odd else 1, max_size=6))
    if data.draw(st.booleans()):
        streams = tuple(streams)
    bs = data.draw(st.sampled_from([0, 24, 16.0, True, np.int64(16), 1, 64])) if odd else 16
    dummy = data.draw(st.sampled_from([-1, np.int64(0), 3])) if odd else 0
    precise = _outcome(_validate_checked, streams, bs, use_mrope, dummy)
    fast = _validate_fast(streams, bs, use_mrope, dummy)
    event(f"precise {precise[0]}, fast {'accepts' if fast is not None else 'defers'}")
    if fast is not None:
        assert precise == ("ok", _batch_summary(fast))
    elif precise[0] == "ok" and not odd and _common_types(streams):
        raise AssertionError("the bulk validator deferred a valid batch of the common input types")


def _common_types(streams) -> bool:
    """Every field of the types the bulk validator is for: exact ints, int/DevicePtr pointers, 1-D int32 or
    int64 tables, no vision positions (where it must not defer to the precise path)."""
    return all(type(s.proc_start) is int and type(s.proc_count) is int and type(s.block_table_dev) in (int, DevicePtr)
               and type(s.seq_len_dev) in (int, DevicePtr) and type(s.block_table) is np.ndarray
               and s.block_table.ndim == 1 and s.block_table.dtype in (np.int32, np.int64)
               and s.mrope_positions is None for s in streams)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_vectorised_pack_equals_the_seed_definition(data):
    n = data.draw(st.integers(1, 12))
    counts = data.draw(st.lists(st.integers(1, 90), min_size=n, max_size=n))
    starts = data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    bs = data.draw(st.sampled_from([1, 2, 16, 64]))
    mrope = data.draw(st.booleans())
    dummy = data.draw(st.integers(0, 5))
    rng = np.random.default_rng(n)
    with open_device("emu") as dev:
        vision = tuple(b for b in range(n) if mrope and data.draw(st.booleans()))
        streams, _ = make_streams(dev, counts, starts, block_size=bs, rng=rng, mrope_vision=vision)
        holes = []
        for s in streams:  # evicted blocks go to the dummy block
            t = s.block_table.copy()
            t[rng.random(t.size) < 0.2] = -1
            holes.append(StreamStageInfo(s.proc_start, s.proc_count, t.astype(data.draw(st.sampled_from(
                [np.int32, np.int64, np.int16]))), s.block_table_dev, s.seq_len_dev, s.mrope_positions))
        b = _validate_fast(holes, bs, mrope, dummy)
        assert b is not None
        layout = stacked_layout(n, sum(counts), mrope)
        out = np.full(layout.staged_bytes + 16, 0xCC, np.uint8)
        cu, kv = pack_metadata(b, layout, bs, dummy, out)
        got = unpack_metadata(out, layout)
        want = expected_fields(holes, block_size=bs, use_mrope=mrope, dummy_kv_block=dummy)
        for name, arr in want.items():
            assert np.array_equal(got[name], arr), name
        assert not got["_pads"].any()
        assert (out[layout.staged_bytes:] == 0xCC).all()  # nothing past the block
        assert list(cu) == [0, *np.cumsum(counts)] and list(kv) == [s + c for s, c in zip(starts, counts)]


def test_memoised_views_and_layouts_do_not_leak_between_buffers_or_layouts():
    with open_device("emu") as dev:
        big, _ = make_streams(dev, [33, 40, 7], starts=[1, 2, 3])
        small, _ = make_streams(dev, [5], starts=[16])
        a = np.full(4096, 0xEE, np.uint8)
        b = np.full(4096, 0xEE, np.uint8)
        for streams, out in ((big, a), (small, a), (big, b), (small, b), (big, a)):
            batch = _validate_fast(streams, 16, True, 0)
            layout = stacked_layout(len(streams), batch.total, True)
            pack_metadata(batch, layout, 16, 0, out)
            got = unpack_metadata(out, layout)
            want = expected_fields(streams, block_size=16, use_mrope=True, dummy_kv_block=0)
            assert all(np.array_equal(got[k], v) for k, v in want.items())
            assert not got["_pads"].any()  # pads rezeroed although the other layout wrote there
    assert stacked_layout(3, 80, True) is stacked_layout(3, 80, True)
    assert stacked_layout(np.int64(3), 80, True) is stacked_layout(3, 80, True)
    with pytest.raises(TypeError):
        stacked_layout(True, 80, True)
    with pytest.raises(TypeError):
        stacked_layout(3, 80, 1)
    with pytest.raises(ValueError):
        stacked_layout(0, 80, True)


def test_fast_metadata_construction_is_the_dataclass():
    with open_device("emu") as dev, ScratchArena(dev, 1 << 16) as arena:
        streams, _ = make_streams(dev, [9, 4])
        meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                           dummy_kv_block=0)
        assert type(meta) is BatchedAttnMetadata
        import dataclasses

        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(BatchedAttnMetadata)}
        slow = BatchedAttnMetadata(**fields)
        assert meta.__dict__.keys() == slow.__dict__.keys() and meta == slow
        with pytest.raises(dataclasses.FrozenInstanceError):
            meta.batch_size = 3
        # the next pass at the same place shares the template, not the per-pass values
        streams2, _ = make_streams(dev, [7, 6])
        arena.reset()
        meta2 = stage_batched_attn_metadata(arena, streams2, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                            dummy_kv_block=0)
        assert meta2.cu_seqlens_host.tolist() == [0, 7, 13] and meta.cu_seqlens_host.tolist() == [0, 9, 13]
        assert meta2.chunk_len == 7 and meta.chunk_len == 9 and meta2.slot_stacked == meta.slot_stacked
        assert meta.counts.tolist() == [9, 4] and not meta.cu_seqlens_host.flags.writeable


def test_padded_pack_sentinels_and_real_part():
    with open_device("emu") as dev:
        streams, _ = make_streams(dev, [5, 8], starts=[16, 3])
        batch = _validate_fast(streams, 16, True, 2)
        layout = stacked_layout(4, 21, True)
        out = np.full(layout.staged_bytes, 0xAB, np.uint8)
        cu, kv = pack_padded(batch, layout, 16, 2, out)
        f = unpack_metadata(out, layout)
        want = expected_fields(streams, block_size=16, use_mrope=True, dummy_kv_block=2)
        for name in ("positions_stacked", "positions_h_stacked", "positions_w_stacked", "slot_stacked"):
            assert np.array_equal(f[name][:13], want[name])
        assert (f["slot_stacked"][13:] == -1).all() and (f["positions_stacked"][13:] == 0).all()
        assert list(cu) == [0, 5, 13, 13, 13] and list(kv) == [21, 11, 0, 0]
        assert list(f["block_table_ptrs"]) == [s.block_table_dev for s in streams] + [streams[0].block_table_dev] * 2
        assert not f["_pads"].any()
        from q12drv import CapacityError

        with pytest.raises(CapacityError):
            pack_padded(batch, stacked_layout(1, 21, True), 16, 2, out)
        with pytest.raises(CapacityError):
            pack_padded(batch, stacked_layout(4, 12, True), 16, 2, out)


# ----------------------------------------------------------------------------- launches
def _kv_launch(dev):
    from q12drv.kernels import ops

    return ops.prepared(dev, "q12_kv_write")


def test_launch_accepts_every_stream_kind_and_bind_reads_current_args(emu):
    launch = _kv_launch(emu)
    calls = []
    emu.driver.launch = lambda func, grid, block, smem, stream, addr: calls.append((grid, stream, addr))
    launch.fire = emu.driver.launcher(launch.kernel.func, launch._addr)
    other = emu.new_stream()

    class TorchLike:
        cuda_stream = other.handle

    for s in (None, emu.stream, other, other.handle, TorchLike()):
        launch.launch((2, 1, 1), (256, 1, 1), 0, s)
    assert [c[1] for c in calls] == [emu.stream.raw, emu.stream.raw, other.raw, other.raw, other.raw]
    with pytest.raises(TypeError, match="stream must be"):
        launch.launch((1, 1, 1), (32, 1, 1), 0, "default")
    fire = launch.bind((3, 1, 1), (64, 1, 1), 0, other)
    launch.set(row_elems=8)
    fire()
    assert calls[-1] == ((3, 1, 1), other.raw, launch._addr) and launch.args.row_elems == 8
    for bad in ((0, 1, 1), (1, 1), (1.5, 1, 1), "abc"):
        with pytest.raises(ValueError, match="grid"):
            launch.bind(bad, (32, 1, 1))
    with pytest.raises(ValueError, match="smem"):
        launch.bind((1, 1, 1), (32, 1, 1), -1)


def test_a_bound_launch_keeps_its_argument_block_alive():
    from q12drv.core.launch import Launch

    with open_device("emu") as dev:
        kernel = _kv_launch(dev).kernel
        launch = Launch(kernel).set(row_elems=24)
        seen = []
        dev.driver.launch = lambda func, grid, block, smem, stream, addr: seen.append(
            ctypes.c_int32.from_address(ctypes.c_void_p.from_address(addr + 5 * 8).value).value)
        fire = launch.bind((1, 1, 1), (32, 1, 1))
        del launch
        gc.collect()
        fire()
        assert seen == [24]  # row_elems (parameter 5) read through the bound argument array


def test_cuda_bound_launchers_raise_on_a_failed_launch():
    from cuda.bindings import driver as cu

    from q12drv.core.driver.cuda import CudaDriver

    drv = CudaDriver.__new__(CudaDriver)  # no libcuda here: only the launch call is exercised
    results = []
    drv._launch = lambda *args: (results.append(args), (results[-1] and cu.CUresult.CUDA_ERROR_INVALID_VALUE,))[1]
    fire = drv.launcher("func", 1234)
    with pytest.raises(CudaError, match="cuLaunchKernel"):
        fire((1, 2, 3), (4, 5, 6), 0, "stream")
    assert results[-1] == ("func", 1, 2, 3, 4, 5, 6, 0, "stream", 1234, 0)
    bound = drv.bound_launcher("func", (7, 1, 1), (32, 1, 1), 16, "s", 99, owner=object())
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        bound()
    drv._launch = lambda *args: (cu.CUresult.CUDA_SUCCESS,)
    drv.launcher("f", 1)((1, 1, 1), (32, 1, 1), 0, None)
    drv.bound_launcher("f", (1, 1, 1), (32, 1, 1), 0, None, 1)()


def _pdl_driver(fail_after=None):
    """A CudaDriver without libcuda (only the configuration and the call are exercised) and the list its
    cuLaunchKernelEx appends to: (config, its grid, block, shared memory and stream at the call, func, params,
    extra); the calls after the first ``fail_after`` return CUDA_ERROR_INVALID_VALUE."""
    from cuda.bindings import driver as cu

    from q12drv.core.driver.cuda import CudaDriver

    drv = CudaDriver.__new__(CudaDriver)
    seen = []

    class FakeCu:
        CUlaunchAttribute, CUlaunchConfig, CUlaunchAttributeID = cu.CUlaunchAttribute, cu.CUlaunchConfig, cu.CUlaunchAttributeID

        @staticmethod
        def cuLaunchKernelEx(cfg, func, params, extra):
            seen.append((cfg, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                         cfg.sharedMemBytes, int(cfg.hStream), func, params, extra))
            failed = fail_after is not None and len(seen) > fail_after
            return (cu.CUresult.CUDA_ERROR_INVALID_VALUE if failed else cu.CUresult.CUDA_SUCCESS,)

    drv._cu = FakeCu
    return drv, seen


def test_dependent_launch_keeps_stream_order_on_emu_and_builds_the_pdl_config_on_cuda(emu):
    """Launch.launch_dependent: on the emulated driver the same launch in stream order (a valid schedule of a
    programmatic dependent launch); on CUDA one cuLaunchKernelEx with the programmatic stream serialization
    attribute, the geometry, shared memory, stream and argument block of the call, and its error raised."""
    from cuda.bindings import driver as cu

    launch = _kv_launch(emu)
    calls = []
    emu.driver.launch = lambda func, grid, block, smem, stream, addr: calls.append((func, grid, block, smem, stream, addr))
    launch.launch_dependent((4, 1, 1), (128, 1, 1), 0)
    assert calls == [(launch.kernel.func, (4, 1, 1), (128, 1, 1), 0, emu.stream.raw, launch._addr)]

    drv, seen = _pdl_driver(fail_after=1)
    drv.launch_dependent("func", (2, 3, 4), (128, 1, 1), 4096, cu.CUstream(0), 1234)
    cfg, grid, block, smem, _stream, func, params, extra = seen[0]
    assert (func, params, extra) == ("func", 1234, 0)
    assert (grid, block, smem, cfg.numAttrs) == ((2, 3, 4), (128, 1, 1), 4096, 1)
    attr = cfg.attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    with pytest.raises(CudaError, match="cuLaunchKernelEx"):
        drv.launch_dependent("func", (1, 1, 1), (32, 1, 1), 0, cu.CUstream(0), 1)


def test_dependent_launcher_keeps_its_config_and_rewrites_it_when_the_launch_changes(emu):
    """CudaDriver.dependent_launcher builds one launch configuration and reuses it while the geometry, shared
    memory and stream stay; a call that changes any of them rewrites its fields first (and a grid given as a list,
    changed in place, is seen as changed). Launch.launch_dependent makes its launcher once and passes every call's
    geometry through it."""
    from cuda.bindings import driver as cu

    drv, seen = _pdl_driver()
    fire = drv.dependent_launcher("func", 1234)
    s0, s1 = cu.CUstream(0), cu.CUstream(7)
    grid = [2, 3, 4]
    fire(grid, (128, 1, 1), 4096, s0)
    fire(grid, (128, 1, 1), 4096, s0)
    grid[0] = 9
    fire(grid, (128, 1, 1), 4096, s0)
    fire((9, 3, 4), (256, 1, 1), 4096, s0)
    fire((9, 3, 4), (256, 1, 1), 0, s0)
    fire((9, 3, 4), (256, 1, 1), 0, s1)
    assert len({id(c[0]) for c in seen}) == 1   # one configuration object for every call
    assert [c[1:7] for c in seen] == [
        ((2, 3, 4), (128, 1, 1), 4096, 0, "func", 1234), ((2, 3, 4), (128, 1, 1), 4096, 0, "func", 1234),
        ((9, 3, 4), (128, 1, 1), 4096, 0, "func", 1234), ((9, 3, 4), (256, 1, 1), 4096, 0, "func", 1234),
        ((9, 3, 4), (256, 1, 1), 0, 0, "func", 1234), ((9, 3, 4), (256, 1, 1), 0, 7, "func", 1234)]
    attr = seen[0][0].attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

    launch = _kv_launch(emu)
    made, calls = [], []

    def dependent_launcher(func, addr):
        made.append((func, addr))
        return lambda grid, block, smem, stream: calls.append((grid, block, smem, stream))

    emu.driver.dependent_launcher = dependent_launcher
    launch.launch_dependent((4, 1, 1), (128, 1, 1), 0)
    launch.launch_dependent((5, 1, 1), (128, 1, 1), 0)
    assert made == [(launch.kernel.func, launch._addr)]
    assert calls == [((4, 1, 1), (128, 1, 1), 0, emu.stream.raw), ((5, 1, 1), (128, 1, 1), 0, emu.stream.raw)]


def test_memoised_launch_geometry_still_refuses_bad_input_every_time(emu):
    from q12drv.kernels import ops

    streams, _ = make_streams(emu, [40, 9])
    with ScratchArena(emu, 1 << 16) as arena:
        meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                           dummy_kv_block=0)
        p = 0x7F00_0000_1000
        for _ in range(2):  # only successful results are memoised: the second bad call raises again
            with pytest.raises(ValueError, match="head_dim"):
                ops.attention(emu, meta, p, p, p, p, num_q_heads=4, num_kv_heads=2, head_dim=96)
            with pytest.raises(ValueError, match="rotary_dim"):
                ops.rope(emu, meta, p, p, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=65, theta=1e4)
        assert emu.sm_count == 132  # from the driver (the emulator reports an H200's 132 SMs)
        tokens = sum(s.proc_count for s in streams)
        assert ops._kvw_geometry(tokens, 512, num_sms=emu.sm_count) == ops._kvw.geometry(tokens, 512, num_sms=132)
        grid, _, _ = ops._kvw.geometry(1 << 20, 512, num_sms=2)
        assert grid[0] <= 2 * 4  # the persistent grid follows the SM count it is given


def test_reserve_all_adopts_this_arenas_regions_and_refuses_anything_else(emu):
    from q12drv import CapacityError

    with ScratchArena(emu, 4096) as arena, ScratchArena(emu, 4096) as other:
        a = arena.reserve("a", 100, offset=0)
        b = arena.reserve("b", 50, offset=128)
        arena.reset()
        arena.reserve_all([a, b])
        assert arena.regions == (a, b) and arena.cursor == 178
        arena.reset()
        foreign = other.reserve("x", 10, offset=0)
        for bad, err in (([foreign], ValueError), ([b, a], ValueError)):
            with pytest.raises(err):
                arena.reserve_all(bad)
            assert arena.regions == () and arena.cursor == 0  # nothing reserved
        arena.reserve("c", 200, offset=0)
        with pytest.raises(ValueError, match="overlap"):
            arena.reserve_all([a])
        big = ScratchArena(emu, 8192)
        try:
            far = big.reserve("far", 100, offset=8000)
            small = type(far)("far", 8000, 100, DevicePtr(int(arena.base) + 8000))
            with pytest.raises(CapacityError):
                arena.reserve_all([small])
        finally:
            big.close()


def test_reserve_again_is_reserve_all_of_one_region(emu):
    from q12drv import CapacityError
    from q12drv.core.errors import Q12Error

    with ScratchArena(emu, 4096) as arena, ScratchArena(emu, 4096) as other:
        a = arena.reserve("a", 100, offset=64)
        arena.reset()
        arena.reserve_again(a)
        assert arena.regions == (a,) and arena.regions[0] is a and arena.cursor == 164
        arena.reset()
        foreign = other.reserve("x", 10, offset=0)
        forged = type(a)("a", 64, 5000, a.ptr)  # this arena's pointer, but past its capacity
        for bad, err in ((foreign, ValueError), (forged, CapacityError), (("a", 64, 100, a.ptr), ValueError)):
            with pytest.raises(err):
                arena.reserve_again(bad)
            assert arena.regions == () and arena.cursor == 0  # nothing reserved
        arena.reserve("c", 65, offset=0)
        with pytest.raises(ValueError, match="overlap"):
            arena.reserve_again(a)
        assert arena.cursor == 65
    with pytest.raises(Q12Error, match="closed"):
        arena.reserve_again(a)


def test_a_plan_laid_out_again_reuses_its_regions(emu):
    from q12drv.prefill import Q12Pass

    streams, _ = make_streams(emu, [40, 9])
    with ScratchArena(emu, 1 << 16) as arena:
        first = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        regions = arena.regions
        again = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        assert again.plan is first.plan and arena.regions == regions
        assert all(x is y for x, y in zip(arena.regions[:3], regions[:3]))  # the MoE area and the blocks, reused


def test_the_planned_host_profile_runs_and_names_the_plan(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, Q12DRV_DRIVER="emu", Q12DRV_CACHE_DIR=str(tmp_path / "cubins"), PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "bench/profile_host.py", "--stub", "--only", "planned", "--reps", "3", "--top", "8"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.count("== ") == 1 and "ExpandPlan.stage" in r.stdout and "expand.py" in r.stdout, r.stdout
