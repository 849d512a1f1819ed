"""Gated DeltaNet prefill, the "wgmma" pair (``ops.gdn(algo="wgmma")``): geometry, sizes, numpy model, emulators.

Two launches, like the split pair of :mod:`q12drv.kernels.gdn_chunk` (whose math, inputs, workspace and
in-place state contract it shares):

1. ``q12_gdn_chunk_prep_tiles_d*`` (``cuda_src/gdn_chunk.cu``, any sm_90 build): every chunk's
   state-independent work in parallel over (chunk, key head, stream), into one record per (chunk, value head)
   in the workspace, laid out as the sequential kernel's shared memory (128-byte swizzled tiles), with the
   block solve already applied (``T = (I + A)^-1``, rounded to bf16 once) and the rows' norms folded into its
   per-token factors.
2. ``q12_gdn_wgmma_seq{,1}_d*`` (``cuda_src/gdn_wgmma.cu``, sm_90a): one warpgroup per (stream, value head,
   64-column dv slice) walks the chunks with the state ``S^T`` as a warpgroup-MMA accumulator; per chunk
   ``V_new^T = R^T T^T`` is one product (the split pair's sequential kernel solves four dependent blocks), the
   state's products take the raw k and q rows (cp.async into swizzled tiles; the record's factors scale them),
   and the record arrives by one bulk copy.

For grids of few sequential CTAs and a long stream (:func:`uses_flow`: one stream of 8192 tokens or more)
the pair runs in its **flow form** instead: the ready flags and an item counter zeroed, then
``q12_gdn_wgmma_prep_flow_d*`` (persistent CTAs of three precompute groups on the SMs the sequential grid leaves
free, each group claiming the next item, chunk-major, from the counter) and ``q12_gdn_wgmma_seq_flow_d*``
launched with programmatic stream serialization, so that the precompute runs beside the sequential kernel; a
chunk's records, and the chunk's k and q tiles the precompute stored beside them, are copied once their item's
ready flag is set (``cuda_src/gdn_wgmma.cu``, "the flow form"). Its records are fla-core's order of the same algebra
(:func:`flow_record_bytes`): ``T diag(beta)`` and ``-W = -T diag(beta EK) k`` from the
precompute, so that the sequential kernel's chain per chunk is ``V_new^T = V^T (T
diag(beta))^T + S^T (-W)^T`` in one accumulator, its first product independent of the state (R's epilogue and
a product group fewer than the two-launch pair's chain); its results are not the two-launch pair's bits
(``chunked_reference(t_product=True, u_minus_ws="fp32")`` models them), and batched == alone holds.

``form="wide"`` (:data:`WIDE_ENTRY`, head_dim 128) runs the sequential kernel as one CTA of two warpgroups per
(stream, value head), sharing the chunk's k and q tiles and V record between the two dv slices (half the shared
memory traffic where the grid fills the device); each warpgroup's arithmetic is the two-stage kernel's.

The sequential kernels (but the flow form's) give grid row z the z-th longest stream, so that a ragged pass's
longest streams start first (``gdnw::longest_first``): the order changes no result, a CTA never mixes streams.

Numerics are the split pair's up to the solve and the raw rows: :func:`q12drv.kernels.gdn_chunk.chunked_reference`
with ``t_product=True`` models the pair (its error against the float64 reference is at or below the split pair's,
measured in numpy: output ~3.6e-3, final state
~1.2e-4 at d 128). The results are not the fused kernel's bits;
batched == alone holds bit for bit (a CTA never mixes streams).
"""

from __future__ import annotations

import numpy as np

from . import gdn as _gdn
from . import gdn_chunk as _gdnc
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "SEQ_ENTRIES",
    "THREADS",
    "STAGES",
    "HEAD_DIMS",
    "entry_name",
    "entries",
    "stage_bytes",
    "seq_smem_bytes",
    "entry_smem_bytes",
    "workspace_bytes",
    "WORKSPACE_FORMS",
    "flow_record_bytes",
    "flow_record_offsets",
    "sw128_offset",
    "sw128_unswizzle",
    "FLOW_VH_CHUNKS",
    "flow_items",
    "flow_ready_value",
    "resolve_form",
    "flags_offset",
    "flag_count",
    "kq_offset",
    "kq_bytes",
    "flags_bytes",
    "stages",
    "geometry",
    "FLOW_ENTRIES",
    "PREP_FLOW_THREADS",
    "flow_entries",
    "prep_flow_smem_bytes",
    "flow_launches",
    "FLOW_MIN_TOKENS",
    "uses_flow",
    "uses_wide",
    "flow_geometry",
    "WIDE_ENTRY",
    "WIDE_THREADS",
    "wide_entries",
    "wide_geometry",
    "EMULATORS",
]

