#!/usr/bin/env python3
"""Nsight Compute's view of the wgmma Gated DeltaNet pair: where its kernels' warps stall.

    PYTHONPATH=. python3 tests/gpu/gdn_ncu.py                       # 8x2048 and 1x8192, every kernel of the pair
    PYTHONPATH=. python3 tests/gpu/gdn_ncu.py --cases 8x2048 --kernels 'prep_tiles|seqw' --out /tmp/ncu.txt
    PYTHONPATH=. python3 tests/gpu/gdn_ncu.py --cases 8x2048 --kernels prep_tiles --source /tmp/ncu-src   # per instruction
    python3 tests/gpu/gdn_ncu.py --phases /tmp/ncu-src/source.csv   # its phases again, on any machine

It runs itself under ``ncu`` (``--clock-control none``: the clocks are left as the machine sets them; see the
device notes) with ``--inner``: the inner process builds each case of ``gdn_debug.TIMING_CASES`` asked for (Hk 16,
Hv 32, d 128, random inputs) and launches, once each, the precompute, both sequential kernels (one and two
stages), the wide form and the flow form, the ones whose entry names match ``--kernels`` (a regular expression).
ncu profiles each matching launch with the sections of ``--sections`` (speed of light, occupancy, launch
statistics, warp states, scheduler statistics, memory workload by default) and the per-reason stall metrics
(``STALL_METRICS``; ``--no-stalls`` leaves them out) and prints them: the stall metrics say what the kernel's warps
wait on (a barrier, a long scoreboard (global or local memory), a short one (shared memory), the tensor cores
(``wait``, ``math_pipe_throttle``), ...), the scheduler table how often an issue slot had no eligible warp.
Nothing here checks results (``gdn_debug.py`` and the GPU tests do): it is a diagnostic, and nothing is timed
(ncu serialises and replays every profiled kernel).

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

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = "SpeedOfLight,Occupancy,LaunchStats,WarpStateStats,SchedulerStats,MemoryWorkloadAnalysis"
#: The warp-state breakdown the WarpStateStats section's text leaves out (run AU printed only its summary): cycles a
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


FORMS = ("seq1", "seq2", "wide", "flow")


def inner(cases: list, kernels: str, forms: tuple = FORMS) -> int:
    """Launch each form in ``forms`` of the pair with a kernel whose entry name matches ``kernels`` once on each
    case (the whole form: its precompute writes the records its sequential kernel reads)."""
    from tests.gpu import gdn_debug as D
    from tests.gpu import test_gdn_gpu as T
    from q12drv.kernels import gdn_wgmma

    pattern = re.compile(kernels)
    torch, _rec, funcs = D.setup()   # gdn/chunked_mma.cu's entries and gdn/chunked_wgmma.cu's, default builds
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for key, n, _tokens, hv, d, vals, tensors in D.timing_cases(torch, cases):
        hk, chunk_len = vals[8].value, int(vals[0].chunk_len)
        seqs = {f"seq{st}": [(e, *geo) for e, geo in zip(gdn_wgmma.entries(d, st),
                                                          gdn_wgmma.geometry(n, chunk_len, hk, hv, d, st))]
                for st in gdn_wgmma.STAGES}
        seqs["wide"] = [(e, *geo) for e, geo in zip(gdn_wgmma.wide_entries(d),
                                                    gdn_wgmma.wide_geometry(n, chunk_len, hk, hv, d))]
        for form, launches in seqs.items():   # each form's precompute writes the records its sequential kernel reads
            if form not in forms or not any(pattern.search(e) for e, *_ in launches):
                continue
            print(f"== {key}: {form}: {', '.join(e for e, *_ in launches)}", flush=True)
            for item in launches:
                T.launch(funcs, *item, vals)
            torch.cuda.synchronize()
        if "flow" in forms and gdn_wgmma.uses_flow(n, chunk_len, hv, d, sms) and any(pattern.search(e) for e in gdn_wgmma.flow_entries(d)):
            flow = D.flow_launches(torch, n, hv, d, vals, tensors)
            print(f"== {key}: flow: {', '.join(item[0] for item in flow[1:])}", flush=True)
            flow[0]()
            for item in flow[1:]:
                T.launch(funcs, *item[:4], vals, dependent=item[4])
            torch.cuda.synchronize()
        del tensors
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="8x2048,1x8192", help="comma-separated keys of gdn_debug.TIMING_CASES")
    ap.add_argument("--kernels", default="gdn_", help="regular expression on the entry names to profile")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated forms to launch, of {', '.join(FORMS)} "
                    "(a precompute is profiled once for each form launched)")
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
    from tests.gpu.gdn_debug import TIMING_CASES

    unknown = sorted(set(cases) - {k for k, _ in TIMING_CASES})
    if unknown:
        ap.error(f"unknown case(s) {unknown}; the cases are {[k for k, _ in TIMING_CASES]}")
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
        print("gdn_ncu: no ncu on PATH, under /usr/local/cuda*/bin or /opt/nvidia/nsight-compute/; install Nsight "
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
        print(f"gdn_ncu: the source page ({len(page.splitlines())} lines, rc {rc2}) in {args.source}/source.csv")
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
