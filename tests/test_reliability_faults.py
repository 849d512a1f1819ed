"""Fault injection through the emulated driver: every driver call a pass makes is made to fail in turn.

For each call site (arena creation, staging, the pinned rings' growth and waits, the per-layer
``h_state_ptrs`` uploads, module loads and launches in the layers, the dump's read-back), the
sweep checks that

* the error reaches the caller as :class:`~q12drv.core.errors.CudaError` with the injected CUDA name
  and the call that failed;
* the arena's reservations and cursor are consistent, no ring slot holds freed memory or a guard
  event for a copy that never ran, and the guard band is intact;
* a retry on the same arena succeeds, verifies with :func:`q12drv.core.staging.verify_readback`, gives
  bit-identical layer outputs to a run without faults, and its dump inspects clean;
* nothing leaks: after ``close()`` every allocation, module, context, stream and event is gone.
"""

from __future__ import annotations

import numpy as np
import pytest

from q12drv import CudaError, HostRaceError, ScratchArena, open_device
from q12drv.core.staging import verify_readback
from q12drv.core.device import Device
from q12drv.tools.dump import dump_pass
from q12drv.core.driver import EmuDriver
from q12drv.tools.inspect import inspect_dump
from q12drv.core.pinned import PinnedRing
from q12drv.core.staging import staging_ring
from tests.reliability import FUSED, GDN, World

#: The CUresult each call fails with (the most plausible real one; CUDA_ERROR_UNKNOWN otherwise).
FAULT_NAMES = {
    "cuMemAlloc": "CUDA_ERROR_OUT_OF_MEMORY",
    "cuMemHostAlloc": "CUDA_ERROR_OUT_OF_MEMORY",
    "cuLaunchKernel": "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    "cuModuleLoadData": "CUDA_ERROR_NO_BINARY_FOR_GPU",
    "cuModuleGetFunction": "CUDA_ERROR_NOT_FOUND",
    "cuStreamSynchronize": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "cuEventSynchronize": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "cuEventRecord": "CUDA_ERROR_INVALID_HANDLE",
    "cuEventCreate": "CUDA_ERROR_OUT_OF_MEMORY",
    "cuMemcpyHtoDAsync": "CUDA_ERROR_INVALID_VALUE",
    "cuMemcpyDtoHAsync": "CUDA_ERROR_INVALID_VALUE",
}
#: Releases are not swept: they run in close() paths, which report but never stop releasing.
RELEASES = {"cuMemFree", "cuMemFreeHost", "cuEventDestroy", "cuStreamDestroy", "cuModuleUnload",
            "cuDevicePrimaryCtxRelease"}
PASSES = 4         # more passes than the staging ring has slots, so slots are waited for and reused
UPLOADS = 5        # per pass: 20 uploads > the h_state ring's 16 slots


def assert_no_leaks(driver: EmuDriver) -> None:
    assert driver.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}
    assert driver.live_handles() == {"contexts": 0, "streams": 0, "events": 0}


def check_rings(arena: ScratchArena) -> None:
    """No slot holds freed pinned memory; the next index is in range."""
    owned = arena.device._owned
    for key in ("ring:staging", "ring:h_state"):
        ring = arena.find_attachment(key)
        if ring is None:
            continue
        assert 0 <= ring._next < ring.nslots
        for slot in ring.slots:
            if slot.buffer is not None:
                assert slot.buffer.addr != 0 and any(o is slot.buffer for o in owned), f"{key} slot {slot.index} holds freed memory"
            assert slot.event.raw is not None


def check_consistent(arena: ScratchArena) -> None:
    arena.check_consistent()
    check_rings(arena)
    assert arena.guard_intact()


def scenario(w: World, arena: ScratchArena, mode: str, tmp_path):
    """Stage PASSES passes with UPLOADS JIT-slot uploads each, run both layers on the last, dump it."""
    w.arena = arena
    for i in range(PASSES):
        q12 = w.new_pass(mode)
        for layer in range(UPLOADS):
            q12.h_slot.upload([w.p("states") + 4096 * ((i * UPLOADS + layer + b) % 7) for b in range(len(w.streams))])
    w.run_layers(q12)
    path = dump_pass(q12, tmp_path / f"{mode}.npz", num_blocks=w.num_blocks)
    return q12, path


