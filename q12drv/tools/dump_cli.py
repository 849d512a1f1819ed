"""The ``inspect``, ``diff`` and ``render`` commands: their options and what they run.

Shared by ``q12drv`` (:mod:`q12drv.tools.cli`) and the stand-alone ``scripts/*_arena_dump.py`` wrappers,
so both take the same options. Exit status: ``inspect`` 0 when every check passes, 1 otherwise;
``diff`` 0 when the dumps are identical, 1 otherwise; ``render`` 0; any of them 2, with one line on
stderr, when a dump cannot be read (:class:`~q12drv.core.errors.DumpError`) or an argument is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

from ..core.errors import Q12Error
from .dump import DEFAULT_MAX_BYTES

__all__ = ["COMMANDS", "ExampleFormatter", "failure_status", "script_main"]


class ExampleFormatter(argparse.HelpFormatter):
    """argparse's help layout, except that a paragraph with indented lines (an epilog's examples) keeps its lines
    as written instead of being wrapped into one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join("\n".join(indent + line for line in block.splitlines()) if "\n  " in block
                           else super(ExampleFormatter, self)._fill_text(block, width, indent)
                           for block in text.split("\n\n"))


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _add_max_bytes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-bytes", type=_positive, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"refuse a dump whose members unpack to more than N bytes (default {DEFAULT_MAX_BYTES:,}: "
                        f"a small file cannot make the reader allocate gigabytes)")


def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump", metavar="DUMP",
                   help="arena dump (.npz) written by q12drv.tools.dump (dump_pass, dump_arena) or demo --dump")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the report")
    p.add_argument("--num-blocks", type=_positive, default=None,
                   help="KV-cache block count, overriding the dump's (enables the blocks_in_cache check)")
    _add_max_bytes(p)


def _run_inspect(args) -> int:
    from .inspect import inspect_dump

    report = inspect_dump(args.dump, num_blocks=args.num_blocks, max_bytes=args.max_bytes)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format())
    return 0 if report.ok else 1


def _add_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="first dump")
    p.add_argument("b", metavar="B", help="second dump")
    p.add_argument("--json", action="store_true", help="print the differences as JSON")
    _add_max_bytes(p)


def _run_diff(args) -> int:
    from .diff import diff_dumps, format_diff

    diffs = diff_dumps(args.a, args.b, max_bytes=args.max_bytes)
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
    _add_max_bytes(p)


def _check_output(output: str, inputs: tuple) -> None:
    """Refuse a picture path that is one of the dumps read (it would be overwritten) or an existing file that is
    not a regular one (writing to a named pipe blocks until someone reads it)."""
    try:
        st = os.stat(output)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise Q12Error(f"cannot write {output}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Q12Error(f"cannot write {output}: it exists and is not a regular file")
    for path in inputs:
        try:
            if os.path.samefile(output, path):
                raise Q12Error(f"refusing to write {output}: it is the dump being read ({path}); choose another -o")
        except OSError:
            pass  # the dump itself cannot be found: reading it says so


def _run_render(args) -> int:
    from .render import render_dump

    _check_output(args.output, (args.dump,))
    try:
        out = render_dump(args.dump, args.output, num_blocks=args.num_blocks, dpi=args.dpi, max_bytes=args.max_bytes)
    except OSError as exc:  # the picture cannot be written (no such directory, read-only, disk full)
        raise Q12Error(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {out}")
    return 0


#: name -> (help, description, examples, add_arguments, run); ``%(prog)s`` in the examples is the command's name
COMMANDS = {
    "inspect": ("decode an arena dump and check it",
                "Print the region map, decode every field (first and last entries, per-stream position and slot "
                "ranges, blocks touched, pointer targets resolved to allocations), then run every check and print "
                "PASS/FAIL/SKIP with the offending offsets and values. Exit status 0 only if no check fails, 1 if "
                "one does, 2 if the dump cannot be read.",
                "examples:\n"
                "  %(prog)s a.npz                   # a dump from 'q12drv demo --dump a.npz' or dump_pass\n"
                "  %(prog)s --json a.npz > a.json   # the same, as JSON",
                _add_inspect, _run_inspect),
    "diff": ("compare two arena dumps",
             "Print the header entries, regions and fields that differ, each with its first differing element "
             "(index, offset, value in A, value in B). Exit status 0 if identical, 1 if they differ, 2 if a dump "
             "cannot be read.",
             "example:\n"
             "  %(prog)s a.npz b.npz   # e.g. the same batch staged twice: what differs",
             _add_diff, _run_diff),
    "render": ("draw an arena dump as a PNG",
               "Draw the arena to scale (regions, fields coloured, per-stream segments of the stacked fields, the "
               "guard band) with failing checks in red. Needs matplotlib.",
               "example:\n"
               "  %(prog)s a.npz -o a.png",
               _add_render, _run_render),
}


def failure_status(prog: str, exc: BaseException) -> int:
    """Report a command's failure as one line on stderr and return its exit status (2; 130 for Ctrl-C).

    A :class:`~q12drv.core.errors.Q12Error`, an ``OSError`` (a file that cannot be read or written) and a refused
    argument (``ValueError``/``TypeError``, e.g. an unknown ``Q12DRV_DRIVER``) are the user's to fix: their
    message. Anything else is q12drv's bug: its type and message, and how to get the traceback
    (``Q12DRV_TRACEBACK=1``). Never a traceback unless asked for.
    """
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if os.environ.get("Q12DRV_TRACEBACK"):
        raise exc
    if isinstance(exc, OSError) and not isinstance(exc, Q12Error):
        where = f": {exc.filename}" if exc.filename else ""
        msg = f"{exc.strerror or exc}{where}"
    elif isinstance(exc, (Q12Error, ValueError, TypeError)):
        msg = str(exc)
    else:
        msg = (f"internal error: {type(exc).__name__}: {exc} (run with Q12DRV_TRACEBACK=1 for the traceback, and "
               f"please report it)")
    print(f"{prog}: {' '.join(msg.split())}", file=sys.stderr)
    return 2


def script_main(command: str, argv: list | None = None, prog: str | None = None) -> int:
    """Run one of :data:`COMMANDS` as a stand-alone program (what ``scripts/*_arena_dump.py`` call).

    Returns
    -------
    int
        The exit status; any failure prints one line ``<prog>: <message>`` and gives 2 (:func:`failure_status`).
    """
    help_, description, example, add, run = COMMANDS[command]
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=example, formatter_class=ExampleFormatter)
    add(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except BaseException as exc:  # noqa: BLE001 -- one line and an exit status, whatever it was
        if isinstance(exc, SystemExit):
            raise
        return failure_status(p.prog, exc)
