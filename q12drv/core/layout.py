"""The sizing single source of truth: the seed's functions, the stacked-field layout, the scratch plan.

Every byte offset q12drv uses is computed here and nowhere else. The functions are pure
arithmetic over ints; nothing here touches memory or a driver.

Layout of one Q12 pass in the scratch arena (offsets from the arena base)::

    [0, A)            MoE top-k staging            A = a64(T * top_k * 8)
    [A, B)            n per-stream blocks          block b = stream b's single-stream metadata
    [B, B + staged)   stacked BatchedAttnMetadata  staged_bytes (fields below, each padded to 8)
    [B + staged, +8n) h_state_ptrs JIT slot        n u64, rewritten before every SSM layer

Stacked fields, in order: positions ``u32[T]`` (then H and W ``u32[T]`` under MRoPE), slots
``i64[T]``, block_table_ptrs ``u64[n]``, seq_len_ptrs ``u64[n]``, cu_seqlens ``i32[n+1]``,
kv_lens ``i32[n]``; ``staged_bytes = S*a8(4T) + 8T + 16n + a8(4n+4) + a8(4n)``, S = 3 under MRoPE.

A per-stream block holds the same layout for n = 1 (the stream alone): what the per-stream
fallback's kernels read. Policy ``"seed"`` gives every block the seed's stride
``max(16*max_len + 64, 4096)`` (so plan totals equal :func:`q12_batched_scratch_bytes_varlen`
exactly); policy ``"exact"`` gives block b ``a64(payload_b)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from .ints import checked_bool, checked_int

__all__ = [
    "Q12_SIZING_STREAMS",
    "POLICIES",
    "a8",
    "a64",
    "align_up",
    "RING_SLOT_ALIGN",
    "ring_slots",
    "q12_batched_scratch_bytes",
    "q12_batched_scratch_bytes_varlen",
    "moe_bytes",
    "seed_stream_block_stride",
    "staged_bytes",
    "FieldSpec",
    "StackedLayout",
    "stacked_layout",
    "single_stream_payload",
    "H_STATE_ENTRY_BYTES",
    "state_tables_bytes",
    "scratch_bytes_bound",
    "h_state_slot_bytes",
    "h_state_slot_offset",
    "h_state_entry_offset",
    "row_offset",
    "rows_extent",
    "decode_partials",
    "Region",
    "ScratchPlan",
    "make_scratch_plan",
]

#: Streams the scratch buffer is provisioned for (seed). Not an admission cap.
Q12_SIZING_STREAMS = 8
#: Per-stream block sizing policies.
POLICIES = ("seed", "exact")

_U32_MAX = (1 << 32) - 1
_I32_MAX = (1 << 31) - 1


def a8(x: int) -> int:
    """Round up to a multiple of 8."""
    return (x + 7) & ~7


def a64(x: int) -> int:
    """Round up to a multiple of 64."""
    return (x + 63) & ~63


def align_up(x: int, align: int) -> int:
    """Round ``x`` up to a multiple of ``align`` (a power of two): where a region aligned as an address starts."""
    return (x + align - 1) & -align


#: Alignment of each slot of a pinned ring carved from the caller's memory.
RING_SLOT_ALIGN = 64


def ring_slots(addr: int, nbytes: int, nslots: int) -> tuple:
    """``(offsets, slot_bytes)``: ``nslots`` equal, :data:`RING_SLOT_ALIGN`-aligned slots carved from ``nbytes`` of
    memory at address ``addr``, each slot's offset from ``addr`` (``slot_bytes`` 0: they do not fit, and
    ``nslots * RING_SLOT_ALIGN + offsets[0]`` bytes would)."""
    first = -addr % RING_SLOT_ALIGN
    slot_bytes = (nbytes - first) // nslots // RING_SLOT_ALIGN * RING_SLOT_ALIGN if nbytes > first else 0
    return tuple(first + i * slot_bytes for i in range(nslots)), slot_bytes


_flag = checked_bool


# --- the seed's functions ---------------------------------------------------------------

def moe_bytes(total_tokens: int, top_k: int) -> int:
    """MoE top-k staging: expert ids (i32) and weights (f32) per token x top_k, 64-aligned."""
    return a64(total_tokens * top_k * 4 * 2)


def seed_stream_block_stride(max_chunk_len: int) -> int:
    """The seed's per-stream metadata block: ``max(16 * max_chunk_len + 64, 4096)``."""
    return max(max_chunk_len * 16 + 64, 4096)


