"""Exception types of q12drv. Every error names what was wrong, the numbers, and what to do."""

from __future__ import annotations

__all__ = [
    "Q12Error",
    "CudaError",
    "DriverUnavailableError",
    "NvrtcError",
    "CapacityError",
    "HostRaceError",
    "DumpError",
]


class Q12Error(Exception):
    """Base class of every error q12drv raises on purpose."""


class CudaError(Q12Error):
    """A CUDA driver call returned a non-zero ``CUresult``.

    Attributes
    ----------
    name : str
        The ``CUresult`` name, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    code : int
        Its numeric value.
    call : str
        The driver call that returned it, e.g. ``"cuMemAlloc"``.
    """

    def __init__(self, name: str, code: int, call: str, detail: str = ""):
        self.name = name
        self.code = int(code)
        self.call = call
        self.detail = detail
        msg = f"{call} failed: {name} ({self.code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class DriverUnavailableError(Q12Error):
    """The real CUDA driver was asked for but cannot be used (no libcuda, no device)."""


class NvrtcError(Q12Error):
    """NVRTC refused to compile a kernel source; ``log`` holds the compiler's full log."""

    def __init__(self, source: str, log: str, options: tuple[str, ...] = ()):
        self.source = source
        self.log = log
        self.options = tuple(options)
        super().__init__(f"NVRTC failed to compile {source}:\n{log.strip()}")


class CapacityError(Q12Error, ValueError):
    """A reservation or a copy does not fit the memory it targets; nothing was written.

    Attributes
    ----------
    region : str
        What was being placed (e.g. ``"stacked metadata"``).
    needed : int
        Bytes the region needs (end offset of the request).
    available : int
        Bytes there are (the capacity it had to fit in).
    """

    def __init__(self, region: str, needed: int, available: int, hint: str = ""):
        self.region = region
        self.needed = int(needed)
        self.available = int(available)
        msg = f"{region} needs {self.needed:,} bytes but only {self.available:,} are available"
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)


class HostRaceError(Q12Error):
    """Pinned host memory was rewritten while a copy that reads it was still pending.

    Raised by the emulated driver in deferred mode, where such a race is detectable on a
    machine with no GPU: on real hardware it silently uploads the wrong bytes.
    """


class DumpError(Q12Error):
    """An arena dump file cannot be read: missing, truncated, not a q12drv dump, an unsupported
    schema version, or a header that contradicts itself or the bytes it describes.

    The message names the file and the problem; nothing in the file is trusted before it is checked.
    """
