"""One Q12 prefill pass over an arena: admission, plan, stage, then the layers, batched or per stream.

:class:`Q12Pass` decides (through :func:`~q12drv.core.admission.decide`, the rules of ``check_kernel_batched_eligible``)
whether the batch runs batched, lays out the arena from the plan, stages the metadata once, and
then runs any number of layers:

* :meth:`Q12Pass.attention_layer`: RoPE/MRoPE on Q and K, KV-cache write, paged attention;
* :meth:`Q12Pass.gdn_layer`: upload this layer's ``h_state_ptrs``, then Gated DeltaNet (one plan for the pass,
  :meth:`Q12Pass.gdn_plan`).

Batched, each kernel is one launch for all streams. Per stream (a refused batch, or
``mode="per_stream"``), each stream's own n = 1 metadata sits in its per-stream block and the
same kernels run once per stream on that stream's rows. Both read the same rows, blocks and
states, with the same instructions, so their results are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import add, is_not
from typing import Any, Callable, Sequence

import numpy as np

from ..core.admission import Admission, decide, parse_chunks
from ..core.arena import ScratchArena
from ..core.device import Stream
from ..core.errors import CapacityError, Q12Error
from ..kernels import ops
from ..kernels.expand import ExpandPlan, stage_on_device
from ..kernels import attention as _attn
from ..kernels import kv_write as _kvw
from ..kernels import attention_decode as _dec
from ..kernels import rope as _rope
from ..kernels.gdn import GdnConfig, GdnPlan, GdnShape, GdnTensors
from ..kernels.gdn.launch import GdnLaunch, check_workspace, resolve_plan
from ..kernels.gdn.plan import check_shape
from ..kernels.args import (ALIGN, FP8_E4M3, FP8_POOL_DTYPES, I32_MAX, check_kv_scales, count, head_group,
                           positive_float)
from ..kernels.conv1d import check_conv1d, conv1d_launch
from ..core.interop import describe
from .tensors import count_of, row_view
from ..core.layout import (h_state_entry_offset, make_scratch_plan, row_offset, rows_extent, scratch_bytes_bound,
                           state_tables_bytes)
from ..core.ptr import DevicePtr
from ..core.staging import (
    BatchedAttnMetadata,
    StateRow,
    StreamStageInfo,
    stage_state_rows,
    validate_streams,
    place_h_state_slot,
    plain_pointers,
    plain_table,
    reserve_h_state_slot,
    stage_stacked,
    stage_stream_metadata,
)

__all__ = ["AttentionShape", "GdnShape", "GdnConfig", "GdnTensors", "Q12Pass", "MODES", "EXPANDS"]

MODES = ("auto", "batched", "per_stream")
#: Where a batched pass writes its per-token metadata (positions, slots): see ``Q12Pass(expand=...)``.
EXPANDS = ("auto", "host", "device")
#: The alignments of the bf16 attention ops' arguments (RoPE, KV write, attention: one table, a layer's union).
_ATTENTION_ALIGN = {**ALIGN["rope"], **ALIGN["kv_write"], **ALIGN["attention"]}
#: (id of an alignment table, argument names in order) -> their bad bits (:func:`_bad_bits`), made on first use.
_BAD: dict = {}


def _bad_bits(align: dict, names: tuple) -> tuple:
    """The bits each address of ``names`` must not have, aligned as ``align`` says (2 bytes where it names none):
    any at or above bit 64 (a negative int has them all) and any below its alignment (a power of two)."""
    return tuple(-(1 << 64) | (align.get(n, 2) - 1) for n in names)


#: The bf16 layer ops' pointers in their kernels' order, and their bad bits (the layer table's alignments).
_ROPE_PTRS, _KV_PTRS, _ATTN_PTRS = ("q", "k"), ("k", "v", "k_pool", "v_pool"), ("q", "k_pool", "v_pool", "o")
_ROPE_BAD, _KV_BAD, _ATTN_BAD = (_bad_bits(_ATTENTION_ALIGN, n) for n in (_ROPE_PTRS, _KV_PTRS, _ATTN_PTRS))
_SCALES = ("k_scale", "v_scale")
_STATE_ALIGN = ALIGN["gdn"]["state"]
_CONV_STATE_ALIGN = ALIGN["conv1d"]["state"]
_BF16 = 2
_F32 = 4
#: A :meth:`Q12Pass._launcher` pointer that is a state-pointer table: advanced by one entry a stream, not by rows.
_TABLE = ("table",)


@dataclass(frozen=True)
class AttentionShape:
    """Shape of an attention layer: heads, head dim, rotary settings (``mrope_mode``: ``q12drv.MROPE_OFF``,
    ``MROPE_CHUNKED`` or ``MROPE_INTERLEAVED``, with ``mrope_section`` the T/H/W sections; see ops.rope).

    ``rope_scaling``: a :class:`~q12drv.kernels.rope.RopeScaling` for models with scaled rotary embeddings
    (its frequencies replace ``rope_theta``'s; :meth:`~q12drv.kernels.rope.RopeScaling.from_transformers` reads
    them from a transformers config).

    ``sliding_window``: the layer's sliding window in transformers' convention, so a runtime passes a model
    config's ``sliding_window`` as it is (for the layers whose ``layer_types`` entry is ``"sliding_attention"``):
    ``W`` is the number of keys a query sees, its own included: the query at position ``p`` sees the keys
    ``p - W + 1 .. p`` (``masking_utils.sliding_window_overlay``: ``j > p - W``), FlashAttention's
    ``window_size=(W - 1, 0)``, :attr:`window_left` ``= W - 1``. ``None`` (default): full causal attention. A
    model may mix sliding and full layers: each layer's shape says which it is. The window changes what
    attention reads, not what RoPE or the KV write do (every key is still written to the cache).

    ``kv_dtype``: the element type of the layer's KV pools (:data:`q12drv.kernels.ops.KV_DTYPES`): ``"bf16"``
    (default), or ``"fp8_e4m3"`` (one byte an element, each value stored as ``e4m3(x / scale[h])`` with the fp32
    per-KV-head scales given to :meth:`Q12Pass.kv_write`). The KV write writes FP8 pools and the decode kernel reads
    them (:meth:`Q12Pass.attention` with ``algo="decode"`` and the same scales: passes whose every stream has at most
    8 new tokens); the prefill kernels read bf16 pools only, so the other algos and :meth:`Q12Pass.attention_layer`
    refuse such a shape.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 1e7
    mrope_mode: int = 0
    mrope_section: tuple = (0, 0, 0)
    scale: float | None = None
    rope_scaling: _rope.RopeScaling | None = None
    sliding_window: int | None = None
    kv_dtype: str = "bf16"

    @property
    def window_left(self) -> int | None:
        """The window in FlashAttention's convention (keys left of the query, ``ops.attention(window_left=)``):
        ``sliding_window - 1``, or None for full causal attention.

        Raises
        ------
        ValueError
            ``sliding_window`` is not None or an int in ``[1, 2**31 - 1]`` (0 or a negative number has no meaning
            here: None is full causal attention).
        """
        sw = self.sliding_window
        if sw is None:
            return None
        if isinstance(sw, bool) or not isinstance(sw, (int, np.integer)) or not 1 <= sw <= I32_MAX:
            raise ValueError(f"shape.sliding_window must be None (full causal attention) or the number of keys a "
                             f"query sees, its own included (transformers' sliding_window: an int in [1, {I32_MAX}]), "
                             f"got {sw!r:.60}")
        return int(sw) - 1


#: (id(plan), arena base) -> (plan, the regions its MoE area and per-stream blocks got there).
_PREFIX_REGIONS: dict = {}

#: (id(shape), use_mrope or None) -> the layer shape object whose checks passed. Shapes are frozen;
#: holding the object keeps its id from being reused; a shape with a mutable field is not remembered.
_SHAPES_OK: dict = {}


#: The exact inputs of an admission decision -> the decision. ``decide`` is a pure function of them and an
#: :class:`~q12drv.core.admission.Admission` (with its plan) is immutable, so a pass of the same shape as an earlier
#: one takes the earlier decision; only inputs of exact types are remembered, only decisions that did not raise.
_ADMISSIONS: dict = {}
_ADMIT_TYPES = (int, bool, int, int, int, bool, bool, bool, str)


def _admit(parsed: list, arena_tokens, is_mla, head_dim, scratch_cap, top_k, use_mrope, allow_chunk_zero, varlen,
           policy, head_dims: frozenset) -> Admission:
    """:func:`~q12drv.core.admission.decide`, remembered per distinct input."""
    settings = (arena_tokens, is_mla, head_dim, scratch_cap, top_k, use_mrope, allow_chunk_zero, varlen, policy)
    if tuple(map(type, settings)) != _ADMIT_TYPES:
        return decide(parsed, *settings, head_dims=head_dims)
    key = (*parsed, settings, head_dims)  # parsed: (int, int, int, bool) tuples (parse_chunks' or the validated streams')
    hit = _ADMISSIONS.get(key)
    if hit is None:
        hit = decide(parsed, *settings, head_dims=head_dims)
        if len(_ADMISSIONS) >= 256:
            _ADMISSIONS.clear()
        _ADMISSIONS[key] = hit
    return hit


