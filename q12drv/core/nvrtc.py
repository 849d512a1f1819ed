"""Compiling ``cuda_src/*.cu`` with NVRTC (through cuda.core), and the on-disk cubin cache.

NVRTC runs on machines with no GPU, so everything here works on CI: it needs only the
``nvidia-cuda-nvrtc`` wheel and the CUDA headers from ``nvidia-cuda-runtime``.

The cache key is cuda.core's :func:`~cuda.core.utils.make_program_cache_key` (NVRTC version,
architecture, options, source) with the digest of every header the source includes, followed
transitively, as ``extra_digest``: editing a ``.cuh`` recompiles everything that includes it.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import NvrtcError

__all__ = [
    "CompiledImage",
    "cuda_src_dir",
    "cuda_header_dir",
    "nvrtc_version",
    "compile_source",
    "target_arch",
    "ARCH_SPECIFIC_SOURCES",
    "cache_dir",
    "local_headers",
]

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.MULTILINE)


@dataclass(frozen=True)
class CompiledImage:
    """A compiled kernel source.

    Attributes
    ----------
    filename : str
        The ``cuda_src`` file it came from.
    arch : str
        ``sm_XX`` it was compiled for.
    image : bytes
        The cubin.
    log : str
        The NVRTC log (ptxas ``-v`` resource report included); empty on a cache hit.
    key : bytes
        The cache key.
    cached : bool
        Whether the cubin came from the on-disk cache.
    """

    filename: str
    arch: str
    image: bytes
    log: str
    key: bytes
    cached: bool


def cuda_src_dir() -> Path:
    """The directory holding the kernel sources (``cuda_src/``), packaged or in a checkout."""
    override = os.environ.get("Q12DRV_CUDA_SRC")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    # installed: the wheel puts cuda_src/ inside the package; a checkout keeps it beside it
    for candidate in (here.parent / "cuda_src", here.parent.parent / "cuda_src"):
        if (candidate / "common/q12_meta.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "cannot find q12drv's kernel sources (cuda_src/common/q12_meta.cuh): reinstall q12drv, "
        "or set Q12DRV_CUDA_SRC to the cuda_src directory of a checkout"
    )


@functools.lru_cache(maxsize=1)
def cuda_header_dir() -> str:
    """The CUDA runtime header directory (``cuda_bf16.h``) NVRTC compiles against."""
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if not found or not Path(found, "cuda_bf16.h").is_file():
        raise FileNotFoundError(
            "NVRTC needs the CUDA runtime headers (cuda_bf16.h) and none were found: "
            "pip install nvidia-cuda-runtime (or set CUDA_HOME to a CUDA toolkit)"
        )
    return str(found)


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise NvrtcError("<nvrtcVersion>", f"nvrtcVersion failed with {err!r}")
    return int(major), int(minor)


def cache_dir() -> Path:
    """Where compiled cubins are kept: ``$Q12DRV_CACHE_DIR`` or ``~/.cache/q12drv/cubin``."""
    root = os.environ.get("Q12DRV_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "q12drv" / "cubin"


def _includes(source: str, include_dirs) -> Iterator[tuple[str, Path | None, bytes]]:
    """The headers ``source`` includes, followed transitively, each once: ``(name as included, resolved path,
    bytes)``, or ``(name, None, b"")`` for one in none of ``include_dirs`` (a header NVRTC provides itself)."""
    seen: set[Path] = set()
    pending = list(_INCLUDE_RE.findall(source))
    while pending:
        name = pending.pop()
        path = next((p for p in (Path(d, name) for d in include_dirs) if p.is_file()), None)
        if path is None:
            yield name, None, b""
            continue
        path = path.resolve()
        if path in seen:
            continue
        seen.add(path)
        data = path.read_bytes()
        yield name, path, data
        pending.extend(_INCLUDE_RE.findall(data.decode("utf-8", "replace")))


def local_headers(source: str) -> tuple[str, ...]:
    """The text of every ``cuda_src`` header ``source`` includes, followed transitively (system headers left out)."""
    return tuple(data.decode() for _, path, data in _includes(source, [cuda_src_dir()]) if path is not None)


def _headers_digest(source: str, include_dirs: list[str]) -> bytes:
    """sha256 over the name and bytes of every header ``source`` includes, transitively (a header NVRTC provides
    itself counts by name: it is part of the NVRTC version)."""
    digest = hashlib.sha256()
    for name, path, data in _includes(source, include_dirs):
        if path is None:
            digest.update(b"builtin:" + name.encode())
            continue
        digest.update(len(name).to_bytes(8, "little") + name.encode())
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


#: Sources that use architecture-specific instructions (wgmma): on sm_90 they compile for sm_90a.
ARCH_SPECIFIC_SOURCES = frozenset({"attention/wgmma.cu", "gdn/chunked_wgmma.cu"})


def target_arch(filename: str, arch: str) -> str:
    """The target ``filename`` compiles for on a device of ``arch``: ``arch`` itself, or ``sm_90a``
    for an :data:`ARCH_SPECIFIC_SOURCES` file on ``sm_90`` / ``sm_90a``.

    Raises
    ------
    ValueError
        An architecture-specific source on any other architecture (wgmma exists on sm_90a only).
    """
    if filename not in ARCH_SPECIFIC_SOURCES:
        return arch
    if arch in ("sm_90", "sm_90a"):
        return "sm_90a"
    raise ValueError(f"{filename} uses wgmma, which exists on sm_90a (Hopper) only; the target is {arch}: "
                     f"use the mma.sync kernels (algo='mma') there")


def compile_source(
    filename: str,
    *,
    arch: str = "sm_90",
    defines: tuple[str, ...] | list[str] = (),
    use_cache: bool = True,
    verbose_resources: bool = False,
    source_dir: str | os.PathLike | None = None,
) -> CompiledImage:
    """Compile one ``cuda_src`` file to a cubin for ``arch``.

    Parameters
    ----------
    filename : str
        File name inside :func:`cuda_src_dir` (e.g. ``"attention/mma.cu"``), or inside ``source_dir``.
    arch : str
        Target, ``"sm_90"`` for the H200; :func:`target_arch` turns it into ``"sm_90a"`` for the
        sources that use wgmma.
    defines : sequence of str
        ``NAME=VALUE`` macros (the metadata mirror's offsets among them).
    use_cache : bool
        Look up and store the cubin in the on-disk cache (:func:`cache_dir`).
    verbose_resources : bool
        Ask ptxas for its resource report (registers, spills, shared memory); bypasses the
        cache read so that the log is fresh.
    source_dir : path-like, optional
        The directory of a source kept outside ``cuda_src`` (the benchmarks' kernels); its
        ``#include`` s are still found in :func:`cuda_src_dir`.

    Returns
    -------
    CompiledImage

    Raises
    ------
    NvrtcError
        With NVRTC's full log when the source does not compile.
    ValueError
        An architecture-specific source for a target that lacks its instructions.
    """
    from cuda.core import Program, ProgramOptions
    from cuda.core.utils import FileStreamProgramCache, make_program_cache_key

    src_dir = cuda_src_dir()
    path = Path(source_dir or src_dir) / filename
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {filename!r} in {source_dir or src_dir}")
    arch = target_arch(filename, arch)
    source = path.read_text()
    include_dirs = [str(src_dir), cuda_header_dir()]
    options = ProgramOptions(
        name=filename,
        arch=arch,
        std="c++17",
        include_path=include_dirs,
        define_macro=list(defines) or None,
        ptxas_options=["-v"] if verbose_resources else None,
        use_fast_math=False,
    )
    key = make_program_cache_key(
        code=source,
        code_type="c++",
        options=options,
        target_type="cubin",
        extra_digest=_headers_digest(source, include_dirs),
    )
    cache = None
    if use_cache:
        cache_dir().mkdir(parents=True, exist_ok=True)
        cache = FileStreamProgramCache(cache_dir())
        if not verbose_resources:
            hit = cache.get(key)
            if hit is not None:
                return CompiledImage(filename, arch, bytes(hit), "", key, True)
    log = io.StringIO()
    try:
        program = Program(source, "c++", options=options)
        obj = program.compile("cubin", logs=log)
    except Exception as exc:  # cuda.core raises its own types; keep the log, name the file
        raise NvrtcError(filename, f"{log.getvalue()}\n{exc}", tuple(map(str, defines))) from exc
    image = bytes(obj.code)
    if cache is not None:
        cache.update({key: image})
    return CompiledImage(filename, arch, image, log.getvalue(), key, False)