#: Kernel source file in ``cuda_src/`` (the sequential kernels; the precompute kernels are gdn/chunked_mma.cu's).
SOURCE = "gdn/chunked_wgmma.cu"
#: Head dims ``dk = dv`` with kernels.
HEAD_DIMS = (128, 64)
#: Stages of the sequential kernel: 2 (the next chunk loads while this one computes, 1 CTA/SM) or 1 (2 CTAs/SM).
STAGES = (2, 1)
#: Sequential entries of the two-launch pair, by head dim then stages.
SEQ_ENTRIES = tuple(f"q12_gdn_wgmma_sequential_{st}stage_d{d}" for d in HEAD_DIMS for st in STAGES)
#: Threads per CTA of both kernels (one warpgroup).
THREADS = 128
#: The flow form's entries (:func:`flow_entries`), by head dim: precompute, then sequential.
FLOW_ENTRIES = tuple(f"q12_gdn_wgmma_overlapped_{k}_d{d}" for d in HEAD_DIMS for k in ("precompute", "sequential"))
#: Threads of a flow precompute CTA: three groups of 128, each working one item at a time.
PREP_FLOW_THREADS = 3 * THREADS
#: The wide form's sequential entry (``ops.gdn(..., form="wide")``, d 128 only): one CTA of two warpgroups per
#: (stream, value head), each warpgroup one 64-column dv slice, the chunk's k and q tiles and V record shared.
WIDE_ENTRY = "q12_gdn_wgmma_sequential_wide_d128"
#: Threads of a wide CTA.
WIDE_THREADS = 2 * THREADS
#: Every entry of ``gdn/chunked_wgmma.cu``: the two-launch pair's sequential kernels, the flow form's two, the wide one.
ENTRIES = SEQ_ENTRIES + FLOW_ENTRIES + (WIDE_ENTRY,)


def entry_name(head_dim: int) -> str:
    """The sequential entry (two stages) for ``dk = dv = head_dim``; raises ValueError for other head dims."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the wgmma Gated DeltaNet pair has kernels for head_dim 64 and 128, not {head_dim}")
    return f"q12_gdn_wgmma_sequential_2stage_d{head_dim}"


def entries(head_dim: int, stages: int = 2) -> tuple[str, str]:
    """``(precompute entry, sequential entry)`` for ``dk = dv = head_dim``; ``stages`` one of :data:`STAGES`."""
    entry_name(head_dim)
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    return _gdnc.tile_prep_entry(head_dim), f"q12_gdn_wgmma_sequential_{stages}stage_d{head_dim}"


_SLICE = 2 * _gdnc.CHUNK * (_gdnc.BV + 8)   # a [64][72] bf16 V or O slice


#: The flow precompute's items: one per (stream, chunk, value head) in each stream's first ``FLOW_VH_CHUNKS``
#: chunks, where the sequential kernel waits for the first records, one per (stream, chunk, key head) after them.
FLOW_VH_CHUNKS = 8


def flow_items(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int) -> int:
    """Items the flow precompute's groups claim for ``n`` streams of at most ``chunk_len`` tokens
    (:data:`FLOW_VH_CHUNKS`): ``n * num_v_heads`` a chunk in the first ``FLOW_VH_CHUNKS`` chunks, ``n * num_k_heads`` a
    chunk after them; the items past a stream's end are claimed and skipped. Its item counter ends at this plus
    one claim a group (each group claims until it gets none)."""
    chunks = -(-chunk_len // _gdnc.CHUNK)
    first = min(chunks, FLOW_VH_CHUNKS)
    return n * (first * num_v_heads + (chunks - first) * num_k_heads)


def flow_ready_value(num_k_heads: int, num_v_heads: int) -> int:
    """A flow ready flag's value once every record of its (stream, chunk, key head) is stored: each value-head item
    adds 1 and a later chunk's key-head item adds its ``num_v_heads // num_k_heads`` value heads at once."""
    return num_v_heads // num_k_heads


