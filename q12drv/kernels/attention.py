"""Batched varlen paged causal prefill attention (``cuda_src/attn_prefill.cu``): the host side.

Stream ``b`` owns packed rows ``cu_seqlens[b] .. cu_seqlens[b+1]`` of Q ``[T, Hq, D]`` and
O ``[T, Hq, D]`` (bf16). Its keys and values, positions ``0 .. kv_lens[b] - 1``, are read from
the paged K and V pools (NHD ``[num_blocks, block_size, Hkv, D]`` bf16) through its block table:
position ``p`` lives in physical block ``block_table_b[p // block_size]`` at offset
``p % block_size``. The current chunk's keys are already in the pools (the KV-write kernel runs
first). Causality is bottom-right: row ``r`` of a stream with ``q_len`` rows sees keys
``0 .. kv_lens[b] - q_len + r``. GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
Softmax in fp32 of ``scale * q.k`` (``scale > 0``: the kernel takes the row max of the raw
scores); bf16 out.

Entries (one per head dim, same parameters)::

    q12_attn_prefill_d64 / _d128 / _d256(Q12Meta m, const bf16* q, const bf16* k_pool,
        const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size,
        float scale)

A CTA of ``THREADS[D]`` threads computes ``BLOCK_M[D]`` query rows of one (stream, head):
grid ``(ceil(chunk_len / BLOCK_M[D]), Hq, n)`` for D=64 and 128. D=256 packs the ``G = Hq / Hkv``
query heads of one kv head into the CTA (rows are (token, head) pairs): grid
``(ceil(chunk_len * G / BLOCK_M[D]), Hkv, n)``; :func:`geometry` then needs ``num_kv_heads``. CTAs whose row tile lies past their stream's
length exit at once. ``block_size`` may be any positive integer (the kernel divides); ``Hq``
must be a multiple of ``Hkv``. The dynamic shared memory (:func:`smem_bytes`) exceeds 48 KiB for
every head dim, so the launcher must set ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` once
per function (and may set ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` to 100 so two
CTAs fit per SM for D=64/128).

Numerics: S and P.V accumulate in fp32 on the tensor cores; P is rounded to bf16 before P.V (as
in FlashAttention); exponentials use ``ex2.approx.ftz``. Against :func:`reference` (fp32, exact
exp, unrounded P) the output differs by about 2-4e-3 relative (the bf16 output rounding alone is
up to 2^-9).
"""

from __future__ import annotations

import numpy as np

from ..core.bf16 import from_bf16_bits, to_bf16_bits
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "HEAD_DIMS",
    "THREADS",
    "BLOCK_M",
    "BLOCK_N",
    "WARPS",
    "WARP_SUBTILES",
    "entry_for_head_dim",
    "smem_bytes",
    "config",
    "knob_overrides",
    "DEFAULT_CONFIG",
    "geometry",
    "reference",
    "emulate_attention",
    "emulate_paged",
    "EMULATORS",
]

SOURCE = "attention/mma.cu"
#: Head dim -> entry point.
HEAD_DIMS = {64: "q12_attn_prefill_d64", 128: "q12_attn_prefill_d128", 256: "q12_attn_prefill_d256"}
ENTRIES = tuple(HEAD_DIMS.values())

#: Head dim -> the compile-time configuration of its entry: the defaults of the
#: ``ATTN_D<d>_<KNOB>`` macros in ``attention/mma.cu`` (a CPU test checks). Knobs: BN keys per K/V
#: tile, NW warps, MW 16-row sub-tiles per warp, QREG Q in registers, ST pipeline (0 = the shipped
#: two-barrier double buffer, >= 2 = an ST-stage one-barrier ring), PSMEM block-table lookups
#: through shared memory, GQA the query heads of one kv head packed into one CTA, WSKIP per-warp
#: causal tile skipping, MINB ``__launch_bounds__`` min blocks (0 = none), DS warp pairs splitting
#: S over key halves and O over head-dim halves (MW must be 2; CTA rows ``8 * NW * MW``; adds the
#: pairs' P tiles and row maxima to the shared memory).
DEFAULT_CONFIG = {
    64: {"BN": 64, "NW": 8, "MW": 1, "QREG": 0, "ST": 2, "PSMEM": 1, "GQA": 0, "WSKIP": 0, "MINB": 0, "DS": 0},
    128: {"BN": 32, "NW": 8, "MW": 2, "QREG": 0, "ST": 2, "PSMEM": 1, "GQA": 1, "WSKIP": 1, "MINB": 0, "DS": 0},
    256: {"BN": 64, "NW": 8, "MW": 2, "QREG": 0, "ST": 2, "PSMEM": 1, "GQA": 1, "WSKIP": 1, "MINB": 0, "DS": 1},
}
_KNOBS = ("BN", "NW", "MW", "QREG", "ST", "PSMEM", "GQA", "WSKIP", "MINB", "DS")

