#!/usr/bin/env python3
"""Nsight Compute's view of the Gated DeltaNet kernels: where their warps stall.

    PYTHONPATH=. python3 tools/ncu_gdn.py                       # 8x2048 and 1x8192, the wgmma builds
    PYTHONPATH=. python3 tools/ncu_gdn.py --cases 8x2048 --kernels 'wgmma_precompute|wide' --out /tmp/ncu.txt
    PYTHONPATH=. python3 tools/ncu_gdn.py --cases 8x2048 --kernels wgmma_precompute --source /tmp/ncu-src   # per instruction
    python3 tools/ncu_gdn.py --phases /tmp/ncu-src/source.csv   # its phases again, on any machine

It runs itself under ``ncu`` (``--clock-control none``: the clocks are left as the machine sets them) with
``--inner``: the inner process stages each case of :data:`CASES` asked for (Hk 16, Hv 32, d 128, random inputs) and
runs, once each, the plan of every build of :data:`FORMS` asked for (:func:`form_plan`: its precompute writes the
records its sequential kernel reads) whose kernels' entry names match ``--kernels`` (a regular expression), through
q12drv's launcher (``q12drv.kernels.gdn.gdn``). ncu profiles each matching launch with the sections of
``--sections`` (speed of light, occupancy, launch statistics, warp states, scheduler statistics, memory workload by
default) and the per-reason stall metrics (``STALL_METRICS``; ``--no-stalls`` leaves them out) and prints them: the
stall metrics say what the kernel's warps wait on (a barrier, a long scoreboard (global or local memory), a short
one (shared memory), the tensor cores (``wait``, ``math_pipe_throttle``), ...), the scheduler table how often an
issue slot had no eligible warp. Nothing here checks results (the GPU tests do): it is a diagnostic, and nothing is
timed (ncu serialises and replays every profiled kernel).

``--source DIR`` adds ncu's SourceCounters section and keeps the report (``DIR/gdn.ncu-rep``); the report's
source page (every SASS instruction of each profiled kernel with how often it executed and the warp-stall samples
taken on it, by reason) then goes to ``DIR/source.csv``: which phase of a kernel its time goes to, to read beside
``q12drv sass`` of the same build. Each profiled launch's instructions are then summed by phase (:func:`phases`:
the runs of instructions between two barriers, ``BAR``, mbarrier waits ``SYNCS``, ``WARPGROUP.ARRIVE``, ``EXIT``)
and printed: its share of the stall samples and of the instructions executed, and its commonest opcodes;
``--phases CSV`` prints that for a kept ``source.csv`` without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.inputs import GDN_CASES as CASES, QWEN3_NEXT  # noqa: E402  (the benchmark's cases and shape)

SECTIONS = "SpeedOfLight,Occupancy,LaunchStats,WarpStateStats,SchedulerStats,MemoryWorkloadAnalysis"
#: The warp-state breakdown the WarpStateStats section's text leaves out (it prints only its summary): cycles a
#: warp spends stalled for each reason per issued instruction (barrier, long_scoreboard, short_scoreboard, wait,
#: math_pipe_throttle, mio_throttle, not_selected, ...); their sum is "Warp Cycles Per Issued Instruction".
STALL_METRICS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"


#: SASS opcodes that end a phase: CTA and named barriers, mbarrier waits, warpgroup MMA fences, the exit.
PHASE_ENDS = ("BAR", "SYNCS", "WARPGROUP.ARRIVE", "EXIT")


def read_source_page(path) -> list:
    """``[(kernel name, [row dict, ...]), ...]``: one entry per profiled launch of an ncu source-page CSV
    (``--page source --csv --print-source sass``), its rows keyed by the CSV's column names."""
    launches, header = [], None
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                launches.append((rec[1], []))
                header = None
            elif rec[0] == "Address":
                header = rec
            elif header is not None and launches:
                launches[-1][1].append(dict(zip(header, rec)))
    return launches


def _opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):   # a predicate guard
        words = words[1:]
    return words[0] if words else ""


def phases(rows: list, min_share: float = 0.01) -> list:
    """One launch's instructions (:func:`read_source_page`) summed by phase: ``(first, last, share of the stall
    samples, share of the warp instructions executed, [(opcode, count in the phase's code), ...] (the six
    commonest))`` for each phase with at least ``min_share`` of the samples. A phase ends at an instruction whose
    opcode starts with one of :data:`PHASE_ENDS` (it belongs to the phase it ends)."""
    def num(row, key):
        value = row.get(key, "")
        return int(value) if value.isdigit() else 0

    total_s = sum(num(r, "Warp Stall Sampling (All Samples)") for r in rows) or 1
    total_e = sum(num(r, "Instructions Executed") for r in rows) or 1
    out, first, samples, executed, ops = [], 0, 0, 0, collections.Counter()
    for i, row in enumerate(rows):
        op = _opcode(row.get("Source", ""))
        samples += num(row, "Warp Stall Sampling (All Samples)")
        executed += num(row, "Instructions Executed")
        ops[op.split(".")[0]] += 1
        if op.startswith(PHASE_ENDS) or i == len(rows) - 1:
            if samples >= min_share * total_s:
                out.append((first, i, samples / total_s, executed / total_e, ops.most_common(6)))
            first, samples, executed, ops = i + 1, 0, 0, collections.Counter()
    return out


