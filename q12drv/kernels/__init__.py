"""Kernels layer: the NVRTC kernels in ``cuda_src/``, their launchers (:mod:`~q12drv.kernels.ops`)
and their numpy references (one module per kernel).

Importing this package registers every kernel's emulator with the emulated driver, so the same
launchers run the numpy reference when there is no GPU.
"""

from __future__ import annotations

from ..driver import register_emulator
from . import attention, attention_wgmma, expand, gdn, gdn_chunk, gdn_wgmma, kv_write, ops, rope

for _mod in (attention, attention_wgmma, expand, gdn, gdn_chunk, gdn_wgmma, kv_write, rope):
    for _name, _fn in _mod.EMULATORS.items():
        register_emulator(_name, _fn)

__all__ = ["ops", "attention", "attention_wgmma", "expand", "gdn", "gdn_chunk", "gdn_wgmma", "kv_write", "rope"]
