"""One comparison run as its sections see it: the device, the options, the results being filled in, and the
helpers every section uses to add table rows, record a failed comparator and size its repetitions."""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any, Callable

from bench.inputs import on_gpu
from bench.timing import cold_sets

__all__ = ["Context", "D2D_TBPS", "HBM_TBPS", "faster", "torch_mod"]

#: H200 device-to-device copy, read + write (measured: bench/RESULTS.md): the KV write's and RoPE's floor.
D2D_TBPS = 4.23
#: H200 HBM3e peak bandwidth (the data sheet's 4.8 TB/s): the short convolution's floor.
HBM_TBPS = 4.8


def faster(k: float) -> tuple:
    """Goal: q12drv at least ``k`` times faster (ratio <= 1/k)."""
    return ("<=", 1.0 / k)


def torch_mod():
    """``torch``, with a CUDA device (RuntimeError without one)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return torch


class Context:
    """A run of ``bench/gpu_compare.py``: what every section reads and writes.

    Parameters
    ----------
    dev : q12drv.Device
        The device every section measures on.
    quick : bool
        Fewer repetitions and curve points.
    budget_s : float
        Seconds after ``t0`` past which no new work starts.
    t0 : float, optional
        The run's start (``time.perf_counter``); default now.

    Attributes
    ----------
    results : dict
        The JSON the run writes: ``meta`` (the environment), ``sections`` (every measurement, by section),
        ``errors`` (name -> what failed) and ``table`` (the rows, in order).
    """

    def __init__(self, dev, *, quick: bool = False, budget_s: float = 80.0, t0: float | None = None):
        self.dev, self.quick, self.budget_s = dev, quick, budget_s
        self.t0 = time.perf_counter() if t0 is None else t0
        self.results: dict = {"meta": {}, "sections": {}, "errors": {}, "table": []}

    @property
    def gpu(self) -> bool:
        """Whether the run is on the real driver (else the emulator: tiny shapes, no torch comparators)."""
        return on_gpu(self.dev)

    def elapsed_s(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t0

    def reps(self, n_gpu: int, n_emu: int = 2) -> int:
        """Repetitions: ``n_gpu`` on the GPU (a quarter, at least 3, with ``quick``), ``n_emu`` on the emulator."""
        return (max(3, n_gpu // 4) if self.quick else n_gpu) if self.gpu else n_emu

    def cold_sets(self, bytes_per_set: int) -> int:
        """Buffer sets to rotate among so the bytes touched between two uses of a set exceed 3x L2 (two on the
        emulator)."""
        return cold_sets(bytes_per_set) if self.gpu else 2

    def section(self, name: str, value: Any) -> Any:
        """Record ``value`` as section ``name``'s measurements (``results["sections"][name]``) and return it."""
        self.results["sections"][name] = value
        return value

    def error(self, name: str, text: str) -> None:
        """Record a failure (``results["errors"][name]``) without stopping the run."""
        self.results["errors"][name] = text

    def row(self, name: str, ours, comparator: str, theirs, goal: tuple | None = None, note: str = "") -> None:
        """A table row: times in us; ``goal`` is (op, value) on the ratio q12drv / comparator, e.g. ("<=", 1.05)."""
        ratio = ours / theirs if (ours is not None and theirs) else None
        met = None
        if goal is not None and ratio is not None:
            op, value = goal
            met = ratio <= value if op == "<=" else ratio >= value
        self.results["table"].append({"name": name, "q12drv_us": ours, "comparator": comparator,
                                      "comparator_us": theirs, "ratio": ratio,
                                      "goal": None if goal is None else f"{goal[0]} {goal[1]:g}", "met": met,
                                      "note": note})

    def comparator(self, name: str, fn: Callable[[], Any]) -> None:
        """Run one comparator; record its error (and print its traceback) instead of losing the section."""
        try:
            fn()
        except Exception as exc:
            self.error(name, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            print(traceback.format_exc(), file=sys.stderr, flush=True)

    def memory_rows(self, name: str, res: dict, key: str, floor_bytes: int, goal_fraction: float | None,
                    tbps: float = D2D_TBPS, of: str = "D2D") -> None:
        """A memory-bound kernel's row against its byte floor: ``res[key]`` (us) against ``floor_bytes`` moved at
        ``tbps`` TB/s; ``res`` gains ``*_tbps`` and ``*_fraction`` (of ``tbps``). ``goal_fraction``: the fraction of
        the floor's speed to reach (the goal is on the time: ratio <= 1 / fraction); ``of`` names ``tbps`` in the
        note."""
        us = res.get(key)
        if us is None:
            return
        achieved = floor_bytes / (us * 1e-6) / 1e12
        res[key.replace("_us", "_tbps")] = achieved
        res[key.replace("_us", "_fraction")] = achieved / tbps
        self.row(name, us, f"floor: {floor_bytes / 1e6:,.0f} MB at {tbps} TB/s", floor_bytes / (tbps * 1e12) * 1e6,
                 ("<=", 1.0 / goal_fraction) if goal_fraction else None,
                 note=f"{achieved:.2f} TB/s = {achieved / tbps:.1%} of {of}")