_PTR_TYPES = frozenset((int, DevicePtr))
#: The bad bits of the GDN layers' pointer arguments: (q, k, v, o) and (g, beta).
_GDN_BAD, _GATE_BAD = _bad_bits(ALIGN["gdn"], ("q", "k", "v", "o")), _bad_bits(ALIGN["gdn"], ("g", "beta"))


def _plain_aligned(ptrs, bad: tuple) -> bool:
    """Whether every pointer is an exact int/DevicePtr, not 0, with none of its ``bad`` bits set (:func:`_bad_bits`):
    :func:`~q12drv.kernels.args.device_ptr`'s common case, all at once."""
    for p, b in zip(ptrs, bad):
        if (type(p) is not int and type(p) is not DevicePtr) or not p or p & b:
            return False
    return True


def _plain_gdn(ptrs: tuple) -> bool:
    """:func:`_plain_aligned` of a GDN layer's ``(q, k, v, g, beta, o)``, unrolled for exact ints."""
    q, k, v, g, beta, o = ptrs
    if int is type(q) is type(k) is type(v) is type(g) is type(beta) is type(o) and q and k and v and g and beta and o:
        return not (q & _GDN_BAD[0] | k & _GDN_BAD[1] | v & _GDN_BAD[2] | o & _GDN_BAD[3] | g & _GATE_BAD[0]
                    | beta & _GATE_BAD[1])
    return _plain_aligned((q, k, v, o), _GDN_BAD) and _plain_aligned((g, beta), _GATE_BAD)


_CONV_BAD = _bad_bits(ALIGN["conv1d"], ("x", "y", "w", "bias"))


def _plain_conv(x, y, w, bias) -> bool:
    """:func:`_plain_aligned` of a short convolution's ``(x, y, w, bias)`` (``bias`` None: none, and x, y and w
    alone are checked; :meth:`Q12Pass.conv1d` unrolls that case for exact ints itself)."""
    return _plain4(x, y, w, bias, _CONV_BAD) if bias is not None else _plain_aligned((x, y, w), _CONV_BAD)


def _plain4(a, b, c, d, bad: tuple) -> bool:
    """:func:`_plain_aligned` of four pointers, unrolled for exact ints: the layer ops' common case in a fraction of
    the loop's time."""
    if int is type(a) is type(b) is type(c) is type(d) and a and b and c and d:
        return not (a & bad[0] | b & bad[1] | c & bad[2] | d & bad[3])
    return _plain_aligned((a, b, c, d), bad)


class _AttentionLayer:
    """What the attention ops of one :class:`AttentionShape` run in a pass, made on the shape's first checked op and
    shared by every layer of that shape: the pools' block counts its block tables were checked against (None: the
    shape checked for RoPE, which reads no pool) and its launches (per block count for the KV writes, per algo for
    attention), each a :class:`~q12drv.kernels.layer_launch.LayerLaunch` (or one per stream) with everything but the
    layer's pointers fixed."""

    __slots__ = ("shape", "blocks", "rope", "kv_write", "kv_write_fp8", "attention")

    def __init__(self, shape: AttentionShape):
        self.shape = shape
        self.blocks: set = set()
        self.rope: Callable | None = None
        self.kv_write: dict = {}
        self.kv_write_fp8: dict = {}
        self.attention: dict = {}


class _GdnLayer:
    """What :meth:`Q12Pass.gdn_layer` runs for one :class:`GdnShape` in a pass: the config asked for last and its
    plan, the workspace as given (``workspace``, ``workspace_bytes``) and as checked (``ws``), and the plan's launches
    (``run``, a :class:`~q12drv.kernels.gdn.launch.GdnLaunch` or one per stream)."""

    __slots__ = ("shape", "config", "plan", "workspace", "workspace_bytes", "ws", "run")


def _same_arg(given, before) -> bool:
    """Whether an argument is the one given before: the same object, or an equal exact int."""
    return given is before or (type(given) is int and type(before) is int and given == before)


class _PerStream:
    """A pass launch made once per stream (the per-stream fallback): each stream's launch, with the layer's
    pointers advanced to that stream's rows."""

    __slots__ = ("launches", "offsets")

    def __init__(self, launches: list, offsets: list):
        self.launches, self.offsets = launches, offsets  # offsets[b][i]: stream b's byte offset of pointer i

    def launch(self, stream: Any, pointers: tuple) -> None:
        for launch, offsets in zip(self.launches, self.offsets):
            launch(stream, tuple(map(add, pointers, offsets)))


def check_attention_pools(shape, algo: str | None = None) -> None:
    """ValueError for FP8 pools where the attention that would run reads bf16 pools only: a prefill kernel (``algo``
    ``"auto"``, ``"mma"``, ``"wgmma"``) or a layer (``algo`` None: an attention layer runs one prefill kernel). The
    decode kernel (``algo="decode"``) reads them."""
    kv = getattr(shape, "kv_dtype", "bf16")
    if kv == "bf16" or algo == "decode":
        return
    what = "an attention layer runs a prefill kernel" if algo is None else f"algo={algo!r} runs a prefill kernel"
    raise ValueError(f"shape.kv_dtype is {kv!r:.60}: {what}, which reads bf16 pools; FP8 pools are read by "
                     f"algo='decode' (passes whose every stream has at most {_dec.MAX_Q_LEN} new tokens and "
                     f"{_dec.MAX_ROWS} (token, query head) rows a kv head): Q12Pass.rope, Q12Pass.kv_write(..., "
                     f"k_scale=, v_scale=), then Q12Pass.attention(..., algo='decode', k_scale=, v_scale=)")


def _remember_shape(shape, use_mrope, *fields) -> None:
    if type(shape) in (AttentionShape, GdnShape) and all(type(f) is tuple for f in fields):
        if len(_SHAPES_OK) >= 256:
            _SHAPES_OK.clear()
        _SHAPES_OK[(id(shape), use_mrope)] = shape


_I32 = np.dtype(np.int32)
_U32 = np.dtype(np.uint32)


