"""Races: 10,000 back-to-back passes with per-layer JIT-slot uploads and no host synchronization, on
the emulated driver's deferred mode (stream work lags the host until something waits), every pass's
metadata and every layer's pointer table captured on the device and verified (q12drv.tools.soak; the GPU
runs the same code through scripts/gpu_soak.py). The pinned rings are never rewritten while their
copies are pending (the deferred driver raises HostRaceError if they are)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import q12drv.tools.soak as soak
from q12drv import HostRaceError, open_device
from q12drv.core.pinned import PinnedRing
from q12drv.core.staging import place_h_state_slot

REPO = Path(__file__).resolve().parents[1]


def test_ten_thousand_passes_without_host_sync():
    with open_device("emu", deferred=True) as dev:
        result = soak.run_soak(dev, 10_000, layers=4)
    print(result.summary())
    assert result.ok, "\n".join(result.mismatches)
    assert result.passes == 10_000 and result.staged_bytes > 10_000 * 1000
    assert result.ring_waits >= 10_000 - 3  # the rings wrapped: every reuse waited for its copy's event
    assert dev.driver.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}


def test_the_soak_catches_a_pinned_slot_rewritten_under_its_copy(monkeypatch):
    monkeypatch.setattr(PinnedRing, "_wait", lambda self, slot: None)  # the ring's guard removed
    with open_device("emu", deferred=True) as dev:
        with pytest.raises(HostRaceError):
            soak.run_soak(dev, 50)
        for s in list(dev.driver._streams.values()):  # let close() find empty queues
            while s.queue:
                try:
                    dev.driver._drain(s)
                except HostRaceError:
                    pass


def test_the_soak_catches_a_misplaced_jit_slot(monkeypatch):
    # The upstream #110 bug: the slot placed by an estimate, inside the live metadata.
    def misplaced(arena, meta):
        arena.cursor -= 16
        arena._regions[-1] = arena._regions[-1].__class__(
            arena._regions[-1].name, arena._regions[-1].offset, arena._regions[-1].nbytes - 16, arena._regions[-1].ptr)
        return place_h_state_slot(arena, meta.__class__(**{**meta.__dict__, "staged_bytes": meta.staged_bytes - 16}))

    monkeypatch.setattr(soak, "place_h_state_slot", misplaced)
    with open_device("emu", deferred=True) as dev:
        result = soak.run_soak(dev, 40)
    assert not result.ok and "metadata fields" in result.mismatches[0] and "kv_lens" in result.mismatches[0]


def test_the_soak_catches_an_upload_on_the_wrong_stream(monkeypatch):
    # A JIT-slot upload not ordered with the pass's stream lands after the copy that should see it.
    real = soak.place_h_state_slot

    def unordered(arena, meta):
        slot = real(arena, meta)
        upload = slot.upload
        slot.upload = lambda ptrs, stream=None: upload(ptrs, None)  # the device's default stream
        return slot

    monkeypatch.setattr(soak, "place_h_state_slot", unordered)
    with open_device("emu", deferred=True) as dev:
        result = soak.run_soak(dev, 40)
    assert not result.ok and "h_state_ptrs slot holds" in "\n".join(result.mismatches)


def test_gpu_soak_script_on_the_emulator():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_soak.py"), "--passes", "200", "--driver", "emu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("soak PASS: 200 passes x 4")
