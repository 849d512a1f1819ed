"""SASS of q12drv's kernels: what ptxas made of a source, read with ``nvdisasm``.

The machine code is the last word on what a kernel's chain costs: how many instructions sit between two
waits, whether a load was vectorised, whether ptxas kept the warpgroup MMAs asynchronous. ptxas 13.0
*serialises* every ``wgmma`` of a kernel (each one its own group, waited alone) as soon as it cannot prove a
pipeline safe (an accumulator in flight across a loop's back edge, say) and says so nowhere in NVRTC's log:
such a build compiles without spills and runs correctly, several times slower. :func:`wgmma_summary` spots
it from the SASS; ``q12drv doctor`` reports it for every kernel and ``q12drv sass`` prints a kernel's code.

``nvdisasm`` comes from the CUDA toolkit or the ``nvidia-cuda-nvdisasm`` wheel (in the ``test`` extra);
:func:`find_nvdisasm` looks on ``PATH``, under ``$CUDA_HOME/bin``, then in the wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.errors import Q12Error
from ..core.nvrtc import compile_source
from ..kernels.ops import SOURCES
from ..kernels.registry import compile_defines

__all__ = ["NvdisasmNotFound", "find_nvdisasm", "disassemble", "WgmmaSummary", "wgmma_summary", "run_sass"]


class NvdisasmNotFound(Q12Error):
    """No ``nvdisasm`` on this machine."""


_NOT_FOUND = ("nvdisasm not found on PATH, under $CUDA_HOME/bin or in the nvidia-cuda-nvdisasm wheel; "
              "pip install nvidia-cuda-nvdisasm (q12drv's test extra has it)")


def find_nvdisasm() -> str | None:
    """Path of an ``nvdisasm`` executable: ``PATH``, ``$CUDA_HOME/bin``, then the ``nvidia-cuda-nvdisasm`` wheel
    (``nvidia/cu13/bin`` or, for CUDA 12 wheels, ``nvidia/cuda_nvdisasm/bin``); None if there is none."""
    hit = shutil.which("nvdisasm")
    if hit:
        return hit
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvdisasm"))
    try:
        import nvidia  # namespace package of NVIDIA's wheels

        for root in nvidia.__path__:
            candidates += [os.path.join(root, sub, "bin", "nvdisasm") for sub in ("cu13", "cuda_nvdisasm")]
    except ImportError:
        pass
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


_SECTION = re.compile(r"^\s*//-+ \.text\.(\w+)\s+-+\s*$", re.M)


def disassemble(image: bytes, nvdisasm: str | None = None) -> dict:
    """``{entry: SASS text}`` of a compiled cubin (``CompiledModule.image``), one entry per ``.text`` section.

    Raises
    ------
    NvdisasmNotFound
        No ``nvdisasm`` (install the ``nvidia-cuda-nvdisasm`` wheel or a CUDA toolkit).
    Q12Error
        ``nvdisasm`` refused the image (its message included): an image that is not a cubin, or a
        disassembler older than the compiler.
    """
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise NvdisasmNotFound(_NOT_FOUND)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image)
        f.flush()
        run = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
    if run.returncode:
        raise Q12Error(f"{tool} failed (exit {run.returncode}): {run.stderr.strip()[:2000]}")
    text = run.stdout
    heads = list(_SECTION.finditer(text))
    return {m.group(1): text[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
            for i, m in enumerate(heads)}


@dataclass(frozen=True)
class WgmmaSummary:
    """One entry's SASS, counted.

    ``instructions``: SASS instructions; ``hgmma``: warpgroup MMAs (``HGMMA``); ``groups``: those that close a
    group (``gsb0``: each ``wgmma.commit_group`` ends on one); ``waits``: ``WARPGROUP.DEPBAR`` (``wgmma.wait_group``).
    ``serialised``: more than one MMA and every one its own group, ptxas's fallback when it gives up on the
    pipeline (a correct build, several times slower)."""

    entry: str
    instructions: int
    hgmma: int
    groups: int
    waits: int

    @property
    def serialised(self) -> bool:
        return self.hgmma > 1 and self.groups == self.hgmma


_INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", re.M)


def wgmma_summary(entry: str, sass: str) -> WgmmaSummary:
    """Count ``entry``'s instructions and warpgroup MMAs in its SASS text (one value of :func:`disassemble`)."""
    ops = _INSTR.findall(sass)
    hgmma = [op for op in ops if "HGMMA" in op]
    return WgmmaSummary(entry, len(ops), len(hgmma), sum("gsb0" in op for op in hgmma),
                        sum("WARPGROUP.DEPBAR" in op for op in ops))


def run_sass(source: str, entries: Sequence[str] = (), *, arch: str = "sm_90", summary_only: bool = False,
             out: Callable[[str], None] = print) -> int:
    """``q12drv sass``: compile ``source`` (a file in ``cuda_src/``) for ``arch`` as q12drv builds it and print the
    SASS of ``entries`` (default: every entry), each followed by its :class:`WgmmaSummary`; return 0, or 1 if one
    of them has its warpgroup MMAs serialised.

    Raises
    ------
    Q12Error
        An unknown source or entry (the known ones listed), no ``nvdisasm``, a compile that fails (NVRTC's log).
    """
    if source not in SOURCES:
        raise Q12Error(f"unknown source {source!r}; cuda_src/ has {', '.join(sorted(SOURCES))}")
    tool = find_nvdisasm()
    if tool is None:  # before the compile
        raise NvdisasmNotFound(_NOT_FOUND)
    try:
        compiled = compile_source(source, arch=arch, defines=compile_defines(source))
    except ValueError as exc:  # an architecture-specific source on another architecture
        raise Q12Error(str(exc)) from None
    code = disassemble(compiled.image, tool)
    missing = [e for e in entries if e not in code]
    if missing:
        raise Q12Error(f"{source} has no entry {', '.join(missing)}; its entries: {', '.join(code)}")
    rc = 0
    for entry in entries or code:
        w = wgmma_summary(entry, code[entry])
        if not summary_only:
            out(f"// ==== {entry} ({source}, {compiled.arch})")
            out(code[entry].rstrip())
        note = "  <- wgmma serialised: ptxas waits for each MMA alone" if w.serialised else ""
        out(f"// {entry}: {w.instructions} instructions, {w.hgmma} HGMMA in {w.groups} groups, {w.waits} waits{note}")
        rc |= w.serialised
    return int(rc)
