#!/usr/bin/env python3
"""A/B timing of Gated DeltaNet kernel builds, each in its own process, the rounds interleaved.

    PYTHONPATH=. python3 bench/gdn_ab.py --case 1x8192 --rounds 4 \\
        --build base --build early=GDN_WG_U_EARLY=1 --build flags16=GDN_WG_FLOW_FLAGS=16

A build is ``NAME`` (the sources as they are) or ``NAME=DEFINE[,DEFINE...]`` (``GDN_WG_X=1``): a copy of
``cuda_src/`` with those ``#define`` lines at the top of ``gdn/chunked_wgmma.cu`` and ``gdn/chunked_mma.cu`` (their knobs
are ``#ifndef``-guarded), loaded through ``Q12DRV_CUDA_SRC``. Every round runs each build once, in order, in a
fresh process, so drift (clocks, the machine's other work) spreads over all of them instead of landing on
one; a process times ``ops.gdn(algo=...)`` by CUDA events (``bench.timing``: the median of batches after
warm-up) on the inputs of ``gpu_compare.py``'s gdn section (Hk 16, Hv 32, d 128; ``--case`` NxT or
``ragged8``). The table gives each build's per-round times, their median and its ratio to the first build,
and whether its o and final state are the first build's bits (one call from the same initial state).

Why: two builds timed one after the other in one process differ by the order (session 14: ``gdn_debug``
gave a build 2% that ``gpu_compare`` did not confirm). On the emulated driver (``--driver emu``) the cases
shrink to a plumbing check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


HK, HV, D = 16, 32, 128
RAGGED8 = [256, 2048, 512, 1792, 768, 1536, 1024, 1280]   # gpu_compare.py's and fla_gdn.py's ragged8
PATCHED = ("gdn/chunked_wgmma.cu", "gdn/chunked_mma.cu")                  # the sources a build's defines go into


def parse_case(text: str) -> list[int]:
    """``"1x8192"`` -> ``[8192]``, ``"ragged8"`` -> the ragged lengths; else ValueError naming the forms."""
    if text == "ragged8":
        return list(RAGGED8)
    n, sep, t = text.partition("x")
    if not sep or not n.isdigit() or not t.isdigit() or int(n) < 1 or int(t) < 1:
        raise ValueError(f"--case {text!r}: expected NxT (streams x tokens, e.g. 1x8192) or ragged8")
    return [int(t)] * int(n)


def parse_build(text: str) -> tuple[str, list[str]]:
    """``"name=A=1,B=2"`` -> ``("name", ["A=1", "B=2"])``; ``"name"`` -> ``("name", [])``."""
    name, _, rest = text.partition("=")
    defines = [d.strip() for d in rest.split(",") if d.strip()]
    if not name or any(not d.partition("=")[0].isidentifier() for d in defines):
        raise ValueError(f"--build {text!r}: expected NAME or NAME=MACRO=VALUE[,MACRO=VALUE...]")
    return name, defines


def make_source_dir(src: Path, defines: list[str], into: Path) -> Path:
    """A copy of ``src`` with ``#define`` lines for ``defines`` at the top of each of :data:`PATCHED`."""
    shutil.copytree(src, into)
    lines = "".join(f"#define {d.partition('=')[0]} {d.partition('=')[2] or 1}\n" for d in defines)
    for name in PATCHED:
        path = into / name
        path.write_text(lines + path.read_text())
    return into