def print_phases(path, out=print) -> None:
    """:func:`phases` of every launch in the source-page CSV at ``path``."""
    for name, rows in read_source_page(path):
        out(f"== {name}: {len(rows)} instructions; phases with 1% of the stall samples or more:")
        for first, last, s_share, e_share, ops in phases(rows):
            out(f"   [{first:5d}..{last:5d}] {100 * s_share:5.1f}% samples {100 * e_share:5.1f}% instructions  "
                + " ".join(f"{o}:{n}" for o, n in ops))


def find_ncu() -> str | None:
    """``ncu`` on PATH, else the newest under /usr/local/cuda*/ or /opt/nvidia/nsight-compute/."""
    found = shutil.which("ncu")
    if found:
        return found
    cands = sorted(glob.glob("/usr/local/cuda*/bin/ncu") + glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    return cands[-1] if cands else None


#: The builds: a config and the SM count it is planned for (the rules then take that build; None: the device's).
FORMS = {"fused": ("fused", "auto", None), "mma": ("two_pass", "mma", None),
         "wgmma-2stage": ("two_pass", "wgmma", 10 ** 6), "wide": ("two_pass", "wgmma", 1),
         "overlapped": ("overlapped", "wgmma", None), "default": ("auto", "auto", None)}
DEFAULT_FORMS = ("wgmma-2stage", "wide", "overlapped")


def form_plan(form: str, shape, n: int, max_tokens: int, device):
    """The plan of build ``form`` (:data:`FORMS`) for ``n`` streams of at most ``max_tokens`` tokens on ``device``
    (planned as for its SM count, or for the form's)."""
    from types import SimpleNamespace

    from q12drv.kernels.gdn import GdnConfig, plan_gdn

    schedule, isa, sms = FORMS[form]
    where = device if sms is None else SimpleNamespace(arch=device.arch, sm_count=sms)
    return plan_gdn(GdnConfig(schedule=schedule, isa=isa), shape, n, max_tokens, where)


def inner(cases: list, kernels: str, forms: tuple = DEFAULT_FORMS) -> int:
    """Run the plan of each form in ``forms`` with a kernel whose entry name matches ``kernels`` once on each case
    (the whole plan: its precompute writes the records its sequential kernel reads)."""
    import numpy as np

    from bench.inputs import make_streams
    from q12drv import ScratchArena, make_scratch_plan, open_device, stage_batched_attn_metadata
    from q12drv.core.bf16 import to_bf16_bits
    from q12drv.kernels.gdn import GdnTensors, gdn

    pattern = re.compile(kernels)
    shape = QWEN3_NEXT["gdn"]
    hk, hv, d = shape.num_k_heads, shape.num_v_heads, shape.head_dim
    rng = np.random.default_rng(0)
    with open_device("cuda") as dev:
        for key in cases:
            counts = CASES[key]
            n, total = len(counts), sum(counts)
            plans = {form: form_plan(form, shape, n, max(counts), dev) for form in forms}
            plans = {f: p for f, p in plans.items() if any(pattern.search(k.entry) for k in p.kernels)}
            if not plans:
                continue
            streams, _, tables = make_streams(dev, counts)
            arena = ScratchArena(dev, make_scratch_plan(counts, 0, False, "exact").total_bytes + 4096)
            host = {"q": to_bf16_bits(rng.standard_normal((total, hk, d))),
                    "k": to_bf16_bits(rng.standard_normal((total, hk, d))),
                    "v": to_bf16_bits(rng.standard_normal((total, hv, d))),
                    "g": (-rng.random((total, hv)) * 0.3).astype(np.float32),
                    "beta": rng.random((total, hv)).astype(np.float32),
                    "o": np.zeros((total, hv, d), np.uint16),
                    "states": (rng.standard_normal((n, hv, d, d)) * 0.1).astype(np.float32)}
            bufs = {name: dev.alloc(a.nbytes, f"ncu {name}") for name, a in host.items()}
            ws_bytes = max([16] + [p.workspace_bytes for p in plans.values()])
            bufs["workspace"] = dev.alloc(ws_bytes, "ncu workspace")
            bufs["h_state_ptrs"] = dev.alloc(8 * n, "ncu state pointers")
            try:
                for name, a in host.items():
                    dev.upload(int(bufs[name].ptr), a)
                dev.upload(int(bufs["h_state_ptrs"].ptr),
                           np.array([int(bufs["states"].ptr) + b * hv * d * d * 4 for b in range(n)], np.uint64))
                meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False,
                                                   scratch_offset_bytes=0, dummy_kv_block=0)
                tensors = GdnTensors(*(int(bufs[k].ptr) for k in ("q", "k", "v", "g", "beta", "o")))
                for form, plan in plans.items():
                    print(f"== {key}: {form}: {', '.join(k.entry for k in plan.kernels)}", flush=True)
                    gdn(dev, meta, int(bufs["h_state_ptrs"].ptr), tensors, shape, plan,
                        workspace=int(bufs["workspace"].ptr), workspace_bytes=ws_bytes)
                    dev.synchronize()
            finally:
                dev.synchronize()
                for buf in bufs.values():
                    buf.free()
                arena.close()
                tables.free()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="8x2048,1x8192", help=f"comma-separated cases, of {', '.join(CASES)}")
    ap.add_argument("--kernels", default="q12_gdn_", help="regular expression on the entry names to profile")
    ap.add_argument("--forms", default=",".join(DEFAULT_FORMS), help=f"comma-separated builds to launch, of "
                    f"{', '.join(FORMS)} (a precompute is profiled once for each build launched)")
    ap.add_argument("--sections", default=SECTIONS, help="comma-separated ncu sections")
    ap.add_argument("--no-stalls", action="store_true", help="leave out the per-reason stall metrics (STALL_METRICS)")
    ap.add_argument("--out", help="also write ncu's report text here")
    ap.add_argument("--source", metavar="DIR", help="also keep the report in DIR and write its per-instruction "
                    "source page (SASS, instructions executed, stall samples by reason) to DIR/source.csv")
    ap.add_argument("--phases", metavar="CSV", help="only print the phases of a kept source page (no GPU, no ncu)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phases:
        if not os.path.isfile(args.phases):
            ap.error(f"--phases {args.phases!r}: no such file (a source.csv that --source wrote)")
        print_phases(args.phases)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; the cases are {list(CASES)}")
    try:
        re.compile(args.kernels)
    except re.error as exc:
        ap.error(f"--kernels {args.kernels!r} is not a regular expression: {exc}")
    forms = tuple(f for f in args.forms.split(",") if f)
    if set(forms) - set(FORMS):
        ap.error(f"unknown form(s) {sorted(set(forms) - set(FORMS))}; the forms are {', '.join(FORMS)}")
    if args.inner:
        return inner(cases, args.kernels, forms)
    ncu = find_ncu()
    if ncu is None:
        print("ncu_gdn: no ncu on PATH, under /usr/local/cuda*/bin or /opt/nvidia/nsight-compute/; install Nsight "
              "Compute or put its ncu on PATH", file=sys.stderr)
        return 2
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{args.kernels}", "--print-units", "base"]
    for sec in (s for s in args.sections.split(",") if s):
        cmd += ["--section", sec]
    if not args.no_stalls:
        cmd += ["--metrics", STALL_METRICS]
    rep = None
    if args.source:
        Path(args.source).mkdir(parents=True, exist_ok=True)
        rep = os.path.join(args.source, "gdn.ncu-rep")
        cmd += ["--section", "SourceCounters", "--import-source", "no", "-f", "-o", rep[:-len(".ncu-rep")]]
    cmd += [sys.executable, os.path.abspath(__file__), "--inner", "--cases", ",".join(cases), "--kernels", args.kernels,
            "--forms", ",".join(forms)]
    text, rc = run(cmd)
    if rep is not None and rc == 0:   # with -o ncu prints no details: read them, then the source page, from the report
        text2, rc = run([ncu, "--import", rep, "--print-units", "base", "--page", "details"])
        text += text2
        page, rc2 = run([ncu, "--import", rep, "--page", "source", "--csv", "--print-source", "sass"], echo=False)
        Path(args.source, "source.csv").write_text(page)
        print(f"ncu_gdn: the source page ({len(page.splitlines())} lines, rc {rc2}) in {args.source}/source.csv")
        if rc2 == 0:
            print_phases(os.path.join(args.source, "source.csv"))
        rc = rc or rc2
    if args.out:
        Path(args.out).write_text(text)
    return rc


def run(cmd: list, echo: bool = True) -> tuple[str, int]:
    """Run ``cmd``, print its command line (and its output when ``echo``); ``(output, exit status)``."""
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if echo:
        sys.stdout.write(proc.stdout)
    return proc.stdout, proc.returncode


if __name__ == "__main__":
    sys.exit(main())
