"""Where the host time of a pass goes: cProfile over q12drv's host paths, on the real driver or the emulator.

Profiles, each over ``--reps`` repetitions after a warm-up, with the stream drained before each
repetition (as in the step benchmark):

* ``staging``: 8 x 2048 MRoPE tokens staged with the device expansion (``stage_on_device``);
* ``planned``: the same pass through an :class:`~q12drv.kernels.expand.ExpandPlan` made once
  (``StagingCase.planned``: ``arena.reset()`` and ``plan.stage(starts, counts)``);
* ``step``: one Qwen3-Next-like step over 8 x 128 tokens (``Q12Pass`` + one attention layer + one
  Gated DeltaNet layer), batched and per stream.

For each it prints the median wall time per repetition without the profiler, then the functions
with the most internal time under it (the profiler inflates small functions; read the ranking,
not the absolute numbers). On the emulated driver the kernels run as numpy: pass ``--stub`` to
replace the driver's copies and launches by no-ops there, leaving q12drv's Python alone.

    python3 bench/profile_host.py                     # the GPU when there is one
    Q12DRV_DRIVER=emu python3 bench/profile_host.py --stub --top 25
    Q12DRV_DRIVER=emu python3 bench/profile_host.py --stub --top 25 --only planned --reps 2000
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import inputs  # noqa: E402


def _median_us(fn, sync, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def _profile(name: str, fn, sync, reps: int, top: int) -> None:
    for _ in range(min(reps, 20)):  # warm-up: caches, compiled modules, pinned ring slots
        fn()
    sync()
    wall = _median_us(fn, sync, reps)
    prof = cProfile.Profile()
    for _ in range(reps):
        sync()
        prof.enable()
        fn()
        prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    print(f"\n== {name}: median {wall:.1f} us per call without the profiler ({reps} calls); top {top} by internal time")
    print("\n".join(lines[start:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="repetitions per profile (default 200)")
    ap.add_argument("--top", type=int, default=20, help="functions listed per profile (default 20)")
    ap.add_argument("--stub", action="store_true", help="emulator only: no-op copies and launches")
    ap.add_argument("--only", choices=("staging", "planned", "step"), help="run one profile")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.top < 1:
        ap.error("--reps and --top must be >= 1")
    dev = inputs.open_bench_device()
    gpu = inputs.on_gpu(dev)
    if args.stub:
        if gpu:
            ap.error("--stub replaces the emulated driver's work; it cannot stub a real GPU")
        inputs.stub_driver(dev)
    print(f"device: {dev.name} ({dev.driver.name}){' with copies and launches stubbed' if args.stub else ''}")
    sync = dev.synchronize
    if args.only in (None, "staging", "planned"):
        case = inputs.StagingCase(dev, 8, 2048 if gpu or args.stub else 256)
        try:
            if args.only in (None, "staging"):
                _profile(f"staging {case.n}x{case.tokens} MRoPE, device expansion", case.device, sync, args.reps,
                         args.top)
            if args.only in (None, "planned"):
                _profile(f"staging {case.n}x{case.tokens} MRoPE, ExpandPlan.stage", case.planned, sync, args.reps,
                         args.top)
        finally:
            case.close()
    if args.only in (None, "step"):
        step = inputs.StepCase(dev, inputs.step_counts("8x128", gpu or args.stub))
        try:
            for mode in ("batched", "per_stream"):
                _profile(f"step 8x128 {mode} (Q12Pass + attention layer + GDN layer)",
                         lambda mode=mode: step.run(mode), sync, args.reps, args.top)
        finally:
            step.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
