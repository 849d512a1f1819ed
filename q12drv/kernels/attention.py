"""Batched varlen paged causal prefill attention (``cuda_src/attention/mma.cu``, mma.sync): the host side.

Stream ``b`` owns packed rows ``cu_seqlens[b] .. cu_seqlens[b+1]`` of Q ``[T, Hq, D]`` and
O ``[T, Hq, D]`` (bf16). Its keys and values, positions ``0 .. kv_lens[b] - 1``, are read from
the paged K and V pools (NHD ``[num_blocks, block_size, Hkv, D]`` bf16) through its block table:
position ``p`` lives in physical block ``block_table_b[p // block_size]`` at offset
``p % block_size``. The current chunk's keys are already in the pools (the KV-write kernel runs
first). Causality is bottom-right: row ``r`` of a stream with ``q_len`` rows (the query at position
``p = kv_lens[b] - q_len + r``) sees keys ``0 .. p``. GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``.

Sliding window (``window_left``, a launch argument, per layer): FlashAttention's convention,
``window_size=(window_left, 0)``: the query at position ``p`` sees the keys ``p - window_left .. p``
(``window_left + 1`` keys, fewer near the start); ``window_left = 0`` is the key at ``p`` alone. transformers'
``config.sliding_window = W`` (``masking_utils.sliding_window_overlay``: key ``j`` visible when ``j > p - W``)
is ``window_left = W - 1``. No window is any value ``>= kv_len``; the host passes :data:`NO_WINDOW`
(``2**31 - 1``, :func:`window_argument`). A CTA starts at the key tile of the first key its first row sees, so
the time grows with the window, not with the context.
Softmax in fp32 of ``scale * q.k`` (``scale > 0``: the kernel takes the row max of the raw
scores); bf16 out.

Entries (one per head dim, the parameter list ``ATTN_PARAMS`` of ``attention/common.cuh``)::

    q12_attn_prefill_d64 / _d128 / _d256(Q12Meta m, const bf16* q, const bf16* k_pool,
        const bf16* v_pool, bf16* o, int num_q_heads, int num_kv_heads, int block_size,
        float scale, int window_left)

A CTA of ``TILES[D].threads`` threads computes ``TILES[D].block_m`` rows of one stream: grid
``(ceil(chunk_len / block_m), Hq, n)`` for D=64, where a row is a token of query head ``blockIdx.y``.
D=128 and 256 pack the ``G = Hq / Hkv`` query heads of one kv head into the CTA (rows are (token,
head) pairs): grid ``(ceil(chunk_len * G / block_m), Hkv, n)``; :func:`geometry` then needs
``num_kv_heads``. CTAs whose row tile lies past their stream's length exit at once. ``block_size``
must be a power of two (the stager's rule); ``Hq`` must be a multiple of ``Hkv``. The dynamic shared
memory (:func:`smem_bytes`) exceeds 48 KiB for every head dim, so the launcher must set
``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` once per function (and may set
``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` to 100 so two CTAs fit per SM at D=64).

:data:`TILES` is the one table the launch geometry comes from; the source's ``attn_config(D)`` must
agree with it, which every compile checks (:data:`CONTRACTS`, ``static_assert`` in the source).

Numerics: S and P.V accumulate in fp32 on the tensor cores; P is rounded to bf16 before P.V (as
in FlashAttention); exponentials use ``ex2.approx.ftz``. Against :func:`reference` (fp32, exact
exp, unrounded P) the output differs by about 2-4e-3 relative (the bf16 output rounding alone is
up to 2^-9).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.bf16 import from_bf16_bits, to_bf16_bits
from ..core.ints import checked_int
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "HEAD_DIMS",
    "WARPS",
    "STAGES",
    "Tiles",
    "TILES",
    "CONTRACTS",
    "NO_WINDOW",
    "window_argument",
    "entry_for_head_dim",
    "smem_bytes",
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
#: Warps per CTA at every head dim (``kWarps`` in the source).
WARPS = 8
#: K/V stages of the cp.async ring (``kStages``).
STAGES = 2
#: bf16 elements of padding per shared-memory row (bank-conflict-free ldmatrix).
_SMEM_PAD = 8
#: The kernels' ``window_left`` argument for no window (INT_MAX: at least every ``kv_len``).
NO_WINDOW = (1 << 31) - 1


@dataclass(frozen=True)
class Tiles:
    """One entry's tiles, as ``attn_config(D)`` in ``attention/mma.cu`` has them, and the launch numbers
    that follow from them. (The source's ``warp_skip`` changes no launch number; the host does not
    mirror it.)"""

    head_dim: int
    #: Keys per K/V tile.
    block_n: int
    #: 16-row sub-tiles per warp.
    warp_subtiles: int
    #: CTA rows are the (token, query head) pairs of one kv head; grid y is Hkv.
    gqa_pack: bool
    #: Warp pairs share their rows (S split by keys, O by head dims), halving the CTA's rows.
    dim_split: bool

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        return 32 * WARPS

    @property
    def block_m(self) -> int:
        """CTA rows (tokens, or (token, head) pairs with :attr:`gqa_pack`)."""
        return 16 * WARPS * self.warp_subtiles // (2 if self.dim_split else 1)

    @property
    def smem(self) -> int:
        """Dynamic shared-memory bytes: Q tile, K and V stages (rows padded by 16 bytes), the [2][BN] slot
        array; with :attr:`dim_split` per warp pair a P tile ``[32][BN + 8]`` bf16 and ``[2][32]`` fp32 row
        maxima / sums."""
        row = (self.head_dim + _SMEM_PAD) * 2
        pairs = WARPS // 2 * (32 * (self.block_n + _SMEM_PAD) * 2 + 2 * 32 * 4) if self.dim_split else 0
        return (self.block_m + 2 * STAGES * self.block_n) * row + 2 * self.block_n * 4 + pairs


#: Head dim -> tiles: the table the launch geometry is computed from (the source checks it at compile time).
TILES = {
    64: Tiles(64, block_n=64, warp_subtiles=1, gqa_pack=False, dim_split=False),
    128: Tiles(128, block_n=32, warp_subtiles=2, gqa_pack=True, dim_split=False),
    256: Tiles(256, block_n=64, warp_subtiles=2, gqa_pack=True, dim_split=True),
}
#: The host/device contract: the launch numbers :func:`geometry` takes from :data:`TILES` (threads, CTA rows,
#: GQA packing, dynamic shared memory of every entry), passed as ``-D`` to every build of ``attention/mma.cu``
#: and checked there against ``attn_config(D)``.
CONTRACTS = {f"Q12_ATTN_D{d}_{field}": value for d, t in TILES.items()
             for field, value in (("THREADS", t.threads), ("BLOCK_M", t.block_m), ("GQA", int(t.gqa_pack)),
                                  ("SMEM", t.smem))}


def window_argument(window_left, name: str = "window_left") -> int:
    """The kernels' ``window_left`` argument for a sliding window of ``window_left`` keys left of the query
    (FlashAttention's ``window_size=(window_left, 0)``; ``W - 1`` for transformers' ``sliding_window = W``).

    Parameters
    ----------
    window_left : int or None
        ``None`` or ``-1``: no window (full causal); ``0 .. 2**31 - 1``: the query at position ``p`` sees the keys
        ``p - window_left .. p``.
    name : str
        The argument's name in the error.

    Returns
    -------
    int
        ``window_left``, or :data:`NO_WINDOW` for none.

    Raises
    ------
    TypeError, ValueError
        Not an int (a bool, a float), or a negative value other than -1.
    """
    if window_left is None or (type(window_left) is int and window_left == -1):
        return NO_WINDOW
    if type(window_left) is int and 0 <= window_left <= NO_WINDOW:  # the common case
        return window_left
    w = checked_int(name, window_left, -1, NO_WINDOW)
    return NO_WINDOW if w == -1 else w


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


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CTA (:attr:`Tiles.smem`): 55 808 bytes (D=64), 104 704 (D=128),
    222 720 (D=256). Above 48 KiB the launcher must raise ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``
    first (the H200 allows 227 KiB)."""
    entry_for_head_dim(head_dim)
    return TILES[int(head_dim)].smem


