"""What every GDN entry's emulator shares: the launch's heads, its pointers' alignment, its workspace, and the
float64 reference run in place on the emulated memory.

Every GDN kernel computes the same recurrence, so every emulator runs :func:`~.reference.reference` per stream
(emulated results do not depend on the kernel a plan chose); each emulator first checks the launch its kernel needs
(grid, block) and maps the workspace it reads and writes, so that a launch the GPU would refuse or fault on raises.
"""

from __future__ import annotations

import numpy as np

from ..args import ALIGN
from .reference import reference

__all__ = ["heads", "map_workspace", "run_reference"]


def heads(args: dict) -> tuple[int, int, int]:
    """``(n, Hk, Hv)`` of a GDN launch's arguments, checked as every GDN kernel needs them."""
    hk, hv = int(args["num_k_heads"]), int(args["num_v_heads"])
    if hk < 1 or hv < 1 or hv % hk:
        raise ValueError(f"num_v_heads ({hv}) must be a positive multiple of num_k_heads ({hk})")
    return int(args["m"].batch_size), hk, hv


def map_workspace(args: dict, mem, nbytes: int) -> None:
    """Map the ``nbytes`` of workspace a launch reads and writes in emulated memory ``mem``: raises where the GPU
    would fault (no workspace, or a shorter one)."""
    mem.array(int(args["workspace"]), np.uint8, (nbytes,))


def run_reference(args: dict, mem, head_dim: int) -> None:
    """Check the launch's pointers' alignment, then run the float64 reference per stream, reading q, k, v, g, beta
    and each stream's state from emulated memory ``mem`` and writing o and the final states in place (a stream of
    length 0 keeps its state)."""
    meta = args["m"]
    n, hk, hv = heads(args)
    for name in ("q", "k", "v", "o"):
        align = ALIGN["gdn"][name]
        if int(args[name]) % align:
            raise ValueError(f"GDN needs {name} {align}-byte aligned, got {int(args[name]):#x}")
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
        ob, fin = reference(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s]), state[None].copy())
        o[s:e] = ob
        state[...] = fin[0]
