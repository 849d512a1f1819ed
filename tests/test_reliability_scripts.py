"""The GPU reliability scripts run on the emulated driver too: the sanitizer's step program (its
checks and guard bands) and the soak script's exit codes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np

from q12drv import open_device

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sanitize_step_passes_on_the_emulator_and_runs_every_kernel(monkeypatch, capsys):
    from q12drv.core.driver.emu import EmuDriver
    from q12drv.kernels import ops

    step = load("sanitize_step")
    launched, launch = set(), EmuDriver.launch

    def recording(self, func, *args, **kwargs):
        launched.add(func.name)
        return launch(self, func, *args, **kwargs)

    monkeypatch.setattr(EmuDriver, "launch", recording)
    assert step.main(["--driver", "emu"]) == 0
    assert "sanitize_step: ok" in capsys.readouterr().out
    # the emulated device is an sm_90 (Hopper): the sanitizer on the H200 sees every kernel q12drv ships
    assert launched == set(ops.ENTRIES), sorted(set(ops.ENTRIES) - launched)
    assert step.main(["--driver", "emu", "--compile-only"]) == 0


def test_sanitize_step_guard_bands_see_a_stray_write():
    step = load("sanitize_step")
    with open_device("emu") as dev:
        g = step.Guarded(dev, "x", np.arange(100, dtype=np.uint16))
        problems = []
        assert g.get(problems) == np.arange(100, dtype=np.uint16).tobytes() and problems == []
        dev.upload(g.ptr + 200, np.array([1], np.uint8))  # one byte past the data
        g.get(problems)
        dev.upload(g.ptr - 1, np.array([1], np.uint8))  # one byte before it
        g.get(problems)
        assert problems == ["guard band around x overwritten"] * 2


def test_sanitize_step_reports_a_batched_per_stream_mismatch(monkeypatch, capsys):
    step = load("sanitize_step")
    from q12drv.prefill import Q12Pass

    real = Q12Pass.attention_layer

    def skewed(self, q, k, v, k_pool, v_pool, o, *a, **kw):
        real(self, q, k, v, k_pool, v_pool, o, *a, **kw)
        if not self.batched:
            self.device.memset(o, 0, 2)  # per stream only: scribble on o's first element

    monkeypatch.setattr(Q12Pass, "attention_layer", skewed)
    assert step.main(["--driver", "emu"]) == 1
    assert "batched and per stream differ in o" in capsys.readouterr().out


def test_sanitize_step_sees_an_output_no_kernel_wrote(monkeypatch, capsys):
    step = load("sanitize_step")
    from q12drv.prefill import Q12Pass

    monkeypatch.setattr(Q12Pass, "conv1d", lambda self, *a, **kw: None)  # a convolution that never ran
    assert step.main(["--driver", "emu"]) == 1
    out = capsys.readouterr().out
    assert "rope d64: cy has elements the kernels never wrote" in out and "3 problems" in out


def test_gpu_soak_exit_codes():
    def run(*args):
        return subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_soak.py"), *args], capture_output=True,
                              text=True, timeout=120)

    ok = run("--passes", "20", "--driver", "emu", "--layers", "2")
    assert ok.returncode == 0 and ok.stdout.startswith("soak PASS: 20 passes x 2")
    bad = run("--passes", "0", "--driver", "emu")
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr
