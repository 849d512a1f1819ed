"""What the GPU scripts of ``bench/`` (``gpu_compare.py``, ``breakdown.py``) share around their measurements: the
run's environment and commit, one section run at a time with its failure recorded, and the epilogue (JSON out, the
table printed last, the device closed)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

__all__ = ["ROOT", "commit", "environment", "run_section", "finish_run"]

#: The repository's root (the scripts run from it, and git is asked there).
ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The tree measured: ``Q12_COMMIT`` when set (``scripts/gpu_check.sh`` passes it: a device machine's copy of
    the tree may carry stale git metadata), else git's short HEAD here, else ``"unknown"``."""
    if os.environ.get("Q12_COMMIT"):
        return os.environ["Q12_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def environment(dev) -> dict:
    """The run's ``meta``: date (UTC), driver, device, architecture, versions, host, commit and whether the
    working tree differs from it (``dirty``)."""
    env = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "driver": dev.driver.name,
           "device": dev.name, "arch": dev.arch, "python": platform.python_version(), "numpy": np.__version__,
           "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    env["commit"] = commit()
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        env["dirty"] = bool(dirty)
    except Exception:
        pass
    try:
        env["driver_version"] = dev.driver.driver_version()
        import cuda.bindings

        env["cuda_bindings"] = cuda.bindings.__version__
    except Exception:
        pass
    try:
        import torch

        env["torch"] = torch.__version__
    except Exception:
        env["torch"] = None
    return env


def section_error(exc: BaseException) -> str:
    """A failed section's entry in the errors: the exception and its traceback (which also goes to stderr)."""
    tb = traceback.format_exc()
    print(tb, file=sys.stderr, flush=True)
    return f"{type(exc).__name__}: {exc}\n{tb}"


def run_section(results: dict, name: str, fn, dev) -> None:
    """One section of a GPU script: ``fn()``, its wall time printed after it; an exception is recorded as
    ``results["errors"][name] = section_error(exc)`` and the device synchronised (so the next section starts on an
    idle device), and the script goes on."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a section's failure is a row of the report, not the end of the run
        results["errors"][name] = section_error(exc)
        try:
            dev.synchronize()
        except Exception:
            pass
    print(f"   ({name}: {time.perf_counter() - t:.1f} s)", flush=True)


def finish_run(results: dict, t0: float, out, print_table, dev) -> None:
    """The GPU scripts' epilogue: the wall time since ``t0`` (``time.perf_counter``) into ``results["meta"]``, every
    measurement as JSON to ``out`` (when given), ``print_table()`` last, then the device closed (a close that fails
    changes nothing measured)."""
    results["meta"]["wall_s"] = time.perf_counter() - t0
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {out}")
    print_table()
    try:
        dev.close()
    except Exception:
        pass
