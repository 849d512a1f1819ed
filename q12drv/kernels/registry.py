"""The kernel registry: which ``cuda_src`` file holds each entry, its emulator, and its pre-packed launch.

Every kernel module registers its source, entries, numpy emulators and the contract defines its source
checks here when it is imported (:func:`register`); every compile of a source takes :func:`build_defines`, and
the launchers ask :func:`prepared` for an entry's :class:`~q12drv.core.launch.Launch`. Nothing here knows what
a kernel computes.
"""

from __future__ import annotations

from typing import Callable, Mapping

from ..core.device import Device
from ..core.driver import register_emulator
from ..core.launch import Launch, load_module
from .meta import Q12MetaC, Q12TailC, meta_defines

__all__ = ["register", "prepared", "build_defines", "SOURCES", "ENTRIES", "CONTRACTS", "struct_types"]

#: Every registered kernel source and its entries, in registration order.
SOURCES: dict[str, tuple[str, ...]] = {}
#: Entry name -> the source that defines it.
ENTRIES: dict[str, str] = {}
#: Source -> its contract defines: the host's launch numbers (``NAME=VALUE``) the source ``static_assert``s.
CONTRACTS: dict[str, tuple[str, ...]] = {}


def register(source: str, entries: tuple[str, ...], emulators: Mapping[str, Callable] | None = None,
             contract: tuple[str, ...] = ()) -> None:
    """Record ``source``'s ``entries`` and ``contract`` defines and make each emulator what an emulated launch of
    its entry runs."""
    SOURCES[source] = tuple(entries)
    CONTRACTS[source] = tuple(contract)
    for entry in entries:
        ENTRIES[entry] = source
    for name, fn in (emulators or {}).items():
        register_emulator(name, fn)


def build_defines(source: str) -> tuple[str, ...]:
    """The ``-D`` macros every compile of ``source`` takes: the metadata mirrors' layout (:func:`meta_defines`)
    and the contract defines its kernel module registered."""
    return tuple(meta_defines()) + CONTRACTS.get(source, ())


def struct_types() -> dict:
    """The by-value struct parameters of the kernels' entries, by C type name."""
    return {"Q12Meta": Q12MetaC, "Q12Tail": Q12TailC}


def prepared(device: Device, entry: str) -> Launch:
    """The pre-packed :class:`~q12drv.core.launch.Launch` of ``entry`` on ``device`` (built once)."""
    key = ("launch", entry)
    launch = device.cache.get(key)
    if launch is None:
        source = ENTRIES.get(entry)
        if source is None:
            raise KeyError(f"unknown kernel {entry!r}; kernels: {', '.join(sorted(ENTRIES))}")
        module = load_module(device, source, defines=build_defines(source), struct_types=struct_types())
        launch = device.cache[key] = module.kernel(entry).prepare()
    return launch
