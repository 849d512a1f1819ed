"""Resource hygiene: 20,000 stage/upload/launch cycles with flat host memory and flat driver
counts; everything released by close() and the context managers; a program that exits without
closing its device exits cleanly (the atexit hook closes it)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np

from q12drv import Q12Error, ScratchArena, open_device, place_h_state_slot, stage_batched_attn_metadata
from q12drv.kernels import ops
from tests.reliability import World

REPO = Path(__file__).resolve().parents[1]
CYCLES = 20_000
SAMPLE_EVERY = 2_000
WARMUP = 2_000
TRACED_CYCLES = 1_500       # tracemalloc makes a cycle about 6 times slower
# What the process may grow by after warm-up. Garbage is collected before each sample (a pass's objects
# die in reference cycles: uncollected, they swing RSS by about 600 KiB), so all three are flat here:
# malloc's bytes in use move by about 200 bytes over 20,000 cycles, RSS by a page, traced memory by a
# few KiB. The bounds catch a leak of 13 bytes a cycle in the C heap (malloc: numpy buffers, the
# driver, C extensions; any leaked block every cycle), of 52 bytes a cycle of pages mapped outside
# malloc (RSS) and of 44 bytes a cycle of Python objects and numpy buffers (traced).
HEAP_BOUND = 256 << 10      # bytes over the CYCLES cycles
RSS_BOUND = 1 << 20         # bytes over the CYCLES cycles
TRACED_BOUND = 64 << 10     # bytes over the TRACED_CYCLES cycles
_LIBC = ctypes.CDLL(None)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class _Mallinfo(ctypes.Structure):  # glibc before 2.33: the same fields as ints (exact below 2 GiB of heap)
    _fields_ = [(name, ctypes.c_int) for name, _ in _Mallinfo2._fields_]


_MALLINFO = getattr(_LIBC, "mallinfo2", None) or _LIBC.mallinfo
_MALLINFO.restype = _Mallinfo2 if hasattr(_LIBC, "mallinfo2") else _Mallinfo


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back (glibc's ``mallinfo2``: ``uordblks + hblkhd``), whatever
    pages they sit on: unlike RSS, a leak into memory freed earlier is seen too."""
    info = _MALLINFO()
    return info.uordblks + info.hblkhd


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def counts(dev) -> tuple:
    return dev.driver.live_allocations(), dev.driver.live_handles()


def make_cycle(w: World):
    plan, arena, streams, dev = w.plan, w.arena, w.streams, w.dev
    ptrs = w.state_ptrs()
    k, v, kp, vp = w.p("k"), w.p("v"), w.p("k_pool"), w.p("v_pool")

    def cycle(i: int) -> None:
        """Stage a pass, place and upload its JIT slot, launch one kernel on it."""
        arena.reset()
        for r in (plan.moe, *plan.stream_blocks):
            arena.reserve(r.name, r.nbytes, offset=r.offset)
        meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=True,
                                           scratch_offset_bytes=plan.stacked.offset, dummy_kv_block=0)
        slot = place_h_state_slot(arena, meta)
        slot.upload([p + 64 * (i % 5) for p in ptrs])
        ops.kv_write(dev, meta, k, v, kp, vp, num_kv_heads=2, head_dim=64, num_blocks=w.num_blocks)
        if i % 1000 == 999:  # now and then a whole pass through Q12Pass with both layers
            w.run_layers(w.new_pass("batched" if i % 2000 == 999 else "per_stream"))

    return cycle


def traced_growth(cycle, n: int, start: int = 0) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(start, start + n):
            cycle(i)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def host_growth(cycle, n: int, start: int = 0, dev=None) -> list:
    """``[(heap, rss), ...]``: the growth (bytes) of :func:`heap_in_use` and of RSS after every SAMPLE_EVERY of
    ``n`` cycles, garbage collected before each sample; with ``dev``, its driver counts must not change
    meanwhile."""
    gc.collect()
    base, base_counts = (heap_in_use(), rss()), dev and counts(dev)
    samples = []
    for i in range(start, start + n):
        cycle(i)
        if (i + 1 - start) % SAMPLE_EVERY == 0:
            gc.collect()
            samples.append((heap_in_use() - base[0], rss() - base[1]))
            assert dev is None or counts(dev) == base_counts, f"driver counts changed after {i + 1 - start} cycles"
    return samples


def test_cycles_keep_host_memory_and_driver_counts_flat():
    with open_device("emu") as dev:
        w = World.build(dev)
        cycle = make_cycle(w)
        for i in range(WARMUP):
            cycle(i)
        samples = host_growth(cycle, CYCLES, WARMUP, dev)
        print(f"(heap, RSS) growth every {SAMPLE_EVERY:,} cycles (bytes): {samples}")
        assert max(h for h, _ in samples) < HEAP_BOUND and max(r for _, r in samples) < RSS_BOUND, samples
        assert traced_growth(cycle, TRACED_CYCLES, WARMUP + CYCLES) < TRACED_BOUND
        w.close()
    assert counts(dev) == ({"device": 0, "pinned": 0, "modules": 0}, {"contexts": 0, "streams": 0, "events": 0})


