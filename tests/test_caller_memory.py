"""Memory the caller owns, on the emulated driver: arenas and pinned rings over it (nothing allocated, nothing
freed), and host memory of other libraries (numpy, torch on the CPU) adopted as emulated device memory."""

import gc

import numpy as np
import pytest

from q12drv import CapacityError, CudaError, ScratchArena, make_scratch_plan, open_device
from q12drv.core.arena import GUARD_BYTES, GUARD_PATTERN, OVER_ALIGN
from q12drv.core.driver import EmuDriver
from q12drv.core.pinned import PinnedRing
from tests.test_threads_devices import COUNTS, attention_pass


def aligned_zeros(nbytes: int, align: int = OVER_ALIGN) -> np.ndarray:
    """``nbytes`` zero bytes starting ``align``-aligned (a view into a slightly larger array, its owner)."""
    raw = np.zeros(nbytes + align, np.uint8)
    return raw[-raw.ctypes.data % align:][:nbytes]


class CAI:
    """A device buffer as CuPy or Numba describe it."""

    def __init__(self, ptr, nbytes):
        self._cai = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3, "strides": None,
                     "stream": None}

    @property
    def __cuda_array_interface__(self):
        return self._cai


def live(dev) -> dict:
    return dev.driver.live_allocations()


# --- arenas over the caller's device memory ----------------------------------------------------------------

def test_an_arena_over_a_device_buffer_allocates_and_frees_nothing(emu):
    buf = emu.alloc(ScratchArena.buffer_bytes(1 << 16))
    emu.memset(buf.ptr, 0, buf.nbytes)
    before = live(emu)
    arena = ScratchArena.over(emu, buf)
    assert live(emu) == before and not arena.owns_memory and arena.base == buf.ptr
    assert arena.capacity == 1 << 16 and arena.guard_intact()  # the guard band is the buffer's last bytes
    band = emu.download(int(buf.ptr) + (1 << 16), GUARD_BYTES)
    assert band == bytes([GUARD_PATTERN]) * GUARD_BYTES
    assert emu.download(buf.ptr, 1 << 16) == bytes(1 << 16)  # nothing else written
    arena.reserve("x", 1000)
    arena.close()
    assert arena.closed and buf.alive and live(emu) == before  # close only forgets it
    buf.free()


def test_an_arena_over_a_raw_pointer_or_an_array_interface_object(emu):
    buf = emu.alloc(8192)
    with ScratchArena.over(emu, int(buf.ptr), 4096) as arena:
        assert arena.capacity == 4096 - GUARD_BYTES
    with ScratchArena.over(emu, CAI(int(buf.ptr), 8192)) as arena:
        assert arena.capacity == 8192 - GUARD_BYTES
    with ScratchArena.over(emu, CAI(int(buf.ptr), 8192), 2048) as arena:
        assert arena.capacity == 2048 - GUARD_BYTES
    assert buf.alive


def test_a_pass_over_the_callers_memory_equals_one_over_an_own_arena(emu):
    need = make_scratch_plan(COUNTS, 0, False).total_bytes
    expected = attention_pass(emu, 7)
    buf = emu.alloc(ScratchArena.buffer_bytes(need))
    with ScratchArena.over(emu, buf) as arena:
        assert attention_pass(emu, 7, arena=arena) == expected
    host = aligned_zeros(ScratchArena.buffer_bytes(need))  # emulated: host memory becomes device memory
    with ScratchArena.over(emu, host) as arena:
        assert attention_pass(emu, 7, arena=arena) == expected
        assert host[:need].any()  # the metadata was staged into the caller's bytes, no copy