def staged_bytes(n: int, total_tokens: int, mrope: bool) -> int:
    """Bytes of the stacked metadata: ``S*a8(4T) + a8(8T) + 2*a8(8n) + a8(4(n+1)) + a8(4n)``.

    Raises
    ------
    TypeError, ValueError
        ``n < 1`` (a pass stages at least one stream), a negative ``total_tokens``, a non-bool ``mrope``.
    """
    if not (type(n) is int and type(total_tokens) is int and type(mrope) is bool and n >= 1 and total_tokens >= 0):
        n, total_tokens = checked_int("n", n, 1), checked_int("total_tokens", total_tokens)
        mrope = _flag("mrope", mrope)
    s = 3 if mrope else 1
    t = total_tokens
    return s * a8(4 * t) + a8(8 * t) + 2 * a8(8 * n) + a8(4 * (n + 1)) + a8(4 * n)


def q12_batched_scratch_bytes_varlen(n: int, total_tokens: int, max_chunk_len: int, top_k: int, mrope: bool) -> int:
    """Exact scratch footprint of a ragged Q12 batch (the seed's ``q12_batched_scratch_bytes_varlen``).

    Parameters
    ----------
    n : int
        Streams in the batch (>= 1: a batch of no streams has no footprint to size).
    total_tokens : int
        Packed token count, Σ per-stream counts (``cu_seqlens[n]``).
    max_chunk_len : int
        Longest per-stream count; sizes every per-stream metadata block.
    top_k : int
        Experts per token (MoE top-k staging).
    mrope : bool
        Whether positions are staged as three streams (T, H, W).

    Returns
    -------
    int
        ``moe + n * per_stream_meta + stage_meta + 8n`` bytes.

    Examples
    --------
    >>> q12_batched_scratch_bytes_varlen(4, 3740, 935, 8, True)
    374392
    """
    n = checked_int("n", n, 1)
    t = checked_int("total_tokens", total_tokens)
    m = checked_int("max_chunk_len", max_chunk_len)
    k = checked_int("top_k", top_k)
    mrope = _flag("mrope", mrope)
    return moe_bytes(t, k) + n * seed_stream_block_stride(m) + staged_bytes(n, t, mrope) + 8 * n


def q12_batched_scratch_bytes(n: int, chunk_len: int, top_k: int, mrope: bool) -> int:
    """Exact scratch footprint of ``n`` streams of ``chunk_len`` tokens each (the seed's uniform form).

    Examples
    --------
    >>> q12_batched_scratch_bytes(4, 935, 8, True)
    374392
    """
    n = checked_int("n", n, 1)
    chunk_len = checked_int("chunk_len", chunk_len)
    return q12_batched_scratch_bytes_varlen(n, n * chunk_len, chunk_len, top_k, mrope)


# --- stacked fields ----------------------------------------------------------------------

@dataclass(frozen=True)
class FieldSpec:
    """One field of a metadata layout.

    Attributes
    ----------
    name : str
        The field's name as in ``BatchedAttnMetadata`` (``positions_stacked``...).
    dtype : str
        numpy dtype string (``"<u4"``, ``"<i8"``, ``"<u8"``, ``"<i4"``).
    count : int
        Elements.
    offset : int
        Byte offset from the start of the layout.
    nbytes : int
        Payload bytes (``count * itemsize``).
    padded : int
        Bytes the field occupies including its zero pad to 8.
    """

    name: str
    dtype: str
    count: int
    offset: int
    nbytes: int
    padded: int

    @property
    def end(self) -> int:
        return self.offset + self.padded

    def element_offset(self, i):
        """Byte offset of element ``i``: an int for an index, an int64 array for an array of indices."""
        size = np.dtype(self.dtype).itemsize
        if isinstance(i, np.ndarray):
            return self.offset + i.astype(np.int64) * size
        return self.offset + int(i) * size


