"""Gated DeltaNet prefill, chunked (WY) tensor-core form: launch geometry, numpy model, emulator.

Same math, inputs and in-place state contract as :mod:`q12drv.kernels.gdn` (the recurrent form);
``cuda_src/gdn_chunk.cu`` computes it 64 tokens at a time with bf16 ``mma.sync``. Per chunk of
one (stream, value head), with ``gamma`` the inclusive cumulative sum of ``g`` inside the chunk,
``K``/``Q`` the l2-normalised (q also scaled) rows rounded to bf16 and ``S`` the fp32 state::

    A      = strictly_lower(beta_i * exp(gamma_i - gamma_j) * (K K^T)_ij)
    R      = beta * (V - exp(gamma) * (K S))
    V_new  = (I + A)^-1 R            # block forward substitution, 16-token blocks
    O      = exp(gamma) * (Q S) + (Q K^T * exp(gamma_i - gamma_j) * [j <= i]) V_new
    S      = exp(gamma_C) S + (K * exp(gamma_C - gamma))^T V_new

(``V_new = (I + A)^-1 beta (V - exp(gamma) K S)`` equals FLA's ``u - w S`` with
``w = T (beta e^gamma K)``, ``u = T (beta V)``, ``T = (I + A)^-1``, without forming w and u.)

:func:`chunked_reference` runs that algorithm in numpy with the kernel's rounding points, so
its distance to the float64 :func:`q12drv.kernels.gdn.reference` is the kernel's error budget.
The emulator registered for the new entries runs the float64 reference (like the recurrent
entries), so emulated results do not depend on the algorithm chosen.

The split pair (``ops.gdn(algo="split")``) runs the same phases in two launches: a precompute kernel,
parallel over (chunk, key head, stream), writes each chunk's state-independent operands into a
workspace (:func:`workspace_bytes`; K records per key head, V records per value head), and a
sequential kernel walks the chunks with only the state step on its serial path
(:func:`split_geometry`, :func:`entry_smem_bytes`). Its results are the fused kernel's bits.
"""

from __future__ import annotations

import numpy as np

from ..core.bf16 import from_bf16_bits, round_to_bf16, to_bf16_bits
from . import gdn as _gdn
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "THREADS",
    "CHUNK",
    "BV",
    "SEQ_STAGES",
    "entry_name",
    "geometry",
    "smem_bytes",
    "split_entries",
    "tile_prep_entry",
    "k_record_bytes",
    "v_record_bytes",
    "tile_v_record_bytes",
    "workspace_bytes",
    "seq_smem_bytes",
    "prep_smem_bytes",
    "split_geometry",
    "split_stages",
    "entry_smem_bytes",
    "chunked_reference",
    "REFERENCE_PATHS",
    "emulate_chunked",
    "touch_workspace",
    "EMULATORS",
]

#: Kernel source file in ``cuda_src/``.
SOURCE = "gdn/chunked_mma.cu"
#: Entry points: the fused kernel for dk = dv = 128 and 64, then the split pair's (:func:`split_entries`), then
#: the precompute kernels of the "wgmma" pair (:mod:`q12drv.kernels.gdn_wgmma`), records as tiles.
ENTRIES = ("q12_gdn_mma_fused_d128", "q12_gdn_mma_fused_d64", "q12_gdn_mma_precompute_d128",
           "q12_gdn_mma_precompute_d64", "q12_gdn_mma_sequential_2stage_d128", "q12_gdn_mma_sequential_2stage_d64",
           "q12_gdn_mma_sequential_1stage_d128", "q12_gdn_mma_sequential_1stage_d64", "q12_gdn_wgmma_precompute_d128",
           "q12_gdn_wgmma_precompute_d64")
