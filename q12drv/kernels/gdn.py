"""Gated DeltaNet (Qwen3-Next) prefill over varlen streams: launch geometry, numpy reference, emulator.

The kernels (``cuda_src/gdn_prefill.cu``) run the recurrent form of the gated delta rule. Per
stream ``b`` (packed rows ``cu_seqlens[b] .. cu_seqlens[b+1]``), per value head ``h`` (key head
``h // (Hv // Hk)``), with the fp32 state ``S`` ``[dk, dv]`` read from and written back to
``h_state_ptrs[b]`` (``[Hv, dk, dv]``, dv fastest)::

    k^ = k / sqrt(sum(k^2) + 1e-6)                  # fp32
    q~ = q / sqrt(sum(q^2) + 1e-6) * dk**-0.5
    S  = exp(g_t) * S                               # decay first
    m  = S^T k^
    S  = S + k^ (beta_t * (v_t - m))^T              # delta rule
    o_t = S^T q~                                    # output reads the updated state

Inputs: q, k ``[T, Hk, dk]`` bf16; v ``[T, Hv, dv]`` bf16; g (log-space gate, <= 0) and beta
(already sigmoided) ``[T, Hv]`` fp32; output o ``[T, Hv, dv]`` bf16.
"""

from __future__ import annotations

import numpy as np

from ..core.bf16 import from_bf16_bits, to_bf16_bits
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "THREADS",
    "LANES_PER_COLUMN",
    "COLS_PER_THREAD",
    "COLS_PER_CTA",
    "entry_name",
    "geometry",
    "reference",
    "emulate_d128",
    "emulate_d64",
    "EMULATORS",
    "emulator_heads",
]

#: Kernel source file in ``cuda_src/``.
SOURCE = "gdn/recurrent.cu"
#: Entry points: dk = dv = 128 and dk = dv = 64.
ENTRIES = ("q12_gdn_recurrent_d128", "q12_gdn_recurrent_d64")
#: Threads per CTA (fixed by the kernel).
THREADS = 128
#: Lanes that split dk for one dv column (``recurrent_config`` in the source).
LANES_PER_COLUMN = 8
#: dv columns one thread owns (``recurrent_config`` in the source).
COLS_PER_THREAD = 2
#: dv columns one CTA owns.
COLS_PER_CTA = THREADS // LANES_PER_COLUMN * COLS_PER_THREAD

_HEAD_DIMS = {"q12_gdn_recurrent_d128": 128, "q12_gdn_recurrent_d64": 64}
_L2_EPS = 1e-6


def entry_name(head_dim: int) -> str:
    """The entry point for ``dk = dv = head_dim``.

    Parameters
    ----------
    head_dim : int
        64 or 128.

    Returns
    -------
    str
        One of :data:`ENTRIES`.
    """
    for name, d in _HEAD_DIMS.items():
        if d == head_dim:
            return name
    raise ValueError(f"GDN prefill has kernels for head_dim 64 and 128, not {head_dim}")


