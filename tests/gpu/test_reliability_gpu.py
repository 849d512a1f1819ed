"""Reliability on the GPU: 2,000 passes back to back with per-layer JIT-slot uploads and no host sync,
every pass's metadata and pointer tables captured by cuMemcpyDtoDAsync and verified (the function of
scripts/gpu_soak.py); a fault-free retry after a refused bad input; and a program that exits without
closing its device exits cleanly."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_soak_2000_passes(capsys):
    rc = _script("gpu_soak").main(["--passes", "2000", "--driver", "cuda"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("soak PASS: 2000 passes")


def test_sanitize_step_without_the_sanitizer(capsys):
    # The program scripts/sanitize.sh runs under compute-sanitizer: its own checks pass on the GPU.
    assert _script("sanitize_step").main(["--driver", "cuda"]) == 0, capsys.readouterr().out


def test_bad_input_leaves_the_gpu_arena_untouched():
    from q12drv import open_device
    from tests.reliability import ATTN, World, assert_same, snapshot

    with open_device("cuda") as dev:
        w = World.build(dev)
        before = snapshot(dev, w.arena)
        with pytest.raises(ValueError, match="q must be 16-byte aligned"):
            w.q12.attention_layer(w.p("q") + 2, *w.attention_args()[1:], ATTN, num_blocks=w.num_blocks)
        with pytest.raises(ValueError, match=r"state_ptrs\[1\]"):
            w.q12.h_slot.upload([w.p("states"), 0, w.p("states")])
        assert_same(before, snapshot(dev, w.arena))
        w.upload_inputs()
        w.run_layers()
        out = w.outputs()
        assert not np.any(np.frombuffer(out["o"], np.uint16) == 0xFFFF)
        assert w.arena.guard_intact()
        w.close()


def test_exit_without_close_on_the_gpu():
    code = textwrap.dedent("""
        from q12drv import open_device
        from tests.reliability import World
        dev = open_device("cuda")
        w = World.build(dev)          # staged, layers enqueued, JIT slot uploaded; nothing closed or synced
        w.q12.h_slot.upload(w.state_ptrs())
        print("staged", w.q12.meta.staged_bytes)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("staged ") and "Traceback" not in proc.stderr and "Error" not in proc.stderr
