"""The benchmarks still run: ``bench/`` with timing disabled, ``bench/gpu_compare.py`` and the plot on the
emulated driver (plumbing only: no numbers are checked, speed is never asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, Q12DRV_DRIVER="emu", Q12DRV_CACHE_DIR=str(tmp_path / "cubins"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_suites_run_with_timing_disabled(tmp_path):
    r = _run(["-m", "pytest", "bench", "-q", "--benchmark-disable", "-p", "no:cacheprovider"], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def test_gpu_compare_and_plot_plumbing(tmp_path):
    out = tmp_path / "results.json"
    r = _run(["bench/gpu_compare.py", "--driver", "emu", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    missing = {"launch", "staging", "curve", "jit_slot", "step", "kv_write", "rope", "attention", "graph"} - set(data["sections"])
    assert not missing, (missing, data["errors"])
    assert not [k for k in data["errors"] if "torch" not in k], data["errors"]  # only torch is absent here
    assert all(data["sections"]["staging"]["verified"].values())
    assert all(g["replay_equals_eager"] for g in data["sections"]["graph"].values())
    assert r.stdout.rstrip().splitlines()[-1].startswith("times in us")  # the table comes last
    png = tmp_path / "curve.png"
    r = _run(["bench/plot_staging_curve.py", str(out), "-o", str(png)], tmp_path)
    assert r.returncode == 0 and png.stat().st_size > 1000, r.stderr


def test_host_profile_runs_and_names_the_hot_functions(tmp_path):
    r = _run(["bench/profile_host.py", "--stub", "--reps", "3", "--top", "5"], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.count("== ") == 4 and "staging/" in r.stdout and "q12pass.py" in r.stdout, r.stdout
    assert "ExpandPlan.stage" in r.stdout and "expand.py" in r.stdout, r.stdout
    r = _run(["bench/profile_host.py", "--reps", "0"], tmp_path)
    assert r.returncode == 2 and "--reps" in r.stderr


def test_torch_events_timer_takes_the_median_of_timed_calls_after_warmup():
    sys.path.insert(0, str(ROOT))
    from bench.timing import torch_events_us

    class FakeTorch:  # the slice of torch's CUDA API the timer uses, with scripted elapsed times
        def __init__(self, elapsed_ms):
            self.elapsed, self.calls, self.synced = list(elapsed_ms), [], 0
            outer = self

            class Event:
                def __init__(self, enable_timing=False):
                    assert enable_timing

                def record(self):
                    outer.calls.append("record")

                def synchronize(self):
                    pass

                def elapsed_time(self, end):
                    return outer.elapsed.pop(0)

            def synchronize():
                outer.synced += 1

            self.cuda = type("Cuda", (), {"Event": Event, "synchronize": staticmethod(synchronize)})

    torch = FakeTorch([0.010, 0.030, 0.020])
    ran = []
    assert torch_events_us(torch, lambda: ran.append(1), reps=3, warmup=2, batch=1) == 20.0  # median, in us
    assert len(ran) == 5 and torch.synced == 1 and torch.calls.count("record") == 6
    # batches: each pair of events brackets `batch` calls; the time per call is the batch's over batch
    torch = FakeTorch([0.040, 0.120, 0.080])
    ran = []
    assert torch_events_us(torch, lambda: ran.append(1), reps=3, warmup=1, batch=4) == 20.0
    assert len(ran) == 1 + 3 * 4 and torch.calls.count("record") == 6
    with pytest.raises(ValueError, match="reps >= 1"):
        torch_events_us(torch, lambda: None, reps=0)
    with pytest.raises(ValueError, match="batch >= 1"):
        torch_events_us(torch, lambda: None, reps=1, batch=0)
