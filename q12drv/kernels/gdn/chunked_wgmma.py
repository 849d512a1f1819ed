"""The chunked GDN kernels on warpgroup MMA (``cuda_src/gdn/chunked_wgmma.cu``, sm_90a): the wgmma two-pass
schedule's sequential kernels and the overlapped schedule's two kernels. Their entries, shared memory, records,
workspace, launch geometry, the rules that choose among them, contract defines and emulators.

The two-pass schedule: :mod:`.chunked_mma`'s wgmma precompute writes one T record per (stream, value head, chunk),
then a sequential kernel (one warpgroup per (stream, value head, 64-column dv slice), one or two stages; or the
wide CTA, two warpgroups per (stream, value head) at d128) walks the chunks with S^T as a warpgroup-MMA accumulator.
The overlapped schedule, for few sequential CTAs and a long stream (:func:`uses_overlapped`): the ready flags and an
item counter zeroed (:func:`flags_offset`, :func:`flags_bytes`), then a persistent precompute on the SMs the
sequential grid leaves free and the sequential kernel launched with programmatic stream serialization beside it,
copying a chunk's records once its flag is complete; its records are fla-core's order ``V_new = U - W S``.
"""

from __future__ import annotations

import numpy as np

from .. import registry
from . import chunked_mma as _mma
from . import emulate

__all__ = ["SOURCE", "HEAD_DIMS", "STAGES", "THREADS", "WIDE_THREADS", "OVERLAP_GROUPS", "OVERLAP_THREADS",
           "OVERLAP_VH_CHUNKS", "OVERLAP_MIN_TOKENS", "ENTRIES", "WIDE_ENTRY", "sequential_entry", "overlapped_entries",
           "stage_bytes", "sequential_smem", "overlapped_precompute_smem", "overlap_record_offsets",
           "overlap_record_bytes", "flags_offset", "flag_count", "flags_bytes", "kq_offset", "kq_bytes",
           "overlapped_workspace_bytes", "overlap_items", "overlap_ready_value", "sw128_offset", "sw128_unswizzle",
           "sequential_geometry", "wide_geometry", "overlapped_geometry", "sequential_stages", "uses_wide",
           "uses_overlapped", "entry_smem", "CONTRACTS", "EMULATORS"]

#: Kernel source file in ``cuda_src/`` (the two-pass precompute is ``gdn/chunked_mma.cu``'s).
SOURCE = "gdn/chunked_wgmma.cu"
#: Head dims ``dk = dv`` with kernels (the wide CTA: 128 only).
HEAD_DIMS = (128, 64)
#: Stages of the two-pass sequential kernel: 2 (the next chunk loads while this one computes, 1 CTA/SM) or 1
#: (2 CTAs/SM).
STAGES = (2, 1)
#: Threads of a sequential CTA (one warpgroup).
THREADS = 128
#: Threads of the wide CTA (two warpgroups, ``wgmma_config().wide_warpgroups``).
WIDE_THREADS = 2 * THREADS
#: 128-thread groups of an overlapped precompute CTA (``wgmma_config().overlap_groups``), each one item at a time.
OVERLAP_GROUPS = 3
#: Threads of an overlapped precompute CTA.
OVERLAP_THREADS = OVERLAP_GROUPS * THREADS
#: The overlapped precompute's items: one per (stream, chunk, value head) in each stream's first
#: ``OVERLAP_VH_CHUNKS`` chunks, where the sequential kernel waits for the first records, one per (stream, chunk,
#: key head) after them (``wgmma_config().value_head_chunks``).
OVERLAP_VH_CHUNKS = 8
#: Tokens of the longest stream from which a grid of few sequential CTAs takes the overlapped schedule.
OVERLAP_MIN_TOKENS = 8192

_C = _mma.CHUNK
_SLICE = 2 * _C * (_mma.SLICE + 8)    # a [64][72] bf16 V or O slice
_TILE = 2 * _C * _mma.SLICE           # a [64][64] bf16 tile
_ALIGN_SLACK = 1024 - 128             # aligning 128-byte aligned dynamic shared memory on 1024 bytes


def _dim(head_dim: int) -> int:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the GDN kernels have head_dim 64 and 128, not {head_dim}")
    return head_dim


