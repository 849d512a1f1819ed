"""A kernel's launch as every layer of a pass makes it: everything but the layer's pointers fixed once.

A pass runs the same kernels in every layer with the same metadata, head counts and geometry; only the
layer's tensors (its activations, its KV pools) change. :class:`LayerLaunch` checks and packs the fixed arguments
into bytes once, so that a layer's launch is one write of the whole argument block (``struct.pack_into``: the
fixed bytes around the layer's pointers) and the driver call.
"""

from __future__ import annotations

import ctypes
import struct
import weakref
from functools import partial
from threading import get_ident
from typing import Any, Callable

from ..core.device import CURRENT, Device
from .registry import prepared

__all__ = ["LayerLaunch", "for_metadata"]

#: (id of the metadata, the launch's other inputs) -> (weak reference to the metadata, its LayerLaunch).
_FOR_META: dict = {}
_FOR_META_MAX = 256


def for_metadata(meta: Any, key: tuple, make: Callable[[], Any], keep: Any = None) -> Any:
    """What ``make()`` builds for staged metadata ``meta`` and ``key`` (a launch, or a plan: the device, the kernel and
    every other fixed argument: values, or ``id()`` of ``keep``, which the entry holds so that its id is not reused),
    made on the first call and kept while ``meta`` lives: what a launcher called layer after layer outside a pass
    reuses (a pass keeps its own). ``meta`` is weakly referenced, so its arena is not kept alive, and its entries go when it does
    (at most :data:`_FOR_META_MAX` entries of live metadata are kept)."""
    full = (id(meta), *key)
    hit = _FOR_META.get(full)
    if hit is None or hit[0]() is not meta:
        if len(_FOR_META) >= _FOR_META_MAX:
            _FOR_META.clear()
        hit = _FOR_META[full] = (weakref.ref(meta, partial(_forget, full)), make(), keep)
    return hit[1]


def _forget(full: tuple, ref: weakref.ref) -> None:
    """Drop the entry ``full`` of metadata that was just freed (its weak reference's callback), unless the key already
    holds another entry."""
    hit = _FOR_META.get(full)
    if hit is not None and hit[0] is ref:
        _FOR_META.pop(full, None)


class LayerLaunch:
    """One kernel's launch with every argument but a run of consecutive pointer parameters fixed: :meth:`launch`
    writes the whole argument block with the layer's pointers and launches it.

    The block written is the calling thread's pre-packed one (:func:`~q12drv.kernels.registry.prepared`): every
    launcher writes all of a block's arguments before it launches it, so nothing another launch left there is read,
    and any thread may launch a LayerLaunch.

    Parameters
    ----------
    device : Device
    entry : str
        The kernel entry (registered).
    grid, block : tuple
        The launch geometry (three positive ints each).
    smem : int
        Dynamic shared memory bytes.
    pointers : tuple of str
        The parameters each call passes, consecutive and 64-bit, in the kernel's order.
    dependent : bool
        Launch with programmatic stream serialization (:meth:`~q12drv.core.launch.Launch.launch_dependent`).
    **fixed
        Every other parameter's value (checked against its C type, as :meth:`~q12drv.core.launch.Launch.set` does).

    Raises
    ------
    ValueError
        ``pointers`` are not consecutive 64-bit parameters of the kernel, or ``fixed`` does not name exactly the
        other parameters.
    TypeError, OverflowError
        A fixed value that does not fit its parameter.
    """

    __slots__ = ("entry", "grid", "block", "smem", "_device", "_dependent", "_pack", "_head", "_tail", "_mine")

    def __init__(self, device: Device, entry: str, grid: tuple, block: tuple, smem: int, pointers: tuple, *,
                 dependent: bool = False, **fixed: Any):
        launch = prepared(device, entry)
        kernel = launch.kernel
        fixed_names, start, pack = _layout(kernel.args_type, tuple(pointers), entry)
        if fixed.keys() != fixed_names:
            raise ValueError(f"kernel {entry}: fixed arguments {sorted(fixed)} must be exactly {sorted(fixed_names)}")
        # the fixed values, checked as set() checks them, in this thread's block; their bytes kept
        raw = bytes(launch.set(**fixed).args)
        self._head, self._tail = raw[:start], raw[start + 8 * len(pointers):]
        self._pack = pack
        if smem > kernel.smem_limit:
            kernel.allow_dynamic_smem(smem)
        self._device = device
        self._dependent = dependent
        self.entry, self.grid, self.block, self.smem = entry, grid, block, smem
        self._mine = (None, None)  # (thread id, its pre-packed launch): the last calling thread's

    def launch(self, stream: Any, pointers: tuple) -> None:
        """Launch on the driver stream ``stream`` (:meth:`Device.as_stream <q12drv.core.device.Device.as_stream>`'s
        result) with ``pointers`` (the parameters named at construction, in order; already checked: ints in
        ``(0, 2**64)``). The device's context is made current in the calling thread first where it is not."""
        ident, launch = self._mine  # one read: another thread replaces the tuple, never changes it
        if ident != get_ident():
            ident, launch = self._mine = get_ident(), prepared(self._device, self.entry)
        self._pack(launch.args, 0, self._head, *pointers, self._tail)
        dev = self._device
        if CURRENT.device is not dev:
            dev.set_current()
        # the launch's driver call read each time: a tracer (bench/breakdown.py) may have wrapped it since
        if self._dependent:
            launch.fire_dependent(self.grid, self.block, self.smem, stream)
        else:
            launch.fire(self.grid, self.block, self.smem, stream)


#: (argument block type, pointer names) -> their layout (:func:`_layout`): a pass makes LayerLaunches of a few kinds.
_LAYOUTS: dict = {}


def _layout(args_type: type, pointers: tuple, entry: str) -> tuple:
    """``(names of the other parameters, byte offset of the first pointer, the block's pack_into)`` for a kernel
    whose argument block is ``args_type`` (a ctypes structure, :attr:`q12drv.core.launch.Kernel.args_type`) called
    with ``pointers``: the block as its bytes before them, the pointers (u64) and its bytes after.

    Raises
    ------
    ValueError
        ``pointers`` are not consecutive pointer (64-bit) parameters of the kernel (``entry``, for the message).
    """
    key = (args_type, pointers)
    hit = _LAYOUTS.get(key)
    if hit is None:
        params = args_type._fields_
        names = [n for n, _ in params]
        first = names.index(pointers[0]) if pointers and pointers[0] in names else -1
        run = params[first:first + len(pointers)] if first >= 0 else ()
        if not run or tuple(n for n, _ in run) != pointers or any(t is not ctypes.c_uint64 for _, t in run):
            raise ValueError(f"kernel {entry}: {pointers} are not consecutive pointer parameters of "
                             f"({', '.join(names)})")
        start = getattr(args_type, pointers[0]).offset
        tail = ctypes.sizeof(args_type) - start - 8 * len(pointers)
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = (set(names) - set(pointers), start,
                               struct.Struct(f"<{start}s{len(pointers)}Q{tail}s").pack_into)
    return hit
