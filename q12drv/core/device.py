"""Device layer: a context on one GPU (or the emulator) and what lives in it.

Allocations, pinned host buffers, streams and events are owned by the :class:`Device` that made
them and released by :meth:`Device.close` (or the ``with`` block), in reverse order.
"""

from __future__ import annotations

import atexit
import ctypes
import weakref
from typing import Any

import numpy as np

from .driver import Driver, open_driver
from .errors import Q12Error
from .ints import checked_int
from .ptr import DevicePtr

__all__ = ["Device", "DeviceBuffer", "PinnedBuffer", "Stream", "Event", "DeviceArray", "open_device"]


class DeviceArray:
    """A typed, non-owning view of device memory that torch and CuPy can wrap without a copy.

    Implements ``__cuda_array_interface__`` version 3 (C-contiguous).
    """

    def __init__(self, ptr: int, dtype, shape, owner: Any = None):
        self.ptr = DevicePtr(ptr)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._owner = owner

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (int(self.ptr), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    def __repr__(self) -> str:
        return f"DeviceArray(ptr={self.ptr!r}, dtype={self.dtype}, shape={self.shape})"


class DeviceBuffer:
    """One ``cuMemAlloc`` allocation. ``ptr`` is a :class:`DevicePtr`; freed by ``free()``/``close()``."""

    def __init__(self, device: "Device", nbytes: int, name: str = ""):
        self.device = device
        self.nbytes = int(nbytes)
        self.name = name
        self.ptr = DevicePtr(device.driver.mem_alloc(self.nbytes))

    @property
    def alive(self) -> bool:
        return self.ptr != 0

    def view(self, dtype, shape, offset: int = 0) -> DeviceArray:
        """A :class:`DeviceArray` over ``[offset, offset + nbytes)``; bounds-checked."""
        arr = DeviceArray(int(self.ptr) + int(offset), dtype, shape, owner=self)
        if offset < 0 or offset + arr.nbytes > self.nbytes:
            raise ValueError(f"view of {arr.nbytes} bytes at offset {offset} exceeds buffer {self.name!r} of {self.nbytes} bytes")
        return arr

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, DevicePtr(0)
            self.device._forget(self)
            self.device.driver.mem_free(ptr)

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.name!r}, ptr={self.ptr!r}, nbytes={self.nbytes})"


class PinnedBuffer:
    """Page-locked host memory (``cuMemHostAlloc``) with a writable numpy uint8 view ``.array``."""

    def __init__(self, device: "Device", nbytes: int, name: str = ""):
        self.device = device
        self.nbytes = int(nbytes)
        self.name = name
        self.addr = device.driver.host_alloc(self.nbytes)
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.addr))

    def free(self) -> None:
        if self.addr:
            addr, self.addr = self.addr, 0
            self.array = None
            self.device._forget(self)
            self.device.driver.host_free(addr)


class Stream:
    """A CUDA stream (non-blocking). ``handle`` is the raw ``CUstream`` as an int."""

    def __init__(self, device: "Device", raw: Any = None, owned: bool = True):
        self.device = device
        self.owned = owned
        self.raw = device.driver.stream_create() if raw is None else raw

    @property
    def handle(self) -> int:
        return self.device.driver.stream_handle(self.raw)

    def synchronize(self) -> None:
        self.device.driver.stream_synchronize(self.raw)

    def wait(self, event: "Event") -> None:
        self.device.driver.stream_wait_event(self.raw, event.raw)

    def destroy(self) -> None:
        if self.owned and self.raw is not None:
            raw, self.raw = self.raw, None
            self.device._forget(self)
            self.device.driver.stream_destroy(raw)


class Event:
    """A CUDA event; ``timing=True`` for elapsed-time measurement."""

    def __init__(self, device: "Device", timing: bool = False):
        self.device = device
        self.raw = device.driver.event_create(timing)

    def record(self, stream: Any = None) -> "Event":
        self.device.driver.event_record(self.raw, self.device.as_stream(stream))
        return self

    def synchronize(self) -> None:
        self.device.driver.event_synchronize(self.raw)

    def query(self) -> bool:
        return self.device.driver.event_query(self.raw)

    def elapsed_ms(self, end: "Event") -> float:
        return self.device.driver.event_elapsed_ms(self.raw, end.raw)

    def destroy(self) -> None:
        if self.raw is not None:
            raw, self.raw = self.raw, None
            self.device._forget(self)
            self.device.driver.event_destroy(raw)


