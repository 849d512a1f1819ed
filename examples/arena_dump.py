"""When a pass goes wrong, look inside its arena: dump a pass, check it, find a corruption.

A pass is staged (three streams at their own offsets), dumped, and inspected (every field decoded and checked, each
check guarding one property); then one KV slot is overwritten as a bug would, and the dump of the damaged arena
fails exactly the check that guards it, and diffs against the good one at that element. The same works on the
command line (``q12drv inspect``, ``q12drv diff``, ``q12drv render``) and on any machine: a dump is a file.

Run it::

    PYTHONPATH=. python3 examples/arena_dump.py [OUT_DIR]        # on the GPU if there is one, else emulated
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

import q12drv
from q12drv.tools.diff import diff_dumps, format_diff
from q12drv.tools.dump import dump_pass
from q12drv.tools.inspect import inspect_dump


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with q12drv.open_device("auto") as dev:
        tables = [np.array([3, 1], np.int32), np.array([7, 2, 5], np.int32), np.array([4], np.int32)]
        dev_tables = dev.alloc(64, "block tables")
        dev.upload(dev_tables.ptr, np.concatenate(tables))
        streams = [q12drv.StreamStageInfo(0, 20, tables[0], dev_tables.ptr, dev_tables.ptr + 48),
                   q12drv.StreamStageInfo(30, 9, tables[1], dev_tables.ptr + 8, dev_tables.ptr + 52),
                   q12drv.StreamStageInfo(5, 1, tables[2], dev_tables.ptr + 20, dev_tables.ptr + 56)]
        with q12drv.ScratchArena(dev, 1 << 16) as arena:
            step = q12drv.Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0)
            good = dump_pass(step, out / "good.npz", num_blocks=8)
            report = inspect_dump(good)
            print(f"{good}: {'every check passed' if report.ok else 'FAILED ' + ', '.join(report.failed)}")
            # a bug writes one token's KV slot into another stream's block
            slot = step.meta.slot_stacked + 8 * 3
            dev.upload(slot, np.array([7 * 16 + 1], np.int64))
            bad = dump_pass(step, out / "bad.npz", num_blocks=8)
    report = inspect_dump(bad)
    print(f"{bad}: failed {', '.join(report.failed)}")
    print(format_diff(diff_dumps(good, bad), str(good), str(bad)))
    return 0 if len(report.failed) == 1 else 1  # one corruption, one check


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="q12drv-dumps-")))
