"""The chunked GDN kernels on mma.sync (``cuda_src/gdn/chunked_mma.cu``): the fused kernel, the mma two-pass
schedule's precompute and sequential kernels, and the wgmma two-pass schedule's precompute. Their entries, shared
memory, records, workspace, launch geometry, contract defines and emulators.

The fused kernel walks each (stream, value head, 64-column dv slice)'s chunks in one launch. The two-pass schedule
first writes every chunk's state-independent work (K K^T, Q K^T, the diagonal inverses...) into a workspace in
parallel over (chunk, key head, stream) (:func:`precompute_geometry`), then the sequential kernel walks the chunks
with only the state step on its serial path (the fused kernel's bits). The wgmma two-pass schedule's precompute
writes its own records (T = (I + A)^-1 as swizzled tiles, :func:`t_record_bytes`) for the sequential kernels of
:mod:`.chunked_wgmma`.
"""

from __future__ import annotations

from .. import registry
from . import emulate

__all__ = ["SOURCE", "HEAD_DIMS", "CHUNK", "SLICE", "THREADS", "STAGES", "ENTRIES", "fused_entry", "check_slice_grid",
           "precompute_entry", "sequential_entry", "fused_smem", "precompute_smem", "sequential_smem",
           "k_record_bytes", "v_record_bytes", "t_record_bytes", "chunks", "mma_workspace_bytes", "t_workspace_bytes",
           "fused_geometry", "precompute_geometry", "sequential_geometry", "sequential_stages", "entry_smem",
           "CONTRACTS", "EMULATORS"]

#: Kernel source file in ``cuda_src/``.
SOURCE = "gdn/chunked_mma.cu"
#: Head dims ``dk = dv`` with kernels.
HEAD_DIMS = (128, 64)
#: Tokens per chunk (``chunked_config().chunk``).
CHUNK = 64
#: dv columns per CTA (``chunked_config().slice``): grid.x = dv / SLICE.
SLICE = 64
#: Threads per CTA: one warpgroup, each warp owning 16 of the slice's dv columns.
THREADS = 128
#: Record buffers of the mma sequential kernel: 2 (the next chunk's records load while this one computes, 1 CTA/SM)
#: or 1 (2 CTAs/SM). See :func:`sequential_stages`.
STAGES = (2, 1)


def _dim(head_dim: int) -> int:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the GDN kernels have head_dim 64 and 128, not {head_dim}")
    return head_dim


def fused_entry(head_dim: int) -> str:
    """The fused kernel for ``dk = dv = head_dim`` (64 or 128)."""
    return f"q12_gdn_mma_fused_d{_dim(head_dim)}"


def precompute_entry(head_dim: int, isa: str = "mma") -> str:
    """The precompute kernel of the ``isa`` (``"mma"`` or ``"wgmma"``) two-pass schedule for ``head_dim``."""
    if isa not in ("mma", "wgmma"):
        raise ValueError(f"isa must be 'mma' or 'wgmma', got {isa!r}")
    return f"q12_gdn_{isa}_precompute_d{_dim(head_dim)}"


def sequential_entry(head_dim: int, stages: int) -> str:
    """The mma two-pass schedule's sequential kernel for ``head_dim`` with ``stages`` record buffers (:data:`STAGES`)."""
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    return f"q12_gdn_mma_sequential_{stages}stage_d{_dim(head_dim)}"


#: Every entry of ``gdn/chunked_mma.cu``.
ENTRIES = (*(fused_entry(d) for d in HEAD_DIMS), *(precompute_entry(d, isa) for isa in ("mma", "wgmma")
                                                   for d in HEAD_DIMS),
           *(sequential_entry(d, st) for st in STAGES for d in HEAD_DIMS))


def fused_smem(head_dim: int) -> int:
    """Dynamic shared memory of the fused kernel (``gdnc::Smem<dk>``): bf16 K hi, K lo and Q ``[64][dk+8]``; raw K
    ``[64][dk]``; two bf16 V/O slices ``[64][SLICE+8]``; -A and P ``[64][72]``; the diagonal inverses ``[64][24]``
    bf16; fp32 diagonal blocks ``[4][16][17]``; fp32 g and beta ``[2][64]`` each, gamma, beta, exp(gamma),
    exp(gamma_C - gamma) ``[64]`` each."""
    dk = _dim(head_dim)
    return 2 * (3 * CHUNK * (dk + 8) + CHUNK * dk + 2 * CHUNK * (SLICE + 8) + 2 * CHUNK * 72 + CHUNK * 24) + \
        4 * (4 * 16 * 17 + 8 * CHUNK)