def sequential_entry(head_dim: int, stages: int) -> str:
    """The two-pass sequential kernel (one warpgroup a CTA) for ``head_dim`` with ``stages`` (:data:`STAGES`; one
    stage at d64 only: at d128 the wide CTA, :data:`WIDE_ENTRY`, runs where one stage would)."""
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    if stages == 1 and head_dim == 128:
        raise ValueError("the one-stage wgmma sequential kernel exists at head_dim 64; at 128 the wide CTA "
                         "(WIDE_ENTRY) takes its place")
    return f"q12_gdn_wgmma_sequential_{stages}stage_d{_dim(head_dim)}"


#: The wide two-pass sequential kernel (two warpgroups a CTA, both dv slices of a value head; head_dim 128).
WIDE_ENTRY = "q12_gdn_wgmma_sequential_wide_d128"


def overlapped_entries(head_dim: int) -> tuple[str, str]:
    """``(precompute, sequential)`` entries of the overlapped schedule for ``head_dim``."""
    d = _dim(head_dim)
    return f"q12_gdn_wgmma_overlapped_precompute_d{d}", f"q12_gdn_wgmma_overlapped_sequential_d{d}"


#: Every entry of ``gdn/chunked_wgmma.cu``.
ENTRIES = (sequential_entry(128, 2), sequential_entry(64, 2), sequential_entry(64, 1), WIDE_ENTRY,
           *(e for d in HEAD_DIMS for e in overlapped_entries(d)))


def overlap_record_offsets(head_dim: int) -> dict:
    """Byte offsets of an overlapped record's fields (``gdnw::OverlapRec<dk>``): ``"W"`` (-W, a ``[64][dk]`` bf16
    tile), ``"P"`` (``[64 t][64 j]`` bf16; both tiles 128-byte swizzled as the sequential kernel's stage holds them,
    :func:`sw128_offset`), ``"EQ"`` and ``"WK"`` (``[64]`` fp32), ``"EGC"`` (exp(gamma_C), then 12 zero bytes),
    ``"TB"`` (T diag(beta) as bf16 hi and lo ``[64 j][64 t]`` swizzled tiles) and ``"END"``
    (:func:`overlap_record_bytes`)."""
    p = 2 * _C * _dim(head_dim)
    eq = p + 2 * _C * _C
    tb = eq + 2 * 4 * _C + 16
    return {"W": 0, "P": p, "EQ": eq, "WK": eq + 4 * _C, "EGC": eq + 8 * _C, "TB": tb, "END": tb + 2 * _TILE}


def overlap_record_bytes(head_dim: int) -> int:
    """One overlapped record per (stream, value head, 64-token chunk): 41,488 B at d128 (2.4x the T record)."""
    return overlap_record_offsets(head_dim)["END"]


