"""The kernel registry: which ``cuda_src`` file holds each entry, its emulator, its contract defines and its
pre-packed launch.

Every kernel module registers its source, entries, numpy emulators and host/device contract defines here when
it is imported (:func:`register`); whatever compiles a registered source asks :func:`compile_defines` for its
``-D`` options, and the launchers ask :func:`prepared` for an entry's :class:`~q12drv.core.launch.Launch`.
Nothing here knows what a kernel computes.

Host/device contracts
---------------------
A number both sides rely on (threads per CTA the host launches, CTAs per SM its persistent grid assumes, a tile
size its geometry divides by) is written once, in the kernel module, and passed to the compiler as
``-D Q12_<KERNEL>_<FIELD>=<value>``::

    CONTRACTS = {"Q12_ROPE_THREADS": THREADS, ...}
    registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)

The source has no default for it and checks it against its constexpr configuration function::

    #ifndef Q12_ROPE_THREADS
    #error "compile through q12drv (registry.compile_defines): it passes the host's contract defines"
    #endif
    static_assert(Q12_ROPE_THREADS <= rope_config().max_threads, "...");

so a host that drifted from the kernel fails to compile, and a build that bypasses q12drv stops at the
``#error``. The metadata mirrors' offsets (:func:`~q12drv.kernels.meta.meta_defines`) follow the same pattern
and go to every source.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

from ..core.device import Device
from ..core.driver import register_emulator
from ..core.launch import Launch, load_module
from .meta import Q12MetaC, Q12TailC, meta_defines

__all__ = ["register", "prepared", "prepared_launches", "compile_defines", "SOURCES", "ENTRIES", "CONTRACTS",
           "struct_types"]

#: Every registered kernel source and its entries, in registration order.
SOURCES: dict[str, tuple[str, ...]] = {}
#: Entry name -> the source that defines it.
ENTRIES: dict[str, str] = {}
#: Source -> its host/device contract defines, ``("NAME=VALUE", ...)``.
CONTRACTS: dict[str, tuple[str, ...]] = {}

#: Source -> the by-value struct parameter types its entries take beyond the metadata's.
_STRUCTS: dict[str, dict[str, type]] = {}

_CONTRACT_NAME = re.compile(r"Q12_[A-Z0-9_]+\Z")


def register(source: str, entries: tuple[str, ...], emulators: Mapping[str, Callable] | None = None, *,
             defines: Mapping[str, int] | None = None, structs: Mapping[str, type] | None = None) -> None:
    """Record ``source``'s ``entries``, make each emulator what an emulated launch of its entry runs, and keep
    ``defines`` (contract name -> int, e.g. ``{"Q12_ROPE_THREADS": 256}``) for every compile of ``source`` and
    ``structs`` (C type name -> ctypes mirror) for the by-value struct parameters of its entries.

    Raises
    ------
    ValueError
        A contract name that is not ``Q12_`` followed by capitals, digits and underscores, or a value that is
        not an int.
    """
    contracts = []
    for name, value in (defines or {}).items():
        if not _CONTRACT_NAME.match(name) or isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{source}: contract define {name}={value!r} must be Q12_<KERNEL>_<FIELD>=<int>")
        contracts.append(f"{name}={value}")
    SOURCES[source] = tuple(entries)
    CONTRACTS[source] = tuple(contracts)
    _STRUCTS[source] = dict(structs or {})
    for entry in entries:
        ENTRIES[entry] = source
    for name, fn in (emulators or {}).items():
        register_emulator(name, fn)


def compile_defines(source: str) -> tuple[str, ...]:
    """Every ``-D`` a build of ``source`` needs: the metadata mirrors' (:func:`~q12drv.kernels.meta.meta_defines`)
    and the source's own contract defines (none for a source no kernel module registered)."""
    return tuple(meta_defines()) + CONTRACTS.get(source, ())


def struct_types(source: str | None = None) -> dict:
    """The by-value struct parameters of ``source``'s entries (every source's: None), by C type name."""
    extra = _STRUCTS.get(source, {}) if source is not None else {k: v for d in _STRUCTS.values() for k, v in d.items()}
    return {"Q12Meta": Q12MetaC, "Q12Tail": Q12TailC, **extra}


def prepared(device: Device, entry: str) -> Launch:
    """The calling thread's pre-packed :class:`~q12drv.core.launch.Launch` of ``entry`` on ``device`` (built once per
    thread; the module and the kernel are loaded once per device).

    A launcher writes its arguments into the block and launches it; each thread has a block of its own, so threads
    launching the same kernel at once never see each other's arguments.
    """
    launches = device.local.launches
    launch = launches.get(entry)
    if launch is None:
        source = ENTRIES.get(entry)
        if source is None:
            raise KeyError(f"unknown kernel {entry!r}; kernels: {', '.join(sorted(ENTRIES))}")
        module = load_module(device, source, defines=compile_defines(source), struct_types=struct_types(source))
        launch = launches[entry] = module.kernel(entry).prepare()
    return launch


def prepared_launches(device: Device) -> dict:
    """The calling thread's pre-packed launches on ``device`` made so far, by entry (a live view: do not change it)."""
    return device.local.launches
