#!/usr/bin/env python3
"""Stage N passes back to back on one stream (per-layer h_state_ptrs uploads, no host sync in
between), capture every pass's metadata and JIT slot on the device, verify them all at the end.

    python3 scripts/gpu_soak.py --passes 10000 --driver cuda

Prints one summary line; exit status 0 when every captured byte matched, 1 on any mismatch,
2 when the run itself failed (no GPU, a CUDA error, a race caught by the emulator).
See q12drv/tools/soak.py (run_soak) for what is checked.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from q12drv import Q12Error, open_device  # noqa: E402
from q12drv.tools.soak import run_soak  # noqa: E402


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=_positive, default=10000, help="passes to stage back to back (default 10000)")
    p.add_argument("--layers", type=_positive, default=4, help="JIT-slot uploads per pass (default 4)")
    p.add_argument("--driver", default="cuda", choices=["cuda", "emu", "auto"], help="default cuda")
    p.add_argument("--immediate", action="store_true", help="emu only: run stream work at enqueue time "
                                                            "(default: deferred, so the device lags the host)")
    args = p.parse_args(argv)
    try:
        with open_device(args.driver, deferred=not args.immediate and args.driver != "cuda") as dev:
            result = run_soak(dev, args.passes, layers=args.layers)
    except Q12Error as exc:
        print(f"soak ERROR: {type(exc).__name__}: {exc}")
        return 2
    print(result.summary())
    for line in result.mismatches[1:]:
        print("  " + line)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