def precompute_smem(head_dim: int) -> int:
    """Dynamic shared memory of both precompute kernels (``gdnc::PrepSmem<dk>``): K and Q ``[64][dk+8]`` bf16, raw K
    ``[64][dk]`` sharing its bytes with -A and P ``[64][72]``, the diagonal inverses ``[64][24]`` bf16, fp32 diagonal
    blocks ``[4][16][17]``, g and beta ``[2][64]``, gamma, the wgmma records' three epilogue exponents, beta,
    exp(gamma), exp(gamma_C - gamma) and the rows' scales ``[64]``: 64,000 B at d128, 3 CTAs/SM."""
    dk = _dim(head_dim)
    return 2 * (2 * CHUNK * (dk + 8) + max(CHUNK * dk, 2 * CHUNK * 72) + CHUNK * 24) + 4 * (4 * 16 * 17 + 13 * CHUNK)


def sequential_smem(head_dim: int, stages: int) -> int:
    """Dynamic shared memory of the mma sequential kernel (``gdnc::SeqSmem<dk, stages>``): per buffer one chunk's
    records with padded rows and a V/O slice ``[64][SLICE+8]``."""
    dk = _dim(head_dim)
    sequential_entry(dk, stages)
    return stages * (2 * (3 * CHUNK * (dk + 8) + 2 * CHUNK * 72 + CHUNK * 24 + CHUNK * (SLICE + 8)) + 3 * 4 * CHUNK)


def k_record_bytes(head_dim: int) -> int:
    """One (stream, key head, chunk) K record of the mma two-pass schedule (``gdnc::KRec<dk>``): normalised K hi,
    K lo and Q ``[64][dk]`` bf16, shared by the value heads of that key head."""
    return 2 * 3 * CHUNK * _dim(head_dim)


def v_record_bytes() -> int:
    """One (stream, value head, chunk) V record of the mma two-pass schedule (``gdnc::VRec``): -A and P ``[64][64]``
    bf16, the diagonal inverses ``[64][16]`` bf16, beta, exp(gamma) and exp(gamma_C - gamma) ``[64]`` fp32."""
    return 2 * (2 * CHUNK * CHUNK + CHUNK * 16) + 3 * 4 * CHUNK


def t_record_bytes() -> int:
    """One (stream, value head, chunk) record of the wgmma two-pass schedule (``gdnc::TRec``, its only record):
    T = (I + A)^-1 and P, two ``[64][64]`` bf16 swizzled tiles, then ``[64]`` fp32 beta, exp(gamma) / |k|,
    exp(gamma) dk^-1/2 / |q|, exp(gamma_C - gamma) / |k|, then exp(gamma_C) padded to 16 bytes."""
    return 2 * 2 * CHUNK * CHUNK + 4 * 4 * CHUNK + 16