#: Record buffers of the split pair's sequential kernel: 2 (the next chunk loads while this one computes,
#: 1 CTA/SM) or 1 (2 CTAs/SM). See :func:`split_stages`.
SEQ_STAGES = (2, 1)
#: Threads per CTA (4 warps, each owning 16 of the CTA's dv columns).
THREADS = 128
#: Tokens per chunk.
CHUNK = 64
#: dv columns per CTA (``chunked_config().slice`` in the source): grid.x = dv / BV. (Narrower slices, BV 32 and 16, were
#: measured 2.3x and 10x slower on the H200 and removed.)
BV = 64

_HEAD_DIMS = {"q12_gdn_mma_fused_d128": 128, "q12_gdn_mma_fused_d64": 64}  # the fused entries


def entry_name(head_dim: int) -> str:
    """The chunked entry point for ``dk = dv = head_dim`` (64 or 128)."""
    for name, d in _HEAD_DIMS.items():
        if d == head_dim:
            return name
    raise ValueError(f"chunked GDN prefill has kernels for head_dim 64 and 128, not {head_dim}")


def split_entries(head_dim: int, stages: int = 2) -> tuple[str, str]:
    """The split pair for ``dk = dv = head_dim``: ``(precompute entry, sequential entry)``; ``stages``: the
    sequential kernel's record buffers (:data:`SEQ_STAGES`)."""
    entry_name(head_dim)
    if stages not in SEQ_STAGES:
        raise ValueError(f"stages must be one of {SEQ_STAGES}, got {stages!r}")
    return f"q12_gdn_mma_precompute_d{head_dim}", f"q12_gdn_mma_sequential_{stages}stage_d{head_dim}"


def k_record_bytes(head_dim: int) -> int:
    """Bytes of one (stream, key head, chunk) record of the split pair's workspace (``gdnc::KRec<dk>``):
    normalised K hi, K lo and Q ``[64][dk]`` bf16, shared by the value heads of that key head (the "wgmma"
    pair has none: its sequential kernel reads the raw rows)."""
    return 2 * 3 * CHUNK * head_dim


def v_record_bytes() -> int:
    """Bytes of one (stream, value head, chunk) record (``gdnc::VRec``): -A and P ``[64][64]`` bf16, the
    diagonal inverses ``[64][16]`` bf16, beta, exp(gamma) and exp(gamma_C - gamma) ``[64]`` fp32."""
    return 2 * (2 * CHUNK * CHUNK + CHUNK * 16) + 3 * 4 * CHUNK


def tile_v_record_bytes() -> int:
    """Bytes of one (stream, value head, chunk) record of the "wgmma" pair (``gdnc::TileVRec``, its only record):
    T = (I + A)^-1 and P, two ``[64][64]`` bf16 swizzled tiles, then ``[64]`` fp32 beta, exp(gamma) / |k|,
    exp(gamma) dk^-1/2 / |q|, exp(gamma_C - gamma) / |k|, then exp(gamma_C) padded to 16 bytes."""
    return 2 * 2 * CHUNK * CHUNK + 4 * 4 * CHUNK + 16


