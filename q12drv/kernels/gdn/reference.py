"""Gated DeltaNet in numpy: the float64 recurrence every kernel is checked against, and the chunked kernels' model.

Per stream ``b`` (packed rows ``cu_seqlens[b] .. cu_seqlens[b+1]``), per value head ``h`` (key head
``h // (Hv // Hk)``), with the fp32 state ``S`` ``[dk, dv]`` read from and written back to the stream's state
(``[Hv, dk, dv]``, dv fastest)::

    k^ = k / sqrt(sum(k^2) + 1e-6)                  # fp32
    q~ = q / sqrt(sum(q^2) + 1e-6) * dk**-0.5
    S  = exp(g_t) * S                               # decay first
    m  = S^T k^
    S  = S + k^ (beta_t * (v_t - m))^T              # delta rule
    o_t = S^T q~                                    # output reads the updated state

Inputs: q, k ``[T, Hk, dk]`` bf16; v ``[T, Hv, dv]`` bf16; g (log-space gate, <= 0) and beta (already sigmoided)
``[T, Hv]`` fp32; output o ``[T, Hv, dv]`` bf16.

The chunked kernels compute the same recurrence 64 tokens at a time (the WY form). Per chunk of one (stream, value
head), with ``gamma`` the inclusive cumulative sum of ``g`` inside the chunk, ``K``/``Q`` the l2-normalised (q also
scaled) rows rounded to bf16 and ``S`` the fp32 state::

    A      = strictly_lower(beta_i * exp(gamma_i - gamma_j) * (K K^T)_ij)
    R      = beta * (V - exp(gamma) * (K S))
    V_new  = (I + A)^-1 R            # block forward substitution, 16-token blocks
    O      = exp(gamma) * (Q S) + (Q K^T * exp(gamma_i - gamma_j) * [j <= i]) V_new
    S      = exp(gamma_C) S + (K * exp(gamma_C - gamma))^T V_new

(``V_new = (I + A)^-1 beta (V - exp(gamma) K S)`` equals FLA's ``u - w S`` with ``w = T (beta e^gamma K)``,
``u = T (beta V)``, ``T = (I + A)^-1``.) :func:`chunked_reference` runs that algorithm with the kernels' rounding
points, so its distance to :func:`reference` is their error budget (``cuda_src/gdn/chunked_mma.cu``'s header has the
numbers).
"""

from __future__ import annotations

import numpy as np

from ...core.bf16 import from_bf16_bits, round_to_bf16, to_bf16_bits

__all__ = ["reference", "chunked_reference", "REFERENCE_PATHS"]

_L2_EPS = 1e-6


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


#: The numerics of the shipped chunked paths (:func:`chunked_reference`'s ``path``; :attr:`GdnPlan.numerics
#: <q12drv.kernels.gdn.GdnPlan.numerics>` names a plan's): ``"mma"`` (the fused kernel and the mma two-pass schedule:
#: one set of bits), ``"wgmma"`` (the wgmma two-pass schedule's T product) and ``"overlapped"`` (the wgmma overlapped
#: schedule, fla-core's order ``V_new = U - W S``).
REFERENCE_PATHS = ("mma", "wgmma", "overlapped")


def chunked_reference(q, k, v, g, beta, cu_seqlens, initial_state, *, path: str = "mma", chunk: int = 64):
    """The chunked kernels' algorithm in numpy, with their rounding points (bf16 casts where they cast).

    Arguments and results as :func:`reference`. Products of bf16 operands are summed in float64
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
