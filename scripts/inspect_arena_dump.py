#!/usr/bin/env python3
"""Decode an arena dump and check it (same as 'q12drv inspect').

Usage: python scripts/inspect_arena_dump.py --help
"""

import os
import sys

try:
    from q12drv.tools.dump_cli import script_main
except ModuleNotFoundError:  # run from a checkout without installing q12drv
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from q12drv.tools.dump_cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("inspect", prog=os.path.basename(__file__)))