def verify(w: World, q12, path, reference: dict) -> None:
    if q12.batched:
        meta = q12.meta
        assert verify_readback(w.arena.read(meta.scratch_offset_bytes, meta.staged_bytes), meta, w.streams) == []
    else:
        for b, meta in enumerate(q12.stream_meta):
            raw = w.arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
            assert verify_readback(raw, meta, [w.streams[b]]) == []
    slot = np.frombuffer(w.arena.read(q12.h_slot.offset, 8 * len(w.streams)), np.uint64)
    assert [int(x) for x in slot] == w.state_ptrs()  # the gdn layer's upload was the last
    out = w.outputs()
    for k, data in reference.items():
        assert out[k] == data, f"{k} differs from the fault-free run"
    report = inspect_dump(path)
    assert report.ok, report.format()


def fresh_world(deferred: bool) -> World:
    dev = open_device("emu", deferred=deferred)
    return World.build(dev, run_layers=False)


def clean_run(mode: str, deferred: bool, tmp_path):
    w = fresh_world(deferred)
    cap = w.arena.capacity
    w.arena.close()
    w.dev.driver.start_trace()
    arena = ScratchArena(w.dev, cap)
    q12, path = scenario(w, arena, mode, tmp_path)
    w.dev.synchronize()
    trace = w.dev.driver.stop_trace()
    reference = w.outputs()
    verify(w, q12, path, reference)
    arena.close()
    w.dev.close()
    assert_no_leaks(w.dev.driver)
    return cap, trace, reference


def fault_points(trace: list) -> list:
    """(call, occurrence) for every call in the trace that is not a release."""
    seen: dict = {}
    points = []
    for call in trace:
        k = seen.get(call, 0)
        seen[call] = k + 1
        if call not in RELEASES:
            points.append((call, k))
    return points


_CLEAN: dict = {}


def _clean(mode, deferred, tmp_path_factory):
    key = (mode, deferred)
    if key not in _CLEAN:
        _CLEAN[key] = clean_run(mode, deferred, tmp_path_factory.mktemp(f"clean-{mode}-{deferred}"))
    return _CLEAN[key]


def sweep_point(mode: str, deferred: bool, cap: int, reference: dict, call: str, k: int, tmp_path) -> str | None:
    """Fail the k-th ``call`` of the scenario; check the error, the state, a retry and leaks.

    Returns what went wrong with the error itself (None when it reached the caller correctly);
    the state, retry and leak checks assert directly.
    """
    name = FAULT_NAMES.get(call, "CUDA_ERROR_UNKNOWN")
    w = fresh_world(deferred)
    w.arena.close()
    drv = w.dev.driver
    buffers = drv.live_allocations()["device"]
    drv.inject_fault(call, name, after=k)
    arena, problem = None, None
    try:
        arena = ScratchArena(w.dev, cap)
        scenario(w, arena, mode, tmp_path)
        w.dev.synchronize()
    except CudaError as exc:
        if (exc.name, exc.call) != (name, call):
            problem = f"{call}#{k}: got {exc.name} from {exc.call}"
    except Exception as exc:  # anything but the CudaError is a bug
        problem = f"{call}#{k}: {type(exc).__name__}: {exc}"
    else:
        problem = f"{call}#{k}: the fault did not reach the caller"
    assert drv.pending_faults() == [], f"{call}#{k} never fired"
    if arena is not None:
        check_consistent(arena)
    else:
        assert drv.live_allocations()["device"] == buffers, f"{call}#{k}: the failed arena leaked its allocation"
    # retry on the same arena (a new one if creating it failed)
    arena = arena or ScratchArena(w.dev, cap)
    w.upload_inputs()
    q12, path = scenario(w, arena, mode, tmp_path)
    verify(w, q12, path, reference)
    check_consistent(arena)
    arena.close()
    w.dev.close()
    assert_no_leaks(drv)
    return problem


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_every_call_site_fails_cleanly_and_a_retry_succeeds(mode, deferred, tmp_path, tmp_path_factory):
    cap, trace, reference = _clean(mode, deferred, tmp_path_factory)
    points = fault_points(trace)
    calls = {c for c, _ in points}
    # the sweep reaches every kind of call site
    for call in ("cuMemAlloc", "cuMemsetD8Async", "cuMemHostAlloc", "cuMemcpyHtoDAsync", "cuEventRecord",
                 "cuEventCreate", "cuEventQuery", "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel",
                 "cuMemcpyDtoHAsync", "cuStreamSynchronize"):
        assert call in calls, f"the scenario never calls {call}"
    if deferred:
        assert "cuEventSynchronize" in calls  # a ring slot was waited for
    failures = [p for call, k in points if (p := sweep_point(mode, deferred, cap, reference, call, k, tmp_path))]
    assert not failures, "\n".join(failures)


