#!/usr/bin/env python3
"""Time q12drv and its comparators in one run on the GPU; print a ratio table last.

    PYTHONPATH=. python3 bench/gpu_compare.py --out results.json [--sections launch,staging,...] [--budget-s 80]
    PYTHONPATH=. python3 bench/gpu_compare.py --driver emu          # plumbing check: tiny shapes, no comparators

Every comparison is measured in the same process, interleaved where it matters, so only the ratios are claimed
(absolute numbers drift from run to run). One module a section (``bench/compare/``: what each times, against what,
and how, is in its docstring); each fails alone: an error is recorded and the rest still run.

* ``launch``: host enqueue time per launch against the raw pre-packed ``cuLaunchKernel``;
* ``staging``, ``curve``: staging 8 x 2048 tokens with MRoPE against copies of the bytes already packed, and the
  round trips over n in {1..64} x {16..8192} tokens a stream;
* ``jit_slot``: the per-SSM-layer ``h_state_ptrs`` upload;
* ``step``: one prefill step, batched against per stream;
* ``kv_write``, ``rope``, ``conv1d``: the memory-bound kernels against their byte floors and torch;
* ``attention``: both attention kernels against torch FA2 and cuDNN;
* ``attention_window``: the sliding window's cost against the same kernel without one on 1/8 of the context, and
  against torch FA2 with the same window;
* ``graph``: a captured pass replayed against the eager pass;
* ``gdn``: the Gated DeltaNet plans against each other and fla-core; ``gdn_decode``: decode steps against their
  byte floor and the chunked form;
* ``layer_ops``: each layer op's host time against the raw driver calls it issues;
* ``client``: ``examples/hybrid_prefill.py``'s batched prefill against transformers per prompt and padded;
* ``decode``: decode attention against its KV-read floor and the wgmma kernel, and a mixed batch against its parts.

The JSON (``--out``) holds every measurement (``sections``), the table (``table``), the errors (``errors``) and the
environment (``meta``). Expected runtime on the H200: about 4-5 minutes for every section (``gdn`` alone about 100 s),
plus NVRTC compiles on a cold cubin cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import q12drv  # noqa: E402
from bench import report  # noqa: E402
from bench.compare import SECTIONS  # noqa: E402
from bench.compare.context import Context  # noqa: E402

T0 = time.perf_counter()
#: The table's columns (name, q12drv, comparator, comparator's time, ratio, goal, met): 120 characters a line.
WIDTHS = (45, 9, 34, 9, 6, 8, 3)


def _us(x) -> str:
    return "-" if x is None else (f"{x:,.1f}" if x < 1e4 else f"{x:,.0f}")


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _goal(goal) -> str:
    if not goal:
        return "-"
    op, value = goal.split()
    return f"{op} {float(value):.3g}"


def table_lines(results: dict) -> list:
    """The final table as lines of at most ``sum(WIDTHS) + 6`` (120) characters: a row whose name or comparator
    does not fit its column goes on over the next lines, in the same column."""
    wn, wq, wc, wt, wr, wg, wm = WIDTHS
    meta = results["meta"]
    width = sum(WIDTHS) + len(WIDTHS) - 1
    out = [f"== q12drv vs comparators: {meta.get('device')} ({meta.get('driver')}), commit {meta.get('commit')}"
           f"{' (dirty)' if meta.get('dirty') else ''}, {meta.get('date_utc')}"[:width]]
    for name, err in results["errors"].items():
        out.append(f"   error in {name}: {(err.splitlines() or [''])[0]}"[:width])
    out.append(f"{'name':<{wn}} {'q12drv':>{wq}} {'comparator':<{wc}} {'comp':>{wt}} {'ratio':>{wr}} {'goal':<{wg}} "
               f"{'met':<{wm}}")
    out.append("-" * width)
    for r in results["table"]:
        names = textwrap.wrap(r["name"], wn) or [""]
        comps = textwrap.wrap(r["comparator"], wc) or [""]
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        out.append(f"{names[0]:<{wn}} {_us(r['q12drv_us']):>{wq}} {comps[0]:<{wc}} {_us(r['comparator_us']):>{wt}} "
                   f"{_ratio(r['ratio']):>{wr}} {_goal(r['goal']):<{wg}} {met:<{wm}}".rstrip())
        for i in range(1, max(len(names), len(comps))):
            name = names[i] if i < len(names) else ""
            comp = comps[i] if i < len(comps) else ""
            out.append(f"{name:<{wn}} {'':>{wq}} {comp}".rstrip())
    out.append("times in us; ratio = q12drv / comparator (lower is faster); goal applies to the ratio")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write every measurement as JSON here")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    ap.add_argument("--driver", default=os.environ.get("Q12DRV_DRIVER") or "cuda",
                    help="cuda (default) or emu (a plumbing check with tiny shapes; no comparators)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and curve points")
    ap.add_argument("--budget-s", type=float, default=80.0, help="stop starting new work after this many seconds")
    args = ap.parse_args(argv)
    dev = q12drv.open_device(args.driver)
    ctx = Context(dev, quick=args.quick, budget_s=args.budget_s, t0=T0)
    results = ctx.results
    results["meta"] = report.environment(dev)
    try:
        for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
            if name not in SECTIONS:
                ctx.error(name, "unknown section")
                continue
            if ctx.elapsed_s() > args.budget_s:
                ctx.error(name, "skipped: time budget spent")
                continue
            print(f"-- {name} ...", flush=True)
            report.run_section(results, name, lambda name=name: SECTIONS[name](ctx), dev)
    finally:
        report.finish_run(results, T0, args.out, lambda: print("\n" + "\n".join(table_lines(results))), dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