def workspace_bytes(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int, *,
                    tiles: bool = False) -> int:
    """Workspace of the split pair (``algo="split"``; ``tiles``: the "wgmma" pair's records) for ``n`` streams of
    at most ``chunk_len`` tokens (the pass's ``meta.chunk_len``): per stream and 64-token chunk, one K record per
    key head and one V record per value head (:func:`k_record_bytes`, :func:`v_record_bytes`); ``tiles``: one
    :func:`tile_v_record_bytes` record per value head and no K records."""
    entry_name(head_dim)
    if n < 1 or chunk_len < 0 or num_k_heads < 1 or num_v_heads < 1:
        raise ValueError(f"need n >= 1, chunk_len >= 0, num_k_heads >= 1, num_v_heads >= 1; got {n}, {chunk_len}, "
                         f"{num_k_heads}, {num_v_heads}")
    per_chunk = num_v_heads * tile_v_record_bytes() if tiles else \
        num_k_heads * k_record_bytes(head_dim) + num_v_heads * v_record_bytes()
    return n * (-(-chunk_len // CHUNK)) * per_chunk


def seq_smem_bytes(head_dim: int, stages: int = 2) -> int:
    """Dynamic shared memory of the split pair's sequential kernel (``gdnc::SeqSmem<dk, stages>``): per
    buffer, one chunk's records with padded rows and a V/O slice ``[64][72]``."""
    dk = head_dim
    return stages * (2 * (3 * CHUNK * (dk + 8) + 2 * CHUNK * 72 + CHUNK * 24 + CHUNK * (BV + 8)) + 3 * 4 * CHUNK)


def entry_smem_bytes(entry: str) -> int:
    """Dynamic shared memory a launch of ``entry`` (any of :data:`ENTRIES`) asks for."""
    if entry not in ENTRIES:
        raise KeyError(f"{entry!r} is not a gdn/chunked_mma.cu entry; entries: {', '.join(ENTRIES)}")
    d = int(entry.rsplit("_d", 1)[1])
    for stages in SEQ_STAGES:
        if entry == split_entries(d, stages)[1]:
            return seq_smem_bytes(d, stages)
    return prep_smem_bytes(d) if entry in (split_entries(d)[0], tile_prep_entry(d)) else smem_bytes(d)


def tile_prep_entry(head_dim: int) -> str:
    """The precompute entry of the "wgmma" pair for ``dk = dv = head_dim``: the split pair's kernel writing the
    "wgmma" pair's records (``gdnc::TileVRec``, swizzled tiles; no K records)."""
    entry_name(head_dim)
    return f"q12_gdn_wgmma_precompute_d{head_dim}"


def split_stages(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> int:
    """Record buffers of the sequential kernel for a pass (:data:`SEQ_STAGES`): 1 (2 CTAs/SM) once its
    ``n * Hv * dv / 64`` CTAs fill two per SM, so a co-resident CTA computes while one loads; else 2
    (1 CTA/SM, the next chunk's records loading behind this one's state step)."""
    return 1 if n * num_v_heads * (head_dim // BV) >= 2 * num_sms else 2


def prep_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the split pair's precompute kernel (``gdnc::PrepSmem<dk>``): normalised K
    and Q ``[64][dk+8]`` bf16, raw K ``[64][dk]`` sharing its bytes with -A and P ``[64][72]``, the
    diagonal inverses ``[64][24]`` bf16, fp32 diagonal blocks ``[4][16][17]``, g and beta ``[2][64]``,
    gamma, the wgmma pair's three epilogue exponents, beta, exp(gamma), exp(gamma_C - gamma) and the rows' scales
    1 / |k|, dk^-1/2 / |q| ``[64]``."""
    dk = head_dim
    return 2 * (2 * CHUNK * (dk + 8) + max(CHUNK * dk, 2 * CHUNK * 72) + CHUNK * 24) + 4 * (4 * 16 * 17 + 13 * CHUNK)


def split_geometry(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int,
                   stages: int = 2) -> tuple:
    """``((grid, block, smem) of the precompute kernel, (grid, block, smem) of the sequential one)``:
    one precompute CTA per (chunk, key head, stream), the sequential grid as the fused kernel's."""
    seq = geometry(n, num_v_heads, head_dim)
    prep = ((max(1, -(-chunk_len // CHUNK)), num_k_heads, n), (THREADS, 1, 1), prep_smem_bytes(head_dim))
    return prep, (seq[0], seq[1], seq_smem_bytes(head_dim, stages))


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CTA; must match ``gdnc::Smem<dk>`` (static_asserts) in the source.

    bf16 K (hi and lo) and Q chunks ``[64][dk+8]`` (Q arrives raw by cp.async and is normalised in
    place); raw K ``[64][dk]`` (the next chunk's, prefetched); two bf16 V/O slices ``[64][BV+8]``;
    -A (off-diagonal blocks) and P ``[64][72]``; bf16 inverted diagonal blocks ``[64][24]``; fp32
    diagonal blocks ``[4][16][17]``; fp32 g and beta ``[2][64]`` each (double buffer), gamma,
    beta, exp(gamma), exp(gamma_C - gamma) ``[64]`` each.
    """
    dk = head_dim
    return 2 * (3 * CHUNK * (dk + 8) + CHUNK * dk + 2 * CHUNK * (BV + 8) + 2 * CHUNK * 72 + CHUNK * 24) + \
        4 * (4 * 16 * 17 + 8 * CHUNK)


def geometry(n: int, num_v_heads: int, head_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """Launch geometry: grid ``(dv / 64, Hv, n)``, block ``(128, 1, 1)``, dynamic smem bytes."""
    entry_name(head_dim)
    if n < 1 or num_v_heads < 1:
        raise ValueError(f"GDN prefill needs n >= 1 and num_v_heads >= 1, got n={n}, num_v_heads={num_v_heads}")
    return (head_dim // BV, num_v_heads, n), (THREADS, 1, 1), smem_bytes(head_dim)


def _split(x: np.ndarray, hilo: bool):
    """What an A operand built from fp32 registers carries: bf16(x) (+ bf16(x - bf16(x)))."""
    hi = round_to_bf16(x)
    if not hilo:
        return hi.astype(np.float64)
    return hi.astype(np.float64) + round_to_bf16(x - hi).astype(np.float64)


def _f32(x):
    return np.asarray(x, np.float64).astype(np.float32)


def _block_solve(R, Aoff, Dinv):
    """X = (I + A)^-1 R by forward substitution over 16-token blocks, as ``block_solve`` does (``R`` [Hv, C, m]
    fp32; the right-hand sides and X enter the products as hi + lo pairs)."""
    X = np.zeros(R.shape, np.float32)
    for i in range(R.shape[1] // 16):
        sl = slice(16 * i, 16 * i + 16)
        Y = R[:, sl].astype(np.float64)
        if i:
            Y = _f32(Y - Aoff[:, sl, : 16 * i] @ _split(X[:, : 16 * i], True))
        X[:, sl] = _f32(Dinv[:, sl, sl] @ _split(Y.astype(np.float32), True))
    return X


#: The numerics of the shipped chunked paths (:func:`chunked_reference`'s ``path``): ``"mma"`` (the fused kernel and
#: the split pair: one set of bits), ``"wgmma"`` (the wgmma pair's T product) and ``"overlapped"`` (the wgmma pair's
#: flow form, fla-core's order ``V_new = U - W S``).
REFERENCE_PATHS = ("mma", "wgmma", "overlapped")


def chunked_reference(q, k, v, g, beta, cu_seqlens, initial_state, *, path: str = "mma", chunk: int = CHUNK):
    """The chunked kernels' algorithm in numpy, with their rounding points (bf16 casts where they cast).

    Arguments and results as :func:`q12drv.kernels.gdn.reference`. Products of bf16 operands are summed in float64
    then rounded to fp32 (the tensor cores accumulate in fp32; the order differs, which is below the bf16 rounding
    this model is about). ``path`` (:data:`REFERENCE_PATHS`) names the shipped numerics:

    * ``"mma"``: the solve's intermediates and V_new enter the mma as bf16 hi + lo pairs
      (``x = bf16(x) + bf16(x - bf16(x))``), S enters ``K S`` and ``Q S`` as one bf16, and the state update
      ``K^T V_new`` takes hi + lo pairs of both K (the fp32 normalised rows) and V_new (three products);
    * ``"wgmma"``: T = (I + A)^-1 is the block solve applied to the identity, rounded to bf16 once, and
      ``V_new = T_hi (R_hi + R_lo)``; the state's products take the raw bf16 k and q rows, each product's token
      scaled after it by the row's fp32 scale (``1 / |k|``, ``dk^-1/2 / |q|``, folded with exp(gamma) or
      exp(gamma_C - gamma)), so the update is ``k^T (Vd_hi + Vd_lo)`` with an exact k; A and P come from the
      products of the raw rows as well, each element scaled by its rows' scales; O's product takes V_new's bf16 hi;
    * ``"overlapped"``: ``"wgmma"``'s operands in fla-core's order ``V_new = U - W S`` with ``U = T diag(beta) V``
      and ``W = T diag(beta EK) k``: each product takes its scaled T, formed from the fp32 T, as a bf16 hi + lo
      pair and the exact bf16 V or raw k rows, fp32 sums; U stays fp32, W is rounded to bf16, S enters ``W S`` as
      bf16.
    """
    if path not in REFERENCE_PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, REFERENCE_PATHS))}, got {path!r}")
    t_product = path != "mma"
    o_lo = not t_product
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"num_v_heads {hv} is not a multiple of num_k_heads {hk}")
    if chunk % 16:
        raise ValueError("chunk must be a multiple of 16")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    n = cu.shape[0] - 1
    if initial_state.shape != (n, hv, dk, dv):
        raise ValueError(f"initial_state must be {(n, hv, dk, dv)}, got {initial_state.shape}")
    kmap = np.arange(hv) // (hv // hk)
    qscale = np.float32(1.0 / np.sqrt(np.float32(dk)))
    o = np.zeros((T, hv, dv), np.float32)
    final = np.empty((n, hv, dk, dv), np.float32)
    nb = chunk // 16
    blk = np.arange(chunk) // 16
    for b in range(n):
        s0, e0 = int(cu[b]), int(cu[b + 1])
        S = initial_state[b].astype(np.float32).copy()  # [Hv, dk, dv]
        for c0 in range(s0, e0, chunk):
            L = min(chunk, e0 - c0)
            C = chunk

            def pad(x):
                out = np.zeros((C,) + x.shape[1:], x.dtype)
                out[:L] = x
                return out

            kf = pad(from_bf16_bits(k[c0:c0 + L]))  # [C, Hk, dk] fp32
            qf = pad(from_bf16_bits(q[c0:c0 + L]))
            kinv = np.float32(1.0) / np.sqrt(np.sum(kf * kf, -1, keepdims=True, dtype=np.float32) + np.float32(1e-6))
            qinv = np.float32(1.0) / np.sqrt(np.sum(qf * qf, -1, keepdims=True, dtype=np.float32) + np.float32(1e-6))
            kn = kf * kinv
            K = round_to_bf16(kn)[:, kmap].transpose(1, 0, 2).astype(np.float64)  # [Hv, C, dk]
            Kx = _split(kn, True)[:, kmap].transpose(1, 0, 2)
            Q = round_to_bf16((qf * qinv) * qscale)[:, kmap].transpose(1, 0, 2).astype(np.float64)
            V = pad(from_bf16_bits(v[c0:c0 + L])).transpose(1, 0, 2).astype(np.float64)  # [Hv, C, dv]
            gg = pad(g[c0:c0 + L].astype(np.float32)).T  # [Hv, C]
            bt = pad(beta[c0:c0 + L].astype(np.float32)).T
            gam = np.cumsum(gg, axis=1, dtype=np.float32)
            diff = _f32(gam[:, :, None].astype(np.float32) - gam[:, None, :])
            low = np.tril(np.ones((C, C), bool), -1)
            incl = np.tril(np.ones((C, C), bool), 0)
            gmat = np.exp(np.where(incl, diff, np.float32(-np.inf)).astype(np.float32))  # exp(gi - gj), j <= i
            if t_product:  # the raw rows' products, scaled by the rows' fp32 scales (the kernel's exponents)
                rk = kinv[:, kmap, 0].T.astype(np.float32)  # [Hv, C]
                rq = _f32(qinv[:, kmap, 0].T * qscale)
                Kraw = kf[:, kmap].transpose(1, 0, 2).astype(np.float64)
                Qraw = qf[:, kmap].transpose(1, 0, 2).astype(np.float64)
                KK = _f32(_f32(Kraw @ Kraw.transpose(0, 2, 1)) * (rk[:, :, None] * rk[:, None, :]))
                QK = _f32(_f32(Qraw @ Kraw.transpose(0, 2, 1)) * (rq[:, :, None] * rk[:, None, :]))
            else:
                KK = _f32(K @ K.transpose(0, 2, 1))
                QK = _f32(Q @ K.transpose(0, 2, 1))
            Afull = _f32(bt[:, :, None] * (gmat * KK)) * low  # fp32, strictly lower
            P = round_to_bf16(_f32(gmat * QK) * incl).astype(np.float64)
            same = blk[:, None] == blk[None, :]
            Aoff = round_to_bf16(Afull * ~same).astype(np.float64)
            Dinv = np.zeros((hv, C, C), np.float64)
            for i in range(nb):
                sl = slice(16 * i, 16 * i + 16)
                D = Afull[:, sl, sl].astype(np.float32) + np.eye(16, dtype=np.float32)
                Dinv[:, sl, sl] = round_to_bf16(_f32(np.linalg.inv(D.astype(np.float64))))
            Ssplit = _split(S, False)
            eg = np.exp(gam).astype(np.float32)
            egC = np.exp(gam[:, -1]).astype(np.float32)
            wdec = np.exp(_f32(gam[:, -1:] - gam)).astype(np.float32)  # [Hv, C]
            if t_product:  # raw rows, their scales after the products (EK, EQ, WK of the kernel's record)
                KS = _f32(Kraw @ Ssplit)
                QS = _f32(Qraw @ Ssplit)
                ek, eq, wk = _f32(eg * rk), _f32(eg * rq), _f32(wdec * rk)
            else:
                KS = _f32(K @ Ssplit)  # [Hv, C, dv]
                QS = _f32(Q @ Ssplit)
                ek, eq, wk = eg, eg, wdec
            R = _f32(bt[:, :, None] * (V - ek[:, :, None] * KS))
            if t_product:
                Tm = _block_solve(np.broadcast_to(np.eye(C, dtype=np.float32), (hv, C, C)), Aoff, Dinv)
                Thi = round_to_bf16(Tm).astype(np.float64)
                if path == "overlapped":  # U, W from T's scaled columns; the chain's product is W S alone
                    Tu = _split(_f32(Tm * bt[:, None, :]), True)
                    Tw = _split(_f32(Tm * _f32(bt * ek)[:, None, :]), True)
                    U = _f32(Tu @ V).astype(np.float64)
                    W = round_to_bf16(_f32(Tw @ Kraw)).astype(np.float64)
                    X = _f32(U - _f32(W @ Ssplit))
                else:
                    X = _f32(Thi @ _split(R, True))
            else:
                X = _block_solve(R, Aoff, Dinv)
            Xs = _split(X, o_lo)
            O = _f32(eq[:, :, None] * QS + _f32(P @ Xs))
            Xd = _split(_f32(X * wk[:, :, None]), True)
            Ku = Kraw if t_product else Kx
            S = _f32(egC[:, None, None] * S + _f32(Ku.transpose(0, 2, 1) @ Xd))
            o[c0:c0 + L] = O[:, :L].transpose(1, 0, 2)
        final[b] = S
    return to_bf16_bits(o), final


def emulate_chunked(args: dict, mem, grid, block, head_dim: int) -> None:
    """Emulate a chunked entry's launch (grid ``(dv / 64, >= Hv, >= n)``, 128 threads): the float64 reference."""
    n, hk, hv = _gdn.emulator_heads(args)
    # the kernel does nothing unless grid.x == dv / 64 and block == 128 threads
    if grid[0] != head_dim // BV:
        raise ValueError(f"chunked GDN prefill needs grid.x = dv / 64 = {head_dim // BV}, got {tuple(grid)}")
    if tuple(block) != (THREADS, 1, 1):
        raise ValueError(f"chunked GDN prefill needs block {(THREADS, 1, 1)}, got {tuple(block)}")
    if grid[1] < hv or grid[2] < n:
        raise ValueError(f"grid {tuple(grid)} does not cover dv/64 = {grid[0]} x Hv = {hv} x n = {n} CTAs")
    # the rest (alignment, the float64 reference per stream) is the recurrent entries' emulator
    rec_grid = (hv * head_dim // _gdn.COLS_PER_CTA, max(n, 1), 1)
    _gdn._emulate(args, mem, rec_grid, (_gdn.THREADS, 1, 1), head_dim)


def emulate_d128(args: dict, mem, grid, block) -> None:
    """Emulate ``q12_gdn_chunk_d128`` (the float64 reference; see :func:`q12drv.kernels.gdn.emulate_d128`)."""
    emulate_chunked(args, mem, grid, block, 128)


def emulate_d64(args: dict, mem, grid, block) -> None:
    """Emulate ``q12_gdn_chunk_d64``."""
    emulate_chunked(args, mem, grid, block, 64)


def touch_workspace(args: dict, mem, head_dim: int, *, tiles: bool = False) -> None:
    """Map the workspace a pair's launch reads and writes (:func:`workspace_bytes`; ``tiles``: the "wgmma"
    pair's format) in emulated memory ``mem``: raises where the GPU would fault."""
    n, hk, hv = _gdn.emulator_heads(args)
    m = args["m"]
    nbytes = workspace_bytes(max(n, 1), int(m.chunk_len), hk, hv, head_dim, tiles=tiles)
    mem.array(int(args["workspace"]), np.uint8, (nbytes,))


def _emulate_prep(head_dim: int, tiles: bool = False):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the split pair's precompute kernel: its records are internal to the pair, so the
        emulator only checks the launch and that the workspace is there (the sequential emulator
        computes the result)."""
        n, hk, hv = _gdn.emulator_heads(args)
        want = split_geometry(max(n, 1), int(args["m"].chunk_len), hk, hv, head_dim)[0]
        if tuple(block) != want[1] or tuple(grid)[1:] != want[0][1:] or grid[0] < want[0][0]:
            raise ValueError(f"the GDN precompute kernel needs grid {want[0]} and block {want[1]}, got "
                             f"{tuple(grid)}, {tuple(block)}")
        touch_workspace(args, mem, head_dim, tiles=tiles)
    return run


def _emulate_seq(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the split pair's sequential kernel: the fused kernel's result (bit-identical on the GPU)."""
        touch_workspace(args, mem, head_dim)
        emulate_chunked(args, mem, grid, block, head_dim)
    return run


#: What the emulated driver runs instead of each entry point.
EMULATORS = {"q12_gdn_mma_fused_d128": emulate_d128, "q12_gdn_mma_fused_d64": emulate_d64,
             **{split_entries(d)[0]: _emulate_prep(d) for d in (128, 64)},
             **{tile_prep_entry(d): _emulate_prep(d, tiles=True) for d in (128, 64)},
             **{split_entries(d, st)[1]: _emulate_seq(d) for d in (128, 64) for st in SEQ_STAGES}}

def contract_defines() -> tuple[str, ...]:
    """The host's numbers ``gdn/chunked_mma.cu`` checks at compile time."""
    return (f"Q12_GDN_CHUNK={CHUNK}", f"Q12_GDN_SLICE={BV}", f"Q12_GDN_THREADS={THREADS}",
            *(f"Q12_GDN_MMA_FUSED_SMEM_D{d}={smem_bytes(d)}" for d in (128, 64)),
            *(f"Q12_GDN_PRECOMPUTE_SMEM_D{d}={prep_smem_bytes(d)}" for d in (128, 64)),
            *(f"Q12_GDN_MMA_SEQUENTIAL_SMEM_{st}STAGE_D{d}={seq_smem_bytes(d, st)}" for st in (2, 1) for d in (128, 64)),
            *(f"Q12_GDN_MMA_KREC_D{d}={k_record_bytes(d)}" for d in (128, 64)),
            f"Q12_GDN_MMA_VREC={v_record_bytes()}", f"Q12_GDN_TREC={tile_v_record_bytes()}")


registry.register(SOURCE, ENTRIES, EMULATORS,
                  defines={k: int(v) for k, v in (d.split("=") for d in contract_defines())})
