"""Device layer: a context on one GPU (or the emulator) and what lives in it.

Allocations, pinned host buffers, streams and events are owned by the :class:`Device` that made
them and released by :meth:`Device.close` (or the ``with`` block), in reverse order.

Threads and devices: a :class:`Device` is its device's primary context (the one torch and CuPy use too).
Any thread may use it: every call makes that context current in the calling thread first, unless it is
already (a thread-local check, no driver call; :meth:`Device.set_current` forces it, for code that changed
the current context behind q12drv's back). Several devices may be open at once, each keeping its own
context current for its own calls. What a thread needs for itself (the kernels' pre-packed argument
blocks) is kept per thread (:attr:`Device.local`); an arena, a pass or a stream is used by one thread at a
time.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from typing import Any

import numpy as np

from .driver import Driver, open_driver
from .errors import CudaError, Q12Error
from .interop import ArrayInfo, describe, device_pointer, host_owner, stream_handle
from .ints import checked_int
from .ptr import DevicePtr

__all__ = ["Device", "DeviceBuffer", "PinnedBuffer", "Stream", "Event", "DeviceArray", "DeviceLocal", "open_device", "CURRENT"]


class _Current(threading.local):
    """Per thread: the :class:`Device` whose context this thread made current last (None: none yet)."""

    device: "Device | None" = None


#: The calling thread's current q12drv device; the hot paths compare it with their device
#: (``if CURRENT.device is not dev: dev.set_current()``) instead of asking the driver.
CURRENT = _Current()


class DeviceLocal(threading.local):
    """What one thread keeps for itself on one device (:attr:`Device.local`).

    Attributes
    ----------
    launches : dict
        Kernel entry -> this thread's pre-packed :class:`~q12drv.core.launch.Launch` (see
        :func:`q12drv.kernels.registry.prepared`).
    """

    def __init__(self):
        self.launches: dict = {}


class DeviceArray:
    """A typed, non-owning view of device memory that torch and CuPy can wrap without a copy.

    Implements ``__cuda_array_interface__`` version 3 (C-contiguous), with the stream its bytes are pending
    on: a consumer (torch, CuPy) makes its own stream wait for that one before it reads them.

    Parameters
    ----------
    ptr : int
    dtype, shape
        numpy dtype and shape.
    owner : object, optional
        Kept alive with the view.
    stream : int, optional
        Raw handle of the stream the bytes are pending on (None: no stream to wait for; 0, the legacy
        default stream, is exported as 1, which is how the interface spells it).
    """

    def __init__(self, ptr: int, dtype, shape, owner: Any = None, stream: int | None = None):
        self.ptr = DevicePtr(ptr)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._owner = owner
        self.stream = None if stream is None else (int(stream) or 1)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (int(self.ptr), False),
            "version": 3,
            "strides": None,
            "stream": self.stream,
        }

    def __repr__(self) -> str:
        return f"DeviceArray(ptr={self.ptr!r}, dtype={self.dtype}, shape={self.shape})"


class DeviceBuffer:
    """One ``cuMemAlloc`` allocation. ``ptr`` is a :class:`DevicePtr`; freed by ``free()``/``close()``."""

    def __init__(self, device: "Device", nbytes: int, name: str = ""):
        self.device = device
        self.nbytes = int(nbytes)
        self.name = name
        device.use()
        self.ptr = DevicePtr(device.driver.mem_alloc(self.nbytes))

    @property
    def alive(self) -> bool:
        return self.ptr != 0

    def view(self, dtype, shape, offset: int = 0, stream: Any = None) -> DeviceArray:
        """A :class:`DeviceArray` over ``[offset, offset + nbytes)``; bounds-checked. ``stream``: what its bytes are
        pending on (as :meth:`Device.as_stream` takes it; None: the device's stream)."""
        arr = DeviceArray(int(self.ptr) + int(offset), dtype, shape, owner=self,
                          stream=self.device.stream_handle_of(stream))
        if offset < 0 or offset + arr.nbytes > self.nbytes:
            raise ValueError(f"view of {arr.nbytes} bytes at offset {offset} exceeds buffer {self.name!r} of {self.nbytes} bytes")
        return arr

    def free(self) -> None:
        if self.ptr:
            self.device.use()
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
        device.use()
        self.addr = device.driver.host_alloc(self.nbytes)
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.addr))

    def free(self) -> None:
        if self.addr:
            self.device.use()
            addr, self.addr = self.addr, 0
            self.array = None
            self.device._forget(self)
            self.device.driver.host_free(addr)


