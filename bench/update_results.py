"""Replace rows of ``bench/RESULTS.md`` with the rows a ``gpu_compare.py`` run measured (its ``--out`` JSON).

    python3 bench/update_results.py bench.json [--results bench/RESULTS.md] [--machine H200] [--commit C] [--check]

A measured row replaces the table row with the same name and comparator; where the comparator's text has changed
(a floor's byte count, a renamed schedule) and both the file and the run have one row of the name, that row; no row
is replaced twice. A name's trailing
parenthesis (what a default resolved to) is dropped where the file has the name without it. Rows the run did not measure
are left as they are (with their own date and commit), and measured rows with no row in the file are listed, not
placed: a new row goes in by hand, in its section, once. ``--check`` prints what would change and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["format_row", "update"]

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "/")


def format_row(row: dict, measured: str, machine: str, commit: str) -> str:
    """One RESULTS.md table line for a ``gpu_compare.py`` JSON row."""
    ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.3f}"
    met = "-" if row.get("met") is None else ("yes" if row["met"] else "NO")
    cells = [_cell(row["name"]), _us(row.get("q12drv_us")), _cell(row.get("comparator")),
             _us(row.get("comparator_us")), ratio, row.get("goal") or "-", met, measured, machine, commit,
             _cell(row.get("note"))]
    return "| " + " | ".join(cells) + " |"


def _key(line: str) -> tuple[str, str] | None:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return (cells[0], cells[2]) if line.startswith("| ") and len(cells) == 11 else None


def update(lines: list[str], run: dict, machine: str, commit: str | None = None) -> tuple[list[str], list[str],
                                                                                   list[str]]:
    """``lines`` with the run's rows in place; also the replaced rows' names and the rows with no place. ``commit``:
    the tree measured, where the run's own record of it is wrong (a device copy with stale git metadata)."""
    meta = run["meta"]
    measured = meta["date_utc"][:16].replace("T", " ")
    commit = commit or (meta["commit"] + ("+" if meta.get("dirty") else ""))
    keys = [_key(line) for line in lines]
    by_name: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            by_name.setdefault(key[0], []).append(i)
    def place(name: str) -> str:  # a suffix saying what a default resolved to, e.g. "(wgmma wide)", dropped
        if name not in by_name and name.endswith(")") and " (" in name:
            return name[:name.rindex(" (")]
        return name

    rows = [(place(_cell(r["name"])), _cell(r.get("comparator")), r) for r in run["table"]]
    per_name: dict[str, int] = {}
    for name, _, _ in rows:
        per_name[name] = per_name.get(name, 0) + 1
    out, replaced, unplaced, used = list(lines), [], [], set()
    for name, comparator, row in rows:
        at = [i for i in by_name.get(name, []) if keys[i][1] == comparator and i not in used]
        if not at and len(by_name.get(name, [])) == 1 and per_name[name] == 1 and by_name[name][0] not in used:
            at = by_name[name]  # the one row of the name, for the run's one row of it (its comparator's text changed)
        if len(at) != 1:
            unplaced.append(f"{name} | {comparator}")
            continue
        used.add(at[0])
        out[at[0]] = format_row(dict(row, name=name), measured, machine, commit)
        replaced.append(f"{name} | {comparator}")
    return out, replaced, unplaced


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the JSON gpu_compare.py --out wrote")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the table to update (default: %(default)s)")
    ap.add_argument("--machine", default="H200", help="the machine column's value (default: %(default)s)")
    ap.add_argument("--commit", help="the commit measured, where the run recorded another (default: the run's)")
    ap.add_argument("--check", action="store_true", help="print what would change; write nothing")
    args = ap.parse_args(argv)
    run = json.loads(args.run.read_text())
    if not run.get("table"):
        print(f"{args.run}: no measured rows (errors: {run.get('errors')})", file=sys.stderr)
        return 1
    lines = args.results.read_text().splitlines()
    new, replaced, unplaced = update(lines, run, args.machine, args.commit)
    print(f"{len(replaced)} rows replaced, {len(unplaced)} with no row in {args.results.name}")
    for name in unplaced:
        print(f"  no row: {name}")
    if not args.check:
        args.results.write_text("\n".join(new) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
