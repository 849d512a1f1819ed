"""Gated DeltaNet prefill, the "wgmma" pair (``ops.gdn(algo="wgmma")``): geometry, sizes, numpy model, emulators.

Two launches, like the split pair of :mod:`q12drv.kernels.gdn_chunk` (whose math, inputs, workspace and
in-place state contract it shares):

1. ``q12_gdn_chunk_prep_tiles_d*`` (``cuda_src/gdn_chunk.cu``, any sm_90 build): every chunk's
   state-independent work in parallel over (chunk, key head, stream), into the workspace, with the records
   laid out as the sequential kernel's shared memory (128-byte swizzled tiles) and the block solve already
   applied: ``T = (I + A)^-1`` per (chunk, value head), rounded to bf16 once.
2. ``q12_gdn_wgmma_seq{,1}_d*`` (``cuda_src/gdn_wgmma.cu``, sm_90a): one warpgroup per (stream, value head,
   64-column dv slice) walks the chunks with the state ``S^T`` as a warpgroup-MMA accumulator; per chunk
   ``V_new^T = R^T T^T`` is one product (the split pair's sequential kernel solves four dependent blocks), and
   each chunk's two records arrive by one bulk copy each.

Numerics are the split pair's up to the solve: :func:`q12drv.kernels.gdn_chunk.chunked_reference` with
``t_product=True`` models the pair (its error against the float64 reference is the split pair's, measured in
numpy: output ~3.5e-3, final state ~2.4e-4). The results are not the fused kernel's bits; batched == alone
holds bit for bit (a CTA never mixes streams).
"""

from __future__ import annotations

from . import gdn_chunk as _gdnc

__all__ = [
    "SOURCE",
    "ENTRIES",
    "THREADS",
    "STAGES",
    "HEAD_DIMS",
    "entry_name",
    "entries",
    "stage_bytes",
    "seq_smem_bytes",
    "entry_smem_bytes",
    "workspace_bytes",
    "stages",
    "geometry",
    "EMULATORS",
]

#: Kernel source file in ``cuda_src/`` (the sequential kernels; the precompute kernels are gdn_chunk.cu's).
SOURCE = "gdn_wgmma.cu"
#: Head dims ``dk = dv`` with kernels.
HEAD_DIMS = (128, 64)
#: Stages of the sequential kernel: 2 (the next chunk loads while this one computes, 1 CTA/SM) or 1 (2 CTAs/SM).
STAGES = (2, 1)
#: Sequential entries, by head dim then stages.
ENTRIES = tuple(f"q12_gdn_wgmma_seq{'' if st == 2 else st}_d{d}" for d in HEAD_DIMS for st in STAGES)
#: Threads per CTA of both kernels (one warpgroup).
THREADS = 128


def entry_name(head_dim: int) -> str:
    """The sequential entry (two stages) for ``dk = dv = head_dim``; raises ValueError for other head dims."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the wgmma Gated DeltaNet pair has kernels for head_dim 64 and 128, not {head_dim}")
    return f"q12_gdn_wgmma_seq_d{head_dim}"


def entries(head_dim: int, stages: int = 2) -> tuple[str, str]:
    """``(precompute entry, sequential entry)`` for ``dk = dv = head_dim``; ``stages`` one of :data:`STAGES`."""
    entry_name(head_dim)
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    return _gdnc.tile_prep_entry(head_dim), f"q12_gdn_wgmma_seq{'' if stages == 2 else stages}_d{head_dim}"


def stage_bytes(head_dim: int) -> int:
    """Bytes of one stage of the sequential kernel (``gdnw::Stage<dk>``): the K record (three ``[64][dk]``
    tiles), the V record (:func:`q12drv.kernels.gdn_chunk.tile_v_record_bytes`), then the V slice and the O
    slice, each ``[64][72]`` bf16 (chunk c's o rows leave from the O slice during chunk c + 1's first products),
    rounded up to 1 KiB (the tiles' alignment)."""
    raw = _gdnc.k_record_bytes(head_dim) + _gdnc.tile_v_record_bytes() + 2 * 2 * _gdnc.CHUNK * (_gdnc.BV + 8)
    return -(-raw // 1024) * 1024


def seq_smem_bytes(head_dim: int, stages: int = 2) -> int:
    """Dynamic shared memory of the sequential kernel: ``stages`` stages, one 8-byte mbarrier each (padded to 16
    bytes), and 1 KiB of slack to align the first stage on 1024 bytes."""
    return stages * stage_bytes(head_dim) + 16 * (-(-stages // 2)) + 1024


def entry_smem_bytes(entry: str) -> int:
    """Dynamic shared memory a launch of ``entry`` (one of :data:`ENTRIES`) asks for."""
    for d in HEAD_DIMS:
        for st in STAGES:
            if entries(d, st)[1] == entry:
                return seq_smem_bytes(d, st)
    raise KeyError(f"{entry!r} is not a gdn_wgmma.cu entry; entries: {', '.join(ENTRIES)}")


def workspace_bytes(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Workspace of the pair for ``n`` streams of at most ``chunk_len`` tokens: per stream and 64-token chunk,
    one K record per key head and one tile V record per value head."""
    entry_name(head_dim)
    return _gdnc.workspace_bytes(n, chunk_len, num_k_heads, num_v_heads, head_dim, tiles=True)


def stages(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> int:
    """Stages of the sequential kernel for a pass: 1 (2 CTAs/SM, a co-resident CTA computes while one
    loads) once its ``n * Hv * dv / 64`` CTAs fill two per SM, else 2."""
    return 1 if n * num_v_heads * (head_dim // _gdnc.BV) >= 2 * num_sms else 2


def geometry(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int, stages: int = 2) -> tuple:
    """``((grid, block, smem) of the precompute kernel, (grid, block, smem) of the sequential one)``: one
    precompute CTA per (chunk, key head, stream), one sequential CTA per (dv / 64, value head, stream)."""
    entries(head_dim, stages)
    prep, seq = _gdnc.split_geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim)
    return prep, (seq[0], seq[1], seq_smem_bytes(head_dim, stages))


def _emulate_seq(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the pair's sequential kernel: the float64 reference (as every GDN entry's emulator)."""
        _gdnc.touch_workspace(args, mem, head_dim, tiles=True)
        _gdnc.emulate_chunked(args, mem, grid, block, head_dim)
    return run


#: What the emulated driver runs instead of each sequential entry (the precompute entries: gdn_chunk's).
EMULATORS = {entries(d, st)[1]: _emulate_seq(d) for d in HEAD_DIMS for st in STAGES}