@dataclass(frozen=True)
class StackedLayout:
    """Field offsets of one stacked metadata block (relative to its start)."""

    n: int
    total_tokens: int
    mrope: bool
    fields: tuple
    staged_bytes: int

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no metadata field {name!r}; fields: {', '.join(f.name for f in self.fields)}")

    @cached_property
    def tail_offset(self) -> int:
        """Offset of ``block_table_ptrs``: the per-stream fields run from here to ``staged_bytes`` (what the
        device-side expansion copies; the per-token fields before it are written on the device)."""
        return self.field("block_table_ptrs").offset

    def shifted(self, base: int) -> tuple:
        """The fields with offsets moved by ``base`` (e.g. to arena offsets)."""
        return tuple(FieldSpec(f.name, f.dtype, f.count, f.offset + base, f.nbytes, f.padded) for f in self.fields)


def stacked_layout(n: int, total_tokens: int, mrope: bool) -> StackedLayout:
    """The stacked metadata layout for ``n`` streams and ``total_tokens`` packed tokens.

    Layouts are immutable and memoised: the same arguments return the same object.

    Raises
    ------
    ValueError
        n < 1, or counts that overflow the on-device types (T and n+1 entries of i32 prefix sums).
    """
    if type(n) is int and type(total_tokens) is int and type(mrope) is bool:  # the common case: no conversion
        hit = _LAYOUTS.get((n, total_tokens, mrope))
        if hit is not None:
            return hit
    n = checked_int("n", n, 1)
    t = checked_int("total_tokens", total_tokens)
    mrope = _flag("mrope", mrope)
    if t > _I32_MAX:
        raise ValueError(f"total_tokens {t} overflows the i32 cu_seqlens prefix sum (max {_I32_MAX})")
    key = (n, t, mrope)
    hit = _LAYOUTS.get(key)
    if hit is None:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = _build_stacked_layout(n, t, mrope)
    return hit


_LAYOUTS: dict = {}
_LAYOUTS_MAX = 1024


def _build_stacked_layout(n: int, t: int, mrope: bool) -> StackedLayout:
    spec = [("positions_stacked", "<u4", t)]
    if mrope:
        spec += [("positions_h_stacked", "<u4", t), ("positions_w_stacked", "<u4", t)]
    spec += [
        ("slot_stacked", "<i8", t),
        ("block_table_ptrs", "<u8", n),
        ("seq_len_ptrs", "<u8", n),
        ("cu_seqlens", "<i4", n + 1),
        ("kv_lens", "<i4", n),
    ]
    fields, off = [], 0
    for name, dtype, count in spec:
        nbytes = count * np.dtype(dtype).itemsize
        fields.append(FieldSpec(name, dtype, count, off, nbytes, a8(nbytes)))
        off += a8(nbytes)
    assert off == staged_bytes(n, t, mrope)
    return StackedLayout(n, t, mrope, tuple(fields), off)


def single_stream_payload(count: int, mrope: bool) -> int:
    """Bytes of one stream's own metadata (the n = 1 stacked layout): ``S*a8(4L) + 8L + 32``."""
    return staged_bytes(1, checked_int("count", count), _flag("mrope", mrope))


# --- the h_state_ptrs slot -------------------------------------------------------------------

#: Bytes of one ``h_state_ptrs`` entry: a stream's u64 state pointer.
H_STATE_ENTRY_BYTES = 8


def h_state_slot_bytes(n: int) -> int:
    """Bytes of an ``h_state_ptrs`` slot for ``n`` streams."""
    return H_STATE_ENTRY_BYTES * n


def h_state_entry_offset(b: int) -> int:
    """Byte offset of stream ``b``'s entry from the slot's start."""
    return H_STATE_ENTRY_BYTES * b


def state_tables_bytes(n: int, rows: int) -> int:
    """Bytes of ``rows`` state-pointer tables of ``n`` streams staged at once (``Q12Pass.stage_states``): each an
    ``h_state_ptrs`` slot's size, back to back at the cursor after the pass's own slot."""
    return h_state_slot_bytes(n) * rows


def h_state_slot_offset(scratch_offset_bytes: int, staged: int) -> int:
    """Where a staged pass's ``h_state_ptrs`` slot goes: right after its stacked metadata (``staged`` bytes at
    ``scratch_offset_bytes``), the seed's ``staged_bytes`` rule."""
    return scratch_offset_bytes + staged


# --- packed token tensors ---------------------------------------------------------------------