def test_the_sweep_would_see_a_swallowed_error(tmp_path, monkeypatch, tmp_path_factory):
    # If a layer swallowed a launch failure, the sweep must report it.
    from q12drv.prefill import Q12Pass

    cap, trace, reference = _clean("batched", False, tmp_path_factory)
    real = Q12Pass.gdn_layer

    def swallowing(self, *a, **kw):
        try:
            real(self, *a, **kw)
        except CudaError:
            pass

    monkeypatch.setattr(Q12Pass, "gdn_layer", swallowing)
    last = trace.count("cuLaunchKernel") - 1  # the gdn launch
    assert sweep_point("batched", False, cap, reference, "cuLaunchKernel", last, tmp_path) == (
        f"cuLaunchKernel#{last}: the fault did not reach the caller")
    monkeypatch.setattr(Q12Pass, "gdn_layer", real)
    assert sweep_point("batched", False, cap, reference, "cuLaunchKernel", last, tmp_path) is None


# --- targeted regressions ---------------------------------------------------------------------

def test_device_open_failure_releases_the_context():
    for call in ("cuStreamCreate", "cuDevicePrimaryCtxRetain"):
        drv = EmuDriver()
        drv.inject_fault(call, "CUDA_ERROR_OUT_OF_MEMORY")
        with pytest.raises(CudaError) as info:
            Device(drv)
        assert info.value.call == call
        assert drv.live_handles() == {"contexts": 0, "streams": 0, "events": 0}
        dev = Device(drv)  # the retry works
        dev.close()
        assert_no_leaks(drv)


@pytest.mark.parametrize("call", ["cuMemAlloc", "cuMemsetD8Async", "cuStreamSynchronize"])
@pytest.mark.parametrize("deferred", [False, True])
def test_arena_creation_failure_frees_the_allocation(call, deferred):
    with open_device("emu", deferred=deferred) as dev:
        dev.driver.inject_fault(call, "CUDA_ERROR_OUT_OF_MEMORY")
        with pytest.raises(CudaError) as info:
            ScratchArena(dev, 1 << 16)
        assert info.value.call == call
        assert dev.driver.live_allocations()["device"] == 0 and dev.buffers == ()
        with ScratchArena(dev, 1 << 16) as arena:
            assert arena.guard_intact()
    assert_no_leaks(dev.driver)


def test_ring_growth_failure_leaves_no_slot_on_freed_memory():
    with open_device("emu") as dev:
        ring = PinnedRing(dev, 2, "t")
        small = ring.acquire(100)
        ring.commit(small, dev.stream.raw)
        ring.acquire(100)
        assert dev.driver.live_allocations()["pinned"] == 2
        dev.driver.inject_fault("cuMemHostAlloc", "CUDA_ERROR_OUT_OF_MEMORY")
        with pytest.raises(CudaError):
            ring.acquire(1 << 20)  # slot 0 must grow: its old buffer is freed, the new one fails
        assert ring.slots[0].buffer is None  # not the freed buffer
        assert dev.driver.live_allocations()["pinned"] == 1
        slot = ring.acquire(1 << 20)  # the retry gets slot 0 again, freshly allocated
        assert slot.index == 0 and slot.buffer.nbytes >= 1 << 20
        slot.array[:] = 7  # usable
        ring.close()
    assert_no_leaks(dev.driver)


