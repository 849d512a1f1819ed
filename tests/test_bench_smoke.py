"""The benchmarks still run: ``bench/`` with timing disabled, ``bench/gpu_compare.py`` (every section, its rows)
and the plot on the emulated driver, ``bench/profile_host.py``, ``bench/fla_gdn.py``'s output without fla-core
(plumbing only: no numbers are checked, speed is never asserted); and no script reaches into another's helpers."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=300):
    # the test session's cubin cache (tests/conftest.py), so the kernels the suite compiled are not compiled again
    env = dict(os.environ, Q12DRV_DRIVER="emu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_suites_run_with_timing_disabled(tmp_path):
    r = _run(["-m", "pytest", "bench", "-q", "--benchmark-disable", "-p", "no:cacheprovider"], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.slow  # about 15 s on two cores, most of it the step section's warm-up runs on the emulator
def test_gpu_compare_and_plot_plumbing(tmp_path):
    out = tmp_path / "results.json"
    r = _run(["bench/gpu_compare.py", "--driver", "emu", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    missing = {"launch", "staging", "curve", "jit_slot", "step", "kv_write", "rope", "conv1d", "attention", "graph",
               "gdn", "gdn_decode", "layer_ops", "attention_window", "decode"} - set(data["sections"])
    assert not missing, (missing, data["errors"])
    assert not [k for k in data["errors"] if "torch" not in k], data["errors"]  # only torch is absent here
    assert all(data["sections"]["staging"]["verified"].values())
    assert all(g["replay_equals_eager"] for g in data["sections"]["graph"].values())
    rows = {(row["name"], row["comparator"]): row for row in data["table"]}
    # the short convolution: each case against its byte floor at 4.8 TB/s, the fraction of it in the note
    conv = data["sections"]["conv1d"]
    assert conv["channels"] == 2 * 16 * 128 + 32 * 128 and conv["width"] == 4
    for key, case in conv["cases"].items():
        n, t, c = len(case["counts"]), case["tokens"], conv["channels"]
        assert case["floor_bytes"] == 2 * t * c * 2 + 2 * n * 3 * c * 2, case
        row = rows[(f"conv1d {key} C{c} W4: vs floor", f"floor: {case['floor_bytes'] / 1e6:,.0f} MB at 4.8 TB/s")]
        assert row["q12drv_us"] > 0 and row["goal"] == f"<= {1 / 0.7:g}" and "of the 4.8 TB/s floor" in row["note"]
    assert {k for k in conv["cases"]} == {"2x16", "ragged8"}
    # each layer op against the driver calls it issues, recorded and replayed bare
    ops = data["sections"]["layer_ops"]
    assert {k: (v["launches"], v["copies"]) for k, v in ops.items() if not k.startswith("gdn_layer")} == {
        "attention_layer": (3, 0), "rope": (1, 0), "kv_write": (1, 0), "attention": (1, 0), "conv1d": (1, 1),
        "conv1d (staged states)": (1, 0)}
    assert ops["gdn_layer"]["launches"] >= 1 and ops["gdn_layer"]["copies"] == 1  # the state pointers' upload
    staged = ops["gdn_layer (staged states)"]  # its state table staged once for the pass: launches only
    assert staged["launches"] == ops["gdn_layer"]["launches"] and staged["copies"] == staged["event_records"] == 0
    assert all(v["op"] > 0 and v["raw"] > 0 for v in ops.values())
    # the client against transformers, where torch and transformers import
    if "client" in data["sections"]:
        case = data["sections"]["client"]["cases"]["ragged3"]
        assert case["q12drv_us"] > 0 and case["per_prompt_us"] > 0 and 0 < case["q12drv_ops_us"] < case["pass_us_profiled"]
    else:
        assert "client/torch+transformers" in data["errors"]
    # decode attention: each batch against its KV-read floor at 4.8 TB/s and the wgmma kernel; the mixed batch
    # against its parts
    decode = data["sections"]["decode"]["cases"]
    for name, case in decode.items():
        if name.startswith("mixed"):
            assert case["q12drv_us"] > 0 and case["parts_us"] > 0
            continue
        hkv, d = (2, 256) if "Hkv2 D256" in name else (8, 128)
        assert case["floor_bytes"] == 2 * sum(case["kv_lens"]) * hkv * d * 2 and case["num_splits"] >= 1, case
        row = rows[(f"decode {name}: vs KV-read floor", f"floor: {case['floor_bytes'] / 1e6:,.0f} MB at 4.8 TB/s")]
        assert row["goal"] == f"<= {1 / 0.85:g}" and "of 4.8 TB/s" in row["note"]
        assert rows[(f"decode {name}", "q12drv wgmma kernel, same batch")]["ratio"] > 0
        if "fp8" in case:  # the first batch on FP8 pools: against the bf16 decode (goal 0.6) and its own floor
            f = case["fp8"]
            assert f["floor_bytes"] * 2 == case["floor_bytes"] and f["q12drv_us"] > 0 and f["num_splits"] >= 1
            assert rows[(f"decode {name} FP8", "q12drv decode kernel, bf16 pools, same batch")]["goal"] == "<= 0.6"
            assert rows[(f"decode {name} FP8: vs FP8 KV-read floor",
                         f"floor: {f['floor_bytes'] / 1e6:,.0f} MB at 4.8 TB/s")]["q12drv_us"] > 0
    assert len(decode) == 2 * 2 + 1
    assert sum("fp8" in case for case in decode.values()) == 2  # one batch a layout
    # scaled RoPE (a RopeScaling table, linear factor 4) beside the plain rows
    tokens = data["sections"]["rope"]["tokens"] // 1024
    scaled = data["sections"]["rope"]["scaled"]
    assert scaled["scaling"] == "linear 4" and scaled["q12drv_us"] > 0
    assert rows[(f"rope {tokens}k tokens: scaled (linear x4)", "q12drv RoPE from theta (no table)")]["ratio"] > 0
    assert any(name == f"rope {tokens}k tokens: scaled (linear x4) vs floor" for name, _ in rows)
    # the sliding window's speed goal: the windowed case against the same kernel's no-window case, both kernels
    assert data["sections"]["attention_window"]["window_left"] == 7
    for d in (128, 256):
        for algo in ("mma", "wgmma"):
            row = rows[(f"attention window 1x(5 on 40) W8 D{d} {algo}", f"q12drv {algo} 1x(5 on 8), no window")]
            assert row["q12drv_us"] > 0 and row["comparator_us"] > 0 and row["goal"] == "<= 1.2"
    lines = r.stdout.rstrip().splitlines()
    assert lines[-1].startswith("times in us")  # the table comes last
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("== q12drv vs comparators")):]
    assert max(len(ln) for ln in table) <= 120, [ln for ln in table if len(ln) > 120]
    assert all(any(row["name"].split()[0] in ln for ln in table) for row in data["table"])
    png = tmp_path / "curve.png"
    r = _run(["bench/plot_staging_curve.py", str(out), "-o", str(png)], tmp_path)
    assert r.returncode == 0 and png.stat().st_size > 1000, r.stderr


def test_gpu_compare_runs_a_subset_and_records_an_unknown_section(tmp_path):
    out = tmp_path / "results.json"
    r = _run(["bench/gpu_compare.py", "--driver", "emu", "--sections", "conv1d,nope", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data["sections"]) == {"conv1d"} and data["errors"] == {"nope": "unknown section"}
    assert [row["name"] for row in data["table"]] == ["conv1d 2x16 C8192 W4: vs floor", "conv1d ragged8 C8192 W4: vs floor"]


def test_fla_comparator_prints_one_json_line_even_without_fla(tmp_path):
    """bench/fla_gdn.py (fla-core's timing, in its own process) always ends with one JSON line: here, without
    torch or fla-core, ``ok`` false and why; a bad case is refused the same way."""
    for args in (["--cases", "ragged8"], ["--cases", "8x"]):
        r = _run(["bench/fla_gdn.py", *args], tmp_path)
        result = json.loads(r.stdout.strip().splitlines()[-1])
        assert result["heads"] == [16, 32, 128]
        if not result["ok"]:
            assert r.returncode == 1 and result["error"], result


def test_no_bench_script_imports_another_scripts_private_names():
    """The scripts share set-ups only through bench's public modules (inputs, timing, report, compare)."""
    scripts = {"gpu_compare", "breakdown", "profile_host", "fla_gdn", "plot_staging_curve"}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                module = node.module.split(".")
                assert not scripts & set(module), (path, node.module)
                assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.module)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert not (a.name.startswith("bench") and scripts & set(a.name.split("."))), (path, a.name)


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
