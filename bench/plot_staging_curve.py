#!/usr/bin/env python3
"""Plot staging round trip vs tokens from ``bench/gpu_compare.py --out`` JSON.

    python3 bench/plot_staging_curve.py results.json -o bench/staging_curve.png

Left: every (n, tokens per stream) point against the total token count, one colour per path
(q12drv host pack, q12drv device expansion, q12drv through an ``ExpandPlan``,
per-field copies, torch-style, and the bare copy of the same bytes as the floor). Right: the same for n = 8 against tokens per stream.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PATHS = (  # (key in a curve point, label, colour, marker)
    ("host", "q12drv (host pack, 1 copy)", "tab:blue", "o"),
    ("device", "q12drv (device expansion)", "tab:green", "s"),
    ("planned", "q12drv (ExpandPlan pass)", "tab:purple", "D"),
    ("per_field", "per-field copies", "tab:orange", "^"),
    ("torch_style", "torch-style (.to per field)", "tab:red", "v"),
    ("bare", "bare copy (floor, pre-packed)", "tab:gray", "x"),
)


def load_points(path: str) -> tuple:
    data = json.loads(Path(path).read_text())
    curve = data.get("sections", {}).get("curve")
    if not curve or not curve.get("points"):
        raise SystemExit(f"{path} has no staging curve (run bench/gpu_compare.py with the 'curve' section)")
    return data.get("meta", {}), curve["points"]


def plot(points: list, meta: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for key, label, colour, marker in PATHS:
        pts = [p for p in points if isinstance(p.get(key), dict) and p[key].get("round_trip_us") is not None]
        if not pts:
            continue
        pts.sort(key=lambda p: p["total_tokens"])
        left.scatter([p["total_tokens"] for p in pts], [p[key]["round_trip_us"] for p in pts], color=colour,
                     marker=marker, s=22, label=label)
        n8 = sorted((p for p in pts if p["n"] == 8), key=lambda p: p["tokens"])
        if n8:
            right.plot([p["tokens"] for p in n8], [p[key]["round_trip_us"] for p in n8], color=colour, marker=marker,
                       label=label)
    for ax, xlabel, title in ((left, "total tokens (n x tokens per stream)", "all n in the run"),
                              (right, "tokens per stream", "n = 8 streams")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("round trip (us): stage + stream sync")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"Staging with MRoPE on {meta.get('device', '?')} ({meta.get('driver', '?')}), "
                 f"commit {meta.get('commit', '?')}, {meta.get('date_utc', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="gpu_compare.py --out file")
    ap.add_argument("-o", "--out", default=str(Path(__file__).with_name("staging_curve.png")))
    args = ap.parse_args(argv)
    meta, points = load_points(args.json)
    plot(points, meta, args.out)
    print(f"wrote {args.out} ({len(points)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
