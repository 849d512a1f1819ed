"""Host-side checks of kernel arguments, shared by the launchers and :mod:`q12drv.prefill`.

A bad argument must raise here, naming it and its bound, before anything is enqueued: on the GPU
a NULL, wrapped or misaligned pointer is a fault (or silent corruption) far from its cause.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.device import Device
from ..core.interop import describe
from ..core.ints import checked_int
from ..core.ptr import device_ptr
from ..core.staging import BatchedAttnMetadata
from ..core.staging.validate import STATE_ALIGN

__all__ = ["I32_MAX", "ALIGN", "KV_DTYPES", "FP8_E4M3", "FP8_POOL_DTYPES", "check_launch", "check_kv_pools", "count",
           "head_group", "positive_float", "workspace_ptr", "check_kv_scales"]

I32_MAX = (1 << 31) - 1
#: The KV-cache element type of FP8 (e4m3) pools with per-KV-head fp32 scales (written by ``q12_kv_write_fp8``).
FP8_E4M3 = "fp8_e4m3"
#: The KV-cache element types: bf16, or :data:`FP8_E4M3`.
KV_DTYPES = ("bf16", FP8_E4M3)
#: The dtypes an FP8 pool tensor may have (torch's float8_e4m3fn, or bytes).
FP8_POOL_DTYPES = ("f8e4m3", "u8")
_F32_MAX = float(np.finfo(np.float32).max)

#: Byte alignment each kernel's accesses need, per pointer parameter (2 = one bf16; the kernels
#: that vectorise opportunistically fall back to 2-byte accesses, the others do not).
ALIGN = {
    "attention": {"q": 16, "k_pool": 16, "v_pool": 16, "o": 16},  # cp.async 16 B loads, uint4 stores
    "gdn": {"h_state_ptrs": 8, "q": 16, "k": 16, "v": 8, "o": 8, "g": 4, "beta": 4, "state": STATE_ALIGN},
    "kv_write": {"k": 2, "v": 2, "k_pool": 2, "v_pool": 2},
    "kv_write_fp8": {"k": 16, "v": 16, "k_pool": 8, "v_pool": 8, "k_scale": 4, "v_scale": 4},
    "rope": {"q": 2, "k": 2},
    # the short convolution: 16-byte row vectors and taps; its states [W - 1, C] bf16 likewise
    "conv1d": {"x": 16, "y": 16, "w": 16, "bias": 2, "state_ptrs": 8, "state": 16},
}
ALIGN["attention_fp8"] = {**ALIGN["attention"], "k_scale": 4, "v_scale": 4}  # the decode kernel on FP8 pools


def check_launch(device, meta) -> None:
    """Raise unless ``device`` is a q12drv :class:`~q12drv.core.device.Device` and ``meta`` current staged
    metadata (TypeError; :class:`~q12drv.core.errors.Q12Error` when its arena was reset since or is closed)."""
    if type(device) is Device and type(meta) is BatchedAttnMetadata:  # the common case: current metadata
        arena = meta.arena
        if arena is None or (not arena.closed and arena.generation == meta.generation):
            return
    if not isinstance(device, Device):
        raise TypeError(f"device must be a q12drv Device, got {type(device).__name__}")
    if not isinstance(meta, BatchedAttnMetadata):
        raise TypeError(f"meta must be a BatchedAttnMetadata (from the stager), got {type(meta).__name__}")
    meta.require_current()  # staged before the arena's last reset, or in a closed arena: Q12Error


def count(name: str, value, lo: int = 1, hi: int = I32_MAX) -> int:
    """``value`` as an int in ``[lo, hi]`` (default: a positive C ``int``)."""
    return checked_int(name, value, lo, hi)


def head_group(name: str, heads, group_name: str, groups) -> tuple[int, int]:
    """``(heads, groups)`` as positive C ints, ``heads`` a multiple of ``groups``: query heads over KV
    heads (GQA), Gated DeltaNet value heads over key heads (TypeError/ValueError naming both)."""
    h, g = count(name, heads), count(group_name, groups)
    if h % g:
        raise ValueError(f"{name} {h} must be a multiple of {group_name} {g} (whole groups of heads)")
    return h, g


def positive_float(name: str, value) -> float:
    """``value`` as a positive finite float (fits a C ``float``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r:.60}")
    v = float(value)
    if not (v > 0 and math.isfinite(v) and v <= _F32_MAX):
        raise ValueError(f"{name} must be a positive finite number that fits a float32, got {v}")
    return v


