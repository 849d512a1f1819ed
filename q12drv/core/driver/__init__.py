"""Driver layer: the CUDA driver API (real or emulated) behind one interface.

``open_driver("auto")`` picks the real driver when libcuda loads and a device is present, and
the emulated one otherwise; ``"cuda"`` insists on the real one (a clear error without it);
``"emu"`` always emulates. ``Q12DRV_DRIVER`` overrides the default ``"auto"``. When ``"auto"`` falls back
to the emulator it says so, once per process, on stderr (a GPU machine whose driver is broken would
otherwise run quietly on numpy), and the driver carries the reason (``EmuDriver.fallback_reason``).
"""

from __future__ import annotations

import os
import sys

from ..errors import DriverUnavailableError
from .base import Driver, PointerInfo
from .emu import DEFAULT_DEVICE_COUNT, TIMING_NOTE, EmuDriver, EmuImage, register_emulator
from .result import check, fail

__all__ = ["Driver", "EmuDriver", "EmuImage", "PointerInfo", "open_driver", "register_emulator", "check", "fail",
           "DRIVER_KINDS", "TIMING_NOTE", "DEFAULT_DEVICE_COUNT"]

DRIVER_KINDS = ("auto", "cuda", "emu")


def open_driver(kind: str | None = None, *, deferred: bool = False) -> Driver:
    """Open a driver.

    Parameters
    ----------
    kind : {"auto", "cuda", "emu"} or None
        None reads ``Q12DRV_DRIVER`` (default ``"auto"``).
    deferred : bool
        Emulated driver only: run stream work at synchronize/event time.

    Returns
    -------
    Driver

    Raises
    ------
    DriverUnavailableError
        ``kind="cuda"`` and there is no usable CUDA driver or device.
    ValueError
        ``kind`` is not one of :data:`DRIVER_KINDS`.
    """
    if kind is None:
        kind = os.environ.get("Q12DRV_DRIVER", "auto") or "auto"
    if not isinstance(kind, str):
        raise TypeError(f"driver must be one of {', '.join(DRIVER_KINDS)}, a Driver or None; got {type(kind).__name__} {kind!r:.60}")
    if not isinstance(deferred, bool):
        raise TypeError(f"deferred must be a bool, got {type(deferred).__name__} {deferred!r:.60}")
    kind = kind.strip().lower()
    if kind not in DRIVER_KINDS:
        raise ValueError(f"driver must be one of {', '.join(DRIVER_KINDS)} (argument or Q12DRV_DRIVER), got {kind!r}")
    if kind == "emu":
        return EmuDriver(deferred=deferred)
    from .cuda import CudaDriver

    if kind == "cuda":
        drv = CudaDriver()
        if drv.device_count() < 1:
            raise DriverUnavailableError("the CUDA driver loaded but reports no device; use driver='emu'")
        return drv
    try:
        drv = CudaDriver()
        if drv.device_count() >= 1:
            return drv
        reason = "the CUDA driver loaded but reports no device"
    except DriverUnavailableError as exc:  # no libcuda / no device: "auto" means emulate
        reason = " ".join(str(exc).split())
    return _fallback(reason, deferred)


_FALLBACK_NOTED = False


def _fallback(reason: str, deferred: bool) -> EmuDriver:
    """The emulated driver ``"auto"`` falls back to, marked with ``reason``; the first fallback of the process
    says so on stderr."""
    global _FALLBACK_NOTED
    drv = EmuDriver(deferred=deferred)
    drv.fallback_reason = reason
    if not _FALLBACK_NOTED:
        _FALLBACK_NOTED = True
        print(f"q12drv: driver 'auto' found no usable CUDA GPU and runs on the emulated driver (numpy on the host, "
              f"far slower than a GPU; choose driver='emu' or Q12DRV_DRIVER=emu to silence this note): {reason}",
              file=sys.stderr)
    return drv
