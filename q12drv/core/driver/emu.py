"""The emulated driver: the same calls as :class:`~q12drv.core.driver.cuda.CudaDriver`, no GPU needed.

Device memory is host memory at real addresses (numpy buffers, 256-byte aligned, filled with
``0xA5`` like the garbage ``cuMemAlloc`` returns, so unwritten bytes are never mistaken for zeros).
A kernel launch runs the numpy emulator registered for that kernel name, reading its arguments
out of the packed parameter array exactly as the GPU would, at enqueue time.

Two modes:

* immediate (default): stream work runs when it is enqueued;
* deferred (``deferred=True``): stream work runs only when something waits for it
  (``stream_synchronize``, ``event_synchronize``, a wait on an event). Host-to-device copies
  remember the bytes their pinned source held at enqueue time; if the host rewrote them before
  the copy ran, the copy raises :class:`~q12drv.core.errors.HostRaceError` (on a GPU that race
  silently uploads wrong bytes).

Contexts and devices: the emulated machine has ``device_count`` devices (default
:data:`DEFAULT_DEVICE_COUNT`, or ``Q12DRV_EMU_DEVICES``), each with one primary context. As on a GPU,
each thread has its own current context (one per process and thread, shared by every emulated
driver, as the real driver's is); a fresh thread has none. Allocations, streams, events and modules
belong to the context that was current when they were made; a call that needs a context fails with
``CUDA_ERROR_INVALID_CONTEXT`` when none of this driver's is current, and work enqueued on a stream or
launching a function of a context that is not the current one fails with
``CUDA_ERROR_INVALID_HANDLE``. A kernel reading another device's memory faults
(``CUDA_ERROR_ILLEGAL_ADDRESS``: no peer access).

Memory another library allocated (a numpy array, a torch CPU tensor) becomes emulated device memory
through :meth:`EmuDriver.adopt` for as long as its owner lives (weakly referenced).

Fault injection (:meth:`EmuDriver.inject_fault`) makes any call fail with a chosen ``CUresult``.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import HostRaceError
from .base import Driver
from .result import cuda_error, fail

__all__ = ["EmuDriver", "EmuMemory", "register_emulator", "EmuImage", "POISON_BYTE", "TIMING_NOTE",
           "DEFAULT_DEVICE_COUNT"]

#: What fresh emulated allocations are filled with.
POISON_BYTE = 0xA5
#: What a timing measured on the emulated driver is (every printed timing on it says so).
TIMING_NOTE = "emulated driver: numpy on the host, not GPU time"
_ALIGN = 256
#: Devices an emulated driver has unless told otherwise (``EmuDriver(device_count=)``, ``Q12DRV_EMU_DEVICES``): two,
#: so that code for several devices runs without a GPU.
DEFAULT_DEVICE_COUNT = 2
#: Stream handles are unique in the process (a handle of another emulated driver is no handle here) and never
#: 0, 1 or 2 (the null, legacy and per-thread default streams' values).
_STREAM_IDS = itertools.count(16)
_DEFAULT_SMEM = 48 * 1024
_OPTIN_SMEM = 227 * 1024

_EMULATORS: dict[str, Callable] = {}


def register_emulator(name: str, fn: Callable) -> None:
    """Make ``fn(args, mem, grid, block)`` what a launch of kernel ``name`` runs on emu."""
    _EMULATORS[name] = fn


@dataclass(frozen=True)
class EmuImage:
    """What an emulated module is loaded from: entry name -> ((param name, ctypes type), ...)."""

    source: str
    entries: dict


class _IllegalAddress(Exception):
    pass


def _default_memory_bytes() -> int:
    """What the emulated device (and its pinned memory) may hold: half the host's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # no sysconf: a fixed bound
        return 8 << 30


class _Adopted:
    """A range of host memory another library allocated, adopted as device memory of ``ordinal``."""

    __slots__ = ("start", "end", "ordinal", "view", "key", "__weakref__")

    def __init__(self, start: int, nbytes: int, ordinal: int, key):
        self.start, self.end, self.ordinal, self.key = start, start + nbytes, ordinal, key
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(start))


