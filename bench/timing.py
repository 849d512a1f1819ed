"""Device time of a call from events recorded around it: the one timing loop the GPU scripts share.

Used by ``bench/gpu_compare.py`` (q12drv and the torch comparators), ``bench/fla_gdn.py`` (fla-core, in its own
process), ``tests/gpu/rope_variants.py`` and ``tests/gpu/gdn_debug.py``. torch is passed in, so importing this module needs
neither torch nor a GPU.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

__all__ = ["torch_events_us", "q12_events_us"]


def _median_us(start, end, elapsed_ms, sync, fn, reps: int, warmup: int) -> float:
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(elapsed_ms() * 1e3)
    return float(statistics.median(times))


def torch_events_us(torch: Any, fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median device time of ``fn()`` in microseconds, from CUDA events recorded around each call.

    Parameters
    ----------
    torch : module
        The ``torch`` module (with CUDA).
    fn : callable
        Enqueues the work on torch's current stream.
    reps : int
        Timed calls (>= 1), each waited for before the next.
    warmup : int
        Untimed calls first (compilation, autotuning, caches).
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    return _median_us(start, end, lambda: start.elapsed_time(end), torch.cuda.synchronize, fn, reps, warmup)


def q12_events_us(dev: Any, fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """:func:`torch_events_us` for work on a q12drv :class:`~q12drv.device.Device`'s stream, from its events
    (on the emulated driver too)."""
    start, end = dev.event(timing=True), dev.event(timing=True)
    try:
        return _median_us(start, end, lambda: start.elapsed_ms(end), dev.synchronize, fn, reps, warmup)
    finally:
        start.destroy()
        end.destroy()