class Device:
    """A context on one device, through a real or emulated driver.

    Use :func:`open_device` to make one; close it (or use ``with``) to release everything it
    allocated.

    Attributes
    ----------
    driver : Driver
    ordinal : int
    name : str
    compute_capability : tuple of int
    arch : str
        NVRTC target for this device, e.g. ``"sm_90"``.
    stream : Stream
        The device's default (non-blocking) stream, used when a call gets ``stream=None``.
    """

    def __init__(self, driver: Driver, ordinal: int = 0):
        if not isinstance(driver, Driver):
            raise TypeError(f"driver must be a q12drv Driver, got {type(driver).__name__}")
        self.driver = driver
        self.ordinal = checked_int("ordinal", ordinal, 0)
        self._owned: list = []
        self._dependents: "weakref.WeakSet" = weakref.WeakSet()  # objects told when the device closes (arenas)
        self._keepalive: list = []  # (stream, host array) of copies a failed wait left pending
        self.cache: dict = {}  # per-device memo for higher layers (loaded modules)
        self._ctx = driver.open_context(self.ordinal)
        try:
            self.name = driver.device_name(self.ordinal)
            self.compute_capability = driver.compute_capability(self.ordinal)
            self.arch = "sm_%d%d" % self.compute_capability
            #: Streaming multiprocessors (persistent grids are sized from it).
            self.sm_count = int(driver.device_attribute(self.ordinal, "multiprocessor_count"))
            self.stream = self._own(Stream(self))
        except BaseException:
            ctx, self._ctx = self._ctx, None  # a half-opened device releases its context
            try:
                driver.close_context(ctx)
            except Exception:
                pass  # the original error is the one to report
            raise
        _OPEN_DEVICES.add(self)

    # ownership -------------------------------------------------------------------------
    def _own(self, obj):
        self._owned.append(obj)
        return obj

    def _forget(self, obj) -> None:
        try:
            self._owned.remove(obj)
        except ValueError:
            pass

    @property
    def closed(self) -> bool:
        return self._ctx is None

    @property
    def buffers(self) -> tuple:
        """The live :class:`DeviceBuffer` allocations this device owns, oldest first."""
        return tuple(o for o in self._owned if isinstance(o, DeviceBuffer) and o.alive)

    def _require_open(self) -> None:
        if self._ctx is None:
            raise Q12Error("this Device is closed; open a new one with q12drv.open_device()")

    # factories -------------------------------------------------------------------------
    def alloc(self, nbytes: int, name: str = "") -> DeviceBuffer:
        """Allocate ``nbytes`` of device memory (``cuMemAlloc``, 256-byte aligned)."""
        self._require_open()
        checked_int("nbytes (allocation size)", nbytes, 1)
        return self._own(DeviceBuffer(self, nbytes, name))

    def pinned(self, nbytes: int, name: str = "") -> PinnedBuffer:
        """Allocate ``nbytes`` of page-locked host memory (``cuMemHostAlloc``)."""
        self._require_open()
        checked_int("nbytes (pinned allocation size)", nbytes, 1)
        return self._own(PinnedBuffer(self, nbytes, name))

    def new_stream(self) -> Stream:
        self._require_open()
        return self._own(Stream(self))

    def event(self, timing: bool = False) -> Event:
        self._require_open()
        return self._own(Event(self, timing))

    # streams ---------------------------------------------------------------------------
    def as_stream(self, stream: Any = None) -> Any:
        """The driver stream for ``stream``.

        Accepts None (the device's default stream), a :class:`Stream`, a raw handle (int; 0 is
        the legacy default stream), or any object exposing ``.cuda_stream`` (torch) or
        ``.handle`` (cuda.core, q12drv).
        """
        if stream is None:
            return self.stream.raw
        if isinstance(stream, Stream):
            if stream.raw is None:
                raise ValueError("that q12drv Stream has been destroyed")
            return stream.raw
        if isinstance(stream, (int, np.integer)):
            return self.driver.stream_from_handle(int(stream))
        for attr in ("cuda_stream", "handle", "ptr"):
            if hasattr(stream, attr):
                return self.driver.stream_from_handle(int(getattr(stream, attr)))
        raise TypeError(
            f"stream must be None, a q12drv Stream, an int handle, or an object with .cuda_stream or "
            f".handle; got {type(stream).__name__}"
        )

    def synchronize(self, stream: Any = None) -> None:
        """Wait for all work on ``stream`` (default: the device's stream)."""
        s = self.as_stream(stream)
        self.driver.stream_synchronize(s)
        if self._keepalive:
            self._keepalive = [(ks, host) for ks, host in self._keepalive if ks is not s]

    def _wait_for_copy(self, s: Any, host: np.ndarray) -> None:
        try:
            self.driver.stream_synchronize(s)
        except BaseException:
            # The copy may still run after the failed wait: its host buffer must outlive it.
            self._keepalive.append((s, host))
            raise

    # copies ----------------------------------------------------------------------------
    def upload(self, dst: int, data, stream: Any = None) -> None:
        """Copy a host array (any contiguous numpy array) to ``dst`` and wait for it."""
        arr = np.ascontiguousarray(data)
        s = self.as_stream(stream)
        self.driver.memcpy_htod_async(int(dst), arr.ctypes.data, arr.nbytes, s)
        self._wait_for_copy(s, arr)

    def download(self, src: int, nbytes: int, stream: Any = None) -> bytes:
        """Copy ``nbytes`` at ``src`` back to the host after the work on ``stream`` (synchronizing)."""
        out = np.empty(int(nbytes), dtype=np.uint8)
        s = self.as_stream(stream)
        if nbytes:
            self.driver.memcpy_dtoh_async(out.ctypes.data, int(src), int(nbytes), s)
        self._wait_for_copy(s, out)
        return out.tobytes()

    def download_array(self, src: int, dtype, shape, stream: Any = None) -> np.ndarray:
        """Like :meth:`download`, as a numpy array of ``dtype`` and ``shape``."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return np.frombuffer(self.download(src, n, stream), dtype=dtype).reshape(shape).copy()

    def memset(self, dst: int, value: int, nbytes: int, stream: Any = None) -> None:
        """Fill ``nbytes`` at ``dst`` with the byte ``value`` (stream-ordered, not waited for).

        Raises
        ------
        TypeError, ValueError
            ``value`` not a byte (0..255: 300 would be written as 44), ``nbytes`` negative, ``dst`` not a
            device address; nothing enqueued.
        """
        value = checked_int("memset value (a byte)", value, 0, 255)
        nbytes = checked_int("memset nbytes", nbytes, 0)
        self.driver.memset_d8_async(int(DevicePtr(dst)), value, nbytes, self.as_stream(stream))

    # lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Synchronize, then release everything this device owns and its context. Idempotent.

        Every release is attempted even when one fails; the first error is raised afterwards.
        Devices still open at interpreter exit are closed by an ``atexit`` hook.
        """
        if self._ctx is None:
            return
        _OPEN_DEVICES.discard(self)
        errors = []
        try:
            self.driver.stream_synchronize(self.stream.raw)
        except Exception as exc:
            errors.append(exc)
        for unload in list(self.cache.get("_unloaders", ())):
            try:
                unload()
            except Exception as exc:
                errors.append(exc)
        self.cache.clear()
        # Streams and events first (destroying a stream lets its queued work finish), memory last,
        # so that no queued copy or kernel outlives the memory it uses even if the wait failed.
        owned = list(reversed(self._owned))
        for obj in [o for o in owned if not isinstance(o, (DeviceBuffer, PinnedBuffer))] + \
                   [o for o in owned if isinstance(o, (DeviceBuffer, PinnedBuffer))]:
            release = getattr(obj, "free", None) or getattr(obj, "destroy", None)
            try:
                release()
            except Exception as exc:
                errors.append(exc)
        self._owned.clear()
        for dep in list(self._dependents):  # e.g. an arena whose allocation was just freed: it is closed now
            dep._device_closed()
        self._dependents.clear()
        ctx, self._ctx = self._ctx, None
        try:
            self.driver.close_context(ctx)
        except Exception as exc:
            errors.append(exc)
        self._keepalive.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        why = getattr(self.driver, "fallback_reason", None)
        driver = self.driver.name if why is None else f"{self.driver.name} (auto fell back: {why})"
        return f"Device({self.name!r}, driver={driver}, arch={self.arch})"


