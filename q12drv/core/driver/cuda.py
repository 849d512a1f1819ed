"""The real driver: ``cuda.bindings.driver``, every call through :func:`_call` (the choke point)."""

from __future__ import annotations

from typing import Any

from ..errors import CudaError, DriverUnavailableError
from .base import Driver, PointerInfo
from .result import check

__all__ = ["CudaDriver"]


def _load_bindings():
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # cuda-python missing entirely
        raise DriverUnavailableError(f"cuda-python is not installed ({exc}); pip install 'cuda-python>=13.0'") from exc
    return cu


class CudaDriver(Driver):
    """CUDA driver API through ``cuda.bindings``.

    Raises
    ------
    DriverUnavailableError
        When libcuda cannot be loaded (no NVIDIA driver) or ``cuInit`` fails.
    """

    name = "cuda"
    runs_cubins = True

    def __init__(self):
        cu = _load_bindings()
        self._cu = cu
        try:
            (err,) = cu.cuInit(0)
        except Exception as exc:  # DynamicLibNotFoundError: libcuda absent, not a CUresult
            raise DriverUnavailableError(
                f"the CUDA driver library cannot be loaded ({type(exc).__name__}: {exc}); "
                "use driver='emu' (or Q12DRV_DRIVER=emu) on a machine without an NVIDIA GPU"
            ) from exc
        if int(err) != 0:
            try:
                check("cuInit", err)
            except Exception as exc:
                raise DriverUnavailableError(f"{exc}; use driver='emu' on a machine without a usable GPU") from exc
        self._launch = cu.cuLaunchKernel
        self._htod_async = cu.cuMemcpyHtoDAsync

    def _call(self, call: str, *args):
        """Run ``cuda.bindings.driver.<call>(*args)``; raise on error; return the outputs."""
        result = getattr(self._cu, call)(*args)
        check(call, result[0])
        if len(result) == 1:
            return None
        if len(result) == 2:
            return result[1]
        return result[1:]

    # context / device -------------------------------------------------------------------
    def device_count(self) -> int:
        return int(self._call("cuDeviceGetCount"))

    def _device(self, ordinal: int):
        return self._call("cuDeviceGet", ordinal)

    def open_context(self, ordinal: int) -> Any:
        dev = self._device(ordinal)
        ctx = self._call("cuDevicePrimaryCtxRetain", dev)
        self._call("cuCtxSetCurrent", ctx)
        return (ordinal, ctx)

    def close_context(self, ctx: Any) -> None:
        ordinal, _ = ctx
        self._call("cuDevicePrimaryCtxRelease", self._device(ordinal))

    def set_current(self, ctx: Any) -> None:
        self._call("cuCtxSetCurrent", ctx[1])

    def current_context(self) -> Any:
        return self._call("cuCtxGetCurrent")

    @property
    def machine(self) -> Any:
        return CudaDriver  # one process, one CUDA driver: every CudaDriver object sees the same devices

    def device_name(self, ordinal: int) -> str:
        raw = self._call("cuDeviceGetName", 256, self._device(ordinal))
        return bytes(raw).split(b"\0", 1)[0].decode()

    def device_attribute(self, ordinal: int, name: str) -> int:
        attr = getattr(self._cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name.upper()}")
        return int(self._call("cuDeviceGetAttribute", attr, self._device(ordinal)))

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        return (self.device_attribute(ordinal, "compute_capability_major"),
                self.device_attribute(ordinal, "compute_capability_minor"))

    def driver_version(self) -> int:
        return int(self._call("cuDriverGetVersion"))

    # memory -----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        return int(self._call("cuMemAlloc", nbytes))

    def mem_free(self, ptr: int) -> None:
        self._call("cuMemFree", ptr)

    def host_alloc(self, nbytes: int) -> int:
        return int(self._call("cuMemHostAlloc", nbytes, 0))

    def host_free(self, ptr: int) -> None:
        self._call("cuMemFreeHost", ptr)

    def pointer_info(self, ptr: int) -> PointerInfo | None:
        """``cuPointerGetAttribute``'s memory type, device ordinal and allocation range of ``ptr``; None when the
        driver does not know the address (``CUDA_ERROR_INVALID_VALUE``: pageable host memory, or no memory)."""
        attr = self._cu.CUpointer_attribute
        try:
            kind = int(self._call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, int(ptr)))
        except CudaError as exc:
            if exc.name == "CUDA_ERROR_INVALID_VALUE":
                return None
            raise
        try:
            start = int(self._call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, int(ptr)))
            size = int(self._call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE, int(ptr)))
        except CudaError:  # memory the driver keeps no range for: its extent is unknown
            start, size = int(ptr), 0
        if kind == int(self._cu.CUmemorytype.CU_MEMORYTYPE_HOST):
            return PointerInfo("host", -1, start, size)
        ordinal = int(self._call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr)))
        return PointerInfo("device", ordinal, start, size)

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        # The staging hot path: bound method, one call, one check.
        check("cuMemcpyHtoDAsync", self._htod_async(dst, src, nbytes, stream)[0])

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._call("cuMemcpyDtoHAsync", dst, src, nbytes, stream)

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._call("cuMemcpyDtoDAsync", dst, src, nbytes, stream)

    def memset_d8_async(self, dst: int, value: int, nbytes: int, stream: Any) -> None:
        self._call("cuMemsetD8Async", dst, value, nbytes, stream)

    # streams and events -----------------------------------------------------------------
    def stream_create(self) -> Any:
        return self._call("cuStreamCreate", self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def stream_destroy(self, stream: Any) -> None:
        self._call("cuStreamDestroy", stream)

    def stream_synchronize(self, stream: Any) -> None:
        self._call("cuStreamSynchronize", stream)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._call("cuStreamWaitEvent", stream, event, 0)

    def stream_handle(self, stream: Any) -> int:
        return int(stream)

    def stream_from_handle(self, handle: int) -> Any:
        return self._cu.CUstream(int(handle))

    def stream_device(self, stream: Any) -> int | None:
        if int(stream) <= 2:  # CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, NULL: the current context's
            return None
        try:
            return int(self._call("cuStreamGetDevice", stream))
        except RuntimeError:  # a driver older than cuStreamGetDevice (CUDA 12.8): the bindings cannot find it
            return None
        except CudaError as exc:
            if exc.name in ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_FOUND"):
                return None
            raise

    def event_create(self, timing: bool = False) -> Any:
        flags = self._cu.CUevent_flags.CU_EVENT_DEFAULT if timing else self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return self._call("cuEventCreate", flags)

    def event_destroy(self, event: Any) -> None:
        self._call("cuEventDestroy", event)

    def event_record(self, event: Any, stream: Any) -> None:
        self._call("cuEventRecord", event, stream)

    def event_synchronize(self, event: Any) -> None:
        self._call("cuEventSynchronize", event)

    def event_query(self, event: Any) -> bool:
        (err,) = self._cu.cuEventQuery(event)
        if int(err) == int(self._cu.CUresult.CUDA_ERROR_NOT_READY):
            return False
        check("cuEventQuery", err)
        return True

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self._call("cuEventElapsedTime", start, end))

    # modules and launches ---------------------------------------------------------------
    def module_load(self, image: Any) -> Any:
        return self._call("cuModuleLoadData", image)

    def module_unload(self, module: Any) -> None:
        self._call("cuModuleUnload", module)

    def module_get_function(self, module: Any, name: str) -> Any:
        return self._call("cuModuleGetFunction", module, name.encode())

    def function_attribute(self, func: Any, name: str) -> int:
        attr = getattr(self._cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}")
        return int(self._call("cuFuncGetAttribute", attr, func))

    def set_max_dynamic_smem(self, func: Any, nbytes: int) -> None:
        attr = self._cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._call("cuFuncSetAttribute", func, attr, int(nbytes))

    def launch(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int) -> None:
        err = self._launch(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream, params_addr, 0)[0]
        check("cuLaunchKernel", err)

    def launch_dependent(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int) -> None:
        self.dependent_launcher(func, params_addr)(grid, block, smem, stream)

    def dependent_launcher(self, func: Any, params_addr: int):
        """``fire(grid, block, smem, stream)``: one ``cuLaunchKernelEx`` with programmatic stream serialization.
        Its launch configuration is built once and its fields rewritten only when the geometry, shared memory or
        stream differ from the previous call's: building one takes about 6 us of Python (cuda-bindings 13, CPython
        3.11 on this project's development machine), and every Gated DeltaNet layer of the wgmma pair launches its
        sequential kernel this way."""
        cu = self._cu
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = cu.CUlaunchConfig()
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        launch_ex = cu.cuLaunchKernelEx
        last = [None]

        def fire(grid, block, smem, stream):
            key = (tuple(grid), tuple(block), smem, stream)
            if key != last[0]:
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = key[0]
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = key[1]
                cfg.sharedMemBytes = smem
                cfg.hStream = stream
                last[0] = key
            err = launch_ex(cfg, func, params_addr, 0)[0]
            if err:  # CUresult is an int enum: CUDA_SUCCESS is falsy
                check("cuLaunchKernelEx", err)

        return fire

    def launcher(self, func: Any, params_addr: int):
        launch = self._launch

        def fire(grid, block, smem, stream):
            err = launch(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream, params_addr, 0)[0]
            if err:  # CUresult is an int enum: CUDA_SUCCESS is falsy
                check("cuLaunchKernel", err)

        return fire

    def bound_launcher(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int,
                       owner: Any = None):
        launch = self._launch
        gx, gy, gz = grid
        bx, by, bz = block

        def fire():
            err = launch(func, gx, gy, gz, bx, by, bz, smem, stream, params_addr, 0)[0]
            if err:
                check("cuLaunchKernel", err)

        fire.owner = owner  # the argument block params_addr points into
        return fire

    # graphs -----------------------------------------------------------------------------
    def begin_capture(self, stream: Any) -> None:
        mode = self._cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._call("cuStreamBeginCapture", stream, mode)

    def end_capture(self, stream: Any) -> Any:
        return self._call("cuStreamEndCapture", stream)

    def stream_is_capturing(self, stream: Any) -> bool:
        return self._call("cuStreamIsCapturing", stream) != self._cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def graph_instantiate(self, graph: Any) -> Any:
        return self._call("cuGraphInstantiate", graph, 0)

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._call("cuGraphLaunch", graph_exec, stream)

    def graph_destroy(self, graph: Any, graph_exec: Any) -> None:
        if graph_exec is not None:
            self._call("cuGraphExecDestroy", graph_exec)
        if graph is not None:
            self._call("cuGraphDestroy", graph)
