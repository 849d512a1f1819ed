"""Kernels layer: the NVRTC kernels in ``cuda_src/``, their launchers (:mod:`~q12drv.kernels.ops`)
and their numpy references (one module per kernel).

Importing a kernel module registers its source, entries and emulators (:mod:`~q12drv.kernels.registry`), so the
same launchers run the numpy reference on the emulated driver.
"""

from __future__ import annotations

from . import attention, attention_decode, attention_wgmma, conv1d, expand, gdn, kv_write, ops, rope

__all__ = ["ops", "attention", "attention_decode", "attention_wgmma", "conv1d", "expand", "gdn", "kv_write", "rope"]
