"""Paged varlen causal prefill attention on Hopper's warpgroup MMA (``cuda_src/attn_wgmma.cu``).

The same computation, arguments and contract as :mod:`q12drv.kernels.attention` (stream ``b``'s
rows ``cu_seqlens[b] .. cu_seqlens[b+1]``, keys through its block table, bottom-right causal,
GQA), for head dims 128 and 256, with S = Q K^T and O += P V on ``wgmma`` (compiled for sm_90a:
:func:`q12drv.core.nvrtc.target_arch`). ``ops.attention(..., algo="wgmma")`` selects it, and so does the
default ``algo="auto"`` on Hopper.

Entries (the parameters of ``q12_attn_prefill_d*``)::

    q12_attn_wgmma_d128 / _d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool,
        bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale)

A CTA of ``WG`` warpgroups computes ``64 * WG`` rows, each a (token, query head) pair of one kv
head: grid ``(ceil(chunk_len * Hq / Hkv / (64 * WG)), Hkv, n)``, block ``128 * (WG + WS)`` (``WS`` 1:
one more warpgroup, the producer, does every copy). Dynamic shared memory (:func:`smem_bytes`): the Q
tile and ``ST`` stages of K and V (two by default), ``(64 * WG + 2 * ST * BN) * D * 2`` bytes, plus a
full and an empty mbarrier per stage and with ``WS`` a Q one (8 bytes each: 40 bytes by default) and
1 KiB to align the swizzled tiles to 1024 bytes.

Numerics: as the mma.sync kernel (fp32 accumulation, P rounded to bf16, ``ex2.approx.ftz``); the
two kernels agree to bf16 rounding, not bit for bit. Batched and single-stream launches of this
kernel are bit-identical (a CTA never mixes streams).
"""

from __future__ import annotations

from . import attention as _attn
from . import registry

__all__ = ["SOURCE", "HEAD_DIMS", "ENTRIES", "DEFAULT_CONFIG", "config", "entry_for_head_dim", "smem_bytes",
           "geometry", "EMULATORS", "SMEM_LIMIT"]

SOURCE = "attention/wgmma.cu"
#: Head dim -> entry point.
HEAD_DIMS = {128: "q12_attn_wgmma_d128", 256: "q12_attn_wgmma_d256"}
ENTRIES = tuple(HEAD_DIMS.values())
#: Head dim -> tiles, the defaults of the ``ATTN_WG_D<d>_<KNOB>`` macros in ``attention/wgmma.cu``: BN
#: keys per K/V tile, WG warpgroups per CTA, MB per-stage mbarriers (1) or a CTA barrier per tile (0),
#: SW the 128-byte swizzled operand layout (1) or the interleaved one (0), WS a producer warpgroup
#: that does every copy (1) or every thread copying and computing (0), ST K/V stages (2; 3 or 4 with
#: WS 1 where shared memory holds them).
DEFAULT_CONFIG = {128: {"BN": 128, "WG": 2, "MB": 1, "SW": 1, "WS": 1, "ST": 2},
                  256: {"BN": 64, "WG": 2, "MB": 1, "SW": 1, "WS": 1, "ST": 2}}
_KNOBS = ("BN", "WG", "MB", "SW", "WS", "ST")
#: Shared memory one CTA may take on sm_90 (227 KiB).
SMEM_LIMIT = 227 * 1024


def entry_for_head_dim(head_dim: int) -> str:
    """The wgmma entry for ``head_dim`` (128 or 256).

    Raises
    ------
    ValueError
        For any other head dim (64 has only the mma.sync kernel).
    """
    try:
        return HEAD_DIMS[int(head_dim)]
    except KeyError:
        raise ValueError(f"no wgmma attention kernel for head_dim={head_dim}; supported: {sorted(HEAD_DIMS)} "
                         f"(algo='mma' covers 64, 128 and 256)") from None