def test_bad_buffers_are_refused_before_anything_is_written(emu):
    buf = emu.alloc(8192)
    emu.memset(buf.ptr, 0x11, 8192)
    other = open_device(emu.driver, 1)
    on1 = other.alloc(8192)
    emu.set_current()
    cases = [
        (lambda: ScratchArena.over(emu, buf, 9000), ValueError, "holds 8,192 bytes, fewer than nbytes=9,000"),
        (lambda: ScratchArena.over(emu, buf, GUARD_BYTES), ValueError, "leave no capacity: the last 256 bytes"),
        (lambda: ScratchArena.over(emu, int(buf.ptr) + 8, 4096), ValueError, "not 64-byte aligned"),
        (lambda: ScratchArena.over(emu, int(buf.ptr)), TypeError, "a raw address needs nbytes="),
        (lambda: ScratchArena.over(emu, int(buf.ptr) + 4096, 8192), ValueError, "run past the end of its allocation"),
        (lambda: ScratchArena.over(emu, int(on1.ptr), 4096), ValueError, "memory of device 1, the arena's device is 0"),
        (lambda: ScratchArena.over(emu, on1), ValueError, "DeviceBuffer is memory of device 1"),
        (lambda: ScratchArena.over(emu, 0x7F00_0000_0000, 4096), ValueError, "no device memory the emu driver knows"),
        (lambda: ScratchArena.over(emu, np.zeros((64, 64), np.uint8)[:, :32]), ValueError, "must be contiguous"),
        (lambda: ScratchArena.over(emu, "buffer"), TypeError, "buffer must be an address \\(int\\) or an object"),
        (lambda: ScratchArena.over(emu, buf, 4096.0), TypeError, "nbytes must be an int"),
    ]
    pinned = emu.pinned(8192)
    cases.append((lambda: ScratchArena.over(emu, pinned.addr, 4096), ValueError, "page-locked host memory"))
    for make, error, match in cases:
        with pytest.raises(error, match=match):
            make()
    assert emu.download(buf.ptr, 8192) == bytes([0x11]) * 8192
    assert emu.download(on1.ptr, 16) != bytes([GUARD_PATTERN]) * 16
    other.close()


def test_an_arena_over_the_callers_memory_closes_with_its_device():
    dev = open_device("emu")
    host = aligned_zeros(8192)
    arena = ScratchArena.over(dev, host)
    dev.close()
    assert arena.closed and arena._buffer is None  # the caller's object is let go


def test_reservations_are_aligned_as_addresses_on_a_less_aligned_base(emu):
    buf = emu.alloc(1 << 14)
    with ScratchArena.over(emu, int(buf.ptr) + 64, 8192) as arena:  # 64-aligned, not 256
        r = arena.reserve("a", 10)
        r = arena.reserve("b", 10, align=256)
        assert int(r.ptr) % 256 == 0
        with pytest.raises(ValueError, match="is not 256-aligned"):
            arena.reserve("c", 10, offset=1024, align=256)  # address base + 1024 is only 64-aligned


# --- pinned rings over the caller's memory ----------------------------------------------------------------

def test_a_pinned_ring_over_the_callers_memory(emu):
    host = np.zeros(1 << 14, np.uint8)
    before = live(emu)
    ring = PinnedRing.over(emu, host, nslots=3)
    assert not ring.owns_memory and ring.nslots == 3 and live(emu) == before
    slot = ring.acquire(1000)
    assert host.ctypes.data <= slot.addr < host.ctypes.data + host.nbytes and slot.addr % 64 == 0
    with pytest.raises(CapacityError, match="cannot grow"):
        ring.acquire(1 << 14)
    ring.close()
    assert live(emu) == before
    for bad, match in [(lambda: PinnedRing.over(emu, np.zeros(64, np.uint8)), "give at least"),
                       (lambda: PinnedRing.over(emu, CAI(int(emu.alloc(4096).ptr), 4096)), "device memory"),
                       (lambda: PinnedRing.over(emu, np.zeros(8192, np.uint8), nslots=1), "at least 2 slots"),
                       (lambda: PinnedRing.over(emu, np.zeros(8192, np.uint8)[::2]), "contiguous")]:
        with pytest.raises(ValueError, match=match):
            bad()