def chunks(max_tokens: int) -> int:
    """64-token chunks of a stream of ``max_tokens`` tokens (the workspace's per-stream extent)."""
    return -(-max_tokens // CHUNK)


def _extent(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int) -> None:
    if n < 1 or max_tokens < 0 or num_k_heads < 1 or num_v_heads < 1:
        raise ValueError(f"need n >= 1, max_tokens >= 0, num_k_heads >= 1, num_v_heads >= 1; got {n}, {max_tokens}, "
                         f"{num_k_heads}, {num_v_heads}")


def mma_workspace_bytes(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Workspace of the mma two-pass schedule for ``n`` streams of at most ``max_tokens`` tokens: per stream and
    64-token chunk one K record per key head and one V record per value head (the K records first)."""
    _extent(n, max_tokens, num_k_heads, num_v_heads)
    return n * chunks(max_tokens) * (num_k_heads * k_record_bytes(head_dim) + num_v_heads * v_record_bytes())


def t_workspace_bytes(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int) -> int:
    """Workspace of the wgmma two-pass schedule: one T record per (stream, 64-token chunk, value head)."""
    _extent(n, max_tokens, num_k_heads, num_v_heads)
    return n * chunks(max_tokens) * num_v_heads * t_record_bytes()


def fused_geometry(n: int, num_v_heads: int, head_dim: int) -> tuple:
    """``(grid, block, smem)`` of the fused kernel: grid ``(dv / 64, Hv, n)``, :data:`THREADS` threads."""
    if n < 1 or num_v_heads < 1:
        raise ValueError(f"GDN needs n >= 1 and num_v_heads >= 1, got n={n}, num_v_heads={num_v_heads}")
    return (_dim(head_dim) // SLICE, num_v_heads, n), (THREADS, 1, 1), fused_smem(head_dim)


def precompute_geometry(n: int, max_tokens: int, num_k_heads: int, head_dim: int) -> tuple:
    """``(grid, block, smem)`` of either precompute kernel: one CTA per (64-token chunk, key head, stream)."""
    return (max(1, chunks(max_tokens)), num_k_heads, n), (THREADS, 1, 1), precompute_smem(head_dim)


def sequential_geometry(n: int, num_v_heads: int, head_dim: int, stages: int) -> tuple:
    """``(grid, block, smem)`` of the mma sequential kernel: the fused kernel's grid, its own shared memory."""
    grid, block, _ = fused_geometry(n, num_v_heads, head_dim)
    return grid, block, sequential_smem(head_dim, stages)


def sequential_stages(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> int:
    """Record buffers of the mma sequential kernel for ``n`` streams: 1 (2 CTAs/SM) once its ``n * Hv * dv / 64``
    CTAs fill two an SM, so that a co-resident CTA computes while one loads; else 2 (1 CTA/SM, the next chunk's
    records loading behind this one's state step)."""
    return 1 if n * num_v_heads * (head_dim // SLICE) >= 2 * num_sms else 2


def entry_smem(entry: str) -> int:
    """Dynamic shared memory a launch of ``entry`` (one of :data:`ENTRIES`) asks for."""
    for d in HEAD_DIMS:
        if entry == fused_entry(d):
            return fused_smem(d)
        if entry in (precompute_entry(d, "mma"), precompute_entry(d, "wgmma")):
            return precompute_smem(d)
        for st in STAGES:
            if entry == sequential_entry(d, st):
                return sequential_smem(d, st)
    raise KeyError(f"{entry!r} is not a {SOURCE} entry; its entries: {', '.join(ENTRIES)}")


def _contracts() -> dict[str, int]:
    """The host's numbers ``gdn/chunked_mma.cu`` checks at compile time."""
    return {"Q12_GDN_CHUNK": CHUNK, "Q12_GDN_SLICE": SLICE, "Q12_GDN_THREADS": THREADS,
            **{f"Q12_GDN_MMA_FUSED_SMEM_D{d}": fused_smem(d) for d in HEAD_DIMS},
            **{f"Q12_GDN_PRECOMPUTE_SMEM_D{d}": precompute_smem(d) for d in HEAD_DIMS},
            **{f"Q12_GDN_MMA_SEQUENTIAL_SMEM_{st}STAGE_D{d}": sequential_smem(d, st) for st in STAGES for d in HEAD_DIMS},
            **{f"Q12_GDN_MMA_KREC_D{d}": k_record_bytes(d) for d in HEAD_DIMS},
            "Q12_GDN_MMA_VREC": v_record_bytes(), "Q12_GDN_TREC": t_record_bytes()}


def check_slice_grid(args: dict, grid, block, head_dim: int, threads: int = THREADS, slices: int | None = None) -> None:
    """Raise unless a launch covers what a kernel of one CTA per (dv slice, value head, stream) covers: grid.x the
    kernel's ``slices`` (dv / 64 by default: it does nothing otherwise), ``threads`` threads, grid.y and grid.z
    covering Hv and n."""
    n, _hk, hv = emulate.heads(args)
    slices = head_dim // SLICE if slices is None else slices
    if grid[0] != slices:
        raise ValueError(f"this GDN kernel needs grid.x = {slices} (its dv slices), got {tuple(grid)}")
    if tuple(block) != (threads, 1, 1):
        raise ValueError(f"this GDN kernel needs block {(threads, 1, 1)}, got {tuple(block)}")
    if grid[1] < hv or grid[2] < n:
        raise ValueError(f"grid {tuple(grid)} does not cover {slices} x Hv = {hv} x n = {n} CTAs")


def _fused_emulator(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the fused kernel: its launch checked, then the float64 reference."""
        check_slice_grid(args, grid, block, head_dim)
        emulate.run_reference(args, mem, head_dim)
    return run


def _workspace(args: dict, head_dim: int, isa: str) -> int:
    n, hk, hv = emulate.heads(args)
    chunk_len = int(args["m"].chunk_len)
    return (mma_workspace_bytes(max(n, 1), chunk_len, hk, hv, head_dim) if isa == "mma"
            else t_workspace_bytes(max(n, 1), chunk_len, hk, hv))


def _precompute_emulator(head_dim: int, isa: str):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate a precompute kernel: its records are internal to its schedule, so the emulator checks the launch
        and maps the workspace it writes (the sequential emulator computes the result)."""
        n, hk, _hv = emulate.heads(args)
        want = precompute_geometry(max(n, 1), int(args["m"].chunk_len), hk, head_dim)
        if tuple(block) != want[1] or tuple(grid)[1:] != want[0][1:] or grid[0] < want[0][0]:
            raise ValueError(f"the GDN precompute kernel needs grid {want[0]} and block {want[1]}, got "
                             f"{tuple(grid)}, {tuple(block)}")
        emulate.map_workspace(args, mem, _workspace(args, head_dim, isa))
    return run


def _sequential_emulator(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the mma sequential kernel: its workspace mapped, then the fused kernel's result (the same bits
        on the GPU)."""
        emulate.map_workspace(args, mem, _workspace(args, head_dim, "mma"))
        check_slice_grid(args, grid, block, head_dim)
        emulate.run_reference(args, mem, head_dim)
    return run


#: What the emulated driver runs instead of each entry point.
EMULATORS = {**{fused_entry(d): _fused_emulator(d) for d in HEAD_DIMS},
             **{precompute_entry(d, isa): _precompute_emulator(d, isa) for d in HEAD_DIMS for isa in ("mma", "wgmma")},
             **{sequential_entry(d, st): _sequential_emulator(d) for d in HEAD_DIMS for st in STAGES}}

#: The host/device contract: the numbers above, passed as ``-D`` to every build of the source and checked there.
CONTRACTS = _contracts()

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