def _table_bound(batch, block_size: int):
    """``max + 1`` over the table entries of every stream below its kv_len (0 when there are none), or None
    when one of them is negative: attention reads them all, so they must lie in ``[0, num_blocks)``."""
    read = [t[:-(-k // block_size)] for t, k in zip(batch.raw_tables, batch.kv_list)]
    read = np.concatenate(read) if len(read) > 1 else read[0]
    if not read.size:
        return 0
    if read.dtype == _I32:  # one reduction: a negative entry is >= 2**31 as a u32
        top = int(read.view(_U32).max())
        return None if top > I32_MAX else top + 1
    return None if int(read.min()) < 0 else int(read.max()) + 1


class Q12Pass:
    """One prefill pass of N streams over ``arena``.

    Parameters
    ----------
    arena : ScratchArena
        Reset and laid out by the pass.
    streams : sequence of StreamStageInfo
    block_size, use_mrope, dummy_kv_block
        As for :func:`~q12drv.core.staging.stage_batched_attn_metadata`.
    top_k : int
        MoE experts per token (sizes the MoE area of the plan).
    head_dim : int
        Attention head dim (admission refuses one no attention kernel exists for on this device).
    chunks : sequence of (chunk_len, eff_len, chunk_start, is_last), optional
        The scheduler's view for admission; default: each stream's own (proc_count, proc_count,
        proc_start, False).
    arena_tokens : int, optional
        Rows of the packed activation buffers (admission's ``arena_cap``); default Σ proc_count.
    is_mla, allow_chunk_zero, varlen
        Admission settings.
    policy : {"exact", "seed"}
        ``"exact"`` (default): per-stream blocks sized for what they hold, and streams at any offsets batched
        (decode steps, prefill chunks beside decode tokens); ``"seed"``: upstream's rules and sizing exactly
        (every stream at one chunk start). See :mod:`q12drv.core.admission`.
    mode : {"auto", "batched", "per_stream"}
        ``"auto"`` runs batched when admitted and per stream otherwise; ``"batched"`` raises if
        refused; ``"per_stream"`` always runs the fallback.
    expand : {"auto", "host", "device"}
        How a batched pass writes its per-token metadata. ``"host"`` packs every field on the host
        and copies ``staged_bytes``; ``"device"`` copies only the per-stream fields and one
        ``q12_expand_meta`` launch writes positions and slots (:mod:`q12drv.kernels.expand`; the
        arena ends up with the same bytes); it refuses streams with vision ``mrope_positions``.
        ``"auto"`` (default) is ``"device"`` unless a stream carries ``mrope_positions``, then
        ``"host"``. The per-stream fallback always packs on the host.
    expand_plan : ExpandPlan, optional
        A batched pass stages through it (:meth:`ExpandPlan.stage <q12drv.kernels.expand.ExpandPlan.stage>`
        with the streams' starts and counts, at the pass's stacked offset) instead of
        :func:`~q12drv.kernels.expand.stage_on_device`: the same bytes, for less host time, when the
        caller keeps one plan across the passes of the same streams. It must have been made on
        ``arena`` for these streams (the same ``block_table_dev`` and ``seq_len_dev``, in order, tables
        covering this pass) with the same ``block_size``, ``use_mrope`` and ``dummy_kv_block``;
        ``expand`` must be ``"auto"`` or ``"device"``. A pass that runs per stream does not use it.
    stream : optional
        CUDA stream for everything the pass enqueues (any form :meth:`Device.as_stream
        <q12drv.core.device.Device.as_stream>` takes). It stays an attribute: set ``step.stream`` between calls to
        enqueue the next layer ops elsewhere (e.g. on a ``torch.cuda.graph`` capture stream, after the staging on
        the stream given here has been waited for). The layers that upload state pointers (``conv1d``,
        ``gdn_layer``) refuse a capturing stream: :class:`~q12drv.prefill.graphs.PassGraph` captures those.

    Attributes
    ----------
    admission : Admission
    batched : bool
    reason : str
        Why the pass runs per stream ("" when batched).
    meta : BatchedAttnMetadata or None
        The stacked metadata (batched).
    expand : str
        ``"host"``, ``"device"`` or ``"plan"`` (the device expansion through ``expand_plan``): how this
        pass staged (``""`` per stream).
    stream_meta : list of BatchedAttnMetadata
        Each stream's own metadata (per stream).
    """

    def __init__(self, arena: ScratchArena, streams: Sequence[StreamStageInfo], *, block_size: int, use_mrope: bool,
                 dummy_kv_block: int, top_k: int = 0, head_dim: int = 128, chunks: Sequence[tuple] | None = None,
                 arena_tokens: int | None = None, is_mla: bool = False, allow_chunk_zero: bool = True,
                 varlen: bool = True, policy: str = "exact", mode: str = "auto", expand: str = "auto",
                 stream: Any = None, expand_plan: ExpandPlan | None = None):
        if not isinstance(arena, ScratchArena):
            raise TypeError(f"arena must be a ScratchArena, got {type(arena).__name__}")
        arena._require_open()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if expand not in EXPANDS:
            raise ValueError(f"expand must be one of {EXPANDS}, got {expand!r}")
        if type(streams) is not list and (isinstance(streams, StreamStageInfo) or not isinstance(streams, Sequence)):
            raise TypeError(f"streams must be a sequence of StreamStageInfo, got {type(streams).__name__}")
        streams = list(streams)
        if not streams:
            raise ValueError("a pass needs at least one stream")
        # Every input is checked before the arena is touched: bad input leaves it as it was.
        batch = validate_streams(streams, block_size, use_mrope, dummy_kv_block)
        vision = [b for b, mp in enumerate(batch.mrope) if mp is not None] if any(map(is_not, batch.mrope, repeat(None))) \
            else []
        if expand == "device" and vision:
            raise ValueError(f"expand='device' writes text positions only, but streams[{vision[0]}] carries "
                             f"mrope_positions (vision tokens); use expand='host' or 'auto'")
        if expand_plan is not None:
            if not isinstance(expand_plan, ExpandPlan):
                raise TypeError(f"expand_plan must be an ExpandPlan, got {type(expand_plan).__name__}")
            if expand == "host":
                raise ValueError("expand='host' packs on the host, but an expand_plan was given (it expands on the "
                                 "device); use expand='auto' or 'device', or leave expand_plan out")
            if vision:
                raise ValueError(f"expand_plan writes text positions only, but streams[{vision[0]}] carries "
                                 f"mrope_positions (vision tokens); leave expand_plan out")
            expand_plan.check_batch(arena, batch, block_size, use_mrope, dummy_kv_block)
        if chunks is not None:
            chunks = list(chunks)
            if len(chunks) != len(streams):
                raise ValueError(f"chunks has {len(chunks)} entries but there are {len(streams)} streams")
            for b, (c, s) in enumerate(zip(chunks, streams)):
                if isinstance(c, (tuple, list)) and len(c) == 4 and c[1] != s.proc_count:
                    raise ValueError(f"chunks[{b}] has eff_len {c[1]!r} but streams[{b}].proc_count is {s.proc_count} "
                                     f"(admission must be asked about the tokens that are staged)")
        self.arena = arena
        self.device = arena.device
        self.streams = streams
        self.stream = stream
        self.block_size = int(block_size)
        self.use_mrope = bool(use_mrope)
        counts = batch.count_list  # validated ints
        # the scheduler's view; by default each stream's own (validated) counts and starts
        parsed = (list(zip(counts, counts, batch.start_list, repeat(False))) if chunks is None
                  else parse_chunks(chunks, len(streams)))
        self.admission: Admission = _admit(parsed, batch.total if arena_tokens is None else arena_tokens, is_mla,
                                           head_dim, arena.capacity, top_k, use_mrope, allow_chunk_zero, varlen,
                                           policy, ops.attention_head_dims(arena.device.arch))
        if mode == "batched" and not self.admission:
            raise ValueError(f"mode='batched' but the batch was {self.admission}")
        self.batched = bool(self.admission) and mode != "per_stream"
        self.expand = ("host" if vision else "device") if expand == "auto" else expand
        if expand_plan is not None:
            self.expand = "plan"
        if not self.batched:
            self.expand = ""
        self.reason = "" if self.batched else ("per_stream requested" if mode == "per_stream" else str(self.admission))
        self.meta: BatchedAttnMetadata | None = None
        self.stream_meta: list = []
        self._layers: dict = {}  # id(shape) -> _AttentionLayer: the shape checked for this pass, its launches
        self._gdn_layers: dict = {}  # id(GdnShape) -> _GdnLayer
        self._conv_launches: dict = {}  # (entry, channels, strides, silu) -> the short convolution's launch
        #: (channels, width, state_stride, silu) as given -> (launch, bytes of x's rows): raw addresses' fast path
        self._conv_layers: dict = {}
        self._resolved_stream: tuple = (None, None)  # (stream as given, its driver stream): _driver_stream's
        self._gdn_plans: dict = {}  # (GdnShape, GdnConfig or id(GdnPlan)) -> (what was given, this pass's plan)
        self._decode_plans: dict = {}  # (Hq, Hkv, D, window, num_splits asked, kv_dtype) -> this pass's DecodePlan
        self._longest = max(counts)  # tokens of the longest stream: a GDN plan's extent, batched or per stream
        plan = self.admission.plan
        if not self.batched:
            if plan is None or plan.first_unfit_stream() is not None or plan.total_bytes > arena.capacity:
                plan = make_scratch_plan(counts, top_k, use_mrope, "exact")
            needed = plan.per_stream_jit_slot.end
            if needed > arena.capacity:
                raise CapacityError("per-stream metadata blocks", needed, arena.capacity,
                                    "even the per-stream fallback needs the MoE area, one block per stream and the "
                                    "h_state_ptrs slot; size the arena with q12drv.core.layout")
        self.plan = plan
        # From here on only the driver can fail (a CudaError); a failed pass leaves the arena empty
        # (cursor 0, no reservations) rather than holding regions whose bytes are half rewritten.
        arena.reset()
        try:
            self._reserve_prefix(plan)
            if self.batched:
                if self.expand == "plan":
                    self.meta = expand_plan.stage(batch.start_list, counts, stream,
                                                  scratch_offset_bytes=plan.stacked.offset)
                elif self.expand == "device":
                    self.meta = stage_on_device(arena, streams, block_size=self.block_size, use_mrope=use_mrope,
                                                scratch_offset_bytes=plan.stacked.offset,
                                                dummy_kv_block=dummy_kv_block, stream=stream, batch=batch)
                else:
                    self.meta = stage_stacked(arena, streams, self.block_size, use_mrope, plan.stacked.offset,
                                              dummy_kv_block, stream, batch=batch)[0]
                self.h_slot = place_h_state_slot(arena, self.meta)
            else:
                common = dict(block_size=block_size, use_mrope=use_mrope, dummy_kv_block=dummy_kv_block)
                self.stream_meta = [stage_stream_metadata(arena, plan, b, s, stream=stream, **common)
                                    for b, s in enumerate(streams)]
                self.h_slot = reserve_h_state_slot(arena, len(streams))
        except BaseException:
            arena.reset()
            raise
        self._batch = batch  # the validated tables and kv_lens (never written)
        self._table_bound = False  # max + 1 of every entry attention reads (None: one is negative), on first use
        # (streams, tokens of the longest) that one GDN launch of this pass covers
        self._gdn_extent = ((self.meta.batch_size, self.meta.chunk_len) if self.batched else
                            (1, max(m.chunk_len for m in self.stream_meta)))
        self._generation = arena.generation

    @staticmethod
    def arena_bytes(counts: Sequence[int], *, top_k: int = 0, use_mrope: bool = False, policy: str = "exact",
                    state_rows: int = 0) -> int:
        """The arena capacity a batched pass of streams with ``counts`` new tokens needs (its whole layout: the MoE
        area, the per-stream blocks, the stacked metadata and the ``h_state_ptrs`` slot; and ``state_rows``
        state-pointer tables for :meth:`stage_states`), for :class:`~q12drv.core.arena.ScratchArena` or
        :meth:`ScratchArena.grow <q12drv.core.arena.ScratchArena.grow>`.

        Examples
        --------
        >>> arena.grow(Q12Pass.arena_bytes([s.proc_count for s in streams], top_k=8))   # doctest: +SKIP
        """
        plan = make_scratch_plan(counts, top_k, use_mrope, policy)
        return plan.total_bytes + state_tables_bytes(len(plan.counts), count("state_rows", state_rows, 0))

    @staticmethod
    def max_arena_bytes(max_streams: int, max_tokens: int, *, top_k: int = 0, use_mrope: bool = False,
                        policy: str = "exact", state_rows: int = 0, max_chunk: int | None = None) -> int:
        """The arena capacity every pass of at most ``max_streams`` streams and ``max_tokens`` tokens (each stream
        at most ``max_chunk``) needs, with ``state_rows`` state tables: what a runtime sizes its arena with once
        (:func:`~q12drv.core.layout.scratch_bytes_bound`). A smaller arena may make some of those batches run per
        stream (admission's ``"scratch"`` rule), though a batch of the same size fitted.

        Examples
        --------
        >>> arena = ScratchArena(dev, Q12Pass.max_arena_bytes(8, 16384, state_rows=72))   # doctest: +SKIP
        """
        n = count("max_streams", max_streams)
        return (scratch_bytes_bound(n, count("max_tokens", max_tokens), top_k, use_mrope, policy, max_chunk)
                + state_tables_bytes(n, count("state_rows", state_rows, 0)))

    def check_block_tables(self) -> None:
        """Check that each stream's device table (``block_table_dev``, what attention reads) holds its host table
        (``block_table``, what the pass was validated against) for every block below ``kv_len``.

        A pass has two copies of each table: the host's decides the KV slots when the per-token metadata is
        packed on the host (``expand="host"``, the per-stream fallback) and is the one validated; the device's is
        what attention reads (and, with ``expand="device"``, the KV slots too). Nothing else compares them. This
        waits for the pass's stream and reads every table back (``4 * ceil(kv_len / block_size)`` bytes a
        stream): a debugging and testing aid, not a per-step call.

        Raises
        ------
        ValueError
            A table differs; the message names the stream, the first logical block and both entries.
        """
        self._require_current()
        b_size, batch, dev = self.block_size, self._batch, self.device
        dev.synchronize(self.stream)
        for b, (ptr, kv, table) in enumerate(zip(batch.table_ptr_list, batch.kv_list, batch.raw_tables)):
            nblk = -(-kv // b_size)
            host = np.asarray(table[:nblk]).astype(np.int64)
            read = dev.download_array(ptr, np.int32, (nblk,)).astype(np.int64)
            differ = np.flatnonzero(read != host)
            if differ.size:
                i = int(differ[0])
                raise ValueError(f"streams[{b}]: block_table_dev[{i}] is {int(read[i])} but block_table[{i}] is "
                                 f"{int(host[i])} ({differ.size} of the {nblk} blocks below kv_len {kv} differ): "
                                 f"attention reads the device table; upload the host table there before the pass")

    @property
    def cu_seqlens(self) -> np.ndarray:
        """The pass's ``cu_seqlens`` (int64, ``n + 1`` entries), made on first access."""
        cu = self.__dict__.get("_cu_seqlens")
        if cu is None:
            cu = self.__dict__["_cu_seqlens"] = np.array(self._batch.cu_list, np.int64)
        return cu

    # argument checks (before anything is enqueued) -------------------------------------------
    def _require_current(self) -> None:
        self.arena._require_open()
        if self.arena.generation != self._generation:
            raise Q12Error("this Q12Pass is stale: its arena was reset by a later pass, which may have "
                           "overwritten its metadata; run the layers through the newest Q12Pass")

    def _check_attention_shape(self, shape: AttentionShape) -> None:
        hq, hkv = head_group("shape.num_q_heads", shape.num_q_heads, "shape.num_kv_heads", shape.num_kv_heads)
        d = count("shape.head_dim", shape.head_dim)
        _attn.entry_for_head_dim(d)
        rd = count("shape.rotary_dim", shape.rotary_dim, 0)
        mode = count("shape.mrope_mode", shape.mrope_mode, 0, 2)
        sections = tuple(shape.mrope_section) if isinstance(shape.mrope_section, (tuple, list)) else None
        if sections is None or len(sections) != 3:
            raise ValueError(f"shape.mrope_section must be 3 ints (T, H, W), got {shape.mrope_section!r}")
        for i, x in enumerate(sections):
            count(f"shape.mrope_section[{i}]", x, 0)
        _rope.check_params(d, rd, mode, sections, hq, hkv)
        if mode and not self.use_mrope:
            raise ValueError(f"shape.mrope_mode {mode} needs a pass staged with use_mrope=True")
        positive_float("shape.rope_theta", shape.rope_theta)
        ops.rope_table(shape.rope_scaling, rd)
        if shape.scale is not None:
            positive_float("shape.scale", shape.scale)
        shape.window_left  # noqa: B018 (checks sliding_window)
        if shape.kv_dtype not in ops.KV_DTYPES:
            raise ValueError(f"shape.kv_dtype must be one of {ops.KV_DTYPES}, got {shape.kv_dtype!r:.60}")

    def _check_tables(self, nb: int) -> None:
        """ValueError unless every block table entry attention reads lies in ``[0, nb)``."""
        bound = self._table_bound
        if bound is False:  # every entry below kv_len, all streams at once
            bound = self._table_bound = _table_bound(self._batch, self.block_size)
        if bound is not None and bound <= nb:
            return
        for b, s in enumerate(self.streams):  # find the stream to name
            table = np.asarray(s.block_table)[:-(-(s.proc_start + s.proc_count) // self.block_size)]
            if table.size and int(table.max()) >= nb:
                raise ValueError(f"streams[{b}].block_table has entry {int(table.max())} where attention reads it, "
                                 f"past the pools' num_blocks={nb}: the kernel would read past the KV cache")
            if table.size and int(table.min()) < 0:
                # staging sends such positions' KV writes to the dummy block, but attention must read
                # every key below kv_len: a missing block there has no defined meaning
                raise ValueError(f"streams[{b}].block_table has a negative (missing) entry where attention reads "
                                 f"keys 0..{s.proc_start + s.proc_count - 1}; every block below kv_len must exist")

    def _check_gdn(self, tensors, shape) -> tuple:
        """The layer's checked pointers ``(q, k, v, g, beta, o)``, the shape checked."""
        self._require_current()
        if not isinstance(tensors, GdnTensors):
            raise TypeError(f"tensors must be a GdnTensors, got {type(tensors).__name__}")
        if _SHAPES_OK.get((id(shape), None)) is not shape:
            check_shape(shape)
            _remember_shape(shape, None)
        ptrs = (tensors.q, tensors.k, tensors.v, tensors.g, tensors.beta, tensors.o)
        ptrs = tuple(map(int, ptrs)) if _plain_gdn(ptrs) else \
            tensors.checked(self.device, self._batch.total, shape)
        return ptrs

    def _reserve_prefix(self, plan) -> None:
        # The MoE area and the per-stream blocks, as the plan lays them out. A plan (memoised per
        # distinct input) laid out again on the same arena reuses the regions it got last time.
        arena = self.arena
        key = (id(plan), arena.base)
        hit = _PREFIX_REGIONS.get(key)
        if hit is not None and hit[0] is plan:
            arena.reserve_all(hit[1])
            return
        first = len(arena.regions)
        for r in (plan.moe, *plan.stream_blocks):
            arena.reserve(r.name, r.nbytes, offset=r.offset)
        if len(_PREFIX_REGIONS) >= 64:
            _PREFIX_REGIONS.clear()
        _PREFIX_REGIONS[key] = (plan, arena.regions[first:])

    @property
    def mode(self) -> str:
        return "batched" if self.batched else "per_stream"

    def _per_stream(self, run: Callable[[BatchedAttnMetadata, int, int], None]) -> None:
        for b, meta in enumerate(self.stream_meta):
            run(meta, b, int(self.cu_seqlens[b]))

    def _launcher(self, make: Callable[[BatchedAttnMetadata, int | None], Any], rows: tuple) -> Callable:
        """A launch of this pass, ``launch(stream, pointers)`` (the layer's pointers, a tuple): ``make(meta, b)`` (a
        :class:`~q12drv.kernels.layer_launch.LayerLaunch` or the like for ``meta``, stream ``b``'s own or the batch's,
        ``b`` None) made once for the batch, or once per stream with the pointers advanced to the stream's first row
        (``rows[i]``: pointer i's ``(elements, bytes)`` a token; ``(0, 0)`` for one that is not a row of tokens, a
        pool; ``_TABLE`` for a state-pointer table, advanced to stream ``b``'s entry)."""
        if self.batched:
            return make(self.meta, None).launch
        offsets = [tuple(h_state_entry_offset(b) if spec is _TABLE else row_offset(int(row), *spec) for spec in rows)
                   for b, row in enumerate(self.cu_seqlens[:-1])]
        return _PerStream([make(meta, b).launch for b, meta in enumerate(self.stream_meta)], offsets).launch

    def _driver_stream(self) -> Any:
        """The driver stream of :attr:`stream` (as :meth:`Device.as_stream <q12drv.core.device.Device.as_stream>`
        resolves it): the device's; a q12drv :class:`~q12drv.core.device.Stream`'s own (read at each call: a
        destroyed one is refused there); any other form resolved once for as long as it stays this pass's stream."""
        st, dev = self.stream, self.device
        if st is None:
            return dev.stream.raw
        if type(st) is Stream and st.device is dev and st.raw is not None:
            return st.raw
        given, raw = self._resolved_stream
        if not _same_arg(st, given):
            raw = dev.as_stream(st)
            self._resolved_stream = (st, raw)
        return raw

    def _layer(self, shape) -> _AttentionLayer | None:
        """``shape``'s layer record when this pass is current and ``shape`` was checked in it (None: check)."""
        layer = self._layers.get(id(shape))
        if layer is not None and layer.shape is shape:
            arena = self.arena
            if arena._buffer is not None and arena.generation == self._generation:
                return layer
        return None

    # attention: RoPE, KV write, paged attention, alone or as one layer -------------------------------------
    def _attention_ops(self, shape: AttentionShape, num_blocks, pools: tuple, tensors: dict,
                       align: dict = _ATTENTION_ALIGN) -> tuple:
        """``(addresses, num_blocks, layer)``: the checked addresses of ``tensors`` (name -> raw address or described
        object: bf16 activations, the pools in ``shape.kv_dtype``, fp32 scales), the pools' block count and the
        shape's :class:`_AttentionLayer`: the shape, the tensors (aligned as ``align``, the op's
        :data:`~q12drv.kernels.args.ALIGN` entry, says) and the block tables checked once, before anything is
        enqueued."""
        key = (id(align), tuple(tensors))
        bad = _BAD.get(key)
        if bad is None:
            bad = _BAD[key] = _bad_bits(align, key[1])
        layer = self._layer(shape)  # the common case first: this very (immutable) shape, checked with these pools
        if (layer is not None and num_blocks in layer.blocks and (type(num_blocks) is int or not pools)
                and _plain_aligned(tensors.values(), bad)):
            return tensors, num_blocks, layer  # (None in the set: the shape checked for an op without pools, RoPE)
        self._require_current()
        if not isinstance(shape, AttentionShape):
            raise TypeError(f"shape must be an AttentionShape, got {type(shape).__name__}")
        hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        if pools and num_blocks is None:
            num_blocks = count_of(pools[0], 0)
            if num_blocks is None:
                raise TypeError("num_blocks is needed when the KV pools are raw addresses (a pool tensor of shape "
                                "[num_blocks, block_size, Hkv, D] says it itself)")
        if _plain_aligned(tensors.values(), bad):
            addrs = tensors
        else:
            t, dev, pool = self._batch.total, self.device, (num_blocks, self.block_size, hkv, d)
            pool_dtype = FP8_POOL_DTYPES if getattr(shape, "kv_dtype", "bf16") == FP8_E4M3 else "bf16"
            spec = {"q": ("bf16", (t, hq, d)), "o": ("bf16", (t, hq, d)), "k": ("bf16", (t, hkv, d)),
                    "v": ("bf16", (t, hkv, d)), "k_pool": (pool_dtype, pool), "v_pool": (pool_dtype, pool),
                    "k_scale": ("f32", (hkv,)), "v_scale": ("f32", (hkv,))}
            addrs = {n: dev.pointer(x, n, dtype=spec[n][0], shape=spec[n][1], align=align.get(n, 2))
                     for n, x in tensors.items()}
        layer = self._layers.get(id(shape))
        if layer is None or layer.shape is not shape or type(num_blocks) is not int or num_blocks not in layer.blocks:
            if _SHAPES_OK.get((id(shape), self.use_mrope)) is not shape:
                self._check_attention_shape(shape)
                _remember_shape(shape, self.use_mrope, shape.mrope_section)
            if layer is None or layer.shape is not shape:
                layer = self._layers[id(shape)] = _AttentionLayer(shape)
            if pools:
                num_blocks = count("num_blocks", num_blocks, 1, I32_MAX // self.block_size)
                self._check_tables(num_blocks)
                layer.blocks.add(num_blocks)
            else:
                layer.blocks.add(None)
        return addrs, num_blocks, layer

    def _each(self, run: Callable) -> None:
        """``run(meta, row)`` once for the batch, or once per stream with its first packed row."""
        if self.batched:
            run(self.meta, 0)
        else:
            self._per_stream(lambda meta, b, row: run(meta, row))

    def _rope_launch(self, layer: _AttentionLayer) -> Callable:
        """The RoPE launch of ``layer``'s (checked) shape in this pass, made on first use."""
        if layer.rope is None:
            shape, dev = layer.shape, self.device
            hq, hkv, d, rd = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.rotary_dim
            theta, mode, sections = float(shape.rope_theta), shape.mrope_mode, tuple(shape.mrope_section)
            table = ops.rope_table(shape.rope_scaling, rd)
            layer.rope = self._launcher(lambda meta, b: ops.rope_launch(dev, meta, hq, hkv, d, rd, theta, mode, sections,
                                                                        table), ((hq * d, _BF16), (hkv * d, _BF16)))
        return layer.rope

    def _kv_write_launch(self, layer: _AttentionLayer, nb: int) -> Callable:
        """The bf16 KV write of ``layer``'s shape into pools of ``nb`` (checked) blocks in this pass."""
        run = layer.kv_write.get(nb)
        if run is None:
            dev, row, slots = self.device, layer.shape.num_kv_heads * layer.shape.head_dim, nb * self.block_size
            run = layer.kv_write[nb] = self._launcher(lambda meta, b: ops.kv_write_launch(dev, meta, row, slots),
                                                      ((row, _BF16), (row, _BF16), (0, 0), (0, 0)))
        return run

    def _attention_launch(self, layer: _AttentionLayer, algo: str) -> Callable:
        """The prefill attention kernel of ``algo`` for ``layer``'s shape in this pass (ValueError for an algo with
        no such kernel, :func:`~q12drv.kernels.ops.attention_entry`)."""
        run = layer.attention.get(algo) if type(algo) is str else None
        if run is None:
            shape, dev = layer.shape, self.device
            entry = ops.attention_entry(algo, shape.head_dim, dev.arch)
            hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
            scale = float(d ** -0.5 if shape.scale is None else shape.scale)
            window = _attn.window_argument(shape.window_left)
            run = layer.attention[algo] = self._launcher(
                lambda meta, b: ops.attention_launch(dev, meta, entry, hq, hkv, d, scale, window),
                ((hq * d, _BF16), (0, 0), (0, 0), (hq * d, _BF16)))
        return run

    def rope(self, q, k, shape: AttentionShape) -> None:
        """RoPE / MRoPE in place on Q ``[T, Hq, D]`` and K ``[T, Hkv, D]`` (bf16) at each token's position, for a
        runtime that writes the KV cache or runs attention its own way.

        Raises
        ------
        TypeError, ValueError
            A bad tensor, address or shape, before anything is enqueued.
        """
        layer = self._layer(shape)
        run = None if layer is None else layer.rope
        if (run is None or type(q) is not int or type(k) is not int or not q or not k
                or q & _ROPE_BAD[0] | k & _ROPE_BAD[1]):  # (the common case unrolled: exact, aligned ints)
            if not _plain_aligned((q, k), _ROPE_BAD) or run is None:
                a, _, layer = self._attention_ops(shape, None, (), {"q": q, "k": k})
                q, k = int(a["q"]), int(a["k"])
                run = self._rope_launch(layer)
        run(self._driver_stream(), (q, k))

    def kv_write(self, k, v, k_pool, v_pool, shape: AttentionShape, *, num_blocks: int | None = None,
                 k_scale=None, v_scale=None) -> None:
        """Write the packed new keys and values ``[T, Hkv, D]`` (bf16) into the paged pools ``[num_blocks,
        block_size, Hkv, D]`` at each token's slot, in ``shape.kv_dtype``. ``num_blocks`` is read from a pool tensor
        when not given. FP8 pools (``"fp8_e4m3"``) need ``k_scale`` and ``v_scale``: each KV head's fp32 scale
        (``[Hkv]`` in device memory; a value is stored as ``e4m3(x / scale)``, rounded to nearest even and saturated
        at +-448).

        Raises
        ------
        TypeError, ValueError
            A bad tensor, address, shape or block count, a missing scale, or a block table (host copy) with an entry
            past the pools, before anything is enqueued.
        """
        layer, ptrs = self._layer(shape), (k, v, k_pool, v_pool)
        run = layer.kv_write.get(num_blocks) if layer is not None and type(num_blocks) is int else None
        if run is None or k_scale is not None or v_scale is not None or not _plain4(k, v, k_pool, v_pool, _KV_BAD):
            if check_kv_scales(getattr(shape, "kv_dtype", "bf16"), k_scale, v_scale, "shape.kv_dtype"):
                self._kv_write_fp8(k, v, k_pool, v_pool, shape, num_blocks, k_scale, v_scale)
                return
            a, nb, layer = self._attention_ops(shape, num_blocks, (k_pool, v_pool),
                                               {"k": k, "v": v, "k_pool": k_pool, "v_pool": v_pool})
            ptrs = tuple(int(a[n]) for n in _KV_PTRS)
            run = self._kv_write_launch(layer, nb)
        run(self._driver_stream(), ptrs)

    def _kv_write_fp8(self, k, v, k_pool, v_pool, shape: AttentionShape, num_blocks, k_scale, v_scale) -> None:
        a, nb, layer = self._attention_ops(shape, num_blocks, (k_pool, v_pool), {
            "k": k, "v": v, "k_pool": k_pool, "v_pool": v_pool, "k_scale": k_scale, "v_scale": v_scale},
            ALIGN["kv_write_fp8"])
        hkv, d = shape.num_kv_heads, shape.head_dim
        _kvw.check_fp8_head_dim(d, "shape.head_dim")
        run = layer.kv_write_fp8.get(nb)
        if run is None:
            dev, row, slots = self.device, hkv * d, nb * self.block_size
            run = layer.kv_write_fp8[nb] = self._launcher(
                lambda meta, b: ops.kv_write_fp8_launch(dev, meta, d, row, slots),
                ((row, _BF16), (row, _BF16), (0, 0), (0, 0), (0, 0), (0, 0)))
        run(self._driver_stream(), tuple(int(a[n]) for n in (*_KV_PTRS, *_SCALES)))

    def attention(self, q, k_pool, v_pool, o, shape: AttentionShape, *, num_blocks: int | None = None,
                  algo: str = "auto", num_splits: int | None = None, workspace=None,
                  workspace_bytes: int | None = None, k_scale=None, v_scale=None) -> None:
        """Batched varlen paged causal attention: O ``[T, Hq, D]`` from Q (positions already applied) and the paged
        pools (bottom-right causal over each stream's ``kv_len``, within ``shape.sliding_window`` where it is set),
        for a runtime with its own RoPE or KV layout. ``algo``: :data:`q12drv.kernels.ops.ATTN_ALGOS`; ``"decode"``
        (every stream at most 8 new tokens) runs :meth:`decode_plan`'s split count (``num_splits``, default planned
        from the pass) and, with splits, needs ``workspace`` of :meth:`decode_workspace_bytes` (a device address with
        ``workspace_bytes``, or a tensor). FP8 pools (``shape.kv_dtype="fp8_e4m3"``, written by :meth:`kv_write`) are
        read by ``"decode"`` only, with ``k_scale`` and ``v_scale`` as :meth:`kv_write` took them (each KV head's
        fp32 scale, ``[Hkv]``). ``"auto"`` runs ``"decode"`` where the decode kernel takes the pass and either the
        pools are FP8 or a ``workspace`` is given and :meth:`decode_plan` splits the keys
        (:func:`~q12drv.kernels.attention_decode.auto_runs`: few long streams); otherwise a prefill kernel.

        Raises
        ------
        TypeError, ValueError
            A bad tensor, address, shape, block count or ``algo``, a block table entry attention would read past
            the pools, FP8 pools without their scales or with another algo than ``"decode"``, scales given for bf16
            pools, or for ``"decode"`` a stream longer than the kernel takes or a missing or small workspace, before
            anything is enqueued.
        """
        layer, ptrs, run = self._layer(shape), (q, k_pool, v_pool, o), None
        if layer is not None and type(num_blocks) is int and num_blocks in layer.blocks and type(algo) is str:
            run = layer.attention.get(algo)  # (a prefill kernel: "decode" is never one)
        if (run is None or workspace is not None or k_scale is not None or v_scale is not None
                or not _plain4(q, k_pool, v_pool, o, _ATTN_BAD)):
            if algo == "auto" and (workspace is not None or k_scale is not None) and self._auto_decode(shape,
                                                                                                    num_splits):
                algo = "decode"
            check_attention_pools(shape, algo)
            if check_kv_scales(getattr(shape, "kv_dtype", "bf16"), k_scale, v_scale, "shape.kv_dtype"):
                a, _, _ = self._attention_ops(shape, num_blocks, (k_pool, v_pool), {
                    "q": q, "k_pool": k_pool, "v_pool": v_pool, "o": o, "k_scale": k_scale, "v_scale": v_scale},
                    ALIGN["attention_fp8"])
                return self._attention_decode(a, shape, num_splits, workspace, workspace_bytes)
            a, _, layer = self._attention_ops(shape, num_blocks, (k_pool, v_pool),
                                              {"q": q, "k_pool": k_pool, "v_pool": v_pool, "o": o})
            if algo == "decode":
                return self._attention_decode(a, shape, num_splits, workspace, workspace_bytes)
            ptrs = tuple(int(a[n]) for n in _ATTN_PTRS)
            run = self._attention_launch(layer, algo)
        run(self._driver_stream(), ptrs)

    def attention_layer(self, q, k, v, k_pool, v_pool, o, shape: AttentionShape, *, num_blocks: int | None = None,
                        algo: str = "auto", workspace=None, workspace_bytes: int | None = None) -> None:
        """:meth:`rope`, :meth:`kv_write` and :meth:`attention` as one layer: RoPE on Q and K in place, K and V into
        the pools, attention into O. Every argument is checked once, before the first launch.

        Q, O ``[T, Hq, D]``; K, V ``[T, Hkv, D]``; the pools ``[num_blocks, block_size, Hkv, D]``; all bf16, as raw
        device addresses (stream b's rows start at ``cu_seqlens[b]``) or tensors. ``algo`` picks the attention
        kernel (:data:`q12drv.kernels.ops.ATTN_ALGOS` but ``"decode"``; ``"auto"``: wgmma on Hopper where it exists,
        or with ``workspace`` (:meth:`decode_workspace_bytes`) the decode kernel where :meth:`attention`'s
        ``"auto"`` runs it: few long streams).

        Raises
        ------
        TypeError, ValueError
            A bad tensor, address (NULL, misaligned, wrong dtype or shape), shape, ``num_blocks`` or ``algo`` (or a
            head dim it has no kernel for), a block table (host copy) with an entry ``>= num_blocks`` where
            attention reads it, or a small workspace where the decode kernel runs: raised before anything is
            enqueued, so no buffer has changed.
        """
        layer = self._layer(shape)
        runs = None
        if layer is not None and type(num_blocks) is int and type(algo) is str:
            runs = (layer.rope, layer.kv_write.get(num_blocks), layer.attention.get(algo))
        if (runs is None or None in runs or workspace is not None or not _plain4(q, k_pool, v_pool, o, _ATTN_BAD)
                or not (int is type(k) is type(v) and k and v and not (k & _KV_BAD[0] | v & _KV_BAD[1]))
                and not _plain_aligned((k, v), _KV_BAD)):  # (k and v: the common case unrolled)
            check_attention_pools(shape)
            a, nb, layer = self._attention_ops(shape, num_blocks, (k_pool, v_pool),
                                               {"q": q, "k": k, "v": v, "k_pool": k_pool, "v_pool": v_pool, "o": o})
            # every argument is checked now (the algo by its launch, the decode plan's workspace by its launcher):
            # the launches write the kernels' blocks
            if algo == "auto" and workspace is not None and self._auto_decode(shape, None):
                decode = self._decode_launch(shape, None, workspace, workspace_bytes)
                attention = lambda st, p: decode(*p)  # noqa: E731  (the decode launches take the pass's stream)
            else:
                attention = self._attention_launch(layer, algo)
            runs = (self._rope_launch(layer), self._kv_write_launch(layer, nb), attention)
            q, k, v, k_pool, v_pool, o = (int(a[n]) for n in ("q", "k", "v", "k_pool", "v_pool", "o"))
        rope, kv_write, attention = runs
        st = self._driver_stream()
        rope(st, (q, k))
        kv_write(st, (k, v, k_pool, v_pool))
        attention(st, (q, k_pool, v_pool, o))

    # state-pointer tables, staged once for every layer ------------------------------------------------------
    def stage_states(self, rows: Sequence[Sequence] | np.ndarray) -> tuple[StateRow, ...]:
        """Stage the state-pointer tables of this pass's layers at once: ``rows[r][b]``, stream b's state in table r
        (a Gated DeltaNet layer's fp32 ``[Hv, D, D]`` states, a short convolution's bf16 ``[W - 1, C]`` states; raw
        addresses or tensors, or every address at once as an integer array ``[tables, n]``), one copy for all of
        them, at the arena's cursor (after the pass's ``h_state_ptrs`` slot). Give row r to :meth:`gdn_layer` or
        :meth:`conv1d` in place of a pointer list: the layer then copies nothing (a list costs each layer a copy into
        the slot, its event and their host time). Size the arena for the rows with :meth:`arena_bytes` or
        :meth:`max_arena_bytes` (``state_rows=``).

        Returns
        -------
        tuple of StateRow
            One per table, valid for this pass (a later pass stages its own).

        Raises
        ------
        TypeError, ValueError
            Not a non-empty sequence of rows, a row that is not one pointer per stream, or a NULL, out-of-range or
            misaligned pointer (the message names the row and the stream); nothing reserved or written.
        CapacityError
            The tables do not fit after the cursor; nothing reserved or written.
        Q12Error
            The pass is stale, or its stream is capturing a CUDA graph (capture :class:`~q12drv.PassGraph` instead).

        Examples
        --------
        >>> rows = step.stage_states([conv_states, ssm_states])       # doctest: +SKIP
        >>> step.conv1d(rows[0], x, y, w)                              # doctest: +SKIP
        >>> step.gdn_layer(rows[1], tensors, shape)                    # doctest: +SKIP
        """
        self._require_current()
        if isinstance(rows, (str, bytes)) or not isinstance(rows, (Sequence, np.ndarray)) or len(rows) == 0:
            raise TypeError(f"rows must be a non-empty sequence of state pointer lists (one per table), got "
                            f"{type(rows).__name__ if not isinstance(rows, Sequence) else 'an empty sequence'}")
        arena, n = self.arena, len(self.streams)
        table, dtypes = plain_table(rows, n, _STATE_ALIGN), None
        if table is None:  # tensors, or something to name: each row checked as a layer checks its list
            values, dtypes = [], []
            for r, row in enumerate(rows):
                seen: set = set()
                values.append(self._state_addresses(row, f"rows[{r}]", _STATE_ALIGN, seen=seen))
                if len(seen) > 1:
                    raise ValueError(f"rows[{r}] mixes tensors of {sorted(seen)}: one table holds the states of one op")
                dtypes.append(seen.pop() if seen else None)
            table = np.array([[int(p) for p in row] for row in values], np.uint64)
        try:
            return stage_state_rows(arena, table, self.stream, dtypes)
        except CapacityError as exc:  # the arena's refusal (nothing reserved), with what to do about it
            if exc.region != "state_tables":
                raise
            raise CapacityError("state_tables", exc.needed, exc.available,
                                f"{len(table)} tables of {n} streams after the cursor at {arena.cursor:,}; size the "
                                f"arena with Q12Pass.arena_bytes(counts, ..., state_rows={len(table)})") from None

    # the short convolution -------------------------------------------------------------------------------
    def conv1d(self, state_ptrs: Sequence | StateRow, x, y, w, *, channels: int | None = None, width: int | None = None,
               bias=None, state_stride: int | None = None, silu: bool = True) -> None:
        """The short convolution of a Gated DeltaNet layer: causal depthwise conv1d (+ SiLU) over ``x`` ``[T, C]``
        into ``y`` ``[T, C]`` (bf16; rows may be a strided slice of a wider buffer: a tensor says its row stride),
        each stream's state ``[W - 1, C]`` bf16 at ``state_ptrs[b]`` read and then overwritten with its last
        ``W - 1`` inputs (a new prompt's state is zeros). ``w``: ``[C, W]`` (or ``[C, 1, W]``, PyTorch's
        depthwise ``Conv1d.weight``); ``channels`` and ``width`` are read from a tensor when not given.

        The state pointers travel through the pass's per-layer pointer slot (the same slot :meth:`gdn_layer` uses
        next, rewritten stream-ordered), so a layer needs no pointer table of its own; or ``state_ptrs`` is a row
        :meth:`stage_states` staged for this pass, read where it was staged (no copy).

        Raises
        ------
        TypeError, ValueError
            A bad tensor, address, stride, width or channel count, x and y overlapping, or a state pointer list of
            the wrong length: before the slot is rewritten or anything is enqueued.
        Q12Error
            A state row staged for another pass.
        """
        arena = self.arena
        if arena._buffer is None or arena.generation != self._generation:
            self._require_current()  # raises
        # the common case first: raw addresses for a layer like one this pass checked (its channels, width, state
        # stride and flag: the same launch); only this layer's pointers are checked (no bias: unrolled here)
        key = (channels, width, state_stride, silu) if (
            type(channels) is int and type(width) is int and type(silu) is bool
            and (state_stride is None or type(state_stride) is int)) else None
        hit = None if key is None else self._conv_layers.get(key)
        if hit is not None and (
                (bias is None and int is type(x) is type(y) is type(w) and x and y and w
                 and not (x & _CONV_BAD[0] | y & _CONV_BAD[1] | w & _CONV_BAD[2]))
                or _plain_conv(x, y, w, bias)) and (x + hit[1] <= y or y + hit[1] <= x):
            run, args = hit[0], (x, y, w, 0 if bias is None else bias)
        else:
            run, args = self._conv1d_checked(key, x, y, w, channels, width, bias, state_stride, silu)
        if type(state_ptrs) is StateRow:
            table = state_ptrs.check(arena, self._generation, _CONV_STATE_ALIGN, "bf16",
                                     "the short convolution's states")
        else:
            states = self._state_addresses(state_ptrs, "state_ptrs", _CONV_STATE_ALIGN, dtype="bf16")
            table = int(self.h_slot.ptr)
            self.h_slot.write_checked(states, self.stream)
        run(self._driver_stream(), (*args, table))

    def _conv1d_checked(self, key: tuple | None, x, y, w, channels, width, bias, state_stride, silu) -> tuple:
        """:meth:`conv1d`'s checks of everything but the states (tensors or addresses, channels, width, strides,
        overlap over the whole batch's rows) and its launch for this pass (made once per channels, width, strides and
        flag; remembered under ``key``, the arguments as given where they are exact ints and a bool, for later layers
        on raw addresses): ``(launch, (x, y, w, bias) addresses)``."""
        dev = self.device
        c = channels if channels is not None else count_of(x, 1)
        if c is None:
            raise TypeError("channels is needed when x is a raw address (a [T, C] tensor says it itself)")
        c = count("channels", c)
        if width is None:
            info = describe(w, "w")
            if info is None:
                raise TypeError("width is needed when w is a raw address (a [C, W] tensor says it itself)")
            width = info.shape[-1]
        align = ALIGN["conv1d"]
        xp, sx = row_view(dev, x, "x", columns=c, dtype="bf16", align=align["x"])
        yp, sy = row_view(dev, y, "y", columns=c, dtype="bf16", align=align["y"])
        wp = dev.pointer(w, "w", dtype="bf16", align=align["w"])
        bp = None if bias is None else dev.pointer(bias, "bias", dtype="bf16", shape=(c,), align=align["bias"])
        entry, strides, bias_addr = check_conv1d(self._batch.total, xp, yp, channels=c, width=width, bias=bp,
                                                 x_stride=sx, y_stride=sy, state_stride=state_stride, silu=silu)
        launches = self._conv_launches.get((entry, c, strides, silu))
        if launches is None:
            launches = self._conv_launches[(entry, c, strides, silu)] = self._launcher(
                lambda meta, b: conv1d_launch(dev, meta, entry, c, *strides, silu),
                ((strides[0], _BF16), (strides[1], _BF16), (0, 0), (0, 0), _TABLE))
        if key is not None and strides[:2] == (c, c):
            # raw addresses' rows are c apart: a later layer with the same key needs only its pointers checked
            self._conv_layers[key] = (launches, rows_extent(self._batch.total, c, c, _BF16))
        return launches, (int(xp), int(yp), int(wp), bias_addr)

    def _state_addresses(self, state_ptrs, name: str, align: int, dtype: str | None = None,
                         seen: set | None = None) -> list:
        """One state address per stream (raw addresses or tensors), checked (``seen``: a set that collects the
        tensors' dtypes, each tensor described once, instead of checking them against ``dtype``)."""
        n = len(self.streams)
        if plain_pointers(state_ptrs, align) and len(state_ptrs) == n:
            return state_ptrs if type(state_ptrs) is list else list(state_ptrs)
        if isinstance(state_ptrs, (str, bytes)) or not isinstance(state_ptrs, (Sequence, np.ndarray)):
            raise TypeError(f"{name} must be a sequence of {n} device pointers or tensors, got "
                            f"{type(state_ptrs).__name__}")
        if len(state_ptrs) != n:
            raise ValueError(f"{name} needs exactly {n} pointers (one per stream), got {len(state_ptrs)}")
        if seen is None:
            return [self.device.pointer(p, f"{name}[{b}]", dtype=dtype, align=align) for b, p in enumerate(state_ptrs)]
        out = []
        for b, p in enumerate(state_ptrs):
            info = None if isinstance(p, (int, np.integer)) else describe(p, f"{name}[{b}]")
            if info is not None:
                seen.add(info.dtype)
            out.append(self.device.pointer(p, f"{name}[{b}]", align=align, info=info))
        return out

    def gdn_plan(self, shape: GdnShape, config: GdnConfig | GdnPlan = GdnConfig()) -> GdnPlan:
        """The plan of ``config`` for this pass: made once from the whole batch (its streams, its longest stream's
        tokens) on this pass's device, and run as is whether the pass runs batched or stream by stream, so both give
        the same bits (:func:`~q12drv.kernels.gdn.plan_gdn`). A :class:`~q12drv.kernels.gdn.GdnPlan` is checked
        to cover the pass once and returned."""
        key = (shape, config if isinstance(config, GdnConfig) else id(config))  # (the entry keeps a plan alive)
        hit = self._gdn_plans.get(key)
        if hit is None:
            hit = self._gdn_plans[key] = (config, resolve_plan(config, shape, len(self.streams), self._longest,
                                                               self.device))
        return hit[1]

    def gdn_workspace_bytes(self, shape: GdnShape, config: GdnConfig | GdnPlan = GdnConfig()) -> int:
        """Workspace ``gdn_layer(..., config=config)`` needs for this pass and ``shape`` (0: none): the plan's for
        the launches this pass makes (per stream: one stream of the longest)."""
        return self.gdn_plan(shape, config).workspace_bytes_for(*self._gdn_extent)

    def gdn_layer(self, state_ptrs: Sequence[int] | StateRow, tensors: GdnTensors, shape: GdnShape, *,
                  config: GdnConfig | GdnPlan = GdnConfig(), workspace: int | None = None,
                  workspace_bytes: int | None = None) -> None:
        """Run Gated DeltaNet over this layer's per-stream states: their pointers copied into the pass's JIT slot
        first, or read where :meth:`stage_states` staged them.

        ``tensors``: q, k ``[T, Hk, D]`` bf16; v, o ``[T, Hv, D]`` bf16; g, beta ``[T, Hv]`` fp32
        (:class:`~q12drv.kernels.gdn.GdnTensors`); ``state_ptrs[b]``: stream b's fp32 ``[Hv, D, D]`` state, updated
        in place. ``state_ptrs`` may instead be a row :meth:`stage_states` staged for this pass: then nothing is
        copied (the layer reads its table where it was staged). ``config`` (:class:`~q12drv.kernels.gdn.GdnConfig`,
        default the fastest path on this device, or a :class:`~q12drv.kernels.gdn.GdnPlan` made for at least this
        pass) is planned once for the pass
        (:meth:`gdn_plan`) and the same kernels run batched or per stream. The two-pass and overlapped schedules
        need ``workspace`` (a device address with ``workspace_bytes`` >= :meth:`gdn_workspace_bytes`, or a tensor that
        large); ``GdnConfig(schedule="fused")`` runs without one.

        Raises
        ------
        TypeError, ValueError
            A bad pointer, shape, config, state pointer list or workspace: raised before the slot is rewritten or
            anything is enqueued.
        Q12Error
            A state row staged for another pass.
        """
        layer = self._gdn_layers.get(id(shape))
        arena = self.arena
        if (layer is not None and layer.shape is shape and layer.config is config and type(tensors) is GdnTensors
                and (workspace is layer.workspace or _same_arg(workspace, layer.workspace))
                and (workspace_bytes is layer.workspace_bytes or _same_arg(workspace_bytes, layer.workspace_bytes))
                and arena._buffer is not None and arena.generation == self._generation):
            # the shape, the plan and the workspace checked for this pass already: the tensors and states are this
            # layer's own
            ptrs = (tensors.q, tensors.k, tensors.v, tensors.g, tensors.beta, tensors.o)
            if not _plain_gdn(ptrs):
                ptrs = tensors.checked(self.device, self._batch.total, shape)
        else:
            ptrs = self._check_gdn(tensors, shape)
            layer = None
        if type(state_ptrs) is StateRow:
            table = state_ptrs.check(arena, self._generation, _STATE_ALIGN, "f32", "Gated DeltaNet's states")
            states = None
        else:
            states = self._state_addresses(state_ptrs, "state_ptrs", _STATE_ALIGN, dtype="f32")
            table = int(self.h_slot.ptr)
        if layer is None:
            layer = self._gdn_layer(shape, config, workspace, workspace_bytes)
        if states is not None:
            self.h_slot.write_checked(states, self.stream)
        layer.run(self._driver_stream(), (table, *ptrs))

    def _gdn_layer(self, shape: GdnShape, config: GdnConfig | GdnPlan, workspace, workspace_bytes) -> _GdnLayer:
        """The :class:`_GdnLayer` of ``shape`` (checked) run with ``config`` and this workspace: the plan, the
        workspace checked, the launches (made again only where the plan or the workspace differ)."""
        plan = self.gdn_plan(shape, config)
        ws = check_workspace(plan, plan.workspace_bytes_for(*self._gdn_extent), workspace, workspace_bytes, self.device)
        layer = self._gdn_layers.get(id(shape))
        if layer is None or layer.shape is not shape or layer.plan is not plan or layer.ws != ws:
            hk, hv, d = plan.shape.num_k_heads, plan.shape.num_v_heads, plan.shape.head_dim
            dev = self.device
            layer = self._gdn_layers[id(shape)] = _GdnLayer()
            layer.shape, layer.plan, layer.ws = shape, plan, ws
            layer.run = self._launcher(
                lambda meta, b: GdnLaunch(dev, meta, plan, ws),
                (_TABLE, (hk * d, _BF16), (hk * d, _BF16), (hv * d, _BF16), (hv, _F32), (hv, _F32), (hv * d, _BF16)))
        layer.config, layer.workspace, layer.workspace_bytes = config, workspace, workspace_bytes
        return layer

    # decode attention --------------------------------------------------------------------------------------
    def decode_plan(self, shape: AttentionShape, num_splits: int | None = None) -> _dec.DecodePlan:
        """The decode attention plan (:func:`~q12drv.kernels.attention_decode.plan_decode`) of ``shape`` for this
        pass: its split count decided once from the whole batch (its streams, the longest stream's tokens and keys,
        ``shape``'s sliding window and pool type, this device's SMs; ``num_splits`` forces it) and run as is whether
        the pass runs batched or stream by stream, so both give the same bits.

        Raises
        ------
        ValueError
            A stream longer than the decode kernel takes (the message names it), or a bad shape or ``num_splits``.
        """
        if num_splits is not None:  # checked before it keys the cache (2.0 == 2)
            num_splits = count("num_splits", num_splits, 1, _dec.MAX_SPLITS)
        key = (shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.window_left, num_splits, shape.kv_dtype)
        plan = self._decode_plans.get(key)
        if plan is None:
            batch = self._batch
            plan = self._decode_plans[key] = _dec.plan_decode(
                len(self.streams), self._longest, max(batch.kv_list), shape.num_q_heads, shape.num_kv_heads,
                shape.head_dim, num_sms=self.device.sm_count, window_left=shape.window_left, num_splits=num_splits,
                q_lens=batch.count_list, kv_dtype=shape.kv_dtype)
        return plan

    def _auto_decode(self, shape: AttentionShape, num_splits) -> bool:
        """Whether ``attention(..., algo="auto")`` runs the decode kernel for ``shape`` in this pass, given a
        workspace or FP8 pools (:func:`~q12drv.kernels.attention_decode.auto_runs`; False where the shape or the
        batch is not the decode kernel's: the checks that follow refuse or route them)."""
        if not isinstance(shape, AttentionShape) or not _dec.takes(self._longest, shape.num_q_heads,
                                                                    shape.num_kv_heads, shape.head_dim):
            return False
        self._check_attention_shape(shape)
        return _dec.auto_runs(self.decode_plan(shape, num_splits))

    def attention_workspace_bytes(self, shape: AttentionShape) -> int:
        """Workspace :meth:`attention` and :meth:`attention_layer` use with ``algo="auto"`` for ``shape`` in this
        pass: the decode kernel's (:meth:`decode_workspace_bytes`) where ``"auto"`` runs it with a workspace (a
        decode batch whose keys it splits), else 0 (a prefill kernel, or one split: none needed). Give the
        ops a workspace this large (or larger) to get the decode kernel where it is the faster one.

        Raises
        ------
        TypeError, ValueError
            A bad shape.
        """
        self._check_attention_shape(shape)
        return self.decode_workspace_bytes(shape) if self._auto_decode(shape, None) else 0

    def decode_workspace_bytes(self, shape: AttentionShape, num_splits: int | None = None) -> int:
        """Workspace ``attention(..., algo="decode", num_splits=num_splits)`` needs for this pass and ``shape`` (0:
        none, one split): the batched launch's, which covers every stream's own."""
        return self.decode_plan(shape, num_splits).workspace_bytes_for(self._batch.total)

    def _attention_decode(self, a: dict, shape: AttentionShape, num_splits, workspace, workspace_bytes) -> None:
        """:meth:`attention` with ``algo="decode"``, its tensors checked (``a``; FP8 pools: with the scales): plan,
        workspace, launches."""
        self._decode_launch(shape, num_splits, workspace, workspace_bytes)(
            int(a["q"]), int(a["k_pool"]), int(a["v_pool"]), int(a["o"]), int(a.get("k_scale", 0)),
            int(a.get("v_scale", 0)))

    def _decode_launch(self, shape: AttentionShape, num_splits, workspace, workspace_bytes) -> Callable:
        """The decode attention of ``shape`` in this pass, its plan and workspace checked now:
        ``run(q, k_pool, v_pool, o, k_scale, v_scale)`` (checked addresses; the scales 0 for bf16 pools) enqueues
        it on the pass's stream."""
        plan = self.decode_plan(shape, num_splits)
        ws = _dec.check_workspace(self.device, plan, plan.workspace_bytes_for(self._batch.total), workspace,
                                  workspace_bytes)
        hq, d = shape.num_q_heads, shape.head_dim
        scale = float(d ** -0.5 if shape.scale is None else shape.scale)
        dev, st = self.device, self.stream

        def run(q: int, kp: int, vp: int, o: int, ks: int = 0, vs: int = 0) -> None:
            self._each(lambda meta, row: _dec.enqueue_decode(dev, meta, plan, q + row_offset(row, hq * d, _BF16), kp,
                                                             vp, o + row_offset(row, hq * d, _BF16), ws, scale, st,
                                                             ks, vs))
        return run
