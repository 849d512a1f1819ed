"""``bench/breakdown.py`` (the step and staging diagnostic run on the GPU) still runs: on the emulated driver,
with a few repetitions (plumbing only: no number is checked)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, Q12DRV_DRIVER="emu", Q12DRV_CACHE_DIR=str(tmp_path / "cubins"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "bench/breakdown.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_breakdown_runs_on_the_emulator_and_prints_its_table_last(tmp_path):
    out = tmp_path / "breakdown.json"
    r = _run(["--driver", "emu", "--reps", "2", "--warmup", "1", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert not data["errors"], data["errors"]
    for mode in ("batched", "per_stream"):
        step = data["step"][mode]
        ops = [o["op"] for o in step["gated"]["ops"]]
        assert ops == [o["op"] for o in step["ungated"]["ops"]], (ops, step["ungated"]["ops"])
        assert any(op.startswith("q12_gdn") for op in ops) and any(op.startswith("q12_rope") for op in ops), ops
        assert step["phases_us"]["pass: total"] > 0 and "init: admission (decide)" in step["phases_us"]
    assert data["step"]["batched"]["gated"]["ops"][0]["op"].startswith("q12_expand_meta_tail")
    assert sum(o["op"].startswith("H2D") for o in data["step"]["per_stream"]["gated"]["ops"]) == 8 + 1
    paths = data["staging"]["paths"]
    assert data["staging"]["arena_bytes_ok"] and len(paths) == 4
    assert all(set(p) >= {"back_to_back", "after_sync", "after_sync_spin200", "interleaved"} for p in paths.values())
    lines = r.stdout.rstrip().splitlines()
    assert lines[-1].startswith("times in us") and any(ln.startswith("per_stream") for ln in lines[-12:]), lines[-12:]


def test_breakdown_refuses_bad_arguments(tmp_path):
    r = _run(["--reps", "0"], tmp_path)
    assert r.returncode == 2 and "--reps" in r.stderr
    r = _run(["--sections", "nope"], tmp_path)
    assert r.returncode == 2 and "nope" in r.stderr
