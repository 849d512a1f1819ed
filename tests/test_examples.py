"""The examples that need nothing beyond q12drv run as written (on the emulated driver). The hybrid-model runtime
is checked by tests/test_client.py, the tensor-parallel one by tests/test_example_tensor_parallel.py."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dump_example_finds_its_corruption(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "Q12DRV_DRIVER": "emu"}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "arena_dump.py"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "good.npz: every check passed" in run.stdout and "bad.npz: failed slots" in run.stdout
    assert "slot_stacked: 1 of 30 differ" in run.stdout
