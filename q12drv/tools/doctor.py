"""``q12drv doctor``: what q12drv will run on, and every kernel's resources from a fresh compile."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..core.driver import open_driver
from ..core.errors import NvrtcError, Q12Error
from ..kernels import attention as _attn
from ..kernels import attention_wgmma as _attnw
from ..kernels import gdn as _gdn
from ..kernels.ops import SOURCES
from ..kernels.registry import compile_defines
from ..core.nvrtc import compile_source, cuda_header_dir, cuda_src_dir, nvrtc_version
from .sass import disassemble, find_nvdisasm, wgmma_summary

__all__ = ["KernelResources", "parse_ptxas_report", "dynamic_smem", "run_doctor"]


@dataclass(frozen=True)
class KernelResources:
    """ptxas's report for one entry."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> list:
    """Per-entry resources from an NVRTC log compiled with ``--ptxas-options=-v``."""
    out, name, props = [], None, (0, 0, 0)
    for line in log.splitlines():
        if (m := _ENTRY.search(line)):
            name = m.group(1)
        elif (m := _PROPS.search(line)) and name:
            props = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and name:
            out.append(KernelResources(name, int(m.group(1)), props[1], props[2], props[0], int(m.group(2) or 0)))
            name = None
    return out


def dynamic_smem(entry: str) -> int:
    """Dynamic shared memory a launch of ``entry`` asks for (0: static only)."""
    if entry in _attn.ENTRIES:
        return _attn.smem_bytes(int(entry.rsplit("_d", 1)[1]))
    if entry in _attnw.ENTRIES:
        return _attnw.smem_bytes(int(entry.rsplit("_d", 1)[1]))
    if entry.startswith("q12_gdn_"):
        return _gdn.entry_smem(entry)
    return 0


def run_doctor(driver: str | None = "auto", *, arch: str | None = None, out: Callable[[str], None] = print) -> int:
    """Print the environment and compile every kernel as q12drv builds it; return 0 when all compile without spills
    and, where ``nvdisasm`` is found (:mod:`q12drv.tools.sass`), no kernel's warpgroup MMAs were serialised by ptxas.

    Each kernel's row: ptxas's registers, spill stores and loads, stack frame and static shared memory, the
    dynamic shared memory its launch asks for, the compile time of its source, and (with ``nvdisasm``) ``sass``:
    its SASS instruction count, ``wgmma``: its warpgroup MMAs and the groups they form.
    """
    ok = True
    try:
        drv = open_driver(driver)
        out(f"driver: {drv.name}" + (" (no usable GPU: emulating)" if drv.name == "emu" and driver == "auto" else ""))
        dev_arch = "sm_90"
        if drv.name == "cuda":
            cc = drv.compute_capability(0)
            dev_arch = "sm_%d%d" % cc
            out(f"device 0: {drv.device_name(0)}, compute capability {cc[0]}.{cc[1]}, driver API {drv.driver_version()}")
        else:
            out("device: emulated (numpy references run in place of kernels)")
    except Q12Error as exc:
        out(f"driver: unavailable ({exc})")
        ok = False
        dev_arch = "sm_90"
    arch = arch or dev_arch
    major, minor = nvrtc_version()
    out(f"NVRTC {major}.{minor}; headers {cuda_header_dir()}; sources {cuda_src_dir()}; target {arch}")
    nvdisasm = find_nvdisasm()
    out(f"SASS: {nvdisasm}" if nvdisasm else
        "SASS: nvdisasm not found (pip install nvidia-cuda-nvdisasm): no instruction counts, no wgmma check")
    out(f"{'kernel':<32}{'regs':>6}{'spill st':>10}{'spill ld':>10}{'stack':>8}{'smem':>8}{'dyn smem':>10}"
        f"{'compile s':>11}{'sass':>7}{'wgmma':>8}")
    for source in SOURCES:
        t0 = time.perf_counter()
        try:
            compiled = compile_source(source, arch=arch, defines=compile_defines(source),
                                      verbose_resources=True)
        except NvrtcError as exc:
            out(f"{source}: FAILED\n{exc.log}")
            ok = False
            continue
        except ValueError as exc:  # an architecture-specific source (wgmma) on another architecture
            out(f"{source}: skipped: {exc}")
            continue
        dt = time.perf_counter() - t0
        sass = disassemble(compiled.image, nvdisasm) if nvdisasm else {}
        for r in parse_ptxas_report(compiled.log):
            flag = "" if r.spill_stores == r.spill_loads == 0 else "  <- spills"
            ok &= not flag
            dyn = f"{dynamic_smem(r.name):>10}"
            code = f"{'-':>7}{'-':>8}"
            if r.name in sass:
                w = wgmma_summary(r.name, sass[r.name])
                code = f"{w.instructions:>7}{f'{w.hgmma}/{w.groups}' if w.hgmma else '-':>8}"
                if w.serialised:
                    flag += "  <- wgmma serialised (ptxas gave up on the pipeline: each MMA waited alone)"
                    ok = False
            out(f"{r.name:<32}{r.registers:>6}{r.spill_stores:>10}{r.spill_loads:>10}{r.stack_frame:>8}"
                f"{r.static_smem:>8}{dyn}{dt:>11.2f}{code}{flag}")
    out("doctor: " + ("ok" if ok else "PROBLEMS FOUND"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_doctor())
