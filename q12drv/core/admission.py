"""Admission: may this batch take the kernel-batched path? (``check_kernel_batched_eligible``)

Upstream's rules in upstream's order, then the per-stream block fit. The scratch rules read the
same :class:`~q12drv.core.layout.ScratchPlan` the stager fills, so admission and staging cannot
disagree about whether a batch fits. A refusal is not an error: the pass runs per stream.

Two policies. ``"seed"`` is upstream exactly: the seed's per-stream block stride, and every stream must
start its chunk where stream 0 does and agree on ``is_last``. ``"exact"`` sizes each stream's block for
what it holds and admits streams at any offsets: q12drv's metadata is per stream (``cu_seqlens``,
``kv_lens``, positions, slots), so a decode step (every stream one token after its own cache) or a mixed
batch (prefill chunks beside decode tokens) runs as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .ints import checked_bool, checked_int
from .layout import POLICIES, ScratchPlan, make_scratch_plan

__all__ = ["Admission", "check_kernel_batched_eligible", "parse_chunks", "decide", "MAX_HEAD_DIM", "RULES"]

#: Largest head dimension the batched attention kernels take.
MAX_HEAD_DIM = 256

#: Rule names in evaluation order.
RULES = (
    "too_few_streams",
    "mla",
    "head_dim",
    "chunk_start_mismatch",
    "is_last_mismatch",
    "chunk_len_mismatch",
    "zero_length_stream",
    "empty",
    "chunk_zero",
    "arena",
    "scratch",
    "stream_block",
)


@dataclass(frozen=True)
class Admission:
    """The decision. Truthy when admitted; otherwise ``rule`` and ``reason`` say why not.

    Attributes
    ----------
    admitted : bool
    rule : str or None
        Which rule refused (one of :data:`RULES`), None when admitted.
    reason : str
        Human-readable, with the numbers ("" when admitted).
    plan : ScratchPlan or None
        The plan the scratch rules read (None if refused before it was built).
    scratch_needed : int or None
        Bytes the batch needs under the policy.
    """

    admitted: bool
    rule: str | None = None
    reason: str = ""
    plan: ScratchPlan | None = None
    scratch_needed: int | None = None

    def __bool__(self) -> bool:
        return self.admitted

    def __str__(self) -> str:
        return "admitted" if self.admitted else f"refused ({self.rule}): {self.reason}"


def _refuse(rule: str, reason: str, plan=None, needed=None) -> Admission:
    return Admission(False, rule, reason, plan, needed)


def check_kernel_batched_eligible(
    streams: Sequence[tuple],
    n: int,
    arena_cap: int,
    is_mla: bool,
    head_dim: int,
    scratch_cap: int,
    top_k: int,
    mrope: bool,
    allow_chunk_zero: bool,
    varlen: bool,
    policy: str = "seed",
    *,
    head_dims: frozenset | None = None,
) -> Admission:
    """Decide whether ``n`` streams may run as one batched pass.

    Parameters
    ----------
    streams : sequence of (chunk_len, eff_len, chunk_start, is_last)
        Per stream: scheduled chunk length, effective (uncached) tokens this pass processes,
        absolute start of the chunk, whether it is the prompt's last chunk.
    n : int
        Number of streams (must equal ``len(streams)``).
    arena_cap : int
        Token rows the packed activation buffer holds (``max_batch_tokens``).
    is_mla : bool
        Multi-head latent attention model (not supported batched).
    head_dim : int
        Attention head dimension.
    scratch_cap : int
        Bytes of the scratch arena.
    top_k : int
        MoE experts per token.
    mrope : bool
        Positions staged as T/H/W.
    allow_chunk_zero : bool
        Admit first chunks (chunk_start 0).
    varlen : bool
        Admit ragged chunk lengths.
    policy : {"seed", "exact"}
        ``"seed"``: upstream's rules and the seed's per-stream block stride; ``"exact"``: blocks sized for what
        they hold, and streams at any offsets admitted (decode steps and mixed batches; see the module).
    head_dims : frozenset of int, optional
        The head dims the attention kernels exist for on the device (``q12drv.kernels.ops.attention_head_dims``):
        another head dim is refused, naming them. Without it only ``head_dim <= 256`` is checked.

    Returns
    -------
    Admission
        Truthy when admitted.

    Raises
    ------
    TypeError, ValueError
        Malformed arguments (as opposed to a batch that is merely refused); a flag (``is_mla``, ``mrope``,
        ``allow_chunk_zero``, ``varlen``, each stream's ``is_last``) that is not a real bool is a TypeError
        naming it: ``"False"``, ``"no"``, ``1`` or NaN are not taken for their truth value.
    """
    return decide(parse_chunks(streams, n), arena_cap, is_mla, head_dim, scratch_cap, top_k, mrope, allow_chunk_zero,
                  varlen, policy, head_dims=head_dims)


def parse_chunks(streams: Sequence[tuple], n: int) -> list:
    """``streams`` (the scheduler's ``(chunk_len, eff_len, chunk_start, is_last)`` per stream, ``n`` of
    them) checked and normalised to a list of (int, int, int, bool).

    Raises
    ------
    TypeError, ValueError
        Not ``n`` tuples of four, a negative or non-int length or start, an ``is_last`` that is not a bool,
        or ``eff_len > chunk_len``.
    """
    n = checked_int("n", n)
    streams = list(streams)
    if len(streams) != n:
        raise ValueError(f"n = {n} but {len(streams)} stream tuples were given")
    parsed = []
    for b, s in enumerate(streams):
        if not isinstance(s, (tuple, list)) or len(s) != 4:
            raise TypeError(f"streams[{b}] must be a (chunk_len, eff_len, chunk_start, is_last) tuple, got {s!r}")
        chunk_len, eff_len, chunk_start = s[:3]
        if not (type(chunk_len) is int and type(eff_len) is int and type(chunk_start) is int
                and chunk_len >= 0 and eff_len >= 0 and chunk_start >= 0):  # else: the named checks
            chunk_len, eff_len, chunk_start = (checked_int(f"streams[{b}].{k}", v) for k, v in
                                               zip(("chunk_len", "eff_len", "chunk_start"), s[:3]))
        if eff_len > chunk_len:
            raise ValueError(f"streams[{b}]: eff_len {eff_len} exceeds chunk_len {chunk_len}")
        is_last = s[3]
        if is_last is not True and is_last is not False:
            is_last = checked_bool(f"streams[{b}].is_last", is_last)
        parsed.append((chunk_len, eff_len, chunk_start, is_last))
    return parsed


def decide(parsed: list, arena_cap: int, is_mla: bool, head_dim: int, scratch_cap: int, top_k: int, mrope: bool,
           allow_chunk_zero: bool, varlen: bool, policy: str = "seed", *, head_dims: frozenset | None = None
           ) -> Admission:
    """:func:`check_kernel_batched_eligible` over streams already checked by :func:`parse_chunks` (or
    built from validated staging input): the settings' checks, then the rules.

    Raises
    ------
    TypeError, ValueError
        A malformed setting (policy, a negative or non-int capacity, head_dim or top_k, a flag that is not
        a real bool).
    """
    is_mla = checked_bool("is_mla", is_mla)
    mrope = checked_bool("mrope", mrope)
    allow_chunk_zero = checked_bool("allow_chunk_zero", allow_chunk_zero)
    varlen = checked_bool("varlen", varlen)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    arena_cap = checked_int("arena_cap", arena_cap)
    head_dim = checked_int("head_dim", head_dim)
    scratch_cap = checked_int("scratch_cap", scratch_cap)
    top_k = checked_int("top_k", top_k)
    n = len(parsed)
    # 1-3: batch-wide shape rules
    if n < 2:
        return _refuse("too_few_streams", f"n = {n}: a batch needs at least 2 streams")
    if is_mla:
        return _refuse("mla", "MLA attention (kv_lora_rank > 0) has no batched kernel")
    if head_dim > MAX_HEAD_DIM:
        return _refuse("head_dim", f"head_dim {head_dim} > {MAX_HEAD_DIM}")
    if head_dims is not None and head_dim not in head_dims:
        return _refuse("head_dim", f"head_dim {head_dim} has no attention kernel (kernels exist for head dims "
                                   f"{', '.join(map(str, sorted(head_dims)))})")
    # 4-6: per stream against stream 0, accumulate (the seed policy: one chunk start and one is_last for all)
    c0, _, s0, last0 = parsed[0]
    same_start = policy == "seed"
    total, max_len = 0, 0
    for b, (chunk_len, eff_len, chunk_start, is_last) in enumerate(parsed):
        if same_start and chunk_start != s0:
            return _refuse("chunk_start_mismatch", f"stream {b} starts at {chunk_start}, stream 0 at {s0} (policy "
                                                   f"'seed'; policy 'exact' admits streams at any offsets)")
        if same_start and is_last != last0:
            return _refuse("is_last_mismatch", f"stream {b} is_last={is_last}, stream 0 is_last={last0}")
        if not varlen and chunk_len != c0:
            return _refuse("chunk_len_mismatch", f"stream {b} chunk_len {chunk_len} != stream 0's {c0} and varlen is off")
        if eff_len == 0:
            return _refuse("zero_length_stream", f"stream {b} has eff_len 0 (a fully cached middle chunk; upstream bug B7)")
        total += eff_len
        max_len = max(max_len, eff_len)
    # 7-9
    if not parsed:
        return _refuse("empty", "no streams")
    if not allow_chunk_zero and any(start == 0 for _, _, start, _ in parsed):
        first = next(b for b, (_, _, start, _) in enumerate(parsed) if start == 0)
        return _refuse("chunk_zero", f"stream {first} is at chunk_start 0 and allow_chunk_zero is off")
    if total > arena_cap:
        return _refuse("arena", f"{total} packed tokens exceed the activation arena of {arena_cap} rows")
    # 10: scratch fit, from the same plan the stager uses
    # The plan is built from what the stager will write (the effective lengths); under "seed" its
    # total is the seed's varlen function exactly, which for equal lengths is the uniform one.
    plan = make_scratch_plan([e for _, e, _, _ in parsed], top_k, bool(mrope), policy)
    needed = plan.total_bytes
    if needed > scratch_cap:
        return _refuse("scratch", f"the batch needs {needed:,} scratch bytes, the arena has {scratch_cap:,} "
                                  f"(policy '{policy}'; ScratchArena.grow({needed}) makes room)", plan, needed)
    # + per-stream block fit (upstream bug B9)
    b = plan.first_unfit_stream()
    if b is not None:
        need = plan.stream_layout(b).staged_bytes
        return _refuse("stream_block", f"stream {b}'s own metadata ({plan.counts[b]} tokens"
                       f"{', MRoPE' if plan.mrope else ''}) needs {need:,} bytes but the '{policy}' per-stream "
                       f"block is {plan.stream_blocks[b].nbytes:,} (upstream bug B9); use policy='exact'", plan, needed)
    return Admission(True, None, "", plan, needed)