def test_the_arena_stages_through_the_callers_pinned_memory(emu):
    from q12drv import place_h_state_slot, stage_batched_attn_metadata
    from tests.helpers import make_streams

    streams, tables = make_streams(emu, COUNTS, rng=np.random.default_rng(8))
    common = dict(block_size=16, use_mrope=False, scratch_offset_bytes=0, dummy_kv_block=0)

    def staged(arena):
        meta = stage_batched_attn_metadata(arena, streams, **common)  # the host packer: one pinned copy
        place_h_state_slot(arena, meta).upload([64 * (b + 1) for b in range(len(COUNTS))])
        return arena.read(0, arena.cursor)

    with ScratchArena(emu, 1 << 16) as arena:
        expected = staged(arena)
    pinned, small = np.zeros(1 << 16, np.uint8), np.zeros(1024, np.uint8)
    with ScratchArena(emu, 1 << 16) as arena:
        arena.use_pinned(pinned, ring="staging")
        arena.use_pinned(small, ring="h_state")
        before = live(emu)
        assert staged(arena) == expected
        assert live(emu)["pinned"] == before["pinned"]  # no ring of its own was made
        assert pinned.any() and small.any()  # packed into the caller's bytes
        with pytest.raises(ValueError, match="exists already"):
            arena.use_pinned(pinned)
        with pytest.raises(ValueError, match="ring must be one of"):
            arena.use_pinned(pinned, ring="other")
    with ScratchArena(emu, 1 << 16) as arena:
        arena.use_pinned(np.zeros(256, np.uint8))  # two slots of 128 bytes: the metadata does not fit
        with pytest.raises(CapacityError, match="cannot grow"):
            stage_batched_attn_metadata(arena, streams, **common)
    tables.free()


# --- host memory of other libraries on the emulated driver ------------------------------------------------

def test_host_arrays_become_device_memory_while_they_live(emu):
    a = np.arange(1024, dtype=np.float32)
    ptr = emu.adopt(a)
    assert ptr == a.ctypes.data and emu.driver.memory.adopted == 1
    assert np.array_equal(emu.download_array(ptr, np.float32, 1024), a)
    emu.memset(ptr, 0, 16)
    emu.synchronize()
    assert a[:4].tolist() == [0, 0, 0, 0]  # written in place: no copy
    view = a[512:]
    assert emu.adopt(view) == view.ctypes.data and emu.driver.memory.adopted == 1  # its owner, adopted already
    del a
    gc.collect()
    assert emu.driver.memory.adopted == 1  # the view keeps its base, hence the adoption, alive
    del view
    gc.collect()
    assert emu.driver.memory.adopted == 0  # weakly referenced: nothing leaks