def _stage_raw(head_dim: int, wgs: int, overlapped: bool) -> int:
    """``gdnw::Stage::RAW``: a stage's bytes before :func:`stage_bytes` rounds them up to the next stage's 1 KiB."""
    tiles = 2 * 2 * _C * _dim(head_dim)
    if overlapped:
        common = overlap_record_offsets(head_dim)["TB"]
        return -(-(tiles + common) // 1024) * 1024 + 3 * _TILE + _SLICE
    return tiles + _mma.t_record_bytes() + wgs * 2 * _SLICE


def stage_bytes(head_dim: int, wgs: int = 1, overlapped: bool = False) -> int:
    """One stage of a sequential kernel (``gdnw::Stage<dk, wgs, overlapped>``), rounded up to 1 KiB (the tiles'
    alignment): the chunk's raw k and q rows (two ``[64][dk]`` bf16 swizzled tiles), the T record, then per
    warpgroup (``wgs``: 2 for the wide CTA) a V and an O slice ``[64][72]`` bf16; ``overlapped``: the overlapped
    record's common part, then (from the next 1 KiB) T diag(beta)'s hi and lo tiles and the V slice (swizzled,
    8 KiB each) and the O slice."""
    return -(-_stage_raw(head_dim, wgs, overlapped) // 1024) * 1024


def sequential_smem(head_dim: int, stages: int, wgs: int = 1, overlapped: bool = False) -> int:
    """Dynamic shared memory of a sequential kernel: ``stages - 1`` stages at their stride, the last one's own bytes,
    one 8-byte mbarrier a stage (16 bytes a pair), and the slack that puts the first stage on 1024 bytes (the
    overlapped kernel checks it and traps where it falls short; d128: 185,232 B)."""
    return ((stages - 1) * stage_bytes(head_dim, wgs, overlapped) + _stage_raw(head_dim, wgs, overlapped)
            + 16 * (-(-stages // 2)) + _ALIGN_SLACK)


def overlapped_precompute_smem(head_dim: int) -> int:
    """Dynamic shared memory of an overlapped precompute CTA: three mma precompute CTAs' worth, in which its three
    groups' swizzled layouts fit; at d128 (192,000 B) one CTA fills an SM, so no sequential CTA shares its SM."""
    return OVERLAP_GROUPS * _mma.precompute_smem(head_dim)


def flags_offset(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Byte offset of the overlapped schedule's ready flags in its workspace: right after the records."""
    _mma.t_workspace_bytes(n, max_tokens, num_k_heads, num_v_heads)   # checks the extent
    return n * _mma.chunks(max_tokens) * num_v_heads * overlap_record_bytes(head_dim)


def flag_count(n: int, max_tokens: int, num_k_heads: int) -> int:
    """Ready flags: one u32 per (stream, 64-token chunk, key head), at :func:`overlap_ready_value` once the records of
    its value heads are stored."""
    return n * _mma.chunks(max_tokens) * num_k_heads


def flags_bytes(n: int, max_tokens: int, num_k_heads: int) -> int:
    """Bytes zeroed before the overlapped schedule's launches: the ready flags, then 16 bytes for the u32 counter its
    precompute groups claim items from."""
    return 4 * flag_count(n, max_tokens, num_k_heads) + 16


def kq_offset(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Byte offset of the k and q tiles the overlapped precompute stores (``gdnw::kq_at``): the first 128-byte
    boundary after the flags and the item counter."""
    end = flags_offset(n, max_tokens, num_k_heads, num_v_heads, head_dim) + flags_bytes(n, max_tokens, num_k_heads)
    return -(-end // 128) * 128


def kq_bytes(n: int, max_tokens: int, num_k_heads: int, head_dim: int) -> int:
    """The k and q tiles: per (stream, chunk, key head) two ``[64][head_dim]`` bf16 tiles."""
    return n * _mma.chunks(max_tokens) * num_k_heads * 4 * _C * head_dim


def overlapped_workspace_bytes(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Workspace of the overlapped schedule: one overlapped record per (stream, chunk, value head), the ready flags
    and the item counter, then the k and q tiles (237 MB at 1 x 8192, Hk 16, Hv 32, d128)."""
    return kq_offset(n, max_tokens, num_k_heads, num_v_heads, head_dim) + kq_bytes(n, max_tokens, num_k_heads,
                                                                                   head_dim)


def overlap_items(n: int, max_tokens: int, num_k_heads: int, num_v_heads: int) -> int:
    """Items the overlapped precompute's groups claim: ``n * Hv`` a chunk in the first :data:`OVERLAP_VH_CHUNKS`
    chunks, ``n * Hk`` a chunk after them (items past a stream's end are claimed and skipped). Its item counter ends
    at this plus one claim a group."""
    c = _mma.chunks(max_tokens)
    first = min(c, OVERLAP_VH_CHUNKS)
    return n * (first * num_v_heads + (c - first) * num_k_heads)


def overlap_ready_value(num_k_heads: int, num_v_heads: int) -> int:
    """A ready flag's value once every record of its (stream, chunk, key head) is stored: each value-head item adds
    1, a key-head item its ``Hv / Hk`` value heads at once."""
    return num_v_heads // num_k_heads


def sw128_offset(row, piece):
    """Byte offset of row ``row``'s 16-byte piece ``piece`` (8 bf16 columns) in a ``[64][cols]`` tile in the
    128-byte swizzle the kernels' tiles and records use (``gdnc::sw128_off``): 64-column atoms of 8 KiB, the piece
    at ``piece ^ (row % 8)`` of its 128-byte row. Takes ints or integer numpy arrays (broadcast)."""
    return (piece >> 3) * (_C * 128) + row * 128 + (((piece & 7) ^ (row & 7)) << 4)


def sw128_unswizzle(raw, cols: int):
    """A swizzled ``[64][cols]`` bf16 tile's bytes (:func:`sw128_offset`; ``cols`` a multiple of 64) as a
    ``[64][cols]`` uint16 array in row-major order: for reading a record's tiles back from a workspace."""
    if cols <= 0 or cols % 64:
        raise ValueError(f"cols must be a positive multiple of 64 (whole 8 KiB atoms), got {cols}")
    words = np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.uint16)
    if words.size != _C * cols:
        raise ValueError(f"a [64][{cols}] bf16 tile is {2 * _C * cols} bytes, got {2 * words.size}")
    r = np.arange(_C)[:, None]
    at = sw128_offset(r, np.arange(cols // 8)[None, :]) // 2             # [row][piece], in elements
    return words[at[:, :, None] + np.arange(8)].reshape(_C, cols)


def sequential_geometry(n: int, num_v_heads: int, head_dim: int, stages: int) -> tuple:
    """``(grid, block, smem)`` of a two-pass sequential kernel (one warpgroup a CTA): grid ``(dv / 64, Hv, n)``."""
    grid, block, _ = _mma.fused_geometry(n, num_v_heads, head_dim)
    return grid, block, sequential_smem(head_dim, stages)


def wide_geometry(n: int, num_v_heads: int) -> tuple:
    """``(grid, block, smem)`` of the wide sequential kernel (d128): one CTA of two warpgroups per (value head,
    stream), two stages."""
    if n < 1 or num_v_heads < 1:
        raise ValueError(f"GDN needs n >= 1 and num_v_heads >= 1, got n={n}, num_v_heads={num_v_heads}")
    return (1, num_v_heads, n), (WIDE_THREADS, 1, 1), sequential_smem(128, 2, 2)


def overlapped_geometry(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> tuple:
    """``((grid, block, smem) of the overlapped precompute, (grid, block, smem) of its sequential kernel)``: the
    precompute takes the ``num_sms - n * Hv * dv / 64`` SMs the sequential CTAs leave free (at least one)."""
    grid, block, _ = _mma.fused_geometry(n, num_v_heads, head_dim)
    ctas = grid[0] * grid[1] * grid[2]
    return (((max(1, num_sms - ctas), 1, 1), (OVERLAP_THREADS, 1, 1), overlapped_precompute_smem(head_dim)),
            (grid, block, sequential_smem(head_dim, 2, overlapped=True)))


def sequential_stages(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> int:
    """Stages of the two-pass sequential kernel: 1 (2 CTAs/SM, a co-resident CTA computes while one loads) once its
    ``n * Hv * dv / 64`` CTAs fill two an SM, else 2."""
    return 1 if n * num_v_heads * (head_dim // _mma.SLICE) >= 2 * num_sms else 2


def uses_wide(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> bool:
    """Whether the two-pass schedule takes the wide CTA: head_dim 128 and a grid that fills two one-warpgroup CTAs an
    SM (:func:`sequential_stages` gives 1); with fewer CTAs half of the SMs would hold none."""
    return head_dim == 128 and sequential_stages(n, num_v_heads, head_dim, num_sms) == 1


def uses_overlapped(n: int, max_tokens: int, num_v_heads: int, head_dim: int, num_sms: int) -> bool:
    """Whether the wgmma schedules take the overlapped one: its ``n * Hv * dv / 64`` sequential CTAs (one an SM)
    leave at least half of the SMs to the precompute, and the longest stream has at least :data:`OVERLAP_MIN_TOKENS`
    tokens (shorter, the fixed costs, the first round before chunk 0's flag and the cleared flags, outweigh the
    overlap; with more CTAs the precompute has too few SMs to stay ahead)."""
    return max_tokens >= OVERLAP_MIN_TOKENS and 2 * n * num_v_heads * (head_dim // _mma.SLICE) <= num_sms


def entry_smem(entry: str) -> int:
    """Dynamic shared memory a launch of ``entry`` (one of :data:`ENTRIES`) asks for."""
    if entry == WIDE_ENTRY:
        return sequential_smem(128, 2, 2)
    for d in HEAD_DIMS:
        for st in STAGES:
            if (d, st) != (128, 1) and entry == sequential_entry(d, st):
                return sequential_smem(d, st)
        prep, seq = overlapped_entries(d)
        if entry == prep:
            return overlapped_precompute_smem(d)
        if entry == seq:
            return sequential_smem(d, 2, overlapped=True)
    raise KeyError(f"{entry!r} is not a {SOURCE} entry; its entries: {', '.join(ENTRIES)}")


def _contracts() -> dict[str, int]:
    """The host's numbers ``gdn/chunked_wgmma.cu`` checks at compile time."""
    return {"Q12_GDN_CHUNK": _C, "Q12_GDN_SLICE": _mma.SLICE, "Q12_GDN_THREADS": THREADS,
            **{f"Q12_GDN_WGMMA_SEQUENTIAL_SMEM_2STAGE_D{d}": sequential_smem(d, 2) for d in HEAD_DIMS},
            "Q12_GDN_WGMMA_SEQUENTIAL_SMEM_1STAGE_D64": sequential_smem(64, 1),
            "Q12_GDN_WGMMA_SEQUENTIAL_SMEM_WIDE_D128": sequential_smem(128, 2, 2),
            **{f"Q12_GDN_OVERLAP_SEQUENTIAL_SMEM_D{d}": sequential_smem(d, 2, overlapped=True) for d in HEAD_DIMS},
            **{f"Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D{d}": overlapped_precompute_smem(d) for d in HEAD_DIMS},
            **{f"Q12_GDN_OVERLAP_REC_D{d}": overlap_record_bytes(d) for d in HEAD_DIMS},
            "Q12_GDN_TREC": _mma.t_record_bytes(), "Q12_GDN_OVERLAP_GROUPS": OVERLAP_GROUPS,
            "Q12_GDN_OVERLAP_VH_CHUNKS": OVERLAP_VH_CHUNKS, "Q12_GDN_WIDE_WARPGROUPS": WIDE_THREADS // THREADS}


def _t_workspace(args: dict, mem) -> None:
    n, hk, hv = emulate.heads(args)
    emulate.map_workspace(args, mem, _mma.t_workspace_bytes(max(n, 1), int(args["m"].chunk_len), hk, hv))


def _sequential_emulator(head_dim: int, wgs: int = 1):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate a two-pass sequential kernel: its launch checked and its workspace mapped, then the float64
        reference (every GDN emulator's result)."""
        _t_workspace(args, mem)
        _mma.check_slice_grid(args, grid, block, head_dim, THREADS * wgs, head_dim // (_mma.SLICE * wgs))
        emulate.run_reference(args, mem, head_dim)
    return run


def _flags(args: dict, mem, head_dim: int):
    """The emulated workspace's ready flags (u32) and, per flag, whether its unit has tokens."""
    n, hk, hv = emulate.heads(args)
    m = args["m"]
    n = max(n, 1)
    chunk_len = int(m.chunk_len)
    emulate.map_workspace(args, mem, overlapped_workspace_bytes(n, chunk_len, hk, hv, head_dim))
    flags = mem.array(int(args["workspace"]) + flags_offset(n, chunk_len, hk, hv, head_dim), np.uint32,
                      (flag_count(n, chunk_len, hk),))
    lens = np.diff(mem.array(int(m.cu_seqlens), np.int32, (n + 1,)).astype(np.int64))
    live = np.arange(_mma.chunks(chunk_len))[None, :] * _C < lens[:, None]   # [stream, chunk]
    return flags, np.repeat(live[:, :, None], hk, axis=2).reshape(-1), hv // hk


def _overlapped_precompute_emulator(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the overlapped precompute: check the launch, complete the flag of every unit with tokens."""
        if tuple(block) != (OVERLAP_THREADS, 1, 1) or tuple(grid)[1:] != (1, 1):
            raise ValueError(f"the overlapped precompute needs grid (P, 1, 1) and block ({OVERLAP_THREADS}, 1, 1), "
                             f"got {tuple(grid)}, {tuple(block)}")
        flags, live, ready = _flags(args, mem, head_dim)
        flags[live] = ready
    return run


def _overlapped_sequential_emulator(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the overlapped sequential kernel: every flag it waits for must be complete (on the GPU it would
        wait forever), then the float64 reference."""
        flags, live, ready = _flags(args, mem, head_dim)
        unset = np.flatnonzero(live & (flags < ready))
        if unset.size:
            raise RuntimeError(f"the overlapped sequential kernel would wait forever: {unset.size} ready flags of "
                               f"units with tokens are incomplete (first: flag {int(unset[0])}); the overlapped "
                               f"precompute must run first, on flags zeroed before it")
        _mma.check_slice_grid(args, grid, block, head_dim)
        emulate.run_reference(args, mem, head_dim)
    return run


#: What the emulated driver runs instead of each entry point (the two-pass precompute: :mod:`.chunked_mma`'s).
EMULATORS = {**{e: _sequential_emulator(int(e.rsplit("_d", 1)[1])) for e in ENTRIES if "_sequential_" in e
                and e != WIDE_ENTRY and "overlapped" not in e},
             WIDE_ENTRY: _sequential_emulator(128, 2),
             **{overlapped_entries(d)[0]: _overlapped_precompute_emulator(d) for d in HEAD_DIMS},
             **{overlapped_entries(d)[1]: _overlapped_sequential_emulator(d) for d in HEAD_DIMS}}

#: The host/device contract: the numbers above, passed as ``-D`` to every build of the source and checked there.
CONTRACTS = _contracts()

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
