"""The driver interface: the subset of the CUDA driver API q12drv uses, as plain Python calls.

Handles (streams, events, modules, functions, contexts) are opaque objects owned by the driver;
device and host addresses are ``int``. Both drivers implement every method here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Driver", "PointerInfo"]


class PointerInfo(NamedTuple):
    """What the driver knows about an address (:meth:`Driver.pointer_info`).

    Attributes
    ----------
    kind : str
        ``"device"`` (device or managed memory) or ``"host"`` (page-locked host memory the driver allocated or
        registered).
    ordinal : int
        The device the memory belongs to; -1 for host memory.
    start, nbytes : int
        The allocation (or registered range) holding the address; ``nbytes`` 0 when the driver does not say.
    """

    kind: str
    ordinal: int
    start: int
    nbytes: int


class Driver:
    """Abstract driver. See :mod:`q12drv.core.driver.cuda` and :mod:`q12drv.core.driver.emu`."""

    #: ``"cuda"`` or ``"emu"``.
    name: str = "abstract"
    #: Whether modules are built from compiled cubins (real GPU) or from registered emulators.
    runs_cubins: bool = False
    #: Whether this is the emulated driver (its device memory is host memory; it adopts other libraries').
    emulated: bool = False

    # context / device
    def device_count(self) -> int: raise NotImplementedError
    def open_context(self, ordinal: int) -> Any: raise NotImplementedError
    def close_context(self, ctx: Any) -> None: raise NotImplementedError
    def set_current(self, ctx: Any) -> None: raise NotImplementedError
    def current_context(self) -> Any: raise NotImplementedError
    def device_name(self, ordinal: int) -> str: raise NotImplementedError
    def compute_capability(self, ordinal: int) -> tuple[int, int]: raise NotImplementedError
    def device_attribute(self, ordinal: int, name: str) -> int: raise NotImplementedError
    def driver_version(self) -> int: raise NotImplementedError

    # memory
    def mem_alloc(self, nbytes: int) -> int: raise NotImplementedError
    def mem_free(self, ptr: int) -> None: raise NotImplementedError
    def host_alloc(self, nbytes: int) -> int: raise NotImplementedError
    def host_free(self, ptr: int) -> None: raise NotImplementedError
    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None: raise NotImplementedError
    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None: raise NotImplementedError
    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None: raise NotImplementedError
    def memset_d8_async(self, dst: int, value: int, nbytes: int, stream: Any) -> None: raise NotImplementedError

    def pointer_info(self, ptr: int) -> PointerInfo | None:
        """What ``ptr`` addresses, or None when the driver knows nothing of it (pageable host memory, garbage).
        Needs a current context (the real driver asks it)."""
        raise NotImplementedError

    @property
    def machine(self) -> Any:
        """Identity of the machine this driver drives: two drivers with the same ``machine`` see the same devices,
        contexts and streams (every real driver object drives the one GPU machine; each emulated driver is a
        machine of its own)."""
        return self

    # streams and events
    def stream_create(self) -> Any: raise NotImplementedError
    def stream_destroy(self, stream: Any) -> None: raise NotImplementedError
    def stream_synchronize(self, stream: Any) -> None: raise NotImplementedError
    def stream_wait_event(self, stream: Any, event: Any) -> None: raise NotImplementedError
    def stream_handle(self, stream: Any) -> int: raise NotImplementedError
    def stream_from_handle(self, handle: int) -> Any: raise NotImplementedError

    def stream_device(self, stream: Any) -> int | None:
        """The ordinal of the device ``stream`` belongs to; None when it cannot be told, or for the handles 0, 1
        and 2 (the null, legacy and per-thread default streams: the current context's own)."""
        raise NotImplementedError
    def event_create(self, timing: bool = False) -> Any: raise NotImplementedError
    def event_destroy(self, event: Any) -> None: raise NotImplementedError
    def event_record(self, event: Any, stream: Any) -> None: raise NotImplementedError
    def event_synchronize(self, event: Any) -> None: raise NotImplementedError
    def event_query(self, event: Any) -> bool: raise NotImplementedError
    def event_elapsed_ms(self, start: Any, end: Any) -> float: raise NotImplementedError

    # modules and launches
    def module_load(self, image: Any) -> Any: raise NotImplementedError
    def module_unload(self, module: Any) -> None: raise NotImplementedError
    def module_get_function(self, module: Any, name: str) -> Any: raise NotImplementedError
    def function_attribute(self, func: Any, name: str) -> int: raise NotImplementedError
    def set_max_dynamic_smem(self, func: Any, nbytes: int) -> None: raise NotImplementedError
    def launch(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int) -> None:
        raise NotImplementedError

    def launch_dependent(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int) -> None:
        """:meth:`launch` with programmatic stream serialization (Hopper's programmatic dependent launch): the
        kernel may start once every CTA of the stream's previous kernel has executed
        ``griddepcontrol.launch_dependents`` (or exited), before that kernel completes.

        A driver without it launches in stream order, which is a valid schedule of the same launch (the
        kernel then starts after its predecessor completes); the emulated driver does that.
        """
        self.launch(func, grid, block, smem, stream, params_addr)

    def dependent_launcher(self, func: Any, params_addr: int):
        """``fire(grid, block, smem, stream)``: :meth:`launch_dependent` of ``func`` with the parameters at
        ``params_addr``. Drivers override it with what a launch's call can keep between calls."""
        def fire(grid, block, smem, stream):
            self.launch_dependent(func, grid, block, smem, stream, params_addr)

        return fire

    def launcher(self, func: Any, params_addr: int):
        """``fire(grid, block, smem, stream)``: :meth:`launch` of ``func`` with the parameters at ``params_addr``.

        Drivers override it with the driver call bound directly (the per-launch hot path).
        """
        def fire(grid, block, smem, stream):
            self.launch(func, grid, block, smem, stream, params_addr)

        return fire

    def bound_launcher(self, func: Any, grid: tuple, block: tuple, smem: int, stream: Any, params_addr: int,
                       owner: Any = None):
        """``fire()``: the same launch with everything bound; ``owner`` is kept alive with it."""
        def fire():
            self.launch(func, grid, block, smem, stream, params_addr)

        fire.owner = owner
        return fire

    # graphs (stream capture)
    def begin_capture(self, stream: Any) -> None: raise NotImplementedError
    def end_capture(self, stream: Any) -> Any: raise NotImplementedError
    def stream_is_capturing(self, stream: Any) -> bool: raise NotImplementedError
    def graph_instantiate(self, graph: Any) -> Any: raise NotImplementedError
    def graph_launch(self, graph_exec: Any, stream: Any) -> None: raise NotImplementedError
    def graph_destroy(self, graph: Any, graph_exec: Any) -> None: raise NotImplementedError