def test_adoption_refusals(emu):
    ro = np.zeros(64, np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-?only"):
        emu.adopt(ro)
    with pytest.raises(TypeError, match="__cuda_array_interface__ or __dlpack__"):
        emu.adopt([1, 2, 3])
    a = np.zeros(256, np.uint8)
    other = open_device(emu.driver, 1)
    other.adopt(a)
    emu.set_current()
    with pytest.raises(ValueError, match="adopted as device 1's"):
        emu.adopt(a)
    other.close()
    drv = EmuDriver()
    with pytest.raises(TypeError, match="cannot be weakly referenced"):
        drv.adopt(a.ctypes.data, 256, 5)
    with pytest.raises(ValueError, match="ordinal must be a device"):
        drv.adopt(a.ctypes.data, 256, a, ordinal=7)
    drv.adopt(a.ctypes.data, 256)  # no owner: until unadopt
    drv.unadopt(a.ctypes.data)
    with pytest.raises(ValueError, match="no adopted memory starts at"):
        drv.unadopt(a.ctypes.data)


def test_a_checked_range_of_a_strided_view_is_adopted(emu):
    wide = np.zeros((8, 64), np.float32)
    rows = wide[:, :32]  # every row's first half: strided, as a caller that checked it hands it over
    extent = (7 * 64 + 32) * 4
    assert emu.adopt(rows, rows.ctypes.data, extent) == rows.ctypes.data
    emu.memset(rows.ctypes.data, 0xFF, extent)
    emu.synchronize()
    assert np.isnan(wide[7, :32]).all()
    with pytest.raises(ValueError, match="must be contiguous"):
        emu.adopt(rows)  # without a range: the object itself, which the kernels cannot read strided


def test_pointer_checks_then_adopts(emu):
    a = np.zeros((8, 4, 64), np.uint16)
    assert emu.pointer(a, "q", dtype="u16", shape=(None, 4, 64), align=16) == a.ctypes.data
    with pytest.raises(ValueError, match=r"q must have shape \(\*, 8, 64\)"):
        emu.pointer(np.zeros((8, 4, 64), np.uint16), "q", shape=(None, 8, 64))
    assert emu.driver.memory.adopted == 1  # the refused one was not adopted
    with pytest.raises(CudaError, match="ILLEGAL_ADDRESS|INVALID_VALUE"):
        emu.download(np.zeros(16, np.uint8).ctypes.data, 16)  # never adopted: not device memory


def test_a_torch_dry_run_needs_no_copies(emu):
    """An attention layer whose every buffer is a torch CPU tensor, run on the emulated device in place."""
    torch = pytest.importorskip("torch")
    expected = attention_pass(emu, 11)
    rng = np.random.default_rng(11)
    from q12drv.core.bf16 import to_bf16_bits
    from q12drv.prefill import Q12Pass
    from tests.helpers import make_streams
    from tests.test_threads_devices import SHAPE, STARTS

    streams, tables = make_streams(emu, COUNTS, STARTS, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    t = sum(COUNTS)
    bf = lambda *s: torch.from_numpy(to_bf16_bits(rng.standard_normal(s)).view(np.int16)).view(torch.bfloat16)  # noqa: E731
    x = {"q": bf(t, 4, 64), "k": bf(t, 2, 64), "v": bf(t, 2, 64), "kp": bf(num_blocks, 16, 2, 64),
         "vp": bf(num_blocks, 16, 2, 64), "o": torch.zeros(t, 4, 64, dtype=torch.bfloat16)}
    workspace = torch.empty(ScratchArena.buffer_bytes(make_scratch_plan(COUNTS, 0, False).total_bytes),
                            dtype=torch.uint8)
    with ScratchArena.over(emu, workspace) as arena:
        chunks = [(s + c, c, 0, False) for s, c in zip(STARTS, COUNTS)]
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64, chunks=chunks,
                      mode="batched")
        p = {k: emu.pointer(v, k, dtype="bf16") for k, v in x.items()}
        q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
        emu.synchronize()
    got = {k: x[k].view(torch.int16).numpy().tobytes() for k in ("o", "kp", "vp", "q", "k")}
    assert got == expected
    tables.free()
    n = emu.driver.memory.adopted
    del x, workspace, p
    gc.collect()
    assert emu.driver.memory.adopted < n


# --- a growing batch: the arena grows in place -----------------------------------------------------------------

def test_an_arena_grows_in_place_and_what_was_staged_on_the_old_memory_is_refused(emu):
    from q12drv import Q12Pass
    from q12drv.core.errors import Q12Error
    from tests.helpers import make_streams

    streams, tables = make_streams(emu, [300, 40])
    counts = [s.proc_count for s in streams]
    need = Q12Pass.arena_bytes(counts)
    assert need == make_scratch_plan(counts, 0, False, "exact").total_bytes
    with ScratchArena(emu, 4096) as arena:
        before = live(emu)
        assert not arena.grow(4096) and arena.capacity == 4096  # enough already: nothing happens
        small = Q12Pass(arena, streams[:1], block_size=16, use_mrope=False, dummy_kv_block=0)
        with pytest.raises(ValueError, match=rf"needs {need:,} scratch bytes.*ScratchArena.grow\({need}\) makes room"):
            Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode="batched")
        base, generation = arena.base, arena.generation
        assert need > 4096 * 3 // 2 and arena.grow(need)
        assert arena.capacity == need and arena.base != base and arena.guard_intact()
        assert arena.regions == () and arena.cursor == 0 and arena.generation > generation
        assert live(emu)["device"] == before["device"]  # the old memory freed, the new one held (rings kept)
        with pytest.raises(Q12Error, match="stale"):
            small.check_block_tables()
        Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode="batched")
        tables.free()
        capacity = arena.capacity
        assert arena.grow(capacity + 1) and arena.capacity == capacity * 3 // 2  # grows by half: O(log) moves
    assert attention_pass(emu, 7, arena=None) == attention_pass(emu, 7, arena=_grown(emu))