def child(args) -> int:
    """Time one build (the sources ``Q12DRV_CUDA_SRC`` names) and print one JSON line."""
    import q12drv
    from bench import common
    from bench.gpu_compare import _staged_pass, gdn_inputs
    from bench.timing import q12_events_us
    from q12drv.kernels import ops

    dev = q12drv.open_device(args.driver)
    on_gpu = common.on_gpu(dev)
    counts = parse_case(args.case) if on_gpu else [16, 16]
    n, total = len(counts), sum(counts)
    with _staged_pass(dev, counts) as (meta, _streams, _nb, _arena, bufs):
        ws_bytes = ops.gdn_workspace_bytes(args.algo, n, max(counts), HK, HV, D)
        x = gdn_inputs(dev, counts, HK, HV, D, ws_bytes, bufs)

        def run():
            ops.gdn(dev, meta, x["h_state_ptrs"].ptr, x["q"].ptr, x["k"].ptr, x["v"].ptr, x["g"].ptr, x["beta"].ptr,
                    x["o"].ptr, num_k_heads=HK, num_v_heads=HV, head_dim=D, algo=args.algo,
                    workspace=x["workspace"].ptr, workspace_bytes=ws_bytes)

        run()   # one call from the initial state: the bits compared across builds
        dev.synchronize()
        digest = hashlib.sha256()
        for name, nbytes in (("o", total * HV * D * 2), ("state", n * HV * D * D * 4)):
            digest.update(dev.download(int(x[name].ptr), nbytes))
        us = q12_events_us(dev, run, args.reps if on_gpu else 2)
    print(json.dumps({"us": us, "bits": digest.hexdigest()[:16], "counts": counts}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--build", action="append", default=[], help="NAME or NAME=MACRO=VALUE[,...] (repeat; the "
                    "first is the baseline; default: one build of the sources as they are)")
    ap.add_argument("--case", default="1x8192", help="NxT (streams x tokens) or ragged8 (default 1x8192)")
    ap.add_argument("--algo", default="wgmma", help="ops.gdn's algo (default wgmma)")
    ap.add_argument("--rounds", type=int, default=3, help="processes a build (default 3)")
    ap.add_argument("--reps", type=int, default=30, help="timed batches a process (default 30)")
    ap.add_argument("--driver", default=os.environ.get("Q12DRV_DRIVER") or "cuda", help="cuda (default) or emu")
    ap.add_argument("--out", help="write the per-round times as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        parse_case(args.case)
        builds = [parse_build(b) for b in args.build] or [("base", [])]
    except ValueError as exc:
        ap.error(str(exc))
    if args.rounds < 1 or args.reps < 1:
        ap.error(f"--rounds {args.rounds} and --reps {args.reps}: each must be at least 1")
    if len({name for name, _ in builds}) != len(builds):
        ap.error("--build: every build needs its own name")
    if args.child:
        return child(args)

    from q12drv.core.nvrtc import cuda_src_dir

    src = cuda_src_dir()
    times: dict[str, list[float]] = {name: [] for name, _ in builds}
    bits: dict[str, str] = {}
    counts: list[int] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="q12-gdn-ab-") as tmp:
        dirs = {name: make_source_dir(src, defines, Path(tmp) / name) for name, defines in builds}
        for r in range(args.rounds):
            for name, _ in builds:
                env = dict(os.environ, Q12DRV_CUDA_SRC=str(dirs[name]))
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--case", args.case, "--algo",
                       args.algo, "--reps", str(args.reps), "--driver", args.driver]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode != 0 or not lines:
                    sys.stderr.write(proc.stdout + proc.stderr)
                    print(f"gdn_ab: build {name} failed in round {r + 1} (rc {proc.returncode}); its output is "
                          "above", file=sys.stderr)
                    return 1
                res = json.loads(lines[-1])
                counts = res["counts"]
                times[name].append(res["us"])
                if bits.setdefault(name, res["bits"]) != res["bits"]:
                    print(f"gdn_ab: build {name} gave different bits in round {r + 1}: its results are not "
                          "deterministic", file=sys.stderr)
                    return 1
                print(f"round {r + 1}/{args.rounds} {name}: {res['us']:.1f} us ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
    base = builds[0][0]
    base_med = statistics.median(times[base])
    shape = (f"{len(counts)} x {counts[0]}" if len(set(counts)) == 1
             else f"{len(counts)} streams of {min(counts)}..{max(counts)}")
    print(f"\nGated DeltaNet {shape} Hk {HK} Hv {HV} d {D}, algo {args.algo}: median over {args.rounds} "
          f"processes (each the median of {args.reps} event-timed batches), us")
    print(f"{'build':<16} {'median':>8} {'ratio':>6} {'bits':>5}  rounds; defines")
    for name, defines in builds:
        m = statistics.median(times[name])
        same = "same" if bits[name] == bits[base] else "diff"
        rounds = " ".join(f"{t:.1f}" for t in times[name])
        print(f"{name:<16} {m:8.1f} {m / base_med:6.3f} {same:>5}  {rounds}; {','.join(defines) or '-'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"case": args.case, "algo": args.algo, "times_us": times,
                                              "bits": bits, "builds": dict(builds)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