def row_offset(row: int, row_elems: int, itemsize: int) -> int:
    """Byte offset of packed token ``row`` of a ``[T, ...]`` tensor with ``row_elems`` elements of ``itemsize``
    bytes per token: where stream b's rows start (``row = cu_seqlens[b]``) for a launch over that stream alone."""
    return row * row_elems * itemsize


def rows_extent(rows: int, columns: int, stride: int, itemsize: int) -> int:
    """Bytes from the start of the first of ``rows`` rows ``stride`` elements apart to the end of the last one's
    ``columns`` elements (0 for no rows): the span a strided ``[rows, >= columns]`` operand covers."""
    return row_offset(rows - 1, stride, itemsize) + columns * itemsize if rows else 0


def decode_partials(num_splits: int, total_tokens: int, num_q_heads: int, head_dim: int) -> tuple[int, int]:
    """``(lse_offset, nbytes)`` of the split-KV decode workspace (``attention/decode.cu``): ``partial_o [S, T, Hq, D]``
    fp32 at 0, then ``partial_lse [S, T, Hq]`` fp32 at ``lse_offset``; ``nbytes`` in all."""
    rows = num_splits * total_tokens * num_q_heads
    return rows * head_dim * 4, rows * (head_dim + 1) * 4


# --- the scratch plan ---------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    """A named byte range of the arena.

    Attributes
    ----------
    name : str
    offset : int
        From the arena base.
    nbytes : int
    kind : str
        ``"moe"``, ``"stream_block"``, ``"stacked"`` or ``"jit_slot"``.
    stream : int or None
        For per-stream blocks, the stream index.
    """

    name: str
    offset: int
    nbytes: int
    kind: str
    stream: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ScratchPlan:
    """The region map of one Q12 pass: every region's and field's offset, from the counts alone.

    Build with :func:`make_scratch_plan`.
    """

    policy: str
    counts: tuple
    top_k: int
    mrope: bool
    moe: Region
    stream_blocks: tuple
    stacked: Region
    jit_slot: Region
    stacked_layout: StackedLayout

    @property
    def n(self) -> int:
        return len(self.counts)

    @property
    def total_tokens(self) -> int:
        return sum(self.counts)

    @property
    def max_chunk_len(self) -> int:
        return max(self.counts)

    @property
    def staged_bytes(self) -> int:
        return self.stacked_layout.staged_bytes

    @property
    def total_bytes(self) -> int:
        """End of the JIT slot: the scratch bytes this pass needs."""
        return self.jit_slot.end

    @property
    def regions(self) -> tuple:
        return (self.moe, *self.stream_blocks, self.stacked, self.jit_slot)

    @property
    def per_stream_jit_slot(self) -> Region:
        """The ``h_state_ptrs`` slot of this plan run stream by stream: right after the last per-stream block (the
        stacked block is not staged); its end is the scratch the per-stream fallback needs."""
        return Region("h_state_ptrs", self.stacked.offset, h_state_slot_bytes(self.n), "jit_slot")

    @property
    def fields(self) -> tuple:
        """The stacked fields at arena offsets."""
        return self.stacked_layout.shifted(self.stacked.offset)

    def stream_layout(self, b: int) -> StackedLayout:
        """Stream ``b``'s single-stream (n = 1) layout, relative to its block."""
        if not 0 <= b < self.n:
            raise IndexError(f"stream {b} out of range for a plan of {self.n} streams")
        return stacked_layout(1, self.counts[b], self.mrope)

    def stream_block_fits(self, b: int) -> bool:
        return self.stream_layout(b).staged_bytes <= self.stream_blocks[b].nbytes

    def first_unfit_stream(self) -> int | None:
        """The first stream whose own metadata does not fit its block (seed stride under MRoPE), or None."""
        return self._first_unfit[0]

    @cached_property
    def _first_unfit(self) -> tuple:
        # computed once per plan (plans are immutable; cached_property writes the instance dict directly)
        for b in range(self.n):
            if not self.stream_block_fits(b):
                return (b,)
        return (None,)

    def describe(self) -> str:
        """The region map as a text table."""
        lines = [f"{'region':<28}{'offset':>12}{'bytes':>12}{'end':>12}"]
        for r in self.regions:
            lines.append(f"{r.name:<28}{r.offset:>12,}{r.nbytes:>12,}{r.end:>12,}")
        lines.append(f"{'total':<28}{'':>12}{self.total_bytes:>12,}")
        return "\n".join(lines)