#: Devices not yet closed; closed at interpreter exit so contexts, modules and pinned memory are
#: released in order (before the driver bindings are torn down) even when the caller forgot. The
#: references are strong on purpose: a device dropped without close() holds its GPU memory anyway.
_OPEN_DEVICES: "set[Device]" = set()


@atexit.register
def _close_open_devices() -> None:
    for dev in list(_OPEN_DEVICES):
        try:
            dev.close()
        except Exception:
            pass  # at exit there is nobody to report to; keep releasing the others


def open_device(driver: str | Driver | None = "auto", ordinal: int = 0, *, deferred: bool = False) -> Device:
    """Open a device.

    Parameters
    ----------
    driver : {"auto", "cuda", "emu"}, Driver or None
        ``"auto"`` uses the GPU when there is one, the emulator otherwise; ``None`` reads
        ``Q12DRV_DRIVER``. An environment setting ``Q12DRV_DRIVER`` overrides ``"auto"``.
    ordinal : int
        Device index.
    deferred : bool
        Emulator only: run stream work only when waited for (see :mod:`q12drv.core.driver.emu`).

    Returns
    -------
    Device
    """
    import os

    if isinstance(driver, Driver):
        return Device(driver, ordinal)
    if driver == "auto" and os.environ.get("Q12DRV_DRIVER"):
        driver = None
    return Device(open_driver(driver, deferred=deferred), ordinal)
