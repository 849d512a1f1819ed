"""The timing loops the benchmarks share: device time from events recorded around a call, host time and round
trip of interleaved paths, host time per call in batches.

Used by ``bench/gpu_compare.py``'s sections (q12drv and the torch comparators), ``bench/breakdown.py``,
``bench/fla_gdn.py`` (fla-core, in its own process), the pytest-benchmark suites and the GPU tests. torch is passed
in, so importing this module needs neither torch nor a GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["torch_events_us", "q12_events_us", "host_and_round_trip", "per_call_batches", "round_trip", "BATCH",
           "L2_BYTES", "cold_sets", "DeviceClock"]


#: Bytes a kernel's inputs must exceed, rotated, to time it with a cold L2: the H200's 50 MiB, with margin.
L2_BYTES = 60 * 2**20


def cold_sets(bytes_per_set: int, l2_bytes: int = L2_BYTES) -> int:
    """Buffer sets to rotate among (2..8) so the bytes touched between two uses of a set exceed 3x L2."""
    return max(2, min(8, -(-3 * l2_bytes // max(int(bytes_per_set), 1))))


#: Calls between one pair of events. With one, the host's work for the call (argument checks, packing,
#: the launch itself: 5-15 us on the H200's VM) falls between the events while the device idles and is
#: counted as device time; with several back to back, the device is still busy with one call while the
#: host prepares the next, and that work is paid once per ``batch`` calls.
BATCH = 8


def _median_us(start, end, elapsed_ms, sync, fn, reps: int, warmup: int, batch: int) -> float:
    if reps < 1 or warmup < 0 or batch < 1:
        raise ValueError(f"need reps >= 1, warmup >= 0 and batch >= 1, got reps={reps}, warmup={warmup}, "
                         f"batch={batch}")
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(elapsed_ms() * 1e3 / batch)
    return float(statistics.median(times))


def torch_events_us(torch: Any, fn: Callable[[], Any], reps: int, warmup: int = 3, batch: int = BATCH) -> float:
    """Median device time of ``fn()`` in microseconds, from CUDA events recorded around ``batch`` calls
    back to back (the time divided by ``batch``; see :data:`BATCH`). ``fn`` that rotates its inputs
    through buffer sets larger than L2 stays cold-L2 call after call.

    Parameters
    ----------
    torch : module
        The ``torch`` module (with CUDA).
    fn : callable
        Enqueues the work on torch's current stream.
    reps : int
        Timed batches (>= 1), each waited for before the next.
    warmup : int
        Untimed calls first (compilation, autotuning, caches).
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    return _median_us(start, end, lambda: start.elapsed_time(end), torch.cuda.synchronize, fn, reps, warmup, batch)


def q12_events_us(dev: Any, fn: Callable[[], Any], reps: int, warmup: int = 3, batch: int = BATCH) -> float:
    """:func:`torch_events_us` for work on a q12drv :class:`~q12drv.core.device.Device`'s stream, from its events
    (on the emulated driver too)."""
    start, end = dev.event(timing=True), dev.event(timing=True)
    try:
        return _median_us(start, end, lambda: start.elapsed_ms(end), dev.synchronize, fn, reps, warmup, batch)
    finally:
        start.destroy()
        end.destroy()


def host_and_round_trip(paths: dict, reps: int, sync: Callable[[], Any], warmup: int = 3) -> dict:
    """Per path (name -> a call that enqueues and returns): median host time of the call and median round trip
    (the call and ``sync()``), in microseconds, the paths interleaved, each call after an idle-stream ``sync()``:
    ``{name: {"host_us": ..., "round_trip_us": ...}}``. ``warmup`` untimed calls of each first."""
    host = {name: [] for name in paths}
    rt = {name: [] for name in paths}
    for fn in paths.values():
        for _ in range(warmup):
            fn()
            sync()
    pc = time.perf_counter
    for _ in range(reps):
        for name, fn in paths.items():
            sync()
            t0 = pc()
            fn()
            t1 = pc()
            sync()
            t2 = pc()
            host[name].append((t1 - t0) * 1e6)
            rt[name].append((t2 - t0) * 1e6)
    return {name: {"host_us": float(statistics.median(host[name])), "round_trip_us": float(statistics.median(rt[name]))}
            for name in paths}


def per_call_batches(paths: dict, batch: int, batches: int, sync: Callable[[], Any]) -> dict:
    """Median host time per call (us) of each zero-argument callable, timed in ``batches`` batches of ``batch``
    calls, the paths interleaved batch by batch (drift hits all alike), ``sync()`` before each batch; a warm-up of
    ``min(batch, 20)`` calls of each first."""
    out = {name: [] for name in paths}
    for fn in paths.values():  # warm-up
        for _ in range(min(batch, 20)):
            fn()
    sync()
    pc = time.perf_counter
    for _ in range(batches):
        for name, fn in paths.items():
            sync()
            t0 = pc()
            for _ in range(batch):
                fn()
            out[name].append((pc() - t0) / batch * 1e6)
    sync()
    return {name: float(statistics.median(v)) for name, v in out.items()}


def round_trip(dev: Any, fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` then a wait for ``dev``'s stream: what one call costs until its work is done."""
    def run():
        fn()
        dev.synchronize()
    return run


class DeviceClock:
    """A pytest-benchmark timer that reads device time: the sum of the event-measured device times of the calls
    :meth:`timed` wrapped so far (seconds). Between two readings around one call, pytest-benchmark sees that call's
    device time, so its statistics, ``--benchmark-compare`` and ``--benchmark-json`` hold kernel times.

    Use it as the marker's timer (``pytest.mark.benchmark(timer=clock)``) with ``benchmark.pedantic`` (no
    calibration, which would wait for a clock that does not run by itself), the target wrapped by :meth:`timed`.
    """

    __name__ = "DeviceClock"  # how pytest-benchmark names the timer in its reports

    def __init__(self) -> None:
        self.total = 0.0
        self._events: list = []

    def __call__(self) -> float:
        return self.total

    def timed(self, dev: Any, fn: Callable[[], Any], batch: int = BATCH) -> Callable[[], None]:
        """``fn`` as a benchmark target: ``batch`` calls back to back between two events on ``dev``'s stream (see
        :data:`BATCH`), waited for; the clock advances by their device time over ``batch``."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        start, end = dev.event(timing=True), dev.event(timing=True)
        self._events += (start, end)

        def run() -> None:
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            self.total += start.elapsed_ms(end) * 1e-3 / batch

        return run

    def close(self) -> None:
        """Destroy the events :meth:`timed` made."""
        while self._events:
            self._events.pop().destroy()