def flow_record_offsets(head_dim: int) -> dict:
    """Byte offsets of a flow record's fields (``gdnw::OverlapRec<dk>``, dk = dv = ``head_dim``): ``"W"`` (-W, a
    ``[64][dk]`` bf16 tile), ``"P"`` (``[64 t][64 j]`` bf16, both tiles 128-byte swizzled as the sequential
    kernel's stage holds them: row r's 16-byte piece c at ``r * 128 + ((c ^ r % 8) << 4)`` within each 64-column
    atom of 8 KiB), ``"EQ"`` and ``"WK"`` (``[64]`` fp32), ``"EGC"`` (exp(gamma_C), then 12 zero bytes), ``"TB"``
    (T diag(beta) as bf16 hi and lo ``[64 j][64 t]`` swizzled tiles) and ``"END"`` (:func:`flow_record_bytes`)."""
    entry_name(head_dim)
    c = _gdnc.CHUNK
    p = 2 * c * head_dim
    eq = p + 2 * c * c
    tb = eq + 2 * 4 * c + 16
    return {"W": 0, "P": p, "EQ": eq, "WK": eq + 4 * c, "EGC": eq + 8 * c, "TB": tb, "END": tb + 2 * 2 * c * c}


def sw128_offset(row, piece):
    """Byte offset of row ``row``'s 16-byte piece ``piece`` (8 bf16 columns) in a ``[64][cols]`` tile in the
    128-byte swizzle the kernels' tiles and records use (``gdnc::sw128_off``): 64-column atoms of 8 KiB, the piece
    at ``piece ^ (row % 8)`` of its 128-byte row. Takes ints or integer numpy arrays (broadcast)."""
    return (piece >> 3) * (_gdnc.CHUNK * 128) + row * 128 + (((piece & 7) ^ (row & 7)) << 4)


