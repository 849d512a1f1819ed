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

Fault injection (:meth:`EmuDriver.inject_fault`) makes any call fail with a chosen ``CUresult``.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import HostRaceError
from .base import Driver
from .result import cuda_error, fail

__all__ = ["EmuDriver", "EmuMemory", "register_emulator", "EmuImage", "POISON_BYTE", "TIMING_NOTE"]

#: What fresh emulated allocations are filled with.
POISON_BYTE = 0xA5
#: What a timing measured on the emulated driver is (every printed timing on it says so).
TIMING_NOTE = "emulated driver: numpy on the host, not GPU time"
_ALIGN = 256
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


class EmuMemory:
    """Address-range bookkeeping for emulated device memory and pinned host memory.

    ``limit``: bytes each kind (device, pinned) may hold at once; an allocation past it fails as the real
    driver's does when the GPU is full (``CUDA_ERROR_OUT_OF_MEMORY``), before any host memory is taken.
    """

    def __init__(self, limit: int | None = None):
        self._bases: list[int] = []
        self._allocs: dict[int, tuple[np.ndarray, int, str]] = {}
        self.limit = _default_memory_bytes() if limit is None else int(limit)
        self._live = {"device": 0, "pinned": 0}

    def add(self, nbytes: int, kind: str, call: str = "cuMemAlloc") -> int:
        nbytes = int(nbytes)
        if nbytes > self.limit - self._live[kind]:
            fail(call, "CUDA_ERROR_OUT_OF_MEMORY")
        try:
            backing = np.empty(max(nbytes, 1) + _ALIGN, dtype=np.uint8)
            backing.fill(POISON_BYTE)
        except MemoryError:  # the host could not back it after all: what the driver says when memory runs out
            fail(call, "CUDA_ERROR_OUT_OF_MEMORY")
        self._live[kind] += nbytes
        addr = backing.ctypes.data
        base = (addr + _ALIGN - 1) // _ALIGN * _ALIGN
        view = backing[base - addr: base - addr + max(int(nbytes), 1)]
        self._allocs[base] = (view, int(nbytes), kind)
        bisect.insort(self._bases, base)
        return base

    def remove(self, base: int, kind: str) -> bool:
        entry = self._allocs.get(int(base))
        if entry is None or entry[2] != kind:
            return False
        del self._allocs[int(base)]
        self._bases.remove(int(base))
        self._live[kind] -= entry[1]
        return True

    def count(self, kind: str) -> int:
        return sum(1 for _, _, k in self._allocs.values() if k == kind)

    def find(self, ptr: int, nbytes: int, kind: str | None = None) -> tuple[np.ndarray, int] | None:
        i = bisect.bisect_right(self._bases, int(ptr)) - 1
        if i < 0:
            return None
        base = self._bases[i]
        view, size, k = self._allocs[base]
        if kind is not None and k != kind:
            return None
        off = int(ptr) - base
        if off + int(nbytes) > size:
            return None
        return view, off

    def array(self, ptr: int, dtype, shape) -> np.ndarray:
        """A writable view of emulated device memory; raises if it leaves the allocation."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        found = self.find(ptr, nbytes, "device")
        if found is None:
            raise _IllegalAddress(f"{nbytes} bytes at {int(ptr):#x} are not inside one device allocation")
        view, off = found
        return view[off: off + nbytes].view(dtype).reshape(shape)


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


@dataclass
class _Stream:
    ident: int
    queue: deque = field(default_factory=deque)
    capture: list | None = None


@dataclass
class _Event:
    timing: bool
    done: bool = True
    stream: _Stream | None = None
    time: float = 0.0
    generation: int = 0


@dataclass
class _Function:
    name: str
    params: tuple
    max_dynamic_smem: int = _DEFAULT_SMEM


class EmuDriver(Driver):
    """Emulated CUDA driver (see the module docstring).

    Parameters
    ----------
    deferred : bool
        Run stream work only when it is waited for (detects pinned-buffer races).
    """

    name = "emu"
    runs_cubins = False
    #: Why ``open_driver("auto")`` fell back to this driver (None: the emulator was asked for).
    fallback_reason: str | None = None

    def __init__(self, deferred: bool = False):
        self.deferred = bool(deferred)
        self.memory = EmuMemory()
        self._null = _Stream(0)
        self._streams: dict[int, _Stream] = {0: self._null}
        self._next_stream = 1
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
        return {"contexts": self._contexts, "streams": len(self._streams) - 1, "events": self._events}

    # running stream work ---------------------------------------------------------------
    def _enqueue(self, stream: Any, op: Callable[[], None]) -> None:
        s = self._stream(stream)
        if s.capture is not None:
            s.capture.append(op)
        elif self.deferred:
            s.queue.append(op)
        else:
            op()

    def _drain(self, s: _Stream, until: Callable[[], bool] | None = None) -> None:
        while s.queue:
            if until is not None and until():
                return
            op = s.queue.popleft()
            op()

    def _stream(self, stream: Any) -> _Stream:
        if stream is None or isinstance(stream, int):
            s = self._streams.get(int(stream or 0))
            if s is None:
                fail("cuStream", "CUDA_ERROR_INVALID_HANDLE")
            return s
        return stream

    # context / device -------------------------------------------------------------------
    def device_count(self) -> int:
        self._fault("cuDeviceGetCount")
        return 1

    def open_context(self, ordinal: int) -> Any:
        self._fault("cuDevicePrimaryCtxRetain")
        if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)) or ordinal != 0:
            fail("cuDeviceGet", "CUDA_ERROR_INVALID_DEVICE")
        self._contexts += 1
        return ("emu-context", ordinal)

    def close_context(self, ctx: Any) -> None:
        self._fault("cuDevicePrimaryCtxRelease")
        self._contexts -= 1

    def set_current(self, ctx: Any) -> None:
        pass

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
        try:
            return self._ATTRS[name.lower()]
        except KeyError:
            fail("cuDeviceGetAttribute", "CUDA_ERROR_INVALID_VALUE")

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        return (9, 0)

    def driver_version(self) -> int:
        return 13000

    # memory -----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        self._fault("cuMemAlloc")
        if int(nbytes) <= 0:
            fail("cuMemAlloc", "CUDA_ERROR_INVALID_VALUE")
        return self.memory.add(nbytes, "device", "cuMemAlloc")

    def mem_free(self, ptr: int) -> None:
        self._fault("cuMemFree")
        if not self.memory.remove(ptr, "device"):
            fail("cuMemFree", "CUDA_ERROR_INVALID_VALUE")

    def host_alloc(self, nbytes: int) -> int:
        self._fault("cuMemHostAlloc")
        if int(nbytes) <= 0:
            fail("cuMemHostAlloc", "CUDA_ERROR_INVALID_VALUE")
        return self.memory.add(nbytes, "pinned", "cuMemHostAlloc")

    def host_free(self, ptr: int) -> None:
        self._fault("cuMemFreeHost")
        if not self.memory.remove(ptr, "pinned"):
            fail("cuMemFreeHost", "CUDA_ERROR_INVALID_VALUE")

    def _check_device(self, call: str, ptr: int, nbytes: int) -> None:
        if self.memory.find(ptr, nbytes, "device") is None:
            fail(call, "CUDA_ERROR_INVALID_VALUE")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyHtoDAsync"
        self._fault(call)
        self._check_device(call, dst, nbytes)
        s = self._stream(stream)
        snapshot = ctypes.string_at(src, nbytes) if (self.deferred and s.capture is None) else None
        self._enqueue(s, _HtoD(dst, src, nbytes, snapshot))

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyDtoHAsync"
        self._fault(call)
        self._check_device(call, src, nbytes)
        self._enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        call = "cuMemcpyDtoDAsync"
        self._fault(call)
        self._check_device(call, dst, nbytes)
        self._check_device(call, src, nbytes)
        self._enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def memset_d8_async(self, dst: int, value: int, nbytes: int, stream: Any) -> None:
        call = "cuMemsetD8Async"
        self._fault(call)
        self._check_device(call, dst, nbytes)
        self._enqueue(stream, lambda: ctypes.memset(dst, int(value) & 0xFF, nbytes))

    # streams and events -----------------------------------------------------------------
    def stream_create(self) -> Any:
        self._fault("cuStreamCreate")
        s = _Stream(self._next_stream)
        self._streams[s.ident] = s
        self._next_stream += 1
        return s

    def stream_destroy(self, stream: Any) -> None:
        self._fault("cuStreamDestroy")
        s = self._stream(stream)
        self._drain(s)
        self._streams.pop(s.ident, None)

    def stream_synchronize(self, stream: Any) -> None:
        self._fault("cuStreamSynchronize")
        self._drain(self._stream(stream))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._fault("cuStreamWaitEvent")
        generation = event.generation
        self._enqueue(stream, lambda: self._wait(event, generation))

    def stream_handle(self, stream: Any) -> int:
        return self._stream(stream).ident

    def stream_from_handle(self, handle: int) -> Any:
        return self._stream(int(handle))

    def event_create(self, timing: bool = False) -> Any:
        self._fault("cuEventCreate")
        self._events += 1
        return _Event(bool(timing))

    def event_destroy(self, event: Any) -> None:
        self._fault("cuEventDestroy")
        self._events -= 1

    def event_record(self, event: Any, stream: Any) -> None:
        self._fault("cuEventRecord")
        s = self._stream(stream)
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
        self._wait(event)

    def event_query(self, event: Any) -> bool:
        self._fault("cuEventQuery")
        return event.done

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        self._fault("cuEventElapsedTime")
        if not (start.timing and end.timing):
            fail("cuEventElapsedTime", "CUDA_ERROR_INVALID_HANDLE")
        if not (start.done and end.done):
            fail("cuEventElapsedTime", "CUDA_ERROR_NOT_READY")
        return (end.time - start.time) * 1e3

    # modules and launches ---------------------------------------------------------------
    def module_load(self, image: Any) -> Any:
        self._fault("cuModuleLoadData")
        if not isinstance(image, EmuImage):
            fail("cuModuleLoadData", "CUDA_ERROR_INVALID_IMAGE")
        self._modules += 1
        return image

    def module_unload(self, module: Any) -> None:
        self._fault("cuModuleUnload")
        self._modules -= 1

    def module_get_function(self, module: Any, name: str) -> Any:
        self._fault("cuModuleGetFunction")
        if name not in module.entries or name not in _EMULATORS:
            fail("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND")
        return _Function(name, tuple(module.entries[name]))

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

        self._enqueue(stream, op)

    # graphs -----------------------------------------------------------------------------
    def begin_capture(self, stream: Any) -> None:
        self._fault("cuStreamBeginCapture")
        s = self._stream(stream)
        if s.capture is not None:
            fail("cuStreamBeginCapture", "CUDA_ERROR_ILLEGAL_STATE")
        s.capture = []

    def end_capture(self, stream: Any) -> Any:
        self._fault("cuStreamEndCapture")
        s = self._stream(stream)
        if s.capture is None:
            fail("cuStreamEndCapture", "CUDA_ERROR_ILLEGAL_STATE")
        ops, s.capture = s.capture, None
        return tuple(ops)

    def graph_instantiate(self, graph: Any) -> Any:
        self._fault("cuGraphInstantiate")
        return graph

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._fault("cuGraphLaunch")
        s = self._stream(stream)
        for op in graph_exec:
            if isinstance(op, _HtoD) and self.deferred and s.capture is None:
                # a captured copy reads its host buffer when the graph runs: the bytes there at
                # this launch are the ones it must upload (a later rewrite is a race)
                op = _HtoD(op.dst, op.src, op.nbytes, ctypes.string_at(op.src, op.nbytes))
            self._enqueue(s, op)

    def graph_destroy(self, graph: Any, graph_exec: Any) -> None:
        pass