def test_a_leak_would_be_seen():
    # The measurements above can fail: a cycle that keeps 48 bytes of Python memory is caught by the traced
    # window; one that leaks 16 bytes of C heap (invisible to tracemalloc, and to RSS while malloc has freed
    # memory to hand out) by the heap samples; one that maps a page and keeps it, by the RSS samples.
    kept = []
    assert traced_growth(lambda i: kept.append(bytes(48)), TRACED_CYCLES) > TRACED_BOUND
    _LIBC.malloc.restype, _LIBC.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    leaked = (ctypes.c_void_p * CYCLES)()  # allocated before the first sample: the addresses add nothing

    def leak(i):
        leaked[i] = _LIBC.malloc(16)

    try:
        assert max(h for h, _ in host_growth(leak, CYCLES)) >= HEAP_BOUND
    finally:
        for p in leaked:
            _LIBC.free(p)
    pages = []

    def map_a_page(i):
        pages.append(mmap.mmap(-1, mmap.PAGESIZE))
        pages[-1][0] = 1  # touched: resident

    try:  # SAMPLE_EVERY pages: 8 MiB
        assert max(r for _, r in host_growth(map_a_page, SAMPLE_EVERY)) >= RSS_BOUND
    finally:
        for m in pages:
            m.close()


def test_close_and_context_managers_release_everything():
    dev = open_device("emu", deferred=True)
    drv = dev.driver
    with ScratchArena(dev, 1 << 16) as arena:
        assert arena.guard_intact()
    assert drv.live_allocations()["device"] == 0
    w = World.build(dev, mode="per_stream")
    extra_stream, extra_event = dev.new_stream(), dev.event(timing=True)
    extra_event.record(extra_stream)
    dev.pinned(4096)
    handles = drv.live_handles()
    assert handles["streams"] == 2 and handles["events"] >= 3 + 16 + 1 and handles["contexts"] == 1
    assert drv.live_allocations()["modules"] == 4 and drv.live_allocations()["pinned"] >= 3
    w.close()
    assert drv.live_allocations()["pinned"] == 1  # the rings' memory went with the arena
    with dev:
        pass
    assert dev.closed
    assert drv.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}
    assert drv.live_handles() == {"contexts": 0, "streams": 0, "events": 0}
    dev.close()  # idempotent
    try:
        dev.alloc(16)
    except Q12Error as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a closed device allocated")


def _run(code: str, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), Q12DRV_DRIVER="emu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(REPO))


EXIT_WITHOUT_CLOSE = """
    import atexit, sys

    seen = {}

    def after_q12drv():  # registered before q12drv's hook, so it runs after it
        import q12drv.core.device as d
        drv = seen["driver"]
        print("open devices:", len(d._OPEN_DEVICES), drv.live_allocations(), drv.live_handles())

    atexit.register(after_q12drv)

    from q12drv import open_device
    from tests.reliability import World

    dev = open_device("emu", deferred=sys.argv[1] == "deferred")
    seen["driver"] = dev.driver
    w = World.build(dev, run_layers=sys.argv[1] == "deferred")   # staged, layers queued, nothing closed
    w.q12.h_slot.upload(w.state_ptrs())
    print("staged", w.q12.meta.staged_bytes)
"""


def test_exit_without_close_is_clean():
    for mode in ("immediate", "deferred"):
        proc = _run(EXIT_WITHOUT_CLOSE, mode)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""
        lines = proc.stdout.strip().splitlines()
        assert lines[0].startswith("staged ")
        assert lines[-1] == ("open devices: 0 {'device': 0, 'pinned': 0, 'modules': 0} "
                             "{'contexts': 0, 'streams': 0, 'events': 0}"), proc.stdout


def test_without_the_atexit_hook_the_exit_check_sees_the_leak():
    # The check above can fail: with the hook unregistered nothing is released at exit.
    code = EXIT_WITHOUT_CLOSE.replace("from q12drv import open_device",
                                      "from q12drv import open_device\n    import q12drv.core.device as _d\n"
                                      "    atexit.unregister(_d._close_open_devices)")
    proc = _run(code, "immediate")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("open devices: 1 {'device': 15")


def test_the_arena_numbers_stay_exact_across_cycles():
    # A cheap cross-check of the cycle itself: after many cycles the staged bytes still verify.
    from q12drv.core.staging import verify_readback

    with open_device("emu") as dev:
        w = World.build(dev)
        cycle = make_cycle(w)
        for i in range(2500):
            cycle(i)
        meta = stage_batched_attn_metadata(w.arena, w.streams, block_size=16, use_mrope=True,
                                           scratch_offset_bytes=w.arena.cursor, dummy_kv_block=0)
        assert verify_readback(w.arena.read(meta.scratch_offset_bytes, meta.staged_bytes), meta, w.streams) == []
        assert np.frombuffer(w.arena.read(w.plan.jit_slot.offset, 24), np.uint64).tolist() == \
            [p + 64 * (2499 % 5) for p in w.state_ptrs()]
        w.close()