def test_a_copy_that_failed_to_enqueue_leaves_its_slot_free():
    w = fresh_world(True)
    w.q12 = w.new_pass()
    ring = staging_ring(w.arena)
    assert w.arena.cursor > 0
    index = ring._next  # the slot the next pass packs into
    w.dev.driver.inject_fault("cuMemcpyHtoDAsync", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(CudaError):
        w.new_pass()
    assert ring.slots[index].buffer is not None and not ring.slots[index].pending
    assert w.arena.cursor == 0 and w.arena.regions == ()  # a failed pass leaves the arena empty
    q12 = w.new_pass()
    w.dev.synchronize()
    assert verify_readback(w.arena.read(q12.meta.scratch_offset_bytes, q12.meta.staged_bytes), q12.meta, w.streams) == []
    w.arena.close()
    w.dev.close()
    assert_no_leaks(w.dev.driver)


@pytest.mark.parametrize("also_sync", [False, True], ids=["record fails", "record and sync fail"])
def test_a_failed_guard_event_never_lets_the_slot_be_rewritten_early(also_sync):
    # Deferred mode: the copy is enqueued, recording its guard event fails. Without a fallback
    # the slot would look free and the next passes would rewrite it under the pending copy.
    w = fresh_world(True)
    drv = w.dev.driver
    q12 = w.new_pass()
    drv.inject_fault("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE")
    if also_sync:
        drv.inject_fault("cuStreamSynchronize", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(CudaError) as info:
        q12.h_slot.upload(w.state_ptrs())
    assert info.value.call == "cuEventRecord"
    assert drv.pending_faults() == []
    for i in range(40):  # far more uploads than ring slots, no host sync
        q12.h_slot.upload([p + 64 * i for p in w.state_ptrs()])
    w.dev.synchronize()  # a rewritten pending slot would raise HostRaceError here
    got = np.frombuffer(w.arena.read(q12.h_slot.offset, 24), np.uint64)
    assert [int(x) for x in got] == [p + 64 * 39 for p in w.state_ptrs()]
    ring = w.arena.find_attachment("ring:h_state")
    assert (len(ring._quarantine) == 1) == also_sync
    w.arena.close()
    w.dev.close()
    assert_no_leaks(drv)


def test_without_the_guard_event_fallback_the_race_is_caught(monkeypatch):
    # The test above can fail: with commit() marking nothing and waiting for nothing, the same
    # sequence rewrites a pending slot and the deferred driver reports it.
    def bare_commit(self, slot, stream):
        self.device.driver.event_record(slot.event.raw, stream)
        slot.pending = True

    monkeypatch.setattr(PinnedRing, "commit", bare_commit)
    w = fresh_world(True)
    q12 = w.new_pass()
    w.dev.driver.inject_fault("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE")
    with pytest.raises(CudaError):
        q12.h_slot.upload(w.state_ptrs())
    with pytest.raises(HostRaceError):
        for i in range(40):
            q12.h_slot.upload([p + 64 * i for p in w.state_ptrs()])
        w.dev.synchronize()
    w.dev.driver._drain(w.dev.stream.raw)


def test_a_failed_layer_launch_changes_nothing_it_did_not_launch():
    # The gdn layer's launch fails: the JIT slot was uploaded, the states are untouched.
    w = fresh_world(False)
    w.q12 = w.new_pass()
    before = w.outputs()
    w.dev.driver.inject_fault("cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED")
    gargs = w.gdn_args()
    with pytest.raises(CudaError) as info:
        w.q12.gdn_layer(*gargs, GDN, config=FUSED)
    assert info.value.name == "CUDA_ERROR_LAUNCH_FAILED"
    assert w.outputs()["states"] == before["states"]
    w.arena.close()
    w.dev.close()
    assert_no_leaks(w.dev.driver)


def test_close_releases_everything_even_when_a_wait_fails():
    w = fresh_world(True)
    w.q12 = w.new_pass()
    w.run_layers()
    drv = w.dev.driver
    drv.inject_fault("cuStreamSynchronize", "CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(CudaError):
        w.arena.close()  # the wait reports the (injected) asynchronous error...
    assert w.arena.closed  # ...the rings were released after waiting for their own copies...
    assert drv.live_allocations()["pinned"] == 0
    assert any(b.name == "q12 scratch arena" for b in w.dev.buffers)  # ...the arena, maybe still in use, was not
    w.dev.close()  # the queued layers run against live memory, then everything is freed
    assert_no_leaks(drv)


def test_inject_fault_rejects_bad_plans():
    drv = EmuDriver()
    drv.open_context(0)
    with pytest.raises(ValueError, match="not a CUresult"):
        drv.inject_fault("cuMemAlloc", "CUDA_ERROR_NOPE")
    with pytest.raises(ValueError, match="after >= 0"):
        drv.inject_fault("cuMemAlloc", after=-1)
    drv.inject_fault("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", after=1, times=2)
    assert drv.pending_faults() == [("cuMemAlloc", 1, 2, "CUDA_ERROR_OUT_OF_MEMORY")]
    drv.mem_free(drv.mem_alloc(8))
    for _ in range(2):
        with pytest.raises(CudaError):
            drv.mem_alloc(8)
    assert drv.pending_faults() == []
    drv.start_trace()
    drv.mem_free(drv.mem_alloc(8))
    assert drv.stop_trace() == ["cuMemAlloc", "cuMemFree"]
