"""Paged varlen causal prefill attention on Hopper's warpgroup MMA (``cuda_src/attention/wgmma.cu``).

The same computation, arguments and contract as :mod:`q12drv.kernels.attention` (stream ``b``'s
rows ``cu_seqlens[b] .. cu_seqlens[b+1]``, keys through its block table, bottom-right causal within the
sliding window ``window_left``, GQA), for head dims 128 and 256, with S = Q K^T and O += P V on ``wgmma`` (compiled for sm_90a:
:func:`q12drv.core.nvrtc.target_arch`). ``ops.attention(..., algo="wgmma")`` selects it, and so does the
default ``algo="auto"`` on Hopper.

Entries (the parameters of ``q12_attn_prefill_d*``, ``ATTN_PARAMS``)::

    q12_attn_wgmma_d128 / _d256(Q12Meta m, const bf16* q, const bf16* k_pool, const bf16* v_pool,
        bf16* o, int num_q_heads, int num_kv_heads, int block_size, float scale, int window_left)

A CTA of :data:`CONSUMERS` consumer warpgroups computes ``64 * CONSUMERS`` rows, each a (token, query
head) pair of one kv head: grid ``(ceil(chunk_len * Hq / Hkv / block_m), Hkv, n)``, block
``128 * (CONSUMERS + 1)`` (one more warpgroup, the producer, does every copy). Dynamic shared memory
(:func:`smem_bytes`): the Q tile and :data:`STAGES` stages of K and V, ``(block_m + 2 * STAGES * BN) * D *
2`` bytes, plus a full and an empty mbarrier per stage and a Q one (8 bytes each) and 1 KiB to align the
swizzled tiles to 1024 bytes. :data:`TILES` is the one table of these numbers; every compile checks them
against the source's ``attn_wg_config(D)`` (:data:`CONTRACTS`).

Numerics: as the mma.sync kernel (fp32 accumulation, P rounded to bf16, ``ex2.approx.ftz``); the
two kernels agree to bf16 rounding, not bit for bit. Batched and single-stream launches of this
kernel are bit-identical (a CTA never mixes streams).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import attention as _attn
from . import registry

__all__ = ["SOURCE", "HEAD_DIMS", "ENTRIES", "CONSUMERS", "STAGES", "Tiles", "TILES", "CONTRACTS",
           "entry_for_head_dim", "smem_bytes", "geometry", "EMULATORS"]

SOURCE = "attention/wgmma.cu"
#: Head dim -> entry point.
HEAD_DIMS = {128: "q12_attn_wgmma_d128", 256: "q12_attn_wgmma_d256"}
ENTRIES = tuple(HEAD_DIMS.values())
#: Consumer warpgroups per CTA, 64 rows each (``kConsumers`` in the source).
CONSUMERS = 2
#: K/V stages (``kStages``).
STAGES = 2


@dataclass(frozen=True)
class Tiles:
    """One entry's tiles, as ``attn_wg_config(D)`` in ``attention/wgmma.cu`` has them, and the launch numbers
    that follow from them."""

    head_dim: int
    #: Keys per K/V tile.
    block_n: int
    #: CTA rows are the (token, query head) pairs of one kv head (always, in this kernel).
    gqa_pack = True

    @property
    def threads(self) -> int:
        """Threads per CTA: the consumer warpgroups and the producer."""
        return 128 * (CONSUMERS + 1)

    @property
    def block_m(self) -> int:
        """CTA rows ((token, head) pairs)."""
        return 64 * CONSUMERS

    @property
    def smem(self) -> int:
        """Dynamic shared-memory bytes: Q, the K and V stages, ``2 * STAGES + 1`` mbarriers, 1 KiB of alignment
        slack."""
        return (self.block_m + 2 * STAGES * self.block_n) * self.head_dim * 2 + 8 * (2 * STAGES + 1) + 1024


#: Head dim -> tiles: the table the launch geometry is computed from (the source checks it at compile time).
TILES = {128: Tiles(128, block_n=128), 256: Tiles(256, block_n=64)}
#: The host/device contract: the launch numbers :func:`geometry` takes from :data:`TILES` (threads, CTA rows,
#: dynamic shared memory of every entry), passed as ``-D`` to every build of ``attention/wgmma.cu`` and checked
#: there against ``attn_wg_config(D)``.
CONTRACTS = {f"Q12_ATTN_WG_D{d}_{field}": value for d, t in TILES.items()
             for field, value in (("THREADS", t.threads), ("BLOCK_M", t.block_m), ("SMEM", t.smem))}


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


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CTA (:attr:`Tiles.smem`): 164,904 bytes (D=128) and 197,672 (D=256)."""
    entry_for_head_dim(head_dim)
    return TILES[int(head_dim)].smem


def geometry(batch_size: int, chunk_len: int, num_q_heads: int, num_kv_heads: int,
             head_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """``(grid, block, dynamic_smem_bytes)`` of ``q12_attn_wgmma_d{head_dim}``: grid
    ``(ceil(chunk_len * Hq / Hkv / block_m), Hkv, n)`` (at least 1 in each dimension), block ``(threads, 1, 1)``.

    Raises
    ------
    ValueError
        An unknown head dim, a negative count, or ``num_kv_heads`` not dividing ``num_q_heads``.
    """
    entry_for_head_dim(head_dim)
    tiles = TILES[int(head_dim)]
    if batch_size < 0 or chunk_len < 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"need batch_size >= 0, chunk_len >= 0 and num_kv_heads dividing num_q_heads; got "
                         f"{batch_size}, {chunk_len}, {num_q_heads}, {num_kv_heads}")
    rows = int(chunk_len) * (int(num_q_heads) // int(num_kv_heads))
    grid = (max(1, -(-rows // tiles.block_m)), int(num_kv_heads), max(1, int(batch_size)))
    return grid, (tiles.threads, 1, 1), tiles.smem


def _emulator(head_dim: int):
    tiles, name = TILES[head_dim], HEAD_DIMS[head_dim]

    def emulate(args: dict, mem, grid, block) -> None:
        _attn.emulate_paged(name, head_dim, tiles, args, mem, grid, block)

    emulate.__name__ = f"emulate_{name}"
    return emulate


#: Entry name -> emulator, for q12drv's emulated driver.
EMULATORS = {entry: _emulator(d) for d, entry in HEAD_DIMS.items()}

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
