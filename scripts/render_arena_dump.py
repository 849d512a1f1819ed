#!/usr/bin/env python3
"""Draw an arena dump as a PNG (same as 'q12drv render').

Usage: python scripts/render_arena_dump.py --help
"""

import os
import sys

try:
    from q12drv.tools.dump_cli import script_main
except ModuleNotFoundError:  # run from a checkout without installing q12drv
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from q12drv.tools.dump_cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("render", prog=os.path.basename(__file__)))