def _grown(emu):
    arena = ScratchArena(emu, 1024)
    arena.grow(make_scratch_plan(COUNTS, 0, False).total_bytes)
    return arena


def test_an_arena_over_the_callers_memory_grows_only_onto_memory_the_caller_gives(emu):
    need = make_scratch_plan(COUNTS, 0, False).total_bytes
    first, small, big = (emu.alloc(ScratchArena.buffer_bytes(n)) for n in (1024, need - 8, need))
    arena = ScratchArena.over(emu, first)
    base = arena.base
    with pytest.raises(ValueError, match=rf"never allocates; pass a buffer of at least "
                                         rf"ScratchArena.buffer_bytes\({need}\)"):
        arena.grow(need)
    with pytest.raises(ValueError, match=rf"holds a {need - 8:,}-byte arena, {need:,} bytes are needed"):
        arena.grow(need, small)
    assert arena.base == base and arena.capacity == 1024  # refused: nothing changed
    before = live(emu)
    assert arena.grow(need, big) and arena.base == big.ptr and arena.capacity == need
    assert live(emu) == before and first.alive  # nothing allocated, the old buffer only forgotten
    assert attention_pass(emu, 7, arena=arena) == attention_pass(emu, 7)
    arena.close()
    with ScratchArena(emu, 1024) as own, pytest.raises(ValueError, match="allocates its own memory"):
        own.grow(need, big)
    for b in (first, small, big):
        b.free()


def test_an_expand_plan_or_pass_graph_made_before_the_arena_grew_is_refused(emu):
    from q12drv.core.errors import Q12Error
    from q12drv.kernels.expand import ExpandPlan
    from q12drv import PassGraph
    from tests.helpers import make_streams

    streams, tables = make_streams(emu, [20, 9])
    with ScratchArena(emu, 1 << 16) as arena:
        plan = ExpandPlan(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0, dummy_kv_block=0)
        plan.stage([0, 0], [20, 9])
        graph = PassGraph(arena, max_streams=2, max_tokens=64, block_size=16, use_mrope=False, dummy_kv_block=0)
        graph.set_streams(streams)
        arena.grow(1 << 17)
        with pytest.raises(Q12Error, match="the arena moved"):
            plan.stage([0, 0], [20, 9])
        with pytest.raises(Q12Error, match="the arena was reset since this PassGraph was made"):
            graph.run_eager(lambda g: None)
        graph.close()
    tables.free()


def test_growing_onto_too_small_a_buffer_writes_nothing_there(emu):
    small = emu.alloc(ScratchArena.buffer_bytes(2048))
    emu.memset(small.ptr, 0x11, small.nbytes)
    first = emu.alloc(ScratchArena.buffer_bytes(1024))
    with ScratchArena.over(emu, first) as arena:
        with pytest.raises(ValueError, match="holds a 2,048-byte arena, 4,096 bytes are needed"):
            arena.grow(4096, small)
    assert emu.download(small.ptr, small.nbytes) == b"\x11" * small.nbytes  # no guard band written
    first.free()
    small.free()