def geometry(n: int, num_v_heads: int, head_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """Launch geometry of the GDN prefill kernels.

    One CTA of :data:`THREADS` threads per (:data:`COLS_PER_CTA` dv columns, value head, stream);
    static shared memory only.

    Parameters
    ----------
    n : int
        Number of streams (``batch_size``).
    num_v_heads : int
        Value heads ``Hv``.
    head_dim : int
        ``dk = dv`` (64 or 128).

    Returns
    -------
    grid : tuple of int
        ``(Hv * dv / COLS_PER_CTA, n, 1)``.
    block : tuple of int
        ``(128, 1, 1)``.
    dynamic_smem_bytes : int
        0.
    """
    entry_name(head_dim)
    if n < 1 or num_v_heads < 1:
        raise ValueError(f"GDN prefill needs n >= 1 and num_v_heads >= 1, got n={n}, num_v_heads={num_v_heads}")
    return (num_v_heads * (head_dim // COLS_PER_CTA), n, 1), (THREADS, 1, 1), 0


def _l2norm(x: np.ndarray, dtype) -> np.ndarray:
    x = x.astype(dtype)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + dtype(_L2_EPS))


def reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    cu_seqlens: np.ndarray,
    initial_state: np.ndarray,
    *,
    dtype=np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule over packed varlen streams, token by token (vectorised over heads and dims).

    Parameters
    ----------
    q, k : numpy.ndarray
        uint16 bf16 bits ``[T, Hk, dk]`` (raw, not normalised).
    v : numpy.ndarray
        uint16 bf16 bits ``[T, Hv, dv]``.
    g, beta : numpy.ndarray
        float32 ``[T, Hv]``: log-space gate (decay ``exp(g)``) and the sigmoided beta.
    cu_seqlens : numpy.ndarray
        int ``[n + 1]``: stream ``b`` owns rows ``cu_seqlens[b] .. cu_seqlens[b+1]``.
    initial_state : numpy.ndarray
        float32 ``[n, Hv, dk, dv]``.
    dtype : numpy dtype, optional
        Accumulation type: float64 (default) or float32.

    Returns
    -------
    o : numpy.ndarray
        uint16 bf16 bits ``[T, Hv, dv]``; rows outside every stream are 0.
    final_state : numpy.ndarray
        float32 ``[n, Hv, dk, dv]``.
    """
    dtype = np.dtype(dtype).type
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, hv) or beta.shape != (T, hv):
        raise ValueError(f"shape mismatch: q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}")
    if hv % hk:
        raise ValueError(f"num_v_heads {hv} is not a multiple of num_k_heads {hk}")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    n = cu.shape[0] - 1
    if initial_state.shape != (n, hv, dk, dv):
        raise ValueError(f"initial_state must be {(n, hv, dk, dv)}, got {initial_state.shape}")
    kmap = np.arange(hv) // (hv // hk)
    o = np.zeros((T, hv, dv), dtype=dtype)
    final = np.empty((n, hv, dk, dv), dtype=np.float32)
    scale = dtype(1.0 / np.sqrt(dk))
    for b in range(n):
        s, e = int(cu[b]), int(cu[b + 1])
        qn = _l2norm(from_bf16_bits(q[s:e]), dtype)[:, kmap] * scale  # [L, Hv, dk]
        kn = _l2norm(from_bf16_bits(k[s:e]), dtype)[:, kmap]
        vv = from_bf16_bits(v[s:e]).astype(dtype)
        alpha = np.exp(g[s:e].astype(dtype))
        bb = beta[s:e].astype(dtype)
        S = initial_state[b].astype(dtype)
        for t in range(e - s):
            S *= alpha[t][:, None, None]
            m = np.matmul(kn[t][:, None, :], S)[:, 0, :]  # [Hv, dv]
            delta = bb[t][:, None] * (vv[t] - m)
            S += kn[t][:, :, None] * delta[:, None, :]
            o[s + t] = np.matmul(qn[t][:, None, :], S)[:, 0, :]
        final[b] = S
    return to_bf16_bits(o), final


def emulator_heads(args: dict) -> tuple[int, int, int]:
    """``(n, Hk, Hv)`` of a GDN launch's arguments, checked as every GDN kernel needs them."""
    hk, hv = int(args["num_k_heads"]), int(args["num_v_heads"])
    if hk < 1 or hv < 1 or hv % hk:
        raise ValueError(f"num_v_heads ({hv}) must be a positive multiple of num_k_heads ({hk})")
    return int(args["m"].batch_size), hk, hv


def _emulate(args: dict, mem, grid, block, head_dim: int) -> None:
    meta = args["m"]
    n, hk, hv = emulator_heads(args)
    want_grid, want_block, _ = geometry(max(n, 1), hv, head_dim)
    if tuple(block) != want_block:
        raise ValueError(f"GDN prefill needs block {want_block}, got {tuple(block)}")
    if grid[0] < want_grid[0] or grid[1] < n or grid[2] < 1:
        raise ValueError(
            f"grid {tuple(grid)} does not cover Hv*dv/{COLS_PER_CTA} = {want_grid[0]} CTAs x n = {n} streams"
        )
    for name, align in (("q", 16), ("k", 16), ("v", 8), ("o", 8)):
        if int(args[name]) % align:
            raise ValueError(f"GDN prefill needs {name} {align}-byte aligned, got {int(args[name]):#x}")
    if n == 0:
        return
    d = head_dim
    cu = mem.array(meta.cu_seqlens, np.int32, (n + 1,)).astype(np.int64)
    ptrs = mem.array(args["h_state_ptrs"], np.uint64, (n,))
    T = int(cu[n])
    q = mem.array(args["q"], np.uint16, (T, hk, d))
    k = mem.array(args["k"], np.uint16, (T, hk, d))
    v = mem.array(args["v"], np.uint16, (T, hv, d))
    g = mem.array(args["g"], np.float32, (T, hv))
    beta = mem.array(args["beta"], np.float32, (T, hv))
    o = mem.array(args["o"], np.uint16, (T, hv, d))
    for b in range(n):
        s, e = int(cu[b]), int(cu[b + 1])
        if e < s:
            raise ValueError(f"stream {b} has {e - s} tokens (cu_seqlens decreases)")
        state = mem.array(int(ptrs[b]), np.float32, (hv, d, d))
        if e == s:  # a padding stream (CUDA-graph pass): the kernel reads its state and writes it back unchanged
            continue
        ob, fin = reference(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s]), state[None].copy()
        )
        o[s:e] = ob
        state[...] = fin[0]


def emulate_d128(args: dict, mem, grid, block) -> None:
    """Emulate ``q12_gdn_prefill_d128`` through emulated device memory ``mem``.

    Parameters
    ----------
    args : dict
        Kernel parameters by name (``m`` is a ``Q12MetaC``; pointers and ints as int).
    mem : object
        Emulated memory with ``array(ptr, dtype, shape)`` returning a writable view.
    grid, block : tuple of int
        The launch geometry; must cover what the kernel covers.
    """
    _emulate(args, mem, grid, block, 128)


def emulate_d64(args: dict, mem, grid, block) -> None:
    """Emulate ``q12_gdn_prefill_d64`` (see :func:`emulate_d128`)."""
    _emulate(args, mem, grid, block, 64)


#: What the emulated driver runs instead of each entry point.
EMULATORS = {"q12_gdn_recurrent_d128": emulate_d128, "q12_gdn_recurrent_d64": emulate_d64}

registry.register(SOURCE, ENTRIES, EMULATORS,
                  defines={"Q12_GDN_RECURRENT_THREADS": THREADS, "Q12_GDN_RECURRENT_COLUMNS": COLS_PER_CTA})