def sw128_unswizzle(raw, cols: int):
    """A swizzled ``[64][cols]`` bf16 tile's bytes (:func:`sw128_offset`; ``cols`` a multiple of 64) as a
    ``[64][cols]`` uint16 array in row-major order: for reading a record's tiles back from a workspace."""
    if cols <= 0 or cols % 64:
        raise ValueError(f"cols must be a positive multiple of 64 (whole 8 KiB atoms), got {cols}")
    words = np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.uint16)
    if words.size != _gdnc.CHUNK * cols:
        raise ValueError(f"a [64][{cols}] bf16 tile is {2 * _gdnc.CHUNK * cols} bytes, got {2 * words.size}")
    r = np.arange(_gdnc.CHUNK)[:, None]
    at = sw128_offset(r, np.arange(cols // 8)[None, :]) // 2             # [row][piece], in elements
    return words[at[:, :, None] + np.arange(8)].reshape(_gdnc.CHUNK, cols)


def _flow_record_common(head_dim: int) -> int:
    """``gdnw::OverlapRec::COMMON``: -W, P, EQ, WK, exp(gamma_C) and 12 zero bytes (:func:`flow_record_offsets`)."""
    return flow_record_offsets(head_dim)["TB"]


def flow_record_bytes(head_dim: int) -> int:
    """Bytes of one flow-form record per (stream, value head, 64-token chunk) (``gdnw::OverlapRec<dk>``, dk = dv =
    ``head_dim``): -W, P, EQ, WK, exp(gamma_C) (one bulk copy), then T diag(beta) as bf16 hi and lo tiles (a second
    bulk copy): 41,488 B at 128, 2.4x the two-launch pair's record."""
    return flow_record_offsets(head_dim)["END"]


def stage_bytes(head_dim: int, wgs: int = 1, uws: bool = False) -> int:
    """Bytes of one stage of the sequential kernel (``gdnw::Stage<dk, wgs, uws>``): the chunk's raw k and q rows
    (two ``[64][dk]`` bf16 swizzled tiles), the V record (:func:`q12drv.kernels.gdn_chunk.tile_v_record_bytes`),
    then per warpgroup (``wgs``: 2 for the wide form) a V slice and an O slice, each ``[64][72]`` bf16 (chunk c's o
    rows leave from the O slice during chunk c + 1's first products), rounded up to 1 KiB (the tiles' alignment).
    ``uws`` (the flow form): the flow record's common part, then (from the next 1 KiB) T diag(beta)'s hi and lo tiles
    and the CTA's V slice (swizzled, 8 KiB each) and its O slice."""
    return -(-_stage_raw(head_dim, wgs, uws) // 1024) * 1024


def _stage_raw(head_dim: int, wgs: int, uws: bool) -> int:
    """``gdnw::Stage::RAW``: a stage's bytes before :func:`stage_bytes` rounds them up to the next stage's 1 KiB."""
    tiles = 2 * 2 * _gdnc.CHUNK * head_dim
    if uws:
        tile = 2 * _gdnc.CHUNK * _gdnc.BV
        return -(-(tiles + _flow_record_common(head_dim)) // 1024) * 1024 + 3 * tile + _SLICE
    return tiles + _gdnc.tile_v_record_bytes() + wgs * 2 * _SLICE


#: Slack to align a kernel's 128-byte aligned dynamic shared memory (``__align__(128)``) on 1024 bytes.
_ALIGN_SLACK = 1024 - 128


def seq_smem_bytes(head_dim: int, stages: int = 2, wgs: int = 1, uws: bool = False) -> int:
    """Dynamic shared memory of the sequential kernel: ``stages - 1`` stages at their 1 KiB stride, the last one's
    own bytes, one 8-byte mbarrier a stage (padded to 16 bytes), and the slack that puts the first stage on 1024
    bytes (the flow form's kernel checks it and traps where it falls short; d 128: 185,232 B)."""
    return ((stages - 1) * stage_bytes(head_dim, wgs, uws) + _stage_raw(head_dim, wgs, uws)
            + 16 * (-(-stages // 2)) + _ALIGN_SLACK)


def entry_smem_bytes(entry: str) -> int:
    """Dynamic shared memory a launch of ``entry`` (one of :data:`ENTRIES`) asks for."""
    if entry == WIDE_ENTRY:
        return seq_smem_bytes(128, 2, 2)
    for d in HEAD_DIMS:
        for st in STAGES:
            if entries(d, st)[1] == entry:
                return seq_smem_bytes(d, st)
        prep, seq = flow_entries(d)
        if entry == prep:
            return prep_flow_smem_bytes(d)
        if entry == seq:
            return seq_smem_bytes(d, 2, uws=True)
    raise KeyError(f"{entry!r} is not a gdn/chunked_wgmma.cu entry; entries: {', '.join(ENTRIES)}")


#: What :func:`workspace_bytes` sizes for: ``"any"`` (whichever form ``form="auto"`` picks on any device: the flow
#: form's, the largest), or one form of ``ops.gdn(algo="wgmma", form=)`` (``"pair"`` and ``"wide"`` need the same).
WORKSPACE_FORMS = ("any", "pair", "flow", "wide")


def workspace_bytes(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int,
                    form: str = "any") -> int:
    """Workspace of the pair for ``n`` streams of at most ``chunk_len`` tokens.

    The two-launch and wide forms (``form="pair"`` or ``"wide"``): per stream and 64-token chunk, one tile V
    record per value head (:func:`q12drv.kernels.gdn_chunk.tile_v_record_bytes`). The flow form (``"flow"``):
    one flow record per value head (:func:`flow_record_bytes`, 2.4x larger), then its ready flags and item counter
    (:func:`flags_offset`, :func:`flags_bytes`), then per key head the chunk's k and q tiles (:func:`kq_offset`,
    :func:`kq_bytes`; 237 MB in all at 1 x 8192, Hk 16, Hv 32, d 128). ``"any"`` (default): the largest, the
    flow form's, which every form fits in. ``ops.gdn`` checks the workspace against the form it takes
    (:func:`resolve_form`), so a caller that knows it (``form="pair"``, or ``resolve_form`` with the device's SM
    count) may pass less.
    """
    if type(form) is not str or form not in WORKSPACE_FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, WORKSPACE_FORMS))}, got {form!r}")
    if form in ("pair", "wide"):
        entry_name(head_dim)
        return _gdnc.workspace_bytes(n, chunk_len, num_k_heads, num_v_heads, head_dim, tiles=True)
    return kq_offset(n, chunk_len, num_k_heads, num_v_heads, head_dim) + kq_bytes(n, chunk_len, num_k_heads, head_dim)


def flags_offset(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Byte offset of the flow form's ready flags in the workspace: right after its records
    (``gdnc::ready_flag_at<UwsRec::BYTES>``)."""
    _gdnc.workspace_bytes(n, chunk_len, num_k_heads, num_v_heads, head_dim, tiles=True)   # checks the extent
    return n * (-(-chunk_len // _gdnc.CHUNK)) * num_v_heads * flow_record_bytes(head_dim)


def flag_count(n: int, chunk_len: int, num_k_heads: int) -> int:
    """Ready flags of the flow form: one u32 per (stream, 64-token chunk, key head), at :func:`flow_ready_value` once
    the records of its value heads are stored."""
    return n * (-(-chunk_len // _gdnc.CHUNK)) * num_k_heads


def flags_bytes(n: int, chunk_len: int, num_k_heads: int) -> int:
    """Bytes the flow form zeroes before its launches: the ready flags (:func:`flag_count`), then 16 bytes for the
    u32 counter its precompute groups claim items from (``gdnc::item_counter_at``)."""
    return 4 * flag_count(n, chunk_len, num_k_heads) + 16


def kq_offset(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> int:
    """Byte offset of the flow form's k and q tiles (``gdnw::kq_at``): the first
    128-byte boundary after the flags and the item counter (:func:`flags_bytes`)."""
    end = flags_offset(n, chunk_len, num_k_heads, num_v_heads, head_dim) + flags_bytes(n, chunk_len, num_k_heads)
    return -(-end // 128) * 128


def kq_bytes(n: int, chunk_len: int, num_k_heads: int, head_dim: int) -> int:
    """Bytes of the flow form's k and q tiles: per precompute item, two ``[64][head_dim]`` bf16 tiles."""
    return n * (-(-chunk_len // _gdnc.CHUNK)) * num_k_heads * 4 * _gdnc.CHUNK * head_dim


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


def flow_entries(head_dim: int) -> tuple[str, str]:
    """``(precompute entry, sequential entry)`` of the flow form for ``dk = dv = head_dim``."""
    entry_name(head_dim)
    return f"q12_gdn_wgmma_overlapped_precompute_d{head_dim}", f"q12_gdn_wgmma_overlapped_sequential_d{head_dim}"


def prep_flow_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of a flow precompute CTA: one precompute kernel's (``gdnc::PrepSmem<dk>``) per group.
    At d 128 (189,696 B) one CTA fills an SM, so a sequential CTA never shares an SM with one."""
    return 3 * _gdnc.prep_smem_bytes(head_dim)


#: Tokens of the longest stream from which a pass of few CTAs takes the flow form (:func:`uses_flow`).
FLOW_MIN_TOKENS = 8192


def uses_flow(n: int, chunk_len: int, num_v_heads: int, head_dim: int, num_sms: int) -> bool:
    """Whether a pass takes the flow form: its ``n * Hv * dv / 64`` sequential CTAs (one per SM) leave at least
    half of the device's SMs to the precompute, and its longest stream has at least :data:`FLOW_MIN_TOKENS`
    tokens. Measured on the H200 (tests/GPU.md, run AS; Hk 16, Hv 32, d 128): 1 x 8192 0.430 ms against the
    two-launch pair's 0.444, 1 x 2048 0.134 against 0.129 (the flow form's fixed costs, the precompute's first
    round before chunk 0's flag and the cleared flags, outweigh its overlap over 32 chunks); lengths between
    were not measured. With more CTAs the precompute has too few SMs to stay ahead of the sequential kernel."""
    return chunk_len >= FLOW_MIN_TOKENS and 2 * n * num_v_heads * (head_dim // _gdnc.BV) <= num_sms


def resolve_form(form: str, n: int, chunk_len: int, num_v_heads: int, head_dim: int, num_sms: int) -> str:
    """The form a pass takes: ``form`` itself unless it is ``"auto"``, then the rules (:func:`uses_flow`, then
    :func:`uses_wide`, else ``"pair"``) on a device of ``num_sms`` SMs."""
    if form != "auto":
        return form
    return ("flow" if uses_flow(n, chunk_len, num_v_heads, head_dim, num_sms) else
            "wide" if uses_wide(n, num_v_heads, head_dim, num_sms) else "pair")


def flow_geometry(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int, num_sms: int) -> tuple:
    """``((grid, block, smem) of the flow precompute, (grid, block, smem) of the flow sequential kernel)``: the
    precompute takes the ``num_sms - n * Hv * dv / 64`` SMs the sequential CTAs leave free (at least one)."""
    entry_name(head_dim)
    prep, seq = geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim, 2)
    ctas = seq[0][0] * seq[0][1] * seq[0][2]
    return ((max(1, num_sms - ctas), 1, 1), (PREP_FLOW_THREADS, 1, 1), prep_flow_smem_bytes(head_dim)), \
        (seq[0], seq[1], seq_smem_bytes(head_dim, 2, uws=True))


def flow_launches(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int,
                  num_sms: int) -> tuple:
    """The flow form's launches, after :func:`flags_bytes` are zeroed, as ``(entry, grid, block, smem, dependent)``:
    the precompute (:func:`flow_geometry`: three groups a CTA, one CTA an SM, its groups claiming items from the
    counter), then the sequential kernel, dependent (programmatic stream serialization), on the SMs it leaves."""
    prep, seq = flow_geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim, num_sms)
    prep_e, seq_e = flow_entries(head_dim)
    return (prep_e, *prep, False), (seq_e, *seq, True)


def wide_entries(head_dim: int) -> tuple[str, str]:
    """``(precompute entry, sequential entry)`` of the wide form; it has a kernel for ``dk = dv = 128`` only (two
    64-column slices a CTA), raises ValueError for other head dims."""
    entry_name(head_dim)
    if head_dim != 128:
        raise ValueError(f"the wide form (form='wide') has a kernel for head_dim 128 only (two 64-column dv slices a "
                         f"CTA), not {head_dim}: use form='auto'")
    return _gdnc.tile_prep_entry(head_dim), WIDE_ENTRY


def uses_wide(n: int, num_v_heads: int, head_dim: int, num_sms: int) -> bool:
    """Whether a pass that does not take the flow form takes the wide form (``form="auto"``): head_dim 128 and a
    grid that fills two one-warpgroup CTAs per SM (:func:`stages` gives 1). Measured on the H200 (tests/GPU.md,
    run AU; Hk 16, Hv 32, d 128, ms, against the one-stage kernel): 8 x 2048 0.472 against 0.491, ragged 8 x
    256..2048 0.320 against 0.321, 8 x 128 0.052 against 0.052; with fewer CTAs (1 x 2048: 0.164 against the
    two-stage kernel's 0.124) half of the SMs would hold none."""
    return head_dim == 128 and stages(n, num_v_heads, head_dim, num_sms) == 1


def wide_geometry(n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> tuple:
    """``((grid, block, smem) of the precompute, (grid, block, smem) of the wide sequential kernel)``: one CTA of
    two warpgroups per (value head, stream), two stages."""
    wide_entries(head_dim)
    prep = geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim, 2)[0]
    return prep, ((head_dim // (2 * _gdnc.BV), num_v_heads, n), (WIDE_THREADS, 1, 1), seq_smem_bytes(head_dim, 2, 2))


def _emulate_wide(args: dict, mem, grid, block) -> None:
    """Emulate the wide sequential kernel: check its launch (grid (1, >= Hv, >= n), 256 threads), then the float64
    reference (as every GDN entry's emulator)."""
    if tuple(block) != (WIDE_THREADS, 1, 1) or grid[0] != 1:
        raise ValueError(f"the wide GDN kernel needs grid (1, Hv, n) and block ({WIDE_THREADS}, 1, 1), got "
                         f"{tuple(grid)}, {tuple(block)}")
    _gdnc.touch_workspace(args, mem, 128, tiles=True)
    _gdnc.emulate_chunked(args, mem, (128 // _gdnc.BV, *tuple(grid)[1:]), (THREADS, 1, 1), 128)


def _flags(args: dict, mem, head_dim: int):
    """The emulated workspace's ready flags (u32) and, per flag, whether its item has tokens."""
    n, hk, hv = _gdn.emulator_heads(args)
    m = args["m"]
    n = max(n, 1)
    chunk_len = int(m.chunk_len)
    count = flag_count(n, chunk_len, hk)
    mem.array(int(args["workspace"]), np.uint8, (workspace_bytes(n, chunk_len, hk, hv, head_dim, "flow"),))
    flags = mem.array(int(args["workspace"]) + flags_offset(n, chunk_len, hk, hv, head_dim), np.uint32, (count,))
    cu = mem.array(int(m.cu_seqlens), np.int32, (n + 1,))
    nch = -(-chunk_len // _gdnc.CHUNK)
    lens = np.diff(cu.astype(np.int64))
    live = (np.arange(nch)[None, :] * _gdnc.CHUNK < lens[:, None])  # [stream, chunk]
    return flags, np.repeat(live[:, :, None], hk, axis=2).reshape(-1)


def _emulate_prep_flow(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the flow precompute: check the launch, release the flag of every item that has tokens."""
        if tuple(block) != (PREP_FLOW_THREADS, 1, 1) or tuple(grid)[1:] != (1, 1):
            raise ValueError(f"the flow precompute needs grid (P, 1, 1) and block ({PREP_FLOW_THREADS}, 1, 1), got "
                             f"{tuple(grid)}, {tuple(block)}")
        flags, live = _flags(args, mem, head_dim)
        flags[live] = 1
    return run


def _emulate_seq_flow(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the flow sequential kernel: every flag it waits for must be set (on the GPU it would wait
        forever), then the float64 reference."""
        flags, live = _flags(args, mem, head_dim)
        unset = np.flatnonzero(live & (flags == 0))
        if unset.size:
            raise RuntimeError(f"the flow sequential kernel would wait forever: {unset.size} ready flags of items with "
                               f"tokens are 0 (first: flag {int(unset[0])}); the flow precompute must run before it")
        _gdnc.emulate_chunked(args, mem, grid, block, head_dim)
    return run


def _emulate_seq(head_dim: int):
    def run(args: dict, mem, grid, block) -> None:
        """Emulate the pair's sequential kernel: the float64 reference (as every GDN entry's emulator)."""
        _gdnc.touch_workspace(args, mem, head_dim, tiles=True)
        _gdnc.emulate_chunked(args, mem, grid, block, head_dim)
    return run


#: What the emulated driver runs instead of each entry here (the two-launch pair's precompute: gdn_chunk's).
EMULATORS = {**{entries(d, st)[1]: _emulate_seq(d) for d in HEAD_DIMS for st in STAGES},
             **{flow_entries(d)[0]: _emulate_prep_flow(d) for d in HEAD_DIMS},
             **{flow_entries(d)[1]: _emulate_seq_flow(d) for d in HEAD_DIMS},
             WIDE_ENTRY: _emulate_wide}

def contract_defines() -> tuple[str, ...]:
    """The host's numbers ``gdn/chunked_wgmma.cu`` checks at compile time."""
    return (f"Q12_GDN_CHUNK={_gdnc.CHUNK}", f"Q12_GDN_SLICE={_gdnc.BV}", f"Q12_GDN_THREADS={THREADS}",
            *(f"Q12_GDN_WGMMA_SEQUENTIAL_SMEM_{st}STAGE_D{d}={seq_smem_bytes(d, st)}" for st in (2, 1) for d in (128, 64)),
            f"Q12_GDN_WGMMA_SEQUENTIAL_SMEM_WIDE_D128={seq_smem_bytes(128, 2, 2)}",
            *(f"Q12_GDN_OVERLAP_SEQUENTIAL_SMEM_D{d}={seq_smem_bytes(d, 2, uws=True)}" for d in (128, 64)),
            *(f"Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D{d}={prep_flow_smem_bytes(d)}" for d in (128, 64)),
            *(f"Q12_GDN_OVERLAP_REC_D{d}={flow_record_bytes(d)}" for d in (128, 64)),
            f"Q12_GDN_TREC={_gdnc.tile_v_record_bytes()}", f"Q12_GDN_OVERLAP_GROUPS={PREP_FLOW_THREADS // THREADS}",
            f"Q12_GDN_OVERLAP_VH_CHUNKS={FLOW_VH_CHUNKS}", f"Q12_GDN_WIDE_WARPGROUPS={WIDE_THREADS // THREADS}")


registry.register(SOURCE, ENTRIES, EMULATORS,
                  defines={k: int(v) for k, v in (d.split("=") for d in contract_defines())})
