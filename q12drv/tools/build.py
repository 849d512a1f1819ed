"""``q12drv build``: compile every kernel into the cubin cache ahead of the first pass, exactly as a launch looks it
up (the same source, architecture and defines: :func:`q12drv.kernels.registry.compile_defines`), so the first pass
of a runtime starts without NVRTC's seconds per source."""

from __future__ import annotations

import time
from typing import Callable

from ..core.nvrtc import cache_dir, compile_source, target_arch
from ..kernels.registry import SOURCES, compile_defines

__all__ = ["build_cache"]


def build_cache(arch: str = "sm_90", out: Callable[[str], None] = print) -> int:
    """Compile every registered kernel source for ``arch`` into the cubin cache; return 0.

    Sources that need another architecture's instructions (wgmma on Hopper only) are skipped with a line saying so.

    Raises
    ------
    NvrtcError
        A source that does not compile (NVRTC's log in the message).
    """
    out(f"cubin cache: {cache_dir()}")
    for source in SOURCES:
        try:
            target = target_arch(source, arch)
        except ValueError as exc:
            out(f"  {source:<24} skipped: {exc}")
            continue
        t0 = time.perf_counter()
        img = compile_source(source, arch=arch, defines=compile_defines(source))
        how = "cached already" if img.cached else f"compiled in {time.perf_counter() - t0:.1f} s"
        out(f"  {source:<24} {target:<7} {how}")
    return 0