def check_kv_pools(device, kv_dtype: str, k_pool, v_pool, k_scale, v_scale, num_kv_heads: int, align: dict,
                   pool_shape=None, what: str = "kv_dtype") -> tuple[int, int, int, int]:
    """The checked addresses ``(k_pool, v_pool, k_scale, v_scale)`` of paged KV pools of ``kv_dtype``
    (:data:`KV_DTYPES`; the scales 0 for bf16 pools): bf16 pools, or FP8 ones (``f8e4m3`` or ``u8`` tensors, or raw
    addresses) with each KV head's fp32 scales ``[num_kv_heads]``, both required; aligned as ``align`` (the op's
    :data:`ALIGN` entry) says, of ``pool_shape`` where given and a tensor says its shape. ``what`` names the argument
    that says the pools' type in the messages.

    Raises
    ------
    TypeError, ValueError
        FP8 pools without both scales, a scale given for bf16 pools, a pool of the other type (a tensor says its
        dtype), or a bad address, alignment or shape.
    """
    fp8 = check_kv_scales(kv_dtype, k_scale, v_scale, what)
    dtype = FP8_POOL_DTYPES if fp8 else "bf16"
    kp = device.pointer(k_pool, "k_pool", dtype=dtype, shape=pool_shape, align=align["k_pool"])
    vp = device.pointer(v_pool, "v_pool", dtype=dtype, shape=pool_shape, align=align["v_pool"])
    if not fp8:
        return kp, vp, 0, 0
    return (kp, vp, device.pointer(k_scale, "k_scale", dtype="f32", shape=(num_kv_heads,), align=align["k_scale"]),
            device.pointer(v_scale, "v_scale", dtype="f32", shape=(num_kv_heads,), align=align["v_scale"]))


def workspace_ptr(need: int, workspace, workspace_bytes, what: str, sizer: str, without: str, align: int = 16,
                  device: Device | None = None) -> int:
    """The checked address of a caller's workspace for a launch that needs ``need`` bytes (0: none needed, none
    read): a device address with ``workspace_bytes``, or (given ``device``) a tensor, whose size is the default for
    ``workspace_bytes``. ``what`` names the launch in the messages (``"the GDN plan (schedule 'two_pass' on mma)"``),
    ``sizer`` the function that says the size, ``without`` how to run without a workspace.

    Raises
    ------
    TypeError, ValueError
        A launch that needs a workspace without one (naming the bytes and ``without``), a NULL or misaligned
        workspace, or one smaller than ``need``.
    """
    if not need:
        return 0
    if device is not None and workspace is not None and type(workspace) is not int:
        info = describe(workspace, "workspace")
        if info is not None:  # a tensor says how large it is
            workspace = device.pointer(workspace, "workspace", align=align)
            workspace_bytes = info.nbytes if workspace_bytes is None else workspace_bytes
    if workspace is None or workspace_bytes is None:
        raise ValueError(f"{what} needs workspace= (a device pointer) and workspace_bytes= (its size) of {need:,} bytes "
                         f"({sizer}); {without}")
    have = count("workspace_bytes", workspace_bytes, 0, None)
    if have < need:
        raise ValueError(f"workspace_bytes {have:,} is too small: {what} needs {need:,} bytes for this launch ({sizer})")
    return device_ptr("workspace", workspace, align)


def check_kv_scales(kv_dtype: str, k_scale, v_scale, what: str = "kv_dtype") -> bool:
    """Whether pools of ``kv_dtype`` are FP8, after checking that the per-KV-head scales come with FP8 pools and only
    with them (``what`` names the argument that says the type in the messages, e.g. ``"shape.kv_dtype"``).

    Raises
    ------
    ValueError
        An unknown ``kv_dtype``, FP8 pools without ``k_scale`` and ``v_scale``, or a scale given for bf16 pools.
    """
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"{what} must be one of {KV_DTYPES}, got {kv_dtype!r:.60}")
    if kv_dtype == FP8_E4M3:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{what}='{FP8_E4M3}' needs k_scale and v_scale: each KV head's fp32 scale, [Hkv] (a "
                             f"pool value q stands for q * scale)")
        return True
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale given for bf16 pools: scales are for {what}='{FP8_E4M3}'")
    return False