def geometry(
    batch_size: int, chunk_len: int, num_q_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """Launch geometry of ``q12_attn_prefill_d{head_dim}``.

    Parameters
    ----------
    batch_size : int
        n, the streams of the pass (grid z).
    chunk_len : int
        Max query tokens of any stream in the pass.
    num_q_heads : int
        Hq.
    head_dim : int
        D: 64, 128 or 256.
    num_kv_heads : int, optional
        Hkv; required where the entry packs GQA groups (:attr:`Tiles.gqa_pack`: D=128 and 256).

    Returns
    -------
    tuple
        ``(grid, block, dynamic_smem_bytes)`` with grid ``(ceil(chunk_len / block_m), Hq, n)`` (at least 1
        in each dimension) and block ``(threads, 1, 1)``; with GQA packing grid
        ``(ceil(chunk_len * Hq / Hkv / block_m), Hkv, n)``.

    Raises
    ------
    ValueError
        An unknown head dim, a negative count, or (with GQA packing) ``num_kv_heads`` missing or not
        dividing ``num_q_heads``.
    """
    entry_for_head_dim(head_dim)
    tiles = TILES[int(head_dim)]
    if batch_size < 0 or chunk_len < 0 or num_q_heads <= 0:
        raise ValueError(
            f"need batch_size >= 0, chunk_len >= 0, num_q_heads > 0; got {batch_size}, {chunk_len}, {num_q_heads}"
        )
    rows, heads = int(chunk_len), int(num_q_heads)
    if tiles.gqa_pack:
        if num_kv_heads is None or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"D={head_dim} packs GQA groups: it needs num_kv_heads dividing num_q_heads "
                             f"({num_q_heads}), got {num_kv_heads}")
        rows, heads = rows * (heads // int(num_kv_heads)), int(num_kv_heads)
    m_tiles = max(1, -(-rows // tiles.block_m))
    grid = (m_tiles, heads, max(1, int(batch_size)))
    return grid, (tiles.threads, 1, 1), tiles.smem


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
    window_left: int | None = None,
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
    window_left : int, optional
        Sliding window: the query at position ``p`` sees the keys ``p - window_left .. p`` (``>= 0``; the module
        docstring has the conventions); None: every key ``<= p``.

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
    if window_left is not None:
        window_left = checked_int("window_left", window_left, 0)
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
            if window_left is not None:
                visible &= pos[None, :] >= bound[:, None] - window_left
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


def emulate_paged(name: str, head_dim: int, tiles, args: dict, mem, grid, block) -> None:
    """Run one launch of attention entry ``name`` on the emulated driver: read the metadata, block
    tables, Q and the pools through ``mem`` as the kernel does, write each stream's O rows from
    :func:`reference`. ``tiles``: the entry's :class:`Tiles` (or the wgmma kernel's), whose ``threads``,
    ``block_m`` and ``gqa_pack`` ``grid`` and ``block`` are checked against."""
    meta = args["m"]
    n = int(meta.batch_size)
    hq, hkv, bs = int(args["num_q_heads"]), int(args["num_kv_heads"]), int(args["block_size"])
    if hq <= 0 or hkv <= 0 or hq % hkv or bs <= 0:
        raise ValueError(f"{name}: bad heads/block_size Hq={hq} Hkv={hkv} block_size={bs}")
    if not float(args["scale"]) > 0:
        raise ValueError(f"{name}: scale must be > 0 (the kernel takes the max of raw scores), got {args['scale']}")
    window_left = int(args["window_left"])
    if window_left < 0:
        raise ValueError(f"{name}: window_left must be >= 0 (NO_WINDOW = 2**31 - 1 for none), got {window_left}")
    if n == 0:
        return
    cu = np.array(mem.array(int(meta.cu_seqlens), np.int32, (n + 1,)), dtype=np.int64)
    kv_lens = np.array(mem.array(int(meta.kv_lens), np.int32, (n,)), dtype=np.int64)
    q_lens = cu[1:] - cu[:-1]
    if (q_lens < 0).any():
        raise ValueError(f"{name}: cu_seqlens not non-decreasing: {cu.tolist()}")
    if tuple(block) != (tiles.threads, 1, 1):
        raise ValueError(f"{name}: block must be ({tiles.threads}, 1, 1), got {tuple(block)}")
    per_token, need_y = (hq // hkv, hkv) if tiles.gqa_pack else (1, hq)
    need_x = -(-int(q_lens.max()) * per_token // tiles.block_m)
    if grid[0] < need_x or grid[1] < need_y or grid[2] < n:
        raise ValueError(
            f"{name}: grid {tuple(grid)} does not cover ({need_x}, {need_y}, {n}) "
            f"(longest stream {int(q_lens.max())} rows x {per_token} heads / {tiles.block_m} per CTA, "
            f"{'Hkv' if tiles.gqa_pack else 'Hq'}, n)"
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
    res = reference(q, k_pool, v_pool, cu, kv_eff, tables, hq, hkv, bs, float(args["scale"]),
                    window_left=window_left)
    for b in range(n):
        o[cu[b] : cu[b + 1]] = res[cu[b] : cu[b + 1]]


def emulate_attention(head_dim: int):
    """The emulated-driver stand-in for ``q12_attn_prefill_d{head_dim}``.

    Returns
    -------
    callable
        ``fn(args, mem, grid, block)``: reads the metadata, block tables, Q and the pools through
        ``mem`` as the kernel does, runs :func:`reference` and writes each stream's O rows in
        place. Raises ``ValueError`` when ``grid`` / ``block`` would not cover the work.
    """
    name = entry_for_head_dim(head_dim)
    tiles = TILES[int(head_dim)]

    def emulate(args: dict, mem, grid, block) -> None:
        emulate_paged(name, int(head_dim), tiles, args, mem, grid, block)

    emulate.__name__ = f"emulate_{name}"
    return emulate


#: Entry name -> emulator, for q12drv's emulated driver.
EMULATORS = {entry: emulate_attention(d) for d, entry in HEAD_DIMS.items()}

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