def scratch_bytes_bound(max_streams: int, max_total_tokens: int, top_k: int, mrope: bool, policy: str = "exact",
                        max_chunk_len: int | None = None) -> int:
    """Arena bytes that every batch of at most ``max_streams`` streams and ``max_total_tokens`` tokens (each stream
    at most ``max_chunk_len``, default ``max_total_tokens``) fits: ``make_scratch_plan(counts, ...).total_bytes`` of
    any such ``counts`` is at most this, so an arena of this size never refuses one of them for lack of space.

    Every region grows with the streams and the tokens but the ``"exact"`` per-stream blocks, which are rounded up
    to 64 bytes each: a batch of 1 + 5 + 3 tokens needs more than one of 1 + 1 + 7. They are bounded here by their
    payloads for all the tokens at once plus each block's largest rounding.
    """
    n = checked_int("max_streams", max_streams, 1)
    t = checked_int("max_total_tokens", max_total_tokens)
    m = t if max_chunk_len is None else checked_int("max_chunk_len", max_chunk_len)
    k = checked_int("top_k", top_k)
    mrope = _flag("mrope", mrope)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "seed":
        return q12_batched_scratch_bytes_varlen(n, t, min(m, t), k, mrope)
    s = 3 if mrope else 1
    # a stream of c tokens: a64(S*a8(4c) + 8c + 32) <= S*4c + 8c + (4S + 32 + 63); summed over at most n streams
    blocks = (4 * s + 8) * t + n * (4 * s + 32 + 63)
    return moe_bytes(t, k) + blocks + staged_bytes(n, t, mrope) + h_state_slot_bytes(n)


def make_scratch_plan(counts: Sequence[int], top_k: int, mrope: bool, policy: str = "seed") -> ScratchPlan:
    """Plan the arena for a batch with per-stream token counts ``counts``.

    Parameters
    ----------
    counts : sequence of int
        Tokens each stream processes in this pass (``proc_count`` / effective length), each >= 1.
    top_k : int
        MoE experts per token.
    mrope : bool
        Stage H and W positions too.
    policy : {"seed", "exact"}
        Per-stream block sizing (see module docstring).

    Returns
    -------
    ScratchPlan
        Under ``"seed"``, ``plan.total_bytes == q12_batched_scratch_bytes_varlen(n, sum(counts),
        max(counts), top_k, mrope)`` for every input.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    counts = tuple(counts)
    if not all(type(c) is int and c >= 1 for c in counts):  # else: the named checks (and conversions)
        counts = tuple(checked_int(f"counts[{i}]", c, 1) for i, c in enumerate(counts))
    if not counts:
        raise ValueError("a scratch plan needs at least one stream (counts is empty)")
    top_k = checked_int("top_k", top_k)
    mrope = _flag("mrope", mrope)
    key = (counts, top_k, mrope, policy)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _build_scratch_plan(counts, top_k, mrope, policy)
    return plan


#: Plans are immutable: the same counts and settings give the same object.
_PLANS: dict = {}
_PLANS_MAX = 512


def _build_scratch_plan(counts: tuple, top_k: int, mrope: bool, policy: str) -> ScratchPlan:
    n, t, m = len(counts), sum(counts), max(counts)
    moe = Region("moe_topk", 0, moe_bytes(t, top_k), "moe")
    cursor = moe.end
    blocks = []
    for b, c in enumerate(counts):
        stride = seed_stream_block_stride(m) if policy == "seed" else a64(single_stream_payload(c, mrope))
        blocks.append(Region(f"stream_block[{b}]", cursor, stride, "stream_block", b))
        cursor += stride
    layout = stacked_layout(n, t, mrope)
    stacked = Region("stacked_metadata", cursor, layout.staged_bytes, "stacked")
    jit = Region("h_state_ptrs", h_state_slot_offset(stacked.offset, layout.staged_bytes), h_state_slot_bytes(n),
                 "jit_slot")
    plan = ScratchPlan(policy, counts, top_k, mrope, moe, tuple(blocks), stacked, jit, layout)
    if policy == "seed":
        assert plan.total_bytes == q12_batched_scratch_bytes_varlen(n, t, m, top_k, mrope)
    return plan