def config(head_dim: int, defines=()) -> dict:
    """The tiles of ``q12_attn_wgmma_d{head_dim}`` built with ``defines`` (``ATTN_WG_D<d>_<KNOB>``
    macros override :data:`DEFAULT_CONFIG`), plus ``threads``, ``block_m``, ``smem`` and ``GQA``
    (always 1: rows are (token, head) pairs).

    Raises
    ------
    ValueError
        Unknown head dim, or tiles the kernel's static_asserts reject.
    """
    d = int(head_dim)
    entry_for_head_dim(d)
    cfg = {**DEFAULT_CONFIG[d], **_attn.knob_overrides(defines, f"ATTN_WG_D{d}_", _KNOBS)}
    bn, wg, mb, sw, ws, st = (cfg[k] for k in _KNOBS)
    threads, block_m = 128 * (wg + ws), 64 * wg  # WS: the producer warpgroup computes no rows
    if bn not in (64, 128) or wg not in (1, 2) or mb not in (0, 1) or sw not in (0, 1):
        raise ValueError(f"D={d}: wgmma tiles need BN 64 or 128, WG 1 or 2, MB 0 or 1 and SW 0 or 1, got {cfg}")
    if ws not in (0, 1) or (ws and not mb) or st not in ((2, 3, 4) if ws else (2,)):
        raise ValueError(f"D={d}: WS is 0 or 1 (1 with MB 1), ST 2 (3 or 4 only with WS 1), got {cfg}")
    # Q, ST K and ST V stages (+ a full and an empty mbarrier per stage, with WS the Q one; + 1 KiB to
    # align the swizzled tiles to 1024 bytes)
    smem = (block_m + 2 * st * bn) * d * 2 + (8 * (2 * st + ws) if mb else 0) + (1024 if sw else 0)
    if smem > SMEM_LIMIT:
        raise ValueError(f"D={d}: tiles {cfg} need {smem} bytes of shared memory, more than the 227 KiB an SM has")
    cfg.update(threads=threads, block_m=block_m, smem=smem, GQA=1)
    return cfg


def smem_bytes(head_dim: int, defines=()) -> int:
    """Dynamic shared memory of one CTA: 164,904 bytes (D=128) and 197,672 (D=256) with the default tiles
    (Q, two K and two V stages, five mbarriers, 1 KiB to align the swizzled tiles); 230,456 at D=128
    with WS 1 and ST 3 (three stages, seven mbarriers)."""
    return config(head_dim, defines)["smem"]


def geometry(batch_size: int, chunk_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
             defines=()) -> tuple:
    """``(grid, block, dynamic_smem_bytes)`` of ``q12_attn_wgmma_d{head_dim}``: grid
    ``(ceil(chunk_len * Hq / Hkv / block_m), Hkv, n)`` (at least 1 in each dimension)."""
    cfg = config(head_dim, defines)
    if batch_size < 0 or chunk_len < 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"need batch_size >= 0, chunk_len >= 0 and num_kv_heads dividing num_q_heads; got "
                         f"{batch_size}, {chunk_len}, {num_q_heads}, {num_kv_heads}")
    rows = int(chunk_len) * (int(num_q_heads) // int(num_kv_heads))
    grid = (max(1, -(-rows // cfg["block_m"])), int(num_kv_heads), max(1, int(batch_size)))
    return grid, (cfg["threads"], 1, 1), cfg["smem"]


def _emulator(head_dim: int):
    cfg, name = config(head_dim), HEAD_DIMS[head_dim]

    def emulate(args: dict, mem, grid, block) -> None:
        _attn.emulate_paged(name, head_dim, cfg, args, mem, grid, block)

    emulate.__name__ = f"emulate_{name}"
    return emulate


#: Entry name -> emulator, for q12drv's emulated driver.
EMULATORS = {entry: _emulator(d) for d, entry in HEAD_DIMS.items()}

registry.register(SOURCE, ENTRIES, EMULATORS)
