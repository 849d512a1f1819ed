"""The ``inspect``, ``diff`` and ``render`` commands: their options and what they run.

Shared by ``q12drv`` (:mod:`q12drv.tools.cli`) and the stand-alone ``scripts/*_arena_dump.py`` wrappers,
so both take the same options. Exit status: ``inspect`` 0 when every check passes, 1 otherwise;
``diff`` 0 when the dumps are identical, 1 otherwise; ``render`` 0; any of them 2 when a dump
cannot be read (:class:`~q12drv.core.errors.DumpError`).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["COMMANDS", "script_main"]


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", metavar="DUMP", help="arena dump (.npz) written by dump_arena / Q12Pass.dump / demo --dump")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    p.add_argument("--num-blocks", type=_positive, default=None,
                   help="KV-cache block count, overriding the dump's (enables the blocks_in_cache check)")


def _run_inspect(args) -> int:
    from .inspect import inspect_dump

    report = inspect_dump(args.dump, num_blocks=args.num_blocks)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format())
    return 0 if report.ok else 1


def _add_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="first dump")
    p.add_argument("b", metavar="B", help="second dump")
    p.add_argument("--json", action="store_true", help="print the differences as JSON")


def _run_diff(args) -> int:
    from .diff import diff_dumps, format_diff

    diffs = diff_dumps(args.a, args.b)
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "identical": not diffs,
                          "differences": [d.to_json() for d in diffs]}, indent=1, default=str))
    else:
        print(format_diff(diffs, args.a, args.b))
    return 0 if not diffs else 1


def _add_render(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", metavar="DUMP", help="arena dump (.npz)")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="the picture to write")
    p.add_argument("--num-blocks", type=_positive, default=None, help="KV-cache block count for the checks")
    p.add_argument("--dpi", type=_positive, default=110, help="resolution (default 110)")


def _run_render(args) -> int:
    from ..core.errors import Q12Error
    from .render import render_dump

    try:
        out = render_dump(args.dump, args.output, num_blocks=args.num_blocks, dpi=args.dpi)
    except OSError as exc:  # the picture cannot be written (no such directory, read-only, disk full)
        raise Q12Error(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {out}")
    return 0


#: name -> (help, description, add_arguments, run)
COMMANDS = {
    "inspect": ("decode an arena dump and check it",
                "Print the region map, decode every field (first and last entries, per-stream position and slot "
                "ranges, blocks touched, pointer targets resolved to allocations), then run every check and print "
                "PASS/FAIL/SKIP with the offending offsets and values. Exit status 0 only if no check fails, 1 if "
                "one does, 2 if the dump cannot be read.", _add_inspect, _run_inspect),
    "diff": ("compare two arena dumps",
             "Print the header entries, regions and fields that differ, each with its first differing element "
             "(index, offset, value in A, value in B). Exit status 0 if identical, 1 if they differ, 2 if a dump "
             "cannot be read.", _add_diff, _run_diff),
    "render": ("draw an arena dump as a PNG",
               "Draw the arena to scale (regions, fields coloured, per-stream segments of the stacked fields, the "
               "guard band) with failing checks in red. Needs matplotlib.", _add_render, _run_render),
}


def script_main(command: str, argv: list | None = None, prog: str | None = None) -> int:
    """Run one of :data:`COMMANDS` as a stand-alone program (what ``scripts/*_arena_dump.py`` call).

    Returns
    -------
    int
        The exit status; a :class:`~q12drv.core.errors.Q12Error` prints ``<prog>: <message>`` and gives 2.
    """
    from ..core.errors import Q12Error

    help_, description, add, run = COMMANDS[command]
    p = argparse.ArgumentParser(prog=prog, description=description)
    add(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except Q12Error as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 2