class Stream:
    """A CUDA stream (non-blocking) of one device. ``handle`` is the raw ``CUstream`` as an int.

    It speaks the CUDA stream protocol (``__cuda_stream__``, as cuda.core defines it), so cuda.core, CuPy
    and torch can take it where they take a stream.
    """

    def __init__(self, device: "Device", raw: Any = None, owned: bool = True):
        self.device = device
        self.owned = owned
        if raw is None:
            device.use()
            raw = device.driver.stream_create()
        self.raw = raw

    @property
    def handle(self) -> int:
        return self.device.driver.stream_handle(self.raw)

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(0, handle)`` (protocol version 0)."""
        if self.raw is None:
            raise ValueError("that q12drv Stream has been destroyed")
        return (0, self.handle)

    def synchronize(self) -> None:
        self.device.use()
        self.device.driver.stream_synchronize(self.raw)

    def wait(self, event: "Event") -> None:
        """Make the work enqueued on this stream from now on wait for ``event`` (which may be another device's)."""
        self.device.use()
        self.device.driver.stream_wait_event(self.raw, event.raw)

    def destroy(self) -> None:
        if self.owned and self.raw is not None:
            self.device.use()
            raw, self.raw = self.raw, None
            self.device._forget(self)
            self.device.driver.stream_destroy(raw)


class Event:
    """A CUDA event; ``timing=True`` for elapsed-time measurement."""

    def __init__(self, device: "Device", timing: bool = False):
        self.device = device
        device.use()
        self.raw = device.driver.event_create(timing)

    def record(self, stream: Any = None) -> "Event":
        self.device.driver.event_record(self.raw, self.device.as_stream(stream))
        return self

    def synchronize(self) -> None:
        self.device.use()
        self.device.driver.event_synchronize(self.raw)

    def query(self) -> bool:
        self.device.use()
        return self.device.driver.event_query(self.raw)

    def elapsed_ms(self, end: "Event") -> float:
        self.device.use()
        return self.device.driver.event_elapsed_ms(self.raw, end.raw)

    def destroy(self) -> None:
        if self.raw is not None:
            self.device.use()
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
    cache : dict
        Per-device memo for higher layers (loaded modules, kernels); shared by every thread (fill it under
        :attr:`lock`).
    local : DeviceLocal
        What the calling thread keeps for itself on this device (its pre-packed kernel arguments).
    lock : threading.RLock
        Held while a thread fills :attr:`cache` (a module is loaded once, not once per racing thread).
    """

    def __init__(self, driver: Driver, ordinal: int = 0):
        if not isinstance(driver, Driver):
            raise TypeError(f"driver must be a q12drv Driver, got {type(driver).__name__}")
        self.driver = driver
        self.ordinal = checked_int("ordinal", ordinal, 0)
        self._owned: list = []
        self._dependents: "weakref.WeakSet" = weakref.WeakSet()  # objects told when the device closes (arenas)
        self._keepalive: list = []  # (stream, host array) of copies a failed wait left pending
        self.cache: dict = {}
        self.local = DeviceLocal()
        self.lock = threading.RLock()
        self._streams_seen: dict = {}  # handle -> driver stream of foreign streams checked to be this device's
        self._ctx = driver.open_context(self.ordinal)  # retained and made current in this thread
        CURRENT.device = self
        try:
            self.name = driver.device_name(self.ordinal)
            self.compute_capability = driver.compute_capability(self.ordinal)
            self.arch = "sm_%d%d" % self.compute_capability
            #: Streaming multiprocessors (persistent grids are sized from it).
            self.sm_count = int(driver.device_attribute(self.ordinal, "multiprocessor_count"))
            self.stream = self._own(Stream(self))
        except BaseException:
            if CURRENT.device is self:
                CURRENT.device = None
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

    # the current context ---------------------------------------------------------------
    def set_current(self) -> None:
        """Make this device's context current in the calling thread (one driver call).

        q12drv does this itself wherever a thread uses the device and another context (or none) is current
        there as far as q12drv knows; call it after code outside q12drv made another device's context current
        in this thread (``torch.cuda.set_device``, cuda.core's ``Device.set_current``), which q12drv cannot see.

        Raises
        ------
        Q12Error
            The device is closed.
        """
        self._require_open()
        self.driver.set_current(self._ctx)
        CURRENT.device = self

    def use(self) -> None:
        """Make the context current in this thread unless it is already (a thread-local check)."""
        if CURRENT.device is not self:
            self.set_current()

    @property
    def emulated(self) -> bool:
        """Whether this device runs on the emulated driver."""
        return self.driver.emulated

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
        """The driver stream for ``stream``, checked to be this device's (and this device's context made current
        in the calling thread).

        Accepts None (the device's default stream), a :class:`Stream`, a raw handle (int; 0 is the
        legacy default stream), an object with the CUDA stream protocol ``__cuda_stream__()`` (cuda.core,
        q12drv, recent torch), or one exposing ``.cuda_stream`` (torch) or ``.handle`` (cuda.core, CuPy).

        Raises
        ------
        TypeError
            Not a stream in any of those forms.
        ValueError
            A stream of another device (or of another emulated driver), or a destroyed q12drv stream.
        """
        if CURRENT.device is not self:
            self.set_current()
        if stream is None:
            return self.stream.raw
        if isinstance(stream, Stream):
            if stream.device is not self and not self._same_context(stream.device):
                raise ValueError(f"stream is a stream of {self._describe_other(stream.device)}, but this call runs "
                                 f"on device {self.ordinal}; {self._STREAM_HINT}")
            if stream.raw is None:
                raise ValueError("that q12drv Stream has been destroyed")
            return stream.raw
        handle = stream_handle(stream)
        raw = self._streams_seen.get(handle)
        if raw is None:
            try:
                raw = self.driver.stream_from_handle(handle)
                if handle > 2 and self.driver.stream_is_capturing(raw):
                    # the driver refuses cuStreamGetDevice on a capturing stream and invalidates the capture:
                    # the stream is taken unchecked (a stream of another device fails at the first launch, in
                    # the driver's words) and checked on its first use after the capture
                    return raw
                owner = self.driver.stream_device(raw)
            except CudaError as exc:
                raise ValueError(f"stream handle {handle:#x} ({type(stream).__name__}) is no stream this device's "
                                 f"driver knows ({exc.name}); {self._STREAM_HINT}") from exc
            if owner is not None and owner != self.ordinal:
                raise ValueError(f"stream {handle:#x} ({type(stream).__name__}) belongs to device {owner}, but this "
                                 f"call runs on device {self.ordinal}; {self._STREAM_HINT}")
            if len(self._streams_seen) >= 64:
                self._streams_seen.clear()
            self._streams_seen[handle] = raw
        return raw

    _STREAM_HINT = "pass a stream of this device (Device.stream, Device.new_stream(), or the framework's stream for it)"

    def _same_context(self, other: "Device") -> bool:
        """Whether ``other`` stands for this device's context (the same device of the same machine)."""
        return other.ordinal == self.ordinal and other.driver.machine is self.driver.machine

    def _describe_other(self, other: "Device") -> str:
        if other.driver.machine is not self.driver.machine:
            return f"device {other.ordinal} of another {other.driver.name} driver"
        return f"device {other.ordinal} ({other.name})"

    def stream_handle_of(self, stream: Any = None) -> int:
        """The raw handle (int) of ``stream`` as :meth:`as_stream` takes it (None: the device's stream)."""
        if stream is None:
            return self.driver.stream_handle(self.stream.raw)
        return self.driver.stream_handle(self.as_stream(stream))

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

    # memory of other libraries -----------------------------------------------------------
    def pointer(self, obj: Any, name: str = "argument", *, dtype: Any = None, shape: Any = None,
                min_bytes: int | None = None, align: int = 1, info: ArrayInfo | None = None) -> int:
        """The address of ``obj`` (a raw address, or an object with ``__cuda_array_interface__`` or ``__dlpack__``)
        for an op on this device, checked as :func:`q12drv.core.interop.device_pointer` checks it; on the
        emulated driver, host memory (a numpy array, a torch CPU tensor) is :meth:`adopt` ed rather than refused.

        Raises
        ------
        TypeError, ValueError
            As :func:`~q12drv.core.interop.device_pointer`: the error names ``name`` and the mismatch.
        """
        return device_pointer(obj, name, dtype=dtype, shape=shape, min_bytes=min_bytes, align=align, device=self,
                              info=info)

    def adopt(self, obj: Any, ptr: int | None = None, nbytes: int | None = None, *, name: str = "buffer") -> DevicePtr:
        """The device address of the memory ``obj`` describes (``__cuda_array_interface__`` or DLPack), usable by
        this device's kernels and copies without a copy.

        On the emulated driver, host memory (a numpy array, a torch CPU tensor) becomes this device's emulated
        device memory for as long as the object that owns it lives (:meth:`EmuDriver.adopt
        <q12drv.core.driver.emu.EmuDriver.adopt>`; weakly referenced, so nothing leaks): a dry run of a torch
        runtime needs no copies. On a GPU, ``obj`` must already be this device's memory.

        Parameters
        ----------
        obj : object with ``__cuda_array_interface__`` or ``__dlpack__``
        ptr, nbytes : int, optional
            The bytes an op will touch, ``[ptr, ptr + nbytes)`` inside ``obj``'s memory, when the caller checked
            ``obj`` already (a strided view's extent, say); default: ``obj`` itself, checked here (contiguous, this
            device's).
        name : str
            For the errors.

        Raises
        ------
        TypeError
            ``obj`` describes no memory, or a read-only numpy array (kernels write where they write).
        ValueError
            Host memory on the real driver, another device's memory, or (without ``ptr``) a non-contiguous view.
        """
        info = describe(obj, name)
        if info is None:
            raise TypeError(f"{name} must be an object with __cuda_array_interface__ or __dlpack__ (a tensor or "
                            f"array), got {type(obj).__name__}")
        if ptr is None:
            return DevicePtr(device_pointer(obj, name, device=self) if info.nbytes else info.ptr)
        if info.device[0] != "cpu":
            return DevicePtr(ptr)
        return DevicePtr(self.adopt_described(obj, info, name, int(ptr), int(info.nbytes if nbytes is None else nbytes)))

    def adopt_described(self, obj: Any, info: ArrayInfo, name: str = "buffer", ptr: int | None = None,
                        nbytes: int | None = None) -> int:
        """:meth:`adopt` of host memory already described (``info``, from :func:`~q12drv.core.interop.describe`)
        on the emulated driver: ``[ptr, ptr + nbytes)`` (default ``info``'s extent) becomes device memory while the
        object owning it lives; returns ``ptr``.

        Raises
        ------
        TypeError
            A read-only numpy array.
        ValueError
            Not the emulated driver (a GPU runs on device memory only), or memory adopted by another device.
        """
        if not self.driver.emulated:
            raise ValueError(f"{name} is host memory ({info.dtype} {info.shape}); on a GPU the kernels need device "
                             f"memory of device {self.ordinal}")
        if isinstance(obj, np.ndarray) and not obj.flags.writeable:
            raise TypeError(f"{name} is a read-only numpy array; the emulated device writes where kernels write: "
                            f"pass a writeable array (a copy)")
        ptr = info.ptr if ptr is None else ptr
        nbytes = info.nbytes if nbytes is None else nbytes
        owner, start, size = host_owner(obj, info)
        if not start <= ptr <= ptr + nbytes <= start + size:  # not inside its owner's memory: that range, for obj
            owner, start, size = obj, ptr, nbytes
        try:
            self.driver.adopt(start, size, owner, ordinal=self.ordinal)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return ptr

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
            self.set_current()  # whichever thread closes it
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
        if CURRENT.device is self:
            CURRENT.device = None
        self._keepalive.clear()
        self._streams_seen.clear()
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