class EmuMemory:
    """Address-range bookkeeping for emulated device memory and pinned host memory.

    ``limit``: bytes each kind (device, pinned) may hold at once; an allocation past it fails as the real
    driver's does when the GPU is full (``CUDA_ERROR_OUT_OF_MEMORY``), before any host memory is taken.
    Device allocations belong to one device (``ordinal``); so do adopted ranges (:meth:`adopt`).
    """

    def __init__(self, limit: int | None = None):
        #: Allocation bases, sorted; replaced (copy-on-write), never changed in place, so that a lookup in one thread
        #: bisects a list that another thread's allocation or free cannot shift under it.
        self._bases: list[int] = []
        self._allocs: dict[int, tuple[np.ndarray, int, str, int]] = {}
        self.limit = _default_memory_bytes() if limit is None else int(limit)
        self._live = {"device": 0, "pinned": 0}
        self._lock = threading.Lock()
        self._starts: list[int] = []  # adopted ranges, by start (they may overlap)
        self._adopted: list[_Adopted] = []
        self._adopted_keys: dict = {}
        #: The device whose kernel this thread is running (its reads of another device's memory fault).
        self._running = threading.local()

    def add(self, nbytes: int, kind: str, call: str = "cuMemAlloc", ordinal: int = 0) -> int:
        nbytes = int(nbytes)
        with self._lock:
            if nbytes > self.limit - self._live[kind]:
                fail(call, "CUDA_ERROR_OUT_OF_MEMORY")
            self._live[kind] += nbytes
        try:
            backing = np.empty(max(nbytes, 1) + _ALIGN, dtype=np.uint8)
            backing.fill(POISON_BYTE)
        except MemoryError:  # the host could not back it after all: what the driver says when memory runs out
            with self._lock:
                self._live[kind] -= nbytes
            fail(call, "CUDA_ERROR_OUT_OF_MEMORY")
        addr = backing.ctypes.data
        base = (addr + _ALIGN - 1) // _ALIGN * _ALIGN
        view = backing[base - addr: base - addr + max(int(nbytes), 1)]
        with self._lock:
            self._allocs[base] = (view, int(nbytes), kind, int(ordinal))
            i = bisect.bisect_right(self._bases, base)
            self._bases = self._bases[:i] + [base] + self._bases[i:]
        return base

    def remove(self, base: int, kind: str) -> bool:
        with self._lock:
            entry = self._allocs.get(int(base))
            if entry is None or entry[2] != kind:
                return False
            del self._allocs[int(base)]
            i = bisect.bisect_left(self._bases, int(base))
            self._bases = self._bases[:i] + self._bases[i + 1:]
            self._live[kind] -= entry[1]
        return True

    def count(self, kind: str) -> int:
        return sum(1 for entry in list(self._allocs.values()) if entry[2] == kind)

    def _allocation(self, ptr: int):
        """``(base, (view, nbytes, kind, ordinal))`` of the allocation holding ``ptr``'s byte, or None."""
        bases = self._bases  # this list is never changed: bisect and index agree
        i = bisect.bisect_right(bases, int(ptr)) - 1
        if i < 0:
            return None
        entry = self._allocs.get(bases[i])
        if entry is None:  # freed by another thread meanwhile
            return None
        base = bases[i]
        return (base, entry) if int(ptr) < base + max(entry[1], 1) else None

    def _adoption(self, ptr: int, nbytes: int) -> _Adopted | None:
        """The adopted range holding ``[ptr, ptr + nbytes)``, or None."""
        ptr, end = int(ptr), int(ptr) + int(nbytes)
        starts, entries = self._starts, self._adopted
        for i in range(bisect.bisect_right(starts, ptr) - 1, -1, -1):
            try:
                entry = entries[i]
            except IndexError:
                continue
            if end <= entry.end:
                return entry
        return None

    def find(self, ptr: int, nbytes: int, kind: str | None = None) -> tuple[np.ndarray, int] | None:
        hit = self._allocation(ptr)
        if hit is not None:
            base, (view, size, k, _) = hit
            off = int(ptr) - base
            if (kind is None or k == kind) and off + int(nbytes) <= size:
                return view, off
        if self._adopted and kind in (None, "device"):
            entry = self._adoption(ptr, nbytes)
            if entry is not None:
                return entry.view, int(ptr) - entry.start
        return None

    def owner(self, ptr: int) -> tuple[str, int, int, int] | None:
        """``(kind, ordinal, start, nbytes)`` of the allocation or adopted range holding ``ptr``, or None.
        ``kind``: ``"device"`` or ``"pinned"``; pinned memory's ordinal is -1."""
        hit = self._allocation(ptr)
        if hit is not None:
            base, (_, size, kind, ordinal) = hit
            return kind, (ordinal if kind == "device" else -1), base, size
        entry = self._adoption(ptr, 1) if self._adopted else None
        if entry is not None:
            return "device", entry.ordinal, entry.start, entry.end - entry.start
        return None

    def array(self, ptr: int, dtype, shape) -> np.ndarray:
        """A writable view of emulated device memory; raises if it leaves the allocation, or if it is another
        device's memory read by a kernel (no peer access)."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        found = self.find(ptr, nbytes, "device")
        if found is None:
            raise _IllegalAddress(f"{nbytes} bytes at {int(ptr):#x} are not inside one device allocation")
        running = getattr(self._running, "ordinal", None)
        if running is not None:
            ordinal = self.owner(ptr)[1]
            if ordinal != running:
                raise _IllegalAddress(f"{nbytes} bytes at {int(ptr):#x} are memory of device {ordinal}, read by a "
                                      f"kernel on device {running} (no peer access)")
        view, off = found
        return view[off: off + nbytes].view(dtype).reshape(shape)

    # memory another library allocated ----------------------------------------------------
    def adopt(self, ptr: int, nbytes: int, ordinal: int, owner=None) -> None:
        """Make ``[ptr, ptr + nbytes)`` device memory of ``ordinal`` until ``owner`` is collected (weakly
        referenced) or :meth:`unadopt` (``owner`` None: until :meth:`unadopt`). Adopting the same range for the
        same live owner again changes nothing."""
        ref = None if owner is None else weakref.ref(owner)  # TypeError: not weakly referenceable
        key = (int(ptr), int(nbytes), int(ordinal), None if owner is None else id(owner))
        with self._lock:
            if key in self._adopted_keys:
                return
            for other in self._adopted:
                if other.ordinal != ordinal and other.start < ptr + nbytes and ptr < other.end:
                    raise ValueError(f"{nbytes:,} bytes at {ptr:#x} overlap memory adopted as device {other.ordinal}'s "
                                     f"([{other.start:#x}, {other.end:#x})); one buffer belongs to one device")
            entry = _Adopted(int(ptr), int(nbytes), int(ordinal), key)
            i = bisect.bisect_right(self._starts, entry.start)
            # copy-on-write: a reader in another thread iterates the old lists undisturbed
            self._starts = self._starts[:i] + [entry.start] + self._starts[i:]
            self._adopted = self._adopted[:i] + [entry] + self._adopted[i:]
            self._adopted_keys[key] = entry
        if ref is not None:
            weakref.finalize(owner, self._drop, weakref.ref(entry))

    def _drop(self, entry_ref) -> None:
        entry = entry_ref()
        if entry is None:
            return
        with self._lock:
            if self._adopted_keys.get(entry.key) is not entry:
                return
            del self._adopted_keys[entry.key]
            i = next(i for i, e in enumerate(self._adopted) if e is entry)
            self._starts = self._starts[:i] + self._starts[i + 1:]
            self._adopted = self._adopted[:i] + self._adopted[i + 1:]

    def unadopt(self, ptr: int) -> int:
        """Forget every adopted range that starts at ``ptr``; return how many there were."""
        gone = [e for e in self._adopted if e.start == int(ptr)]
        for entry in gone:
            self._drop(weakref.ref(entry))
        return len(gone)

    @property
    def adopted(self) -> int:
        """How many adopted ranges are live."""
        return len(self._adopted)


class _HtoD:
    """An enqueued host-to-device copy; ``snapshot``: the host bytes at enqueue (deferred mode), checked at run."""

    __slots__ = ("dst", "src", "nbytes", "snapshot")

    def __init__(self, dst: int, src: int, nbytes: int, snapshot: bytes | None):
        self.dst, self.src, self.nbytes, self.snapshot = dst, src, nbytes, snapshot

    def __call__(self) -> None:
        dst, src, nbytes = self.dst, self.src, self.nbytes
        if self.snapshot is not None and ctypes.string_at(src, nbytes) != self.snapshot:
            ctypes.memmove(dst, src, nbytes)
            raise HostRaceError(
                f"pinned host memory at {src:#x} ({nbytes} bytes) was rewritten after "
                f"cuMemcpyHtoDAsync was enqueued and before it ran: wait for the copy's event first"
            )
        ctypes.memmove(dst, src, nbytes)


class _Context:
    """The primary context of one emulated device, from its first retain to its last release."""

    __slots__ = ("driver", "ordinal", "retains", "null", "__weakref__")

    def __init__(self, driver: "EmuDriver", ordinal: int):
        self.driver, self.ordinal, self.retains = driver, ordinal, 0
        self.null = _Stream(0, self)

    @property
    def alive(self) -> bool:
        return self.retains > 0

    def __repr__(self) -> str:
        return f"<emulated context of device {self.ordinal}{'' if self.alive else ', released'}>"


class _Current(threading.local):
    """Each thread's current context (shared by every emulated driver, as the real driver's is)."""

    ctx: _Context | None = None


_CURRENT = _Current()


@dataclass(eq=False)
class _Stream:
    ident: int
    ctx: Any = None
    queue: deque = field(default_factory=deque)
    capture: list | None = None
    capture_invalidated: bool = False  # a call the real driver refuses during capture was made on it
    # one thread at a time runs a stream's queued work (another thread's event wait may drain it), in order
    lock: Any = field(default_factory=threading.RLock)


@dataclass(eq=False)
class _Event:
    timing: bool
    ctx: Any = None
    done: bool = True
    stream: _Stream | None = None
    time: float = 0.0
    generation: int = 0


@dataclass(eq=False)
class _Module:
    image: EmuImage
    ctx: Any


@dataclass(eq=False)
class _Function:
    name: str
    params: tuple
    ctx: Any = None
    max_dynamic_smem: int = _DEFAULT_SMEM


class EmuDriver(Driver):
    """Emulated CUDA driver (see the module docstring).

    Parameters
    ----------
    deferred : bool
        Run stream work only when it is waited for (detects pinned-buffer races).
    device_count : int, optional
        Devices of the emulated machine (ordinals ``0 .. device_count - 1``); default ``Q12DRV_EMU_DEVICES``,
        else :data:`DEFAULT_DEVICE_COUNT`.
    """

    name = "emu"
    runs_cubins = False
    emulated = True
    #: Why ``open_driver("auto")`` fell back to this driver (None: the emulator was asked for).
    fallback_reason: str | None = None

    def __init__(self, deferred: bool = False, device_count: int | None = None):
        if device_count is None:
            env = os.environ.get("Q12DRV_EMU_DEVICES", "").strip()
            try:
                device_count = int(env) if env else DEFAULT_DEVICE_COUNT
            except ValueError:
                raise ValueError(f"Q12DRV_EMU_DEVICES must be a positive int, got {env!r}") from None
        if isinstance(device_count, bool) or not isinstance(device_count, (int, np.integer)) or not 1 <= device_count <= 64:
            raise ValueError(f"device_count must be an int in [1, 64], got {device_count!r}")
        self.deferred = bool(deferred)
        self._device_count = int(device_count)
        self.memory = EmuMemory()
        self._primary: dict[int, _Context] = {}
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._faults: dict[str, list[list]] = {}
        self._modules = 0
        self._contexts = 0
        self._events = 0
        #: When a list, every driver call that can fail appends its name here (see :meth:`start_trace`).
        self.trace: list | None = None

    # fault injection -------------------------------------------------------------------
    def inject_fault(self, call: str, name: str = "CUDA_ERROR_UNKNOWN", *, after: int = 0, times: int = 1) -> None:
        """Make the ``after+1``-th next ``call`` (e.g. ``"cuMemAlloc"``) fail with ``name``, ``times`` times.

        A failing call raises the :class:`~q12drv.core.errors.CudaError` the real driver would give
        before it has any effect (nothing allocated, nothing enqueued).
        """
        if isinstance(after, bool) or int(after) < 0 or isinstance(times, bool) or int(times) < 1:
            raise ValueError(f"inject_fault needs after >= 0 and times >= 1, got after={after!r}, times={times!r}")
        from .result import result_code

        result_code(name)  # a CUresult name, or ValueError now rather than at the faulting call
        self._faults.setdefault(call, []).append([int(after), int(times), name])

    def clear_faults(self) -> None:
        self._faults.clear()

    def pending_faults(self) -> list:
        """The injected faults that have not fired yet, as ``(call, after, times, name)``."""
        return [(call, *plan) for call, plans in self._faults.items() for plan in plans]

    def start_trace(self) -> None:
        """Record the name of every driver call that can fail (for fault-injection sweeps)."""
        self.trace = []

    def stop_trace(self) -> list:
        """Stop recording; return the calls recorded since :meth:`start_trace`, in order."""
        calls, self.trace = self.trace or [], None
        return calls

    def _fault(self, call: str) -> None:
        if self.trace is not None:
            self.trace.append(call)
        plans = self._faults.get(call)
        if not plans:
            return
        plan = plans[0]
        if plan[0] > 0:
            plan[0] -= 1
            return
        plan[1] -= 1
        if plan[1] <= 0:
            plans.pop(0)
        fail(call, plan[2])

    def live_allocations(self) -> dict[str, int]:
        """Counts of live device and pinned allocations and loaded modules (for leak checks)."""
        return {"device": self.memory.count("device"), "pinned": self.memory.count("pinned"), "modules": self._modules}

    def live_handles(self) -> dict[str, int]:
        """Counts of open contexts, created (non-null) streams and events (for leak checks)."""
        return {"contexts": self._contexts, "streams": len(self._streams), "events": self._events}

    # contexts ---------------------------------------------------------------------------
    def _current(self, call: str) -> _Context:
        """This driver's context current in the calling thread, or the error the driver gives without one."""
        ctx = _CURRENT.ctx
        if ctx is None or ctx.driver is not self or not ctx.alive:
            fail(call, "CUDA_ERROR_INVALID_CONTEXT")
        return ctx

    def _in_current(self, call: str, ctx: _Context) -> None:
        """Raise unless ``ctx`` (an object's context) is the current one."""
        current = self._current(call)
        if ctx is not current:
            raise cuda_error(call, "CUDA_ERROR_INVALID_HANDLE",
                             f"a handle of {ctx!r} used while {current!r} is current in this thread")

    # running stream work ---------------------------------------------------------------
    def _enqueue(self, s: _Stream, op: Callable[[], None]) -> None:
        if s.capture is not None:
            s.capture.append(op)
        elif self.deferred:
            s.queue.append(op)
        else:
            with s.lock:
                self._run(s, op)

    def _run(self, s: _Stream, op: Callable[[], None]) -> None:
        running = self.memory._running
        outer = getattr(running, "ordinal", None)
        running.ordinal = s.ctx.ordinal
        try:
            op()
        finally:
            running.ordinal = outer

    def _drain(self, s: _Stream, until: Callable[[], bool] | None = None) -> None:
        with s.lock:
            while s.queue:
                if until is not None and until():
                    return
                op = s.queue.popleft()
                self._run(s, op)

    def _stream(self, stream: Any, call: str = "cuStream") -> _Stream:
        """The stream ``stream`` (a handle or a stream object) names; 0, 1 and 2 (the null, legacy and per-thread
        default streams) name the current context's null stream."""
        if stream is None or isinstance(stream, (int, np.integer)):
            h = int(stream or 0)
            if h <= 2:
                return self._current(call).null
            s = self._streams.get(h)
            if s is None:
                fail(call, "CUDA_ERROR_INVALID_HANDLE")
            return s
        return stream

    def _work_stream(self, stream: Any, call: str) -> _Stream:
        """The stream work is enqueued on: it must belong to the current context."""
        s = self._stream(stream, call)
        self._in_current(call, s.ctx)
        return s

    # context / device -------------------------------------------------------------------
    def device_count(self) -> int:
        self._fault("cuDeviceGetCount")
        return self._device_count

    def _ordinal(self, ordinal: Any) -> int:
        if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)) or not 0 <= ordinal < self._device_count:
            fail("cuDeviceGet", "CUDA_ERROR_INVALID_DEVICE")
        return int(ordinal)

    def open_context(self, ordinal: int) -> Any:
        """Retain device ``ordinal``'s primary context and make it current in the calling thread (as
        :meth:`~q12drv.core.driver.cuda.CudaDriver.open_context`)."""
        self._fault("cuDevicePrimaryCtxRetain")
        ordinal = self._ordinal(ordinal)
        with self._lock:
            ctx = self._primary.get(ordinal)
            if ctx is None or not ctx.alive:  # released to nothing: retaining makes a new context
                ctx = self._primary[ordinal] = _Context(self, ordinal)
            ctx.retains += 1
            self._contexts += 1
        _CURRENT.ctx = ctx
        return ctx

    def close_context(self, ctx: Any) -> None:
        self._fault("cuDevicePrimaryCtxRelease")
        with self._lock:
            if ctx.retains > 0:
                ctx.retains -= 1
                self._contexts -= 1
        if not ctx.alive and _CURRENT.ctx is ctx:
            _CURRENT.ctx = None

    def set_current(self, ctx: Any) -> None:
        self._fault("cuCtxSetCurrent")
        if ctx is not None and (not isinstance(ctx, _Context) or ctx.driver is not self or not ctx.alive):
            fail("cuCtxSetCurrent", "CUDA_ERROR_INVALID_CONTEXT")
        _CURRENT.ctx = ctx

    def current_context(self) -> Any:
        """The context current in the calling thread (any driver's), or None."""
        return _CURRENT.ctx

    def device_name(self, ordinal: int) -> str:
        return "q12drv emulated GPU (numpy)"

    _ATTRS = {
        "compute_capability_major": 9,
        "compute_capability_minor": 0,
        "multiprocessor_count": 132,
        "max_shared_memory_per_block_optin": _OPTIN_SMEM,
        "l2_cache_size": 50 * 1024 * 1024,
        "max_threads_per_block": 1024,
    }

    def device_attribute(self, ordinal: int, name: str) -> int:
        self._ordinal(ordinal)
        try:
            return self._ATTRS[name.lower()]
        except KeyError:
            fail("cuDeviceGetAttribute", "CUDA_ERROR_INVALID_VALUE")

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        self._ordinal(ordinal)
        return (9, 0)

    def driver_version(self) -> int:
        return 13000

    @property
    def machine(self) -> Any:
        return self  # each emulated driver is a machine of its own

    # memory -----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        self._fault("cuMemAlloc")
        ctx = self._current("cuMemAlloc")
        if int(nbytes) <= 0:
            fail("cuMemAlloc", "CUDA_ERROR_INVALID_VALUE")
        return self.memory.add(nbytes, "device", "cuMemAlloc", ctx.ordinal)

    def mem_free(self, ptr: int) -> None:
        self._fault("cuMemFree")
        self._current("cuMemFree")
        if not self.memory.remove(ptr, "device"):
            fail("cuMemFree", "CUDA_ERROR_INVALID_VALUE")

    def host_alloc(self, nbytes: int) -> int:
        self._fault("cuMemHostAlloc")
        self._current("cuMemHostAlloc")
        if int(nbytes) <= 0:
            fail("cuMemHostAlloc", "CUDA_ERROR_INVALID_VALUE")
        return self.memory.add(nbytes, "pinned", "cuMemHostAlloc")

    def host_free(self, ptr: int) -> None:
        self._fault("cuMemFreeHost")
        self._current("cuMemFreeHost")
        if not self.memory.remove(ptr, "pinned"):
            fail("cuMemFreeHost", "CUDA_ERROR_INVALID_VALUE")

    def pointer_info(self, ptr: int):
        """See :meth:`~q12drv.core.driver.base.Driver.pointer_info`: emulated device memory (allocated or adopted)
        is ``"device"``, :meth:`host_alloc`'s is ``"host"``; anything else is unknown (None)."""
        from .base import PointerInfo

        found = self.memory.owner(int(ptr))
        if found is None:
            return None
        kind, ordinal, start, size = found
        return PointerInfo("device" if kind == "device" else "host", ordinal, start, size)

    def adopt(self, ptr: int, nbytes: int, owner: Any = None, *, ordinal: int = 0) -> None:
        """Make host memory another library allocated, ``[ptr, ptr + nbytes)``, device memory of device ``ordinal``:
        launches and copies may use it as they use :meth:`mem_alloc`'s, without a copy.

        It stays device memory until ``owner`` is garbage-collected (weakly referenced: adopting never keeps it
        alive) or :meth:`unadopt` is called (``owner`` None: until then). The caller vouches that the bytes stay
        valid meanwhile; a numpy array or torch tensor that owns them is the natural ``owner``. Adopting the same
        range for the same live owner again does nothing.

        Raises
        ------
        TypeError
            ``owner`` cannot be weakly referenced.
        ValueError
            A NULL or out-of-range address, a negative size, no such device, or a range that overlaps memory
            adopted for another device.
        """
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or not 0 < int(ptr) < 1 << 64:
            raise ValueError(f"adopt: ptr must be a non-NULL address in (0, 2**64), got {ptr!r:.60}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or not 0 <= int(nbytes) < 1 << 48:
            raise ValueError(f"adopt: nbytes must be an int in [0, 2**48), got {nbytes!r:.60}")
        if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)) or not 0 <= ordinal < self._device_count:
            raise ValueError(f"adopt: ordinal must be a device of this emulated driver (0..{self._device_count - 1}), "
                             f"got {ordinal!r}")
        try:
            self.memory.adopt(int(ptr), int(nbytes), int(ordinal), owner)
        except TypeError:  # weakref.ref(owner)
            raise TypeError(f"adopt: owner {type(owner).__name__} cannot be weakly referenced; pass the array or "
                            f"tensor that owns the memory, or None (then call unadopt)") from None

    def unadopt(self, ptr: int) -> None:
        """Forget the adopted ranges that start at ``ptr`` (their memory is the owner's again).

        Raises
        ------
        ValueError
            Nothing adopted starts at ``ptr``.
        """
        if not self.memory.unadopt(int(ptr)):
            raise ValueError(f"unadopt: no adopted memory starts at {int(ptr):#x}")

    def _check_device(self, call: str, ptr: int, nbytes: int) -> None:
        if self.memory.find(ptr, nbytes, "device") is None:
            fail(call, "CUDA_ERROR_INVALID_VALUE")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyHtoDAsync"
        self._fault(call)
        s = self._work_stream(stream, call)
        self._check_device(call, dst, nbytes)
        snapshot = ctypes.string_at(src, nbytes) if (self.deferred and s.capture is None) else None
        self._enqueue(s, _HtoD(dst, src, nbytes, snapshot))

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyDtoHAsync"
        self._fault(call)
        s = self._work_stream(stream, call)
        self._check_device(call, src, nbytes)
        self._enqueue(s, lambda: ctypes.memmove(dst, src, nbytes))

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyDtoDAsync"
        self._fault(call)
        s = self._work_stream(stream, call)
        self._check_device(call, dst, nbytes)
        self._check_device(call, src, nbytes)
        self._enqueue(s, lambda: ctypes.memmove(dst, src, nbytes))

    def memset_d8_async(self, dst: int, value: int, nbytes: int, stream: Any) -> None:
        call = "cuMemsetD8Async"
        self._fault(call)
        s = self._work_stream(stream, call)
        self._check_device(call, dst, nbytes)
        self._enqueue(s, lambda: ctypes.memset(dst, int(value) & 0xFF, nbytes))

    # streams and events -----------------------------------------------------------------
    def stream_create(self) -> Any:
        self._fault("cuStreamCreate")
        s = _Stream(next(_STREAM_IDS), self._current("cuStreamCreate"))
        self._streams[s.ident] = s
        return s

    def stream_destroy(self, stream: Any) -> None:
        self._fault("cuStreamDestroy")
        self._current("cuStreamDestroy")
        s = self._stream(stream, "cuStreamDestroy")
        self._drain(s)
        self._streams.pop(s.ident, None)

    def stream_synchronize(self, stream: Any) -> None:
        self._fault("cuStreamSynchronize")
        self._current("cuStreamSynchronize")
        self._drain(self._stream(stream, "cuStreamSynchronize"))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._fault("cuStreamWaitEvent")
        s = self._work_stream(stream, "cuStreamWaitEvent")  # the event may be another device's
        generation = event.generation
        self._enqueue(s, lambda: self._wait(event, generation))

    def stream_handle(self, stream: Any) -> int:
        return self._stream(stream).ident

    def stream_from_handle(self, handle: int) -> Any:
        return self._stream(int(handle), "cuStreamFromHandle")

    def stream_device(self, stream: Any) -> int | None:
        """The ordinal of the device ``stream`` (a stream object or handle) belongs to; None for the handles 0, 1
        and 2, which name the current context's own null stream."""
        if isinstance(stream, (int, np.integer)) and 0 <= int(stream) <= 2:
            return None
        s = self._stream(stream, "cuStreamGetDevice")
        if s.capture is not None:  # as the real driver: refused, and the capture is invalidated
            s.capture_invalidated = True
            fail("cuStreamGetDevice", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        return s.ctx.ordinal

    def event_create(self, timing: bool = False) -> Any:
        self._fault("cuEventCreate")
        ctx = self._current("cuEventCreate")
        with self._lock:
            self._events += 1
        return _Event(bool(timing), ctx)

    def event_destroy(self, event: Any) -> None:
        self._fault("cuEventDestroy")
        self._current("cuEventDestroy")
        with self._lock:
            self._events -= 1

    def event_record(self, event: Any, stream: Any) -> None:
        self._fault("cuEventRecord")
        s = self._work_stream(stream, "cuEventRecord")
        if event.ctx is not s.ctx:
            raise cuda_error("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE",
                             f"an event of {event.ctx!r} recorded on a stream of {s.ctx!r}")
        event.generation += 1
        generation = event.generation
        event.stream = s
        if s.capture is None:
            event.done = False

        def op():
            if event.generation == generation:
                event.time = time.perf_counter()
                event.done = True

        self._enqueue(s, op)

    def _wait(self, event: _Event, generation: int | None = None) -> None:
        if event.stream is None:
            return
        self._drain(event.stream, until=lambda: event.done or (generation is not None and event.generation != generation))

    def event_synchronize(self, event: Any) -> None:
        self._fault("cuEventSynchronize")
        self._current("cuEventSynchronize")
        self._wait(event)

    def event_query(self, event: Any) -> bool:
        self._fault("cuEventQuery")
        self._current("cuEventQuery")
        return event.done

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        self._fault("cuEventElapsedTime")
        self._current("cuEventElapsedTime")
        if not (start.timing and end.timing):
            fail("cuEventElapsedTime", "CUDA_ERROR_INVALID_HANDLE")
        if not (start.done and end.done):
            fail("cuEventElapsedTime", "CUDA_ERROR_NOT_READY")
        return (end.time - start.time) * 1e3

    # modules and launches ---------------------------------------------------------------
    def module_load(self, image: Any) -> Any:
        self._fault("cuModuleLoadData")
        ctx = self._current("cuModuleLoadData")
        if not isinstance(image, EmuImage):
            fail("cuModuleLoadData", "CUDA_ERROR_INVALID_IMAGE")
        with self._lock:
            self._modules += 1
        return _Module(image, ctx)

    def module_unload(self, module: Any) -> None:
        self._fault("cuModuleUnload")
        self._in_current("cuModuleUnload", module.ctx)
        with self._lock:
            self._modules -= 1

    def module_get_function(self, module: Any, name: str) -> Any:
        self._fault("cuModuleGetFunction")
        self._in_current("cuModuleGetFunction", module.ctx)
        entries = module.image.entries
        if name not in entries or name not in _EMULATORS:
            fail("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND")
        return _Function(name, tuple(entries[name]), module.ctx)

    def function_attribute(self, func: Any, name: str) -> int:
        values = {"max_dynamic_shared_size_bytes": func.max_dynamic_smem, "num_regs": 0,
                  "local_size_bytes": 0, "shared_size_bytes": 0, "max_threads_per_block": 1024}
        try:
            return values[name.lower()]
        except KeyError:
            fail("cuFuncGetAttribute", "CUDA_ERROR_INVALID_VALUE")

    def set_max_dynamic_smem(self, func: Any, nbytes: int) -> None:
        self._fault("cuFuncSetAttribute")
        if not 0 <= int(nbytes) <= _OPTIN_SMEM:
            fail("cuFuncSetAttribute", "CUDA_ERROR_INVALID_VALUE")
        func.max_dynamic_smem = int(nbytes)

    def _decode_params(self, func: _Function, params_addr: int) -> dict:
        args = {}
        slots = (ctypes.c_void_p * len(func.params)).from_address(params_addr) if func.params else ()
        for i, (pname, ctype) in enumerate(func.params):
            raw = ctypes.string_at(slots[i], ctypes.sizeof(ctype))
            value = ctype.from_buffer_copy(raw)
            args[pname] = value if issubclass(ctype, ctypes.Structure) else value.value
        return args

    def launch(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int) -> None:
        call = "cuLaunchKernel"
        self._fault(call)
        self._in_current(call, func.ctx)
        s = self._work_stream(stream, call)
        if min(grid) < 1 or min(block) < 1 or block[0] * block[1] * block[2] > 1024 or smem > func.max_dynamic_smem:
            fail(call, "CUDA_ERROR_INVALID_VALUE")
        args = self._decode_params(func, params_addr)  # parameters are captured at enqueue time
        emulate = _EMULATORS[func.name]
        grid, block = tuple(grid), tuple(block)

        def op():
            try:
                emulate(args, self.memory, grid, block)
            except _IllegalAddress as exc:
                raise cuda_error(call, "CUDA_ERROR_ILLEGAL_ADDRESS", f"{func.name}: {exc}") from None

        self._enqueue(s, op)

    # graphs -----------------------------------------------------------------------------
    def begin_capture(self, stream: Any) -> None:
        self._fault("cuStreamBeginCapture")
        s = self._work_stream(stream, "cuStreamBeginCapture")
        if s.capture is not None:
            fail("cuStreamBeginCapture", "CUDA_ERROR_ILLEGAL_STATE")
        s.capture = []

    def end_capture(self, stream: Any) -> Any:
        self._fault("cuStreamEndCapture")
        s = self._work_stream(stream, "cuStreamEndCapture")
        if s.capture is None:
            fail("cuStreamEndCapture", "CUDA_ERROR_ILLEGAL_STATE")
        ops, s.capture = s.capture, None
        if s.capture_invalidated:
            s.capture_invalidated = False
            fail("cuStreamEndCapture", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
        return (s.ctx, tuple(ops))

    def stream_is_capturing(self, stream: Any) -> bool:
        return self._stream(stream, "cuStreamIsCapturing").capture is not None  # any context's stream

    def graph_instantiate(self, graph: Any) -> Any:
        self._fault("cuGraphInstantiate")
        self._in_current("cuGraphInstantiate", graph[0])
        return graph

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._fault("cuGraphLaunch")
        s = self._work_stream(stream, "cuGraphLaunch")
        if graph_exec[0] is not s.ctx:
            raise cuda_error("cuGraphLaunch", "CUDA_ERROR_INVALID_HANDLE",
                             f"a graph of {graph_exec[0]!r} launched on a stream of {s.ctx!r}")
        for op in graph_exec[1]:
            if isinstance(op, _HtoD) and self.deferred and s.capture is None:
                # a captured copy reads its host buffer when the graph runs: the bytes there at
                # this launch are the ones it must upload (a later rewrite is a race)
                op = _HtoD(op.dst, op.src, op.nbytes, ctypes.string_at(op.src, op.nbytes))
            self._enqueue(s, op)

    def graph_destroy(self, graph: Any, graph_exec: Any) -> None:
        pass
