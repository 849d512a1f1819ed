"""Split-KV paged decode attention (``cuda_src/attention/decode.cu``, mma.sync): the host side.

The computation of :mod:`q12drv.kernels.attention` (stream ``b``'s rows ``cu_seqlens[b] .. cu_seqlens[b+1]`` of Q and
O ``[T, Hq, D]`` bf16, its keys through its block table in the paged pools ``[num_blocks, block_size, Hkv, D]``,
bottom-right causal, the sliding window ``window_left`` as :mod:`q12drv.kernels.attention` takes it, GQA, softmax in
fp32 of ``scale * q.k``), for passes whose every stream has at most
:data:`MAX_Q_LEN` new tokens and ``q_len * Hq / Hkv <= MAX_ROWS`` (decode steps, speculative decode): a stream's
``q_len * G`` rows of one kv head are one CTA, so each K/V byte is read once, and a stream's keys are split over
``num_splits`` CTAs where the batch alone would leave SMs idle. ``ops.attention(..., algo="decode")`` and
``Q12Pass.attention(..., algo="decode")`` run it; ``algo="auto"`` runs it on FP8 pools and, given a workspace, where
its plan splits the keys (:func:`auto_runs`: measured on the H200, the wgmma prefill kernel reads a decode batch
faster where one split suffices, streams x kv heads filling the SMs; ``docs/kernels/attention_decode.md``). It is
also the kernel that reads FP8 (e4m3)
pools (``kv_dtype="fp8_e4m3"``, written by ``q12_kv_write_fp8`` with each KV head's fp32 scales): the prefill kernels
read bf16 pools only.

Entries (``DECODE_PARAMS`` / ``DECODE_FP8_PARAMS`` / ``DECODE_MERGE_PARAMS`` in the source)::

    q12_attn_decode_d64 / _d128 / _d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool,
        bf16* o, float* partial, int num_q_heads, int num_kv_heads, int block_size, float scale, int window_left,
        int num_splits)
    q12_attn_decode_fp8_d64 / _d128 / _d256(Q12Meta m, const bf16* q, const u8* k_pool, const u8* v_pool,
        const float* k_scale, const float* v_scale, bf16* o, float* partial, int num_q_heads, int num_kv_heads,
        int block_size, float scale, int window_left, int num_splits)
    q12_attn_decode_merge_d64 / _d128 / _d256(Q12Meta m, const float* partial, bf16* o, int num_q_heads,
        int num_kv_heads, int window_left, int num_splits)

The split kernel's grid is ``(num_splits, Hkv, n)``, :attr:`Tiles.threads` threads, :attr:`Tiles.smem` bytes of
dynamic shared memory (:attr:`Tiles.smem_fp8` for FP8 pools). Stream ``b``'s key tiles (``BN = Tiles.block_n`` keys, from the tile of the first key its first
token sees, 0 without a window, to ``n_tiles = ceil(kv_len / BN)``) go to the splits in contiguous ranges of ``tps``
tiles (:func:`split_ranges`): a stream's partition depends on its ``q_len``, ``kv_len``, the window and
``num_splits`` only, so batched and single-stream launches with the same ``num_splits`` give the same bits. ``num_splits == 1``: the split kernel writes O. ``num_splits > 1``: each non-empty
split writes its normalised fp32 O and its log-sum-exp (log2 units) into the workspace, ``partial_o[s][t][h][D]``
then ``partial_lse[s][t][h]`` (``t < T = total_tokens``; :meth:`DecodePlan.workspace_bytes_for`), and the merge
kernel (grid ``(ceil(chunk_len * Hq / rows_per_cta), 1, n)``, :data:`MERGE_THREADS` threads, ``D / 8`` a row)
combines the stream's non-empty splits into O; it is launched as a programmatic dependent launch (set up while the
split grid's last CTAs run; the split kernel triggers nothing early, so it starts as they exit). :func:`plan_decode`
is the one place the split count is decided (:func:`split_count`) and the launch geometry computed; :data:`TILES` is the table of tile sizes every compile checks
against the source's ``decode_config(D)`` (:data:`CONTRACTS`).

Numerics: as the prefill kernels (fp32 accumulation on the tensor cores, P rounded to bf16, ``ex2.approx.ftz``),
plus the split merge in fp32. :func:`model` is the numpy model of exactly this math in float32 (the key groups of a
CTA, its splits and the merge), which the emulated driver runs: batched equals per stream bit for bit, and a split
result equals the unsplit one to fp32 rounding before the bf16 output (``tests/test_kernel_attention_decode.py``
states the tolerance).

FP8 pools: the same template with one-byte K/V elements. 16-byte cp.async copies move the e4m3 rows (half the bf16
bytes) into a ring of :attr:`Tiles.fp8_stages` stages; each tile is converted, by all the CTA's threads, to bf16
(exactly: every e4m3 value is a bf16 value) into the shared-memory layout the bf16 entries' MMAs read (two tiles:
tile j + 1 is converted while tile j is computed, one barrier a tile). The scales are folded into the math, not
multiplied into the elements: the scores use ``(scale * k_scale[h]) * log2(e)`` (one fp32 constant a CTA) and the
row's ``1 / L`` becomes ``(1 / L) * v_scale[h]`` where the key groups are combined, before the bf16 store (one split)
or the fp32 partial (splits; the merge, linear in the partials, is the bf16 entries'). :func:`model` takes the same
steps in the same order. Against the bf16 decode of the K/V the pools were quantized from, the result differs by
e4m3's rounding (3 mantissa bits): 2.8% to 3.7% relative L2 error on Gaussian K/V with amax / 448 scales
(``docs/kernels/attention_decode.md`` states the measurement and the bound the tests hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from ..core.bf16 import from_bf16_bits, round_to_bf16, to_bf16_bits
from ..core.fp8 import from_e4m3_bits
from ..core.layout import decode_partials
from .args import (ALIGN, FP8_E4M3 as FP8, KV_DTYPES, check_kv_pools, check_kv_scales, check_launch, count, head_group,
                   positive_float, workspace_ptr)
from .attention import _SMEM_PAD, NO_WINDOW, window_argument
from .meta import meta_struct
from . import registry
from .layer_launch import for_metadata

__all__ = [
    "SOURCE", "HEAD_DIMS", "FP8_ENTRIES", "MERGE_ENTRIES", "ENTRIES", "WARPS", "MAX_Q_LEN", "MAX_ROWS", "MERGE_THREADS",
    "MAX_SPLITS", "MIN_SPLIT_TILES", "EFFICIENCY", "Tiles", "TILES", "CONTRACTS", "entry_for_head_dim", "check_rows",
    "split_count", "split_ranges", "DecodePlan", "plan_decode", "takes", "auto_runs", "auto_algo", "check_workspace",
    "attention", "enqueue_decode",
    "model", "EMULATORS",
]

SOURCE = "attention/decode.cu"
#: Head dim -> split entry (bf16 pools).
HEAD_DIMS = {64: "q12_attn_decode_d64", 128: "q12_attn_decode_d128", 256: "q12_attn_decode_d256"}
#: Head dim -> split entry (FP8 e4m3 pools with per-KV-head scales).
FP8_ENTRIES = {64: "q12_attn_decode_fp8_d64", 128: "q12_attn_decode_fp8_d128", 256: "q12_attn_decode_fp8_d256"}
#: Head dim -> merge entry (both pool types: the splits' partials are fp32).
MERGE_ENTRIES = {64: "q12_attn_decode_merge_d64", 128: "q12_attn_decode_merge_d128", 256: "q12_attn_decode_merge_d256"}
ENTRIES = tuple(HEAD_DIMS.values()) + tuple(FP8_ENTRIES.values()) + tuple(MERGE_ENTRIES.values())
#: Warps per split CTA (``kWarps``).
WARPS = 4
#: New tokens a stream may have (``kMaxQLen``): decode steps and speculative decode of up to 8 tokens.
MAX_Q_LEN = 8
#: CTA rows a stream may have, ``q_len * Hq / Hkv`` (``kMaxRows``: four 16-row m-tiles).
MAX_ROWS = 64
#: Threads per merge CTA (``kMergeThreads``).
MERGE_THREADS = 128
#: The most splits :func:`plan_decode` takes or accepts.
MAX_SPLITS = 64
#: :func:`split_count` splits a stream only where every split gets at least this many key tiles.
MIN_SPLIT_TILES = 4
#: :func:`split_count` takes the fewest splits whose wave efficiency is at least this fraction of the best one.
EFFICIENCY = 0.95
#: An sm_90 SM's shared memory for its CTAs and what the driver reserves per CTA (bytes).
_SM_SMEM, _CTA_RESERVED = 233472, 1024
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Tiles:
    """One split entry's tiles, as ``decode_config(D)`` in ``attention/decode.cu`` has them, and the launch numbers
    that follow from them."""

    head_dim: int
    #: Keys per K/V tile.
    block_n: int
    #: K/V stages of the cp.async ring (bf16 pools).
    stages: int
    #: e4m3 K/V stages of the cp.async ring (FP8 pools; the MMAs read two bf16 tiles converted from it).
    fp8_stages: int

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        return 32 * WARPS

    @property
    def smem(self) -> int:
        """Dynamic shared-memory bytes (bf16 pools): Q (:data:`MAX_ROWS` rows), the K and V stages (rows padded by 16
        bytes), the ``[2][BN]`` slot array."""
        return (MAX_ROWS + 2 * self.stages * self.block_n) * (self.head_dim + _SMEM_PAD) * 2 + 2 * self.block_n * 4

    @property
    def smem_fp8(self) -> int:
        """Dynamic shared-memory bytes (FP8 pools): Q, two bf16 K and V tiles (rows padded by 16 bytes), the e4m3 K
        and V stages (unpadded rows of D bytes), the slot array."""
        return ((MAX_ROWS + 2 * 2 * self.block_n) * (self.head_dim + _SMEM_PAD) * 2
                + 2 * self.fp8_stages * self.block_n * self.head_dim + 2 * self.block_n * 4)

    def smem_for(self, kv_dtype: str) -> int:
        """:attr:`smem` or :attr:`smem_fp8` for pools of ``kv_dtype`` (:data:`KV_DTYPES`)."""
        return self.smem_fp8 if kv_dtype == FP8 else self.smem

    def ctas_per_sm(self, kv_dtype: str = "bf16") -> int:
        """Split CTAs an SM holds at once for pools of ``kv_dtype``: by shared memory, and at most two by registers
        (128 threads of up to 255 registers)."""
        return max(1, min(2, _SM_SMEM // (self.smem_for(kv_dtype) + _CTA_RESERVED)))

    def key_groups(self, rows: int) -> tuple[int, int, int]:
        """``(MT, KW, KPW)`` of a stream of ``rows`` CTA rows: its 16-row m-tiles (1, 2 or 4), the key groups each
        m-tile's keys are split into (one warp each) and the keys of a tile a group takes, as the source's
        ``decode_body<D, MT>``."""
        mt = 1 if rows <= 16 else 2 if rows <= 32 else 4
        kw = min(WARPS // mt, self.block_n // 16)
        return mt, kw, self.block_n // kw


#: Head dim -> tiles: the table the launch geometry and the split count come from (the source checks it).
TILES = {64: Tiles(64, block_n=64, stages=4, fp8_stages=8), 128: Tiles(128, block_n=64, stages=4, fp8_stages=8),
         256: Tiles(256, block_n=32, stages=5, fp8_stages=7)}
#: The host/device contract: the numbers :func:`plan_decode` and :func:`check_rows` take from :data:`TILES` and this
#: module, passed as ``-D`` to every build of ``attention/decode.cu`` and checked there against ``decode_config(D)``.
CONTRACTS = {"Q12_DECODE_MAX_Q_LEN": MAX_Q_LEN, "Q12_DECODE_MAX_ROWS": MAX_ROWS,
             "Q12_DECODE_MERGE_THREADS": MERGE_THREADS,
             **{f"Q12_DECODE_D{d}_{field}": value for d, t in TILES.items()
                for field, value in (("THREADS", t.threads), ("BLOCK_N", t.block_n), ("SMEM", t.smem),
                                     ("FP8_SMEM", t.smem_fp8))}}


def entry_for_head_dim(head_dim: int, kv_dtype: str = "bf16") -> str:
    """The split entry for ``head_dim`` (64, 128 or 256) and pools of ``kv_dtype`` (:data:`KV_DTYPES`).

    Raises
    ------
    ValueError
        For any other head dim or pool type.
    """
    entries = {"bf16": HEAD_DIMS, FP8: FP8_ENTRIES}.get(kv_dtype) if isinstance(kv_dtype, str) else None
    if entries is None:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r:.60}")
    try:
        return entries[int(head_dim)]
    except KeyError:
        raise ValueError(f"no decode attention kernel for head_dim={head_dim}; supported: {sorted(HEAD_DIMS)}") from None


def check_rows(chunk_len: int, num_q_heads: int, num_kv_heads: int, q_lens=None) -> None:
    """Refuse a batch the decode kernel does not take: a stream of more than :data:`MAX_Q_LEN` new tokens or of more
    than :data:`MAX_ROWS` CTA rows (``q_len * Hq / Hkv``). ``chunk_len`` is the longest stream's tokens; ``q_lens``
    (each stream's, optional) names the stream in the message.

    Raises
    ------
    ValueError
        Naming the stream (where ``q_lens`` is given), its tokens and the bound, and the algo to use instead.
    """
    g = num_q_heads // num_kv_heads
    bound = min(MAX_Q_LEN, MAX_ROWS // g)
    if chunk_len <= bound:
        return
    where = ""
    if q_lens is not None:
        b = int(np.argmax(np.asarray(q_lens)))
        where = f" (streams[{b}])"
    why = (f"at most {MAX_Q_LEN} new tokens" if bound == MAX_Q_LEN else
           f"at most {bound} new tokens at {g} query heads per kv head ({MAX_ROWS} rows of (token, head) a CTA)")
    raise ValueError(f"algo='decode' takes passes whose every stream has {why}; this pass's longest stream has "
                     f"{chunk_len}{where}: run it with algo='auto' (the prefill kernels)")


@lru_cache(maxsize=1024)
def split_count(ctas: int, n_tiles: int, slots: int) -> int:
    """How many splits each stream's keys get: 1 when ``ctas`` (streams x kv heads) fill at least 80% of ``slots``
    (SMs x CTAs an SM holds); otherwise the fewest splits ``s`` whose wave efficiency ``w / ceil(w)``, ``w = ctas * s /
    slots``, is at least :data:`EFFICIENCY` of the best over ``s = 1 ..`` (FlashAttention-2's rule, stricter), counting
    only the ``s`` that give each split fewer tiles than ``s - 1`` and at least :data:`MIN_SPLIT_TILES` of the longest
    stream's ``n_tiles``."""
    if ctas <= 0 or ctas >= 0.8 * slots:
        return 1
    cap = min(MAX_SPLITS, n_tiles // MIN_SPLIT_TILES)
    effs = {}
    for s in range(1, cap + 1):
        if s > 1 and -(-n_tiles // s) == -(-n_tiles // (s - 1)):
            continue
        waves = ctas * s / slots
        effs[s] = waves / math.ceil(waves)
    if not effs:
        return 1
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= EFFICIENCY * best)


def split_ranges(kv_len: int, head_dim: int, num_splits: int, q_len: int = 1,
                 window_left: int = NO_WINDOW) -> list[tuple[int, int]]:
    """The key tiles ``[t0, t1)`` of each non-empty split of a stream of ``q_len`` new tokens and ``kv_len`` keys
    (tiles of ``TILES[head_dim].block_n`` keys; ``window_left`` the kernels' argument), as the kernels partition them:
    the tiles from the one holding the first key the first token sees (0 without a window) to the last, in contiguous
    ranges; one (possibly empty) range for ``num_splits == 1``."""
    bn = TILES[head_dim].block_n
    n_tiles = -(-kv_len // bn) if kv_len > 0 else 0
    t_lo = (max(kv_len - q_len, window_left) - window_left) // bn
    tps = max(1, -(-(n_tiles - t_lo) // num_splits))
    if num_splits == 1:
        return [(t_lo, n_tiles)]
    return [(t_lo + s * tps, min(n_tiles, t_lo + (s + 1) * tps)) for s in range(-(-(n_tiles - t_lo) // tps))]


@dataclass(frozen=True)
class DecodePlan:
    """What a decode launch runs: the head layout, the head dim, the split count and the window (the kernels'
    ``window_left``, :data:`~q12drv.kernels.attention.NO_WINDOW` for none), decided once (:func:`plan_decode`) and run
    as is for the whole batch or stream by stream (the same bits)."""

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    num_splits: int
    window_left: int = NO_WINDOW
    #: The pools' element type (:data:`KV_DTYPES`): the split entry and its shared memory.
    kv_dtype: str = "bf16"

    @cached_property
    def entry(self) -> str:
        """The split entry."""
        return entry_for_head_dim(self.head_dim, self.kv_dtype)

    @cached_property
    def merge_entry(self) -> str | None:
        """The merge entry (None: one split, no merge)."""
        return MERGE_ENTRIES[self.head_dim] if self.num_splits > 1 else None

    def launches(self, batch_size: int, chunk_len: int) -> tuple:
        """``((grid, block, smem), merge)`` for ``batch_size`` streams of at most ``chunk_len`` tokens: the split
        kernel's geometry, and the merge's ``(grid, block, 0)`` or None (one split)."""
        return _launches(self.head_dim, self.num_q_heads, self.num_kv_heads, self.num_splits, self.kv_dtype,
                         max(1, int(batch_size)), int(chunk_len))

    def workspace_bytes_for(self, total_tokens: int) -> int:
        """The workspace a launch over ``total_tokens`` packed rows needs: ``num_splits * T * Hq * (D + 1)`` fp32 (0 for
        one split)."""
        if self.num_splits == 1:
            return 0
        return decode_partials(self.num_splits, int(total_tokens), self.num_q_heads, self.head_dim)[1]


def _merge_rows(head_dim: int) -> int:
    """(token, head) rows a merge CTA combines: D / 8 threads a row."""
    return MERGE_THREADS // (head_dim // 8)


@lru_cache(maxsize=1024)
def _launches(d: int, hq: int, hkv: int, splits: int, kv_dtype: str, n: int, chunk_len: int) -> tuple:
    t = TILES[d]
    split = ((splits, hkv, n), (t.threads, 1, 1), t.smem_for(kv_dtype))
    if splits == 1:
        return split, None
    return split, ((max(1, -(-chunk_len * hq // _merge_rows(d))), 1, n), (MERGE_THREADS, 1, 1), 0)


def plan_decode(batch_size: int, chunk_len: int, max_kv_len: int, num_q_heads: int, num_kv_heads: int,
                head_dim: int, *, num_sms: int, window_left: int | None = None, num_splits: int | None = None,
                q_lens=None, kv_dtype: str = "bf16") -> DecodePlan:
    """The decode plan for ``batch_size`` streams of at most ``chunk_len`` new tokens and ``max_kv_len`` keys.

    Parameters
    ----------
    batch_size, chunk_len, max_kv_len : int
        Streams, the longest stream's new tokens and keys.
    num_q_heads, num_kv_heads, head_dim : int
        Hq, Hkv (dividing Hq) and D (64, 128 or 256).
    num_sms : int
        The device's SMs (:attr:`q12drv.core.device.Device.sm_count`).
    window_left : int, optional
        Sliding window (:func:`~q12drv.kernels.attention.window_argument`: None or -1 for none).
    num_splits : int, optional
        Force the split count (1 .. :data:`MAX_SPLITS`); default :func:`split_count` over ``batch_size * num_kv_heads``
        CTAs, the key tiles the longest stream reads (at most its window's) and ``num_sms *
        TILES[head_dim].ctas_per_sm(kv_dtype)`` slots.
    q_lens : sequence of int, optional
        Each stream's new tokens, to name the stream a refusal is about.
    kv_dtype : str
        The pools' element type (:data:`KV_DTYPES`): ``"fp8_e4m3"`` runs the FP8 entries (the same split count
        wherever their CTAs an SM are bf16's, as on every head dim today).

    Raises
    ------
    ValueError
        An unknown head dim or pool type, a head layout or count out of range, a stream the kernel does not take
        (:func:`check_rows`) or ``num_splits`` out of range.
    """
    entry_for_head_dim(head_dim, kv_dtype)
    hq, hkv = head_group("num_q_heads", num_q_heads, "num_kv_heads", num_kv_heads)
    n = count("batch_size", batch_size, 0)
    chunk, kv = count("chunk_len", chunk_len, 0), count("max_kv_len", max_kv_len, 0)
    check_rows(chunk, hq, hkv, q_lens)
    window = window_argument(window_left)
    d = int(head_dim)
    t = TILES[d]
    if num_splits is None:
        span = min(kv, window + chunk)  # keys a stream's tokens see together
        tiles = min(-(-kv // t.block_n), -(-span // t.block_n) + 1)
        splits = split_count(n * hkv, tiles, count("num_sms", num_sms) * t.ctas_per_sm(kv_dtype))
    else:
        splits = count("num_splits", num_splits, 1, MAX_SPLITS)
    return DecodePlan(d, hq, hkv, splits, window, kv_dtype)


def check_workspace(device, plan: DecodePlan, need: int, workspace, workspace_bytes) -> int:
    """The checked workspace address for a launch of ``plan`` that needs ``need`` bytes (0 when it needs none).
    ``workspace``: a device address with ``workspace_bytes``, or a tensor (its size when ``workspace_bytes`` is
    None).

    Raises
    ------
    TypeError, ValueError
        A plan that needs a workspace without one (the message names the bytes, and ``num_splits=1`` as the way to run
        without one), a NULL or misaligned one, or one smaller than ``need``.
    """
    return workspace_ptr(need, workspace, workspace_bytes, f"algo='decode' with {plan.num_splits} splits",
                         "DecodePlan.workspace_bytes_for, Q12Pass.decode_workspace_bytes",
                         "num_splits=1 runs without one", device=device)  # 16-byte aligned: the kernels' stores


def takes(chunk_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the decode kernel takes a batch whose longest stream has ``chunk_len`` new tokens: a head dim it has,
    and every stream within :func:`check_rows`' bounds (False also for arguments their own checks refuse)."""
    if not (type(chunk_len) is type(num_q_heads) is type(num_kv_heads) is type(head_dim) is int) or num_kv_heads <= 0:
        return False
    g, r = divmod(num_q_heads, num_kv_heads)
    return head_dim in HEAD_DIMS and r == 0 and g > 0 and 0 < chunk_len <= min(MAX_Q_LEN, MAX_ROWS // g)


def auto_runs(plan: DecodePlan) -> bool:
    """Whether ``algo="auto"`` runs the decode kernel with ``plan`` (for a batch it :func:`takes`, given a workspace):
    on FP8 pools (the one kernel that reads them), and where ``plan`` splits the keys (few long streams: on the H200
    the splits ran 16 x 32k and 4 x 128k keys 2.7x to 10x faster than the wgmma kernel); not where one split
    suffices (streams x kv heads fill the SMs: the wgmma kernel's 128-row tiles read 1.2x faster,
    ``docs/kernels/attention_decode.md``)."""
    return plan.kv_dtype == FP8 or plan.num_splits > 1


def auto_algo(device, meta, num_q_heads: int, num_kv_heads: int, head_dim: int, window_left: int | None = None,
              num_splits: int | None = None, kv_dtype: str = "bf16") -> str:
    """``"decode"`` where ``algo="auto"`` runs the decode kernel on ``meta``'s batch (:func:`takes`, :func:`auto_runs`;
    the caller has a workspace or FP8 pools), else ``"auto"`` (the prefill kernels)."""
    if not meta.batch_size or not takes(meta.chunk_len, num_q_heads, num_kv_heads, head_dim):
        return "auto"
    return "decode" if auto_runs(_plan_for(device, meta, num_q_heads, num_kv_heads, head_dim, window_left, num_splits,
                                           kv_dtype)) else "auto"


def _plan_for(device, meta, num_q_heads: int, num_kv_heads: int, head_dim: int, window_left, num_splits,
              kv_dtype: str) -> DecodePlan:
    """:func:`plan_decode` of ``meta``'s streams on ``device``'s SMs, made once per metadata and arguments (kept
    while ``meta`` lives: :func:`auto_algo`, then :func:`attention`, and every layer's call plan it once)."""
    def make() -> DecodePlan:
        kv_max = int(meta.kv_lens_host.max()) if meta.batch_size else 0
        return plan_decode(meta.batch_size, meta.chunk_len, kv_max, num_q_heads, num_kv_heads, head_dim,
                           num_sms=device.sm_count, window_left=window_left, num_splits=num_splits,
                           q_lens=meta.counts, kv_dtype=kv_dtype)

    key = (device, "decode plan", num_q_heads, num_kv_heads, head_dim, window_left, num_splits, kv_dtype)
    try:
        return for_metadata(meta, key, make)
    except TypeError:  # an unhashable argument: plan_decode names it
        return make()


def attention(device, meta, q, k_pool, v_pool, o, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
              scale: float | None = None, window_left: int | None = None, num_splits: int | None = None,
              workspace=None, workspace_bytes: int | None = None, stream: Any = None, kv_dtype: str = "bf16",
              k_scale=None, v_scale=None) -> DecodePlan:
    """``ops.attention(..., algo="decode")``: check every argument, plan (:func:`plan_decode` from ``meta``'s streams
    and the device's SMs), launch. Returns the plan launched. ``kv_dtype="fp8_e4m3"``: the pools hold e4m3 bytes
    and ``k_scale``, ``v_scale`` (fp32 ``[Hkv]``, device memory) each KV head's scales, as the FP8 KV write took them.

    Raises
    ------
    TypeError, ValueError
        A bad argument, missing scales (FP8 pools) or scales for bf16 pools, a stream the kernel does not take or a
        missing or small workspace, before anything is enqueued.
    """
    check_launch(device, meta)
    hq, hkv = head_group("num_q_heads", num_q_heads, "num_kv_heads", num_kv_heads)
    kp, vp, ks, vs = check_kv_pools(device, kv_dtype, k_pool, v_pool, k_scale, v_scale, hkv,
                                    ALIGN["attention_fp8"])  # the arguments first
    plan = _plan_for(device, meta, hq, hkv, head_dim, window_left, num_splits, kv_dtype)
    sc = float(plan.head_dim ** -0.5 if scale is None else positive_float("scale", scale))
    bf16 = lambda name, value: device.pointer(value, name, dtype="bf16", align=16)  # noqa: E731
    ws = check_workspace(device, plan, plan.workspace_bytes_for(meta.total_tokens), workspace, workspace_bytes)
    enqueue_decode(device, meta, plan, bf16("q", q), kp, vp, bf16("o", o), ws, sc, stream, ks, vs)
    return plan


def enqueue_decode(device, meta, plan: DecodePlan, q: int, k_pool: int, v_pool: int, o: int, workspace: int,
                   scale: float, stream: Any, k_scale: int = 0, v_scale: int = 0) -> None:
    """:func:`attention` with every argument already checked (ints; ``plan`` taking ``meta``'s streams, ``workspace``
    from :func:`check_workspace`, the scales from :func:`~q12drv.kernels.args.check_kv_pools`: FP8 plans only): the split launch and, with
    splits, the merge."""
    (grid, block, smem), merge = plan.launches(meta.batch_size, meta.chunk_len)
    mc = meta_struct(meta)
    launch = registry.prepared(device, plan.entry)
    a = launch.args
    a.q, a.k_pool, a.v_pool, a.o, a.partial = q, k_pool, v_pool, o, workspace
    if plan.kv_dtype == FP8:
        a.k_scale, a.v_scale = k_scale, v_scale
    a.num_q_heads, a.num_kv_heads, a.block_size, a.scale = plan.num_q_heads, plan.num_kv_heads, meta.block_size, scale
    a.window_left, a.num_splits = plan.window_left, plan.num_splits
    a.m = mc
    launch.launch(grid, block, smem, stream)
    if merge is not None:
        ml = registry.prepared(device, plan.merge_entry)
        b = ml.args
        b.partial, b.o, b.num_q_heads, b.num_kv_heads = workspace, o, plan.num_q_heads, plan.num_kv_heads
        b.window_left, b.num_splits = plan.window_left, plan.num_splits
        b.m = mc
        ml.launch_dependent(*merge, stream)


# ---------------------------------------------------------------------------------------------------- numpy model
def _cta(qg: np.ndarray, kg: np.ndarray, vg: np.ndarray, q_len: int, kv_len: int, group: int, scale: float,
         window_left: int, tiles: Tiles, t0: int, t1: int, ks: np.ndarray, vs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One split CTA of every kv head of a stream: ``qg`` ``[Hkv, R, D]`` (R = q_len * G rows, row r = token r // G),
    ``kg``, ``vg`` ``[Hkv, n_tiles * BN, D]`` (zeros past kv_len) as float32: the pools' values as the kernels' MMAs
    read them (bf16, or the raw e4m3 values, each exactly a bf16 value); ``ks``, ``vs`` ``[Hkv]`` float32 the kv heads'
    scales (ones for bf16 pools); tiles ``t0 .. t1 - 1``. Returns the normalised O ``[Hkv, R, D]`` and the
    log-sum-exp ``[Hkv, R]`` (log2 units, -inf where a row saw no key), float32, with the kernel's steps: per key
    group the online softmax tile by tile (raw-score max, ``2^(s * sl2 - m)`` with ``sl2 = (scale * ks) * log2(e)``,
    P rounded to bf16 for P V, fp32 sums), then the groups combined in order, the row's ``1 / L`` times ``vs``."""
    f32 = np.float32
    h, rows, d = qg.shape
    bn = tiles.block_n
    _, kw, kpw = tiles.key_groups(rows)
    sl2 = ((f32(scale) * ks).astype(f32) * f32(_LOG2E)).astype(f32)[:, None, None]  # [H, 1, 1]
    bound = (kv_len - q_len) + np.arange(rows) // group  # last key each row sees
    first = bound - window_left  # and its first (int64: no overflow)
    m = np.full((h, rows, kw), -np.inf, f32)
    l = np.zeros((h, rows, kw), f32)
    acc = np.zeros((h, kw, rows, d), f32)
    with np.errstate(invalid="ignore", over="ignore"):
        for n in range(t0, t1):
            keys = n * bn + np.arange(bn)
            s = np.matmul(qg, kg[:, n * bn:(n + 1) * bn].transpose(0, 2, 1))  # [H, R, BN]
            hidden = (keys[None, :] > bound[:, None]) | (keys[None, :] < first[:, None])
            s = np.where(hidden[None], f32(-np.inf), s).reshape(h, rows, kw, kpw)
            mnew = np.maximum(m, s.max(-1) * sl2)
            muse = np.where(mnew == -np.inf, f32(0), mnew)
            alpha = np.exp2(m - muse)
            p = np.exp2(s * sl2[..., None] - muse[..., None])
            l = l * alpha + p.sum(-1, dtype=f32)
            pb = round_to_bf16(p).transpose(0, 2, 1, 3)  # [H, KW, R, KPW]
            pv = np.matmul(pb, vg[:, n * bn:(n + 1) * bn].reshape(h, kw, kpw, d))  # [H, KW, R, D]
            acc = acc * alpha.transpose(0, 2, 1)[..., None] + pv
            m = mnew
        mx = m.max(-1)
        lsum = np.zeros((h, rows), f32)
        o = np.zeros((h, rows, d), f32)
        for k in range(kw):
            a = np.where(mx == -np.inf, f32(0), np.exp2(m[..., k] - mx))
            lsum = lsum + a * l[..., k]
            o = o + a[..., None] * acc[:, k]
        inv = np.where(lsum > 0, f32(1) / np.where(lsum > 0, lsum, f32(1)), f32(0)) * vs[:, None]
        lse = np.where(lsum > 0, mx + np.log2(np.where(lsum > 0, lsum, f32(1))), f32(-np.inf))
    return (o * inv[..., None]).astype(f32), lse.astype(f32)


def _merge(parts: np.ndarray, lses: np.ndarray) -> np.ndarray:
    """The merge kernel's combination of a stream's non-empty splits (``parts`` ``[S, ..., D]``, ``lses`` ``[S, ...]``
    float32), in split order; float32 (zeros where no split saw a key)."""
    f32 = np.float32
    if not parts.shape[0]:
        return np.zeros(parts.shape[1:], f32)
    mx = lses.max(0)
    wsum = np.zeros(mx.shape, f32)
    x = np.zeros(parts.shape[1:], f32)
    with np.errstate(invalid="ignore"):
        for s in range(parts.shape[0]):
            w = np.where(mx == -np.inf, f32(0), np.exp2(lses[s] - mx))
            wsum = wsum + w
            x = x + w[..., None] * parts[s]
    inv = np.where(wsum > 0, f32(1) / np.where(wsum > 0, wsum, f32(1)), f32(0))
    return x * inv[..., None]


def _stream_parts(q_b: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, q_len: int, kv_len: int, table,
                  num_kv_heads: int, block_size: int, scale: float, head_dim: int, num_splits: int,
                  window_left: int, k_scale=None, v_scale=None) -> tuple:
    """A stream's splits: ``(ranges, parts [S, q_len, Hq, D], lses [S, q_len, Hq])`` over its non-empty splits (for
    one split, the one range). ``q_b`` uint16 ``[q_len, Hq, D]``; ``k_rows``/``v_rows`` ``[slots, Hkv, D]``, uint16
    bf16 bits, or uint8 e4m3 bytes with the kv heads' float32 scales ``k_scale``, ``v_scale`` ``[Hkv]``."""
    hq, d, hkv = q_b.shape[1], head_dim, num_kv_heads
    fp8 = k_rows.dtype == np.uint8
    values = from_e4m3_bits if fp8 else from_bf16_bits
    ks = np.asarray(k_scale, np.float32) if fp8 else np.ones(hkv, np.float32)
    vs = np.asarray(v_scale, np.float32) if fp8 else np.ones(hkv, np.float32)
    g = hq // hkv
    tiles = TILES[d]
    ranges = split_ranges(kv_len, d, num_splits, q_len, window_left)
    n_pad = max(1, -(-kv_len // tiles.block_n)) * tiles.block_n
    pos = np.arange(kv_len, dtype=np.int64)
    table = np.asarray(table, dtype=np.int64)
    slots = table[pos // block_size] * block_size + pos % block_size
    kg = np.zeros((hkv, n_pad, d), np.float32)
    vg = np.zeros((hkv, n_pad, d), np.float32)
    kg[:, :kv_len] = values(k_rows[slots]).transpose(1, 0, 2)
    vg[:, :kv_len] = values(v_rows[slots]).transpose(1, 0, 2)
    qg = from_bf16_bits(q_b).reshape(q_len, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, q_len * g, d)
    parts, lses = [np.zeros((0, q_len, hq, d), np.float32)], [np.zeros((0, q_len, hq), np.float32)]
    for t0, t1 in ranges:
        o, lse = _cta(np.ascontiguousarray(qg), kg, vg, q_len, kv_len, g, scale, window_left, tiles, t0, t1, ks, vs)
        parts.append(o.reshape(hkv, q_len, g, d).transpose(1, 0, 2, 3).reshape(1, q_len, hq, d))
        lses.append(lse.reshape(hkv, q_len, g).transpose(1, 0, 2).reshape(1, q_len, hq))
    return ranges, np.concatenate(parts), np.concatenate(lses)


def model(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, cu_seqlens, kv_lens, block_tables, num_q_heads: int,
          num_kv_heads: int, block_size: int, scale: float, num_splits: int,
          window_left: int | None = None, *, k_scale=None, v_scale=None) -> np.ndarray:
    """The decode kernels' result in numpy: every stream through :func:`_cta` per split and, with splits, the merge.

    FP8 pools (uint8): the kernels' own steps, not a dequantized copy: the raw e4m3 values (each exactly a bf16 value)
    in the MMAs, ``scale * k_scale[h]`` folded into the scores' one constant, ``v_scale[h]`` into the row's ``1 / L``.

    Parameters
    ----------
    q : numpy.ndarray
        uint16 bf16 bits ``[T, Hq, D]``.
    k_pool, v_pool : numpy.ndarray
        uint16 bf16 bits, or uint8 e4m3 bytes (FP8 pools), ``[num_blocks, block_size, Hkv, D]``.
    cu_seqlens, kv_lens, block_tables
        As :func:`q12drv.kernels.attention.reference` (every stream at most :data:`MAX_Q_LEN` rows).
    num_q_heads, num_kv_heads, block_size : int
    scale : float
    num_splits : int
    window_left : int, optional
        Sliding window (:func:`~q12drv.kernels.attention.window_argument`: None or -1 for none).
    k_scale, v_scale : array_like, optional
        float32 ``[Hkv]``: the kv heads' scales of FP8 pools (required with them, refused with bf16 ones).

    Returns
    -------
    numpy.ndarray
        uint16 bf16 bits ``[T, Hq, D]``; rows outside every stream are zero.
    """
    q = np.asarray(q)
    t_total, hq, d = q.shape
    if hq != num_q_heads or hq % num_kv_heads:
        raise ValueError(f"q has {hq} heads; num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    k_pool, v_pool = np.asarray(k_pool), np.asarray(v_pool)
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in (np.uint16, np.uint8):
        raise ValueError(f"the pools must both be uint16 (bf16 bits) or uint8 (e4m3 bytes), got {k_pool.dtype} and "
                         f"{v_pool.dtype}")
    check_kv_scales(FP8 if k_pool.dtype == np.uint8 else "bf16", k_scale, v_scale)
    k_rows = np.asarray(k_pool).reshape(-1, num_kv_heads, d)
    v_rows = np.asarray(v_pool).reshape(-1, num_kv_heads, d)
    cu = np.asarray(cu_seqlens, np.int64)
    window = window_argument(window_left)
    out = np.zeros((t_total, hq, d), np.float32)
    for b in range(len(kv_lens)):
        s0, s1, kv = int(cu[b]), int(cu[b + 1]), int(kv_lens[b])
        if s1 <= s0:
            continue
        check_rows(s1 - s0, hq, num_kv_heads)
        _, parts, lses = _stream_parts(q[s0:s1], k_rows, v_rows, s1 - s0, kv, block_tables[b], num_kv_heads,
                                       block_size, scale, d, num_splits, window, k_scale, v_scale)
        out[s0:s1] = parts[0] if num_splits == 1 else _merge(parts, lses)
    return to_bf16_bits(out)


# ---------------------------------------------------------------------------------------------------- emulators
def _read_batch(name: str, args: dict, mem, grid, need_grid, block, threads) -> tuple:
    """The launch's metadata as the kernels read it: ``(n, cu, kv_lens, q_lens)``, the grid and block checked."""
    meta = args["m"]
    n = int(meta.batch_size)
    hq, hkv = int(args["num_q_heads"]), int(args["num_kv_heads"])
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise ValueError(f"{name}: bad heads Hq={hq} Hkv={hkv}")
    splits = int(args["num_splits"])
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{name}: num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    if int(args["window_left"]) < 0:
        raise ValueError(f"{name}: window_left must be >= 0 (NO_WINDOW = 2**31 - 1 for none), got {args['window_left']}")
    if tuple(block) != (threads, 1, 1):
        raise ValueError(f"{name}: block must be ({threads}, 1, 1), got {tuple(block)}")
    if n == 0:
        return n, None, None, None
    cu = np.array(mem.array(int(meta.cu_seqlens), np.int32, (n + 1,)), dtype=np.int64)
    kv_lens = np.array(mem.array(int(meta.kv_lens), np.int32, (n,)), dtype=np.int64)
    q_lens = cu[1:] - cu[:-1]
    if (q_lens < 0).any():
        raise ValueError(f"{name}: cu_seqlens not non-decreasing: {cu.tolist()}")
    b = int(np.argmax(q_lens))
    if q_lens[b] > min(MAX_Q_LEN, MAX_ROWS // (hq // hkv)):
        raise ValueError(f"{name}: stream {b} has {int(q_lens[b])} new tokens at {hq // hkv} query heads per kv head; "
                         f"the decode kernels take at most {MAX_Q_LEN} and {MAX_ROWS} rows (ops refuses such a batch)")
    need = need_grid(n, int(q_lens.max()))
    if any(gd < nd for gd, nd in zip(grid, need)):
        raise ValueError(f"{name}: grid {tuple(grid)} does not cover {need}")
    return n, cu, kv_lens, q_lens


def _partial_views(mem, args: dict, splits: int, t_total: int, hq: int, d: int) -> tuple:
    """The workspace's ``partial_o [S, T, Hq, D]`` and ``partial_lse [S, T, Hq]`` (float32)."""
    base = int(args["partial"])
    po = mem.array(base, np.float32, (splits, t_total, hq, d))
    pl = mem.array(base + decode_partials(splits, t_total, hq, d)[0], np.float32, (splits, t_total, hq))
    return po, pl


def _emulate_split(head_dim: int, kv_dtype: str = "bf16"):
    name, tiles = entry_for_head_dim(head_dim, kv_dtype), TILES[head_dim]
    fp8 = kv_dtype == FP8
    pool_dtype = np.uint8 if fp8 else np.uint16

    def emulate(args: dict, mem, grid, block) -> None:
        hq, hkv, bs = int(args["num_q_heads"]), int(args["num_kv_heads"]), int(args["block_size"])
        splits = int(args["num_splits"])
        n, cu, kv_lens, q_lens = _read_batch(name, args, mem, grid, lambda n, c: (splits, hkv, n), block, tiles.threads)
        if not float(args["scale"]) > 0:
            raise ValueError(f"{name}: scale must be > 0, got {args['scale']}")
        if n == 0:
            return
        meta = args["m"]
        t_total, d = int(meta.total_tokens), head_dim
        ptrs = mem.array(int(meta.block_table_ptrs), np.uint64, (n,))
        q = mem.array(int(args["q"]), np.uint16, (int(cu[-1]), hq, d))
        o = mem.array(int(args["o"]), np.uint16, (int(cu[-1]), hq, d)) if splits == 1 else None
        po, pl = _partial_views(mem, args, splits, t_total, hq, d) if splits > 1 else (None, None)
        scales = ((np.array(mem.array(int(args["k_scale"]), np.float32, (hkv,))),
                   np.array(mem.array(int(args["v_scale"]), np.float32, (hkv,)))) if fp8 else (None, None))
        for b in range(n):
            ql, kv = int(q_lens[b]), int(kv_lens[b])
            if ql == 0:
                continue
            nblk = -(-kv // bs) if kv > 0 else 0
            tab = np.array(mem.array(int(ptrs[b]), np.int32, (nblk,)), dtype=np.int64) if nblk else np.zeros(0, np.int64)
            top = int(tab.max()) + 1 if nblk else 0
            pool = (top * bs, hkv, d)
            k_rows = mem.array(int(args["k_pool"]), pool_dtype, pool) if top else np.zeros(pool, pool_dtype)
            v_rows = mem.array(int(args["v_pool"]), pool_dtype, pool) if top else np.zeros(pool, pool_dtype)
            s0 = int(cu[b])
            ranges, parts, lses = _stream_parts(q[s0:s0 + ql], k_rows, v_rows, ql, kv, tab, hkv, bs,
                                                float(args["scale"]), d, splits, int(args["window_left"]), *scales)
            if splits == 1:
                o[s0:s0 + ql] = to_bf16_bits(parts[0])
            else:
                po[:len(ranges), s0:s0 + ql] = parts
                pl[:len(ranges), s0:s0 + ql] = lses

    emulate.__name__ = f"emulate_{name}"
    return emulate


def _emulate_merge(head_dim: int):
    name = MERGE_ENTRIES[head_dim]
    rows_per_cta = _merge_rows(head_dim)

    def emulate(args: dict, mem, grid, block) -> None:
        hq = int(args["num_q_heads"])
        splits = int(args["num_splits"])
        n, cu, kv_lens, q_lens = _read_batch(name, args, mem, grid,
                                             lambda n, c: (-(-c * hq // rows_per_cta), 1, n), block, MERGE_THREADS)
        if n == 0:
            return
        meta = args["m"]
        t_total, d = int(meta.total_tokens), head_dim
        po, pl = _partial_views(mem, args, splits, t_total, hq, d)
        o = mem.array(int(args["o"]), np.uint16, (int(cu[-1]), hq, d))
        for b in range(n):
            s0, s1 = int(cu[b]), int(cu[b + 1])
            if s1 <= s0:
                continue
            ns = len(split_ranges(int(kv_lens[b]), d, splits, s1 - s0, int(args["window_left"])))
            o[s0:s1] = to_bf16_bits(_merge(np.array(po[:ns, s0:s1]), np.array(pl[:ns, s0:s1])))

    emulate.__name__ = f"emulate_{name}"
    return emulate


#: Entry name -> emulator, for q12drv's emulated driver.
EMULATORS = {**{entry: _emulate_split(d) for d, entry in HEAD_DIMS.items()},
             **{entry: _emulate_split(d, FP8) for d, entry in FP8_ENTRIES.items()},
             **{entry: _emulate_merge(d) for d, entry in MERGE_ENTRIES.items()}}

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