#: Head dim -> warps per CTA (shipped configuration).
WARPS = {d: c["NW"] for d, c in DEFAULT_CONFIG.items()}
#: Head dim -> 16-row sub-tiles per warp (a warp computes 16 * this query rows).
WARP_SUBTILES = {d: c["MW"] for d, c in DEFAULT_CONFIG.items()}
#: Head dim -> keys per pipelined K/V tile.
BLOCK_N = {d: c["BN"] for d, c in DEFAULT_CONFIG.items()}
#: Head dim -> threads per CTA.
THREADS = {d: 32 * w for d, w in WARPS.items()}
#: Head dim -> query rows per CTA (CTA rows are (token, head) pairs with GQA packing; DS warp
#: pairs share their rows).
BLOCK_M = {d: 16 * WARPS[d] * WARP_SUBTILES[d] // (2 if DEFAULT_CONFIG[d]["DS"] else 1) for d in WARPS}
#: bf16 elements of padding per shared-memory row (bank-conflict-free ldmatrix).
_SMEM_PAD = 8


def config(head_dim: int, defines=()) -> dict:
    """The configuration of ``q12_attn_prefill_d{head_dim}`` compiled with ``defines``.

    ``defines`` are NVRTC macros ``"NAME=VALUE"``; ``ATTN_D<d>_<KNOB>`` ones override
    :data:`DEFAULT_CONFIG`. Returns a dict with the knobs plus ``threads``, ``block_m``,
    ``stages`` (K/V buffers in shared memory) and ``smem`` (dynamic shared-memory bytes).

    Raises
    ------
    ValueError
        Unknown head dim, or a combination the kernel's static_asserts reject.
    """
    d = int(head_dim)
    entry_for_head_dim(d)
    cfg = {**DEFAULT_CONFIG[d], **knob_overrides(defines, f"ATTN_D{d}_", _KNOBS)}
    bn, nw, mw, st = cfg["BN"], cfg["NW"], cfg["MW"], cfg["ST"]
    threads = 32 * nw
    cpr = d // 8
    ds = cfg["DS"]
    block_m = 16 * nw * mw // (2 if ds else 1)
    if ds and (mw != 2 or nw % 2 or bn % 32):
        raise ValueError(f"D={d}: DS needs MW=2, an even NW and BN % 32 == 0, got {cfg}")
    if bn % 16 or threads % cpr or (bn * cpr) % threads or (block_m * cpr) % threads:
        raise ValueError(f"D={d}: tiles {cfg} do not split over {threads} threads")
    if st not in (0,) and st < 2:
        raise ValueError(f"D={d}: ST must be 0 or >= 2, got {st}")
    if cfg["PSMEM"] and (st < 2 or bn > threads):
        raise ValueError(f"D={d}: PSMEM needs ST >= 2 and BN <= threads")
    stages = 2 if st == 0 else st
    smem = (block_m + 2 * stages * bn) * (d + _SMEM_PAD) * 2 + (2 * bn * 4 if cfg["PSMEM"] else 0)
    if ds:  # per warp pair: P tile [32][BN + 8] bf16 and row maxima/sums [2][32] fp32
        smem += (nw // 2) * (32 * (bn + _SMEM_PAD) * 2 + 2 * 32 * 4)
    cfg.update(threads=threads, block_m=block_m, stages=stages, smem=smem)
    return cfg


def knob_overrides(defines, prefix: str, knobs) -> dict:
    """``{knob: int}`` for every ``"<prefix><knob>=<value>"`` in ``defines`` (NVRTC macros; a bare
    ``"<prefix><knob>"`` means 1) whose knob is in ``knobs``; other macros are ignored."""
    out = {}
    for item in defines:
        name, _, value = str(item).partition("=")
        if name.startswith(prefix) and name[len(prefix):] in knobs:
            out[name[len(prefix):]] = int(value or 1)
    return out


def entry_for_head_dim(head_dim: int) -> str:
    """The entry point for ``head_dim`` (64, 128 or 256).

    Raises
    ------
    ValueError
        For any other head dim.
    """
    try:
        return HEAD_DIMS[int(head_dim)]
    except KeyError:
        raise ValueError(f"no attention kernel for head_dim={head_dim}; supported: {sorted(HEAD_DIMS)}") from None


def smem_bytes(head_dim: int, defines=()) -> int:
    """Dynamic shared memory of one CTA: Q tile + K and V stages, padded rows (+ the slot array).

    ``(BLOCK_M + 4 * BLOCK_N) * (D + 8) * 2 + 8 * BLOCK_N`` bytes with the default tiles (two
    stages, slot array, the shipped tiles): 55 808 (D=64), 104 704 (D=128); D=256 (DS) adds per warp pair a
    P tile ``[32][BN + 8]`` bf16 and ``[2][32]`` fp32 row maxima/sums: 203 264 + 19 456 = 222 720. Above 48 KiB the launcher must raise
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` first (the H200 allows 227 KiB).
    ``defines``: see :func:`config`.
    """
    return config(head_dim, defines)["smem"]


def geometry(
    batch_size: int, chunk_len: int, num_q_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
    defines=(),
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """Launch geometry of ``q12_attn_prefill_d{head_dim}``.

    Parameters
    ----------
    batch_size : int
        n, the streams of the pass (grid z).
    chunk_len : int
        Max query tokens of any stream in the pass.
    num_q_heads : int
        Hq (grid y).
    head_dim : int
        D: 64, 128 or 256.
    num_kv_heads : int, optional
        Hkv; required when the entry packs GQA groups (``ATTN_D<d>_GQA=1``).
    defines : sequence of str
        The macros the module was compiled with (:func:`config`); none for the default tiles.

    Returns
    -------
    tuple
        ``(grid, block, dynamic_smem_bytes)`` with grid ``(ceil(chunk_len / BLOCK_M[D]), Hq, n)``
        (at least 1 in each dimension) and block ``(THREADS[D], 1, 1)``; with GQA packing grid
        ``(ceil(chunk_len * Hq / Hkv / BLOCK_M), Hkv, n)``.
    """
    d = int(head_dim)
    cfg = config(d, defines)
    if batch_size < 0 or chunk_len < 0 or num_q_heads <= 0:
        raise ValueError(
            f"need batch_size >= 0, chunk_len >= 0, num_q_heads > 0; got {batch_size}, {chunk_len}, {num_q_heads}"
        )
    rows, heads = int(chunk_len), int(num_q_heads)
    if cfg["GQA"]:
        if num_kv_heads is None or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"GQA packing needs num_kv_heads dividing num_q_heads, got {num_kv_heads}")
        rows, heads = rows * (heads // int(num_kv_heads)), int(num_kv_heads)
    m_tiles = max(1, -(-rows // cfg["block_m"]))
    grid = (m_tiles, heads, max(1, int(batch_size)))
    return grid, (cfg["threads"], 1, 1), cfg["smem"]


def reference(
    q: np.ndarray,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    cu_seqlens: np.ndarray,
    kv_lens: np.ndarray,
    block_tables,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    scale: float,
    *,
    dtype=np.float32,
    row_chunk: int = 1024,
) -> np.ndarray:
    """Paged causal prefill attention in numpy (bf16 values, ``dtype`` math).

    Parameters
    ----------
    q : numpy.ndarray
        uint16 bf16 bits ``[T, Hq, D]`` (``T >= cu_seqlens[-1]``).
    k_pool, v_pool : numpy.ndarray
        uint16 bf16 bits ``[num_blocks, block_size, Hkv, D]``.
    cu_seqlens : numpy.ndarray
        int ``[n + 1]``, stream ``b`` owns rows ``cu_seqlens[b] .. cu_seqlens[b+1]``.
    kv_lens : numpy.ndarray
        int ``[n]``, keys of stream ``b`` (cached before the chunk + the chunk).
    block_tables : sequence of numpy.ndarray
        ``n`` int arrays, physical block ids of each stream (at least
        ``ceil(kv_lens[b] / block_size)`` entries).
    num_q_heads, num_kv_heads : int
        Hq and Hkv (``Hq % Hkv == 0``).
    block_size : int
        Tokens per block.
    scale : float
        Softmax scale (usually ``D ** -0.5``); the kernel requires ``scale > 0``.
    dtype : numpy dtype
        Accumulation type, float32 (default, the kernel's) or float64.
    row_chunk : int
        Query rows processed at once (bounds the ``[G, rows, kv_len]`` score matrix).

    Returns
    -------
    numpy.ndarray
        uint16 bf16 bits ``[T, Hq, D]``; rows outside every stream are zero. A row that sees no
        key (only for ``kv_lens[b] < q_len``, which is not valid input) is zero.
    """
    q = np.asarray(q)
    if q.dtype != np.uint16 or q.ndim != 3:
        raise ValueError(f"q must be uint16 bf16 bits [T, Hq, D], got {q.dtype} {q.shape}")
    t_total, hq, d = q.shape
    hkv = int(num_kv_heads)
    if hq != num_q_heads or hkv <= 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads; num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    bs = int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    k_rows = np.asarray(k_pool).reshape(-1, hkv, d)
    v_rows = np.asarray(v_pool).reshape(-1, hkv, d)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    kvl = np.asarray(kv_lens, dtype=np.int64)
    n = kvl.shape[0]
    if cu.shape[0] != n + 1 or cu[-1] > t_total:
        raise ValueError(f"cu_seqlens {cu.tolist()} does not fit {n} streams over {t_total} rows")
    grp = hq // hkv
    out = np.zeros((t_total, hq, d), dtype=np.float32)
    for b in range(n):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        q_len, kv = s1 - s0, int(kvl[b])
        if q_len <= 0 or kv <= 0:
            continue
        pos = np.arange(kv, dtype=np.int64)
        table = np.asarray(block_tables[b], dtype=np.int64)
        slots = table[pos // bs] * bs + pos % bs
        # head-major and contiguous, so the matmuls below run on BLAS
        kb = np.ascontiguousarray(from_bf16_bits(k_rows[slots]).astype(dtype).transpose(1, 2, 0))  # [Hkv, D, kv]
        vb = np.ascontiguousarray(from_bf16_bits(v_rows[slots]).astype(dtype).transpose(1, 0, 2))  # [Hkv, kv, D]
        qb = from_bf16_bits(q[s0:s1]).astype(dtype)  # [q_len, Hq, D]
        for r0 in range(0, q_len, row_chunk):
            r1 = min(q_len, r0 + row_chunk)
            bound = kv - q_len + np.arange(r0, r1)  # last key each row sees
            visible = pos[None, :] <= bound[:, None]  # [rows, kv]
            for hk in range(hkv):
                qg = np.ascontiguousarray(qb[r0:r1, hk * grp : (hk + 1) * grp].transpose(1, 0, 2))  # [G, rows, D]
                sc = (qg @ kb[hk]) * dtype(scale)  # [G, rows, kv]
                sc = np.where(visible[None], sc, -np.inf)
                mx = sc.max(axis=-1, keepdims=True)
                mx = np.where(np.isfinite(mx), mx, 0)
                p = np.exp(sc - mx)
                den = p.sum(axis=-1, keepdims=True)
                og = (p @ vb[hk]) / np.where(den > 0, den, 1)
                og = np.where(den > 0, og, 0)
                out[s0 + r0 : s0 + r1, hk * grp : (hk + 1) * grp] = og.transpose(1, 0, 2)
    return to_bf16_bits(out)


def emulate_paged(name: str, head_dim: int, cfg: dict, args: dict, mem, grid, block) -> None:
    """Run one launch of attention entry ``name`` on the emulated driver: read the metadata, block
    tables, Q and the pools through ``mem`` as the kernel does, write each stream's O rows from
    :func:`reference`. ``cfg``: the entry's ``threads``, ``block_m`` and ``GQA`` (rows per CTA and
    whether they are (token, head) pairs), against which ``grid`` and ``block`` are checked."""
    meta = args["m"]
    n = int(meta.batch_size)
    hq, hkv, bs = int(args["num_q_heads"]), int(args["num_kv_heads"]), int(args["block_size"])
    if hq <= 0 or hkv <= 0 or hq % hkv or bs <= 0:
        raise ValueError(f"{name}: bad heads/block_size Hq={hq} Hkv={hkv} block_size={bs}")
    if not float(args["scale"]) > 0:
        raise ValueError(f"{name}: scale must be > 0 (the kernel takes the max of raw scores), got {args['scale']}")
    if n == 0:
        return
    cu = np.array(mem.array(int(meta.cu_seqlens), np.int32, (n + 1,)), dtype=np.int64)
    kv_lens = np.array(mem.array(int(meta.kv_lens), np.int32, (n,)), dtype=np.int64)
    q_lens = cu[1:] - cu[:-1]
    if (q_lens < 0).any():
        raise ValueError(f"{name}: cu_seqlens not non-decreasing: {cu.tolist()}")
    if tuple(block) != (cfg["threads"], 1, 1):
        raise ValueError(f"{name}: block must be ({cfg['threads']}, 1, 1), got {tuple(block)}")
    per_token, need_y = (hq // hkv, hkv) if cfg["GQA"] else (1, hq)
    need_x = -(-int(q_lens.max()) * per_token // cfg["block_m"])
    if grid[0] < need_x or grid[1] < need_y or grid[2] < n:
        raise ValueError(
            f"{name}: grid {tuple(grid)} does not cover ({need_x}, {need_y}, {n}) "
            f"(longest stream {int(q_lens.max())} rows x {per_token} heads / {cfg['block_m']} per CTA, "
            f"{'Hkv' if cfg['GQA'] else 'Hq'}, n)"
        )
    ptrs = mem.array(int(meta.block_table_ptrs), np.uint64, (n,))
    tables = []
    num_blocks = 0
    for b in range(n):
        # The kernel reads only the entries of keys a valid row can see.
        last_key = int(kv_lens[b]) - 1 if q_lens[b] > 0 else -1
        nblk = last_key // bs + 1 if last_key >= 0 else 0
        tab = np.array(mem.array(int(ptrs[b]), np.int32, (nblk,)), dtype=np.int64) if nblk else np.zeros(0, np.int64)
        if (tab < 0).any():
            raise ValueError(f"{name}: stream {b} block table has negative ids {tab[tab < 0][:4].tolist()}")
        tables.append(tab)
        if nblk:
            num_blocks = max(num_blocks, int(tab.max()) + 1)
    t_total = int(cu[-1])
    d = head_dim
    q = mem.array(int(args["q"]), np.uint16, (t_total, hq, d))
    o = mem.array(int(args["o"]), np.uint16, (t_total, hq, d))
    pool_shape = (num_blocks, bs, hkv, d)
    k_pool = mem.array(int(args["k_pool"]), np.uint16, pool_shape) if num_blocks else np.zeros(pool_shape, np.uint16)
    v_pool = mem.array(int(args["v_pool"]), np.uint16, pool_shape) if num_blocks else np.zeros(pool_shape, np.uint16)
    kv_eff = np.where(q_lens > 0, kv_lens, 0)
    res = reference(q, k_pool, v_pool, cu, kv_eff, tables, hq, hkv, bs, float(args["scale"]))
    for b in range(n):
        o[cu[b] : cu[b + 1]] = res[cu[b] : cu[b + 1]]


def emulate_attention(head_dim: int, defines=()):
    """The emulated-driver stand-in for ``q12_attn_prefill_d{head_dim}`` (compiled with ``defines``).

    Returns
    -------
    callable
        ``fn(args, mem, grid, block)``: reads the metadata, block tables, Q and the pools through
        ``mem`` as the kernel does, runs :func:`reference` and writes each stream's O rows in
        place. Raises ``ValueError`` when ``grid`` / ``block`` would not cover the work.
    """
    cfg = config(head_dim, defines)
    name = HEAD_DIMS[int(head_dim)]

    def emulate(args: dict, mem, grid, block) -> None:
        emulate_paged(name, int(head_dim), cfg, args, mem, grid, block)

    emulate.__name__ = f"emulate_{HEAD_DIMS[int(head_dim)]}"
    return emulate


#: Entry name -> emulator, for q12drv's emulated driver.
EMULATORS = {entry: emulate_attention(d) for d, entry in HEAD_DIMS.items()}

registry.register(SOURCE, ENTRIES, EMULATORS)
