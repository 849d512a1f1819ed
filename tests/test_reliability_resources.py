"""Resource hygiene: 100,000 stage/upload/launch cycles with flat host memory and flat driver
counts; everything released by close() and the context managers; a program that exits without
closing its device exits cleanly (the atexit hook closes it)."""

from __future__ import annotations

import gc
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
CYCLES = 100_000
SAMPLE_EVERY = 10_000
WARMUP = 5_000
RSS_BOUND = 4 << 20         # bytes the process may grow by over the 100,000 cycles (after warm-up)
TRACED_BOUND = 128 << 10     # bytes Python objects may grow by over a traced window (after warm-up)


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


def test_100k_cycles_keep_host_memory_and_driver_counts_flat():
    with open_device("emu") as dev:
        w = World.build(dev)
        cycle = make_cycle(w)
        for i in range(WARMUP):
            cycle(i)
        assert traced_growth(cycle, 3000, WARMUP) < TRACED_BOUND
        gc.collect()
        base_rss, base_counts = rss(), counts(dev)
        samples = []
        for i in range(CYCLES):
            cycle(i)
            if (i + 1) % SAMPLE_EVERY == 0:
                samples.append(rss() - base_rss)
                assert counts(dev) == base_counts, f"driver counts changed after {i + 1} cycles"
        print(f"RSS growth every {SAMPLE_EVERY:,} cycles (bytes): {samples}")
        assert max(samples) < RSS_BOUND, samples
        w.close()
    assert counts(dev) == ({"device": 0, "pinned": 0, "modules": 0}, {"contexts": 0, "streams": 0, "events": 0})


def test_a_leak_would_be_seen():
    # The measurement above can fail: a cycle that keeps 200 bytes per call is caught.
    kept = []
    assert traced_growth(lambda i: kept.append(bytes(200)), 3000) > TRACED_BOUND


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
