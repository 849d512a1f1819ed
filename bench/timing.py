"""Device time of a call on the current torch CUDA stream: the one event-timing loop the GPU scripts share.

Used by ``bench/gpu_compare.py`` (the torch comparators), ``bench/fla_gdn.py`` (fla-core, in its own
process) and ``tests/gpu/rope_variants.py``. torch is passed in, so importing this module needs
neither torch nor a GPU.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

__all__ = ["torch_events_us"]


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
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(statistics.median(times))
