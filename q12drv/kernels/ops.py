"""Launchers: one function per kernel, taking staged metadata and raw device pointers.

Each launcher validates the shapes it is given, computes the launch geometry from host-known
values (never from device memory), writes the arguments into the kernel's pre-packed argument
block and enqueues one launch. The metadata struct is built once per staged
:class:`~q12drv.core.staging.BatchedAttnMetadata` and passed by value.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..core.device import Device
from ..core.staging import BatchedAttnMetadata
from . import attention as _attn
from . import attention_wgmma as _attnw
from . import expand as _expand
from . import gdn as _gdn
from . import gdn_chunk as _gdnc
from . import gdn_wgmma as _gdnw
from . import kv_write as _kvw
from . import args as _args
from . import rope as _rope
from .meta import meta_struct
from .registry import ENTRIES, SOURCES, prepared, struct_types

__all__ = ["kv_write", "rope", "attention", "gdn", "ATTN_ALGOS", "attention_entry", "GDN_ALGOS", "GDN_MODULES",
           "enqueue_kv_write", "enqueue_rope", "enqueue_attention", "enqueue_gdn", "check_gdn_algo", "check_gdn_form",
           "GDN_FORMS", "gdn_workspace",
           "gdn_workspace_bytes", "GDN_WORKSPACE_ALGOS",
           "prepared", "SOURCES", "ENTRIES", "struct_types"]

#: ``(name, value, align)`` -> the int address: non-NULL, < 2**64, aligned (TypeError/ValueError).
_ptr = _args.device_ptr


def _positive(name: str, value) -> int:
    return _args.count(name, value)  # an int in [1, 2**31 - 1] (TypeError/ValueError)


# Launch geometry and parameter checks are pure functions of a few ints: each distinct input is
# computed (and checked) once. Only successful results are cached; a bad input raises every time.
_kvw_geometry = lru_cache(maxsize=1024, typed=True)(_kvw.geometry)
_rope_geometry = lru_cache(maxsize=1024, typed=True)(_rope.geometry)
_rope_params = lru_cache(maxsize=256, typed=True)(_rope.check_params)


#: Attention kernels (``ops.attention(..., algo=)``): ``"mma"`` (``attention/mma.cu``, mma.sync, any sm_90
#: build, head dims 64/128/256), ``"wgmma"`` (``attention/wgmma.cu``, sm_90a, head dims 128/256) and
#: ``"auto"``: wgmma where it exists (Hopper, head dims 128 and 256; faster on every measured case,
#: bench/RESULTS.md), mma.sync elsewhere.
ATTN_ALGOS = ("auto", "mma", "wgmma")
_ATTN_MODULES = {"mma": _attn, "wgmma": _attnw}


def attention_entry(algo: str, head_dim: int, arch: str = "sm_90") -> str:
    """The attention entry of ``algo`` for ``head_dim`` on a device of ``arch``.

    Raises
    ------
    ValueError
        An unknown ``algo``, or a head dim that ``algo`` has no kernel for.
    """
    if algo == "auto":
        algo = "wgmma" if head_dim in _attnw.HEAD_DIMS and arch in ("sm_90", "sm_90a") else "mma"
    mod = _ATTN_MODULES.get(algo) if isinstance(algo, str) else None
    if mod is None:
        raise ValueError(f"attention algo must be one of {ATTN_ALGOS}, got {algo!r}")
    return mod.entry_for_head_dim(head_dim)


@lru_cache(maxsize=1024, typed=True)
def _attn_geometry(entry: str, batch_size: int, chunk_len: int, num_q_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple:
    if entry in _attnw.ENTRIES:
        return _attnw.geometry(batch_size, chunk_len, num_q_heads, num_kv_heads, head_dim)
    return _attn.geometry(batch_size, chunk_len, num_q_heads, head_dim, num_kv_heads=num_kv_heads)


def _check(device, meta) -> None:
    if type(device) is Device and type(meta) is BatchedAttnMetadata:  # the common case: current metadata
        arena = meta.arena
        if arena is None or (not arena.closed and arena.generation == meta.generation):
            return
    if not isinstance(device, Device):
        raise TypeError(f"device must be a q12drv Device, got {type(device).__name__}")
    if not isinstance(meta, BatchedAttnMetadata):
        raise TypeError(f"meta must be a BatchedAttnMetadata (from the stager), got {type(meta).__name__}")
    meta.require_current()  # staged before the arena's last reset, or in a closed arena: Q12Error


def kv_write(device: Device, meta: BatchedAttnMetadata, k: int, v: int, k_pool: int, v_pool: int, *,
             num_kv_heads: int, head_dim: int, num_blocks: int, stream: Any = None) -> None:
    """Write the packed new keys/values ``[T, Hkv, D]`` into the paged pools at ``slot_stacked``.

    Tokens with a negative slot are skipped; slots at or past ``num_blocks * block_size`` are
    never written.
    """
    _check(device, meta)
    row = _positive("num_kv_heads", num_kv_heads) * _positive("head_dim", head_dim)
    if row % 8 or row > _args.I32_MAX:
        raise ValueError(f"num_kv_heads * head_dim = {row} must be a multiple of 8 (16-byte rows) and fit an int32")
    enqueue_kv_write(device, meta, _ptr("k", k), _ptr("v", v), _ptr("k_pool", k_pool), _ptr("v_pool", v_pool), row,
                     _positive("num_blocks", num_blocks) * meta.block_size, stream)


def enqueue_kv_write(device: Device, meta: BatchedAttnMetadata, k: int, v: int, k_pool: int, v_pool: int,
                     row_elems: int, num_slots: int, stream: Any) -> None:
    """:func:`kv_write` with every argument already checked (ints in range): geometry, pack, launch."""
    grid, block, smem = _kvw_geometry(meta.total_tokens, row_elems, num_sms=device.sm_count)
    launch = prepared(device, "q12_kv_write")
    a = launch.args
    a.k, a.v, a.k_pool, a.v_pool, a.row_elems, a.num_slots = k, v, k_pool, v_pool, row_elems, num_slots
    a.m = meta_struct(meta)
    launch.launch(grid, block, smem, stream)


def rope(device: Device, meta: BatchedAttnMetadata, q: int, k: int, *, num_q_heads: int, num_kv_heads: int,
         head_dim: int, rotary_dim: int, theta: float, mrope_mode: int = 0, sections: tuple = (0, 0, 0),
         scaling: _rope.RopeScaling | None = None, stream: Any = None) -> None:
    """Rotate Q ``[T, Hq, D]`` and K ``[T, Hkv, D]`` in place (NeoX pairs, positions from ``meta``).

    ``mrope_mode``: 0 plain, 1 chunked sections (Qwen2-VL), 2 interleaved (Qwen3-VL, Qwen3.5). ``scaling``: a
    :class:`~q12drv.kernels.rope.RopeScaling` (scaled RoPE: its frequencies replace ``theta``'s, and cos and sin are
    multiplied by its attention factor).
    """
    _check(device, meta)
    hq, hkv = _args.count("num_q_heads", num_q_heads, 0), _args.count("num_kv_heads", num_kv_heads, 0)
    d, rd = _positive("head_dim", head_dim), _args.count("rotary_dim", rotary_dim, 0)
    mode = _args.count("mrope_mode", mrope_mode, 0, 2)
    if isinstance(sections, (str, bytes)) or not isinstance(sections, (tuple, list)) or len(sections) != 3:
        raise ValueError(f"MRoPE sections must be 3 ints (T, H, W), got {sections!r:.60}")
    secs = tuple(_args.count(f"sections[{i}]", x, 0) for i, x in enumerate(sections))
    _rope_params(d, rd, mode, secs, hq, hkv)
    if mode and not meta.use_mrope:
        raise ValueError("mrope_mode needs metadata staged with use_mrope=True (H and W position streams)")
    theta = _args.positive_float("theta", theta)
    enqueue_rope(device, meta, _ptr("q", q), _ptr("k", k), hq, hkv, d, rd, theta, mode, secs, stream,
                 rope_table(scaling, rd))


def rope_table(scaling, rotary_dim: int):
    """The launch's frequency table for ``scaling`` (None: none), checked against ``rotary_dim``.

    Raises
    ------
    TypeError, ValueError
        ``scaling`` is not a :class:`~q12drv.kernels.rope.RopeScaling`, or its table is not ``rotary_dim // 2`` long.
    """
    if scaling is None:
        return _rope.NO_TABLE
    if not isinstance(scaling, _rope.RopeScaling):
        raise TypeError(f"scaling must be a q12drv.kernels.rope.RopeScaling or None, got {type(scaling).__name__}")
    if scaling.half != rotary_dim // 2:
        raise ValueError(f"the RopeScaling table has {scaling.half} frequencies but rotary_dim {rotary_dim} needs "
                         f"{rotary_dim // 2}")
    return scaling.table()


def enqueue_rope(device: Device, meta: BatchedAttnMetadata, q: int, k: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, rotary_dim: int, theta: float, mrope_mode: int, sections: tuple, stream: Any,
                 table=_rope.NO_TABLE) -> None:
    """:func:`rope` with every argument already checked (ints, a float, 3 section ints, ``table`` from
    :func:`rope_table`): geometry, pack, launch."""
    grid, block, smem = _rope_geometry(meta.total_tokens, num_q_heads, num_kv_heads, head_dim, rotary_dim,
                                       num_sms=device.sm_count)
    launch = prepared(device, "q12_rope")
    a = launch.args
    a.q, a.k, a.num_q_heads, a.num_kv_heads, a.head_dim, a.rotary_dim = q, k, num_q_heads, num_kv_heads, head_dim, rotary_dim
    a.theta, a.mrope_mode, a.sec_t, a.sec_h, a.sec_w = theta, mrope_mode, sections[0], sections[1], sections[2]
    if a.table.size or table.size:  # 1 KiB: written only when a table is or was in it
        a.table = table
    a.m = meta_struct(meta)
    launch.launch(grid, block, smem, stream)


def attention(device: Device, meta: BatchedAttnMetadata, q: int, k_pool: int, v_pool: int, o: int, *,
              num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
              algo: str = "auto", stream: Any = None) -> None:
    """Batched varlen paged causal attention: O ``[T, Hq, D]`` from Q and the paged K/V pools.

    ``algo`` (:data:`ATTN_ALGOS`): ``"auto"`` (default: wgmma on Hopper for head dims 128 and 256,
    else mma.sync), ``"mma"`` (mma.sync, head dims 64/128/256) or ``"wgmma"`` (Hopper's warpgroup
    MMA, compiled for sm_90a; head dims 128/256). The kernels agree to bf16 rounding.
    """
    _check(device, meta)
    if scale is not None:
        _args.positive_float("scale", scale)
    d = _positive("head_dim", head_dim)
    entry = attention_entry(algo, d, device.arch)
    hq, hkv = _args.head_group("num_q_heads", num_q_heads, "num_kv_heads", num_kv_heads)
    enqueue_attention(device, meta, entry, _ptr("q", q, 16), _ptr("k_pool", k_pool, 16), _ptr("v_pool", v_pool, 16),
                      _ptr("o", o, 16), hq, hkv, d, float(d ** -0.5 if scale is None else scale), stream)


def enqueue_attention(device: Device, meta: BatchedAttnMetadata, entry: str, q: int, k_pool: int, v_pool: int, o: int,
                      num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, stream: Any) -> None:
    """:func:`attention` with every argument already checked and ``entry`` its kernel: geometry, pack, launch."""
    grid, block, smem = _attn_geometry(entry, meta.batch_size, meta.chunk_len, num_q_heads, num_kv_heads, head_dim)
    launch = prepared(device, entry)
    a = launch.args
    a.q, a.k_pool, a.v_pool, a.o, a.num_q_heads, a.num_kv_heads = q, k_pool, v_pool, o, num_q_heads, num_kv_heads
    a.block_size, a.scale = meta.block_size, scale
    a.m = meta_struct(meta)
    launch.launch(grid, block, smem, stream)


#: Gated DeltaNet algorithms (``ops.gdn(..., algo=)``) and the kernel module of each.
GDN_MODULES = {"chunked": _gdnc, "recurrent": _gdn, "split": _gdnc, "wgmma": _gdnw}
#: The algorithms that run a precompute kernel into a caller-provided workspace.
GDN_WORKSPACE_ALGOS = ("split", "wgmma")
GDN_ALGOS = tuple(GDN_MODULES)
#: Forms of the wgmma pair (``ops.gdn(..., algo="wgmma", form=)``): ``"auto"`` (the rules,
#: :func:`q12drv.kernels.gdn_wgmma.uses_flow` then :func:`~q12drv.kernels.gdn_wgmma.uses_wide`, decide per pass),
#: ``"pair"`` (its two launches, one after the other, one warpgroup a CTA), ``"flow"`` (the flow form: the
#: precompute beside the sequential kernel), ``"wide"`` (head_dim 128: the sequential kernel as one CTA of two
#: warpgroups per value head, sharing the chunk's tiles). The same results.
GDN_FORMS = ("auto", "pair", "flow", "wide")


@lru_cache(maxsize=1024, typed=True)
def _gdn_launches(algo: str, n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int,
                  num_sms: int, form: str = "auto") -> tuple:
    """``(zero, ((entry, grid, block, smem, dependent), ...))`` of one Gated DeltaNet layer: one launch, or a pair's
    two. ``zero``: ``(workspace offset, bytes)`` to clear before the launches (the flow form's ready flags), or
    None; ``dependent``: launched with programmatic stream serialization (the wgmma pair's sequential kernel, every
    form).
    ``form``: one of :data:`GDN_FORMS` (checked by :func:`check_gdn_form`)."""
    if algo == "wgmma":   # the rules (a few CTAs and a long stream: flow; a full device: wide)
        form = _gdnw.resolve_form(form, n, chunk_len, num_v_heads, head_dim, num_sms)
    # the wgmma pair's sequential kernel is launched with PDL in every form: it loads its inputs and state while the
    # precompute finishes, and waits for it before the first record (gdn/chunked_mma.cu, the tile precompute)
    if algo == "wgmma" and form == "wide":
        geos = _gdnw.wide_geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim)
        return None, tuple((entry, *geo, dep) for entry, geo, dep in zip(_gdnw.wide_entries(head_dim), geos,
                                                                        (False, True)))
    if algo == "wgmma" and form == "flow":
        zero = (_gdnw.flags_offset(n, chunk_len, num_k_heads, num_v_heads, head_dim),
                _gdnw.flags_bytes(n, chunk_len, num_k_heads))
        return zero, _gdnw.flow_launches(n, chunk_len, num_k_heads, num_v_heads, head_dim, num_sms)
    if algo == "wgmma":
        stages = _gdnw.stages(n, num_v_heads, head_dim, num_sms)
        geos = _gdnw.geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim, stages)
        return None, tuple((entry, *geo, dep) for entry, geo, dep in zip(_gdnw.entries(head_dim, stages), geos,
                                                                        (False, True)))
    if algo == "split":
        stages = _gdnc.split_stages(n, num_v_heads, head_dim, num_sms)
        geos = _gdnc.split_geometry(n, chunk_len, num_k_heads, num_v_heads, head_dim, stages)
        return None, tuple((entry, *geo, False) for entry, geo in zip(_gdnc.split_entries(head_dim, stages), geos))
    mod = GDN_MODULES[algo]
    return None, ((mod.entry_name(head_dim), *mod.geometry(n, num_v_heads, head_dim), False),)


def gdn(device: Device, meta: BatchedAttnMetadata, h_state_ptrs: int, q: int, k: int, v: int, g: int, beta: int,
        o: int, *, num_k_heads: int, num_v_heads: int, head_dim: int, algo: str = "chunked",
        workspace: int | None = None, workspace_bytes: int | None = None, form: str = "auto",
        stream: Any = None) -> None:
    """Gated DeltaNet over the packed streams; stream b's fp32 state at ``h_state_ptrs[b]`` is updated in place.

    ``algo``:

    * ``"chunked"`` (default): ``gdn/chunked_mma.cu``'s fused kernel, 64-token chunks on the tensor cores;
    * ``"split"``: the same arithmetic in two launches, bit-identical to ``"chunked"``: a precompute
      kernel does every chunk's state-independent work in parallel into ``workspace``, then the
      sequential kernel walks the chunks with only the state step on its serial path (one of two
      builds, by grid size: :func:`q12drv.kernels.gdn_chunk.split_stages`). Faster than the fused
      kernel on every pass measured on the H200, 2x on one long stream. Needs
      ``workspace`` (device pointer, 16-byte aligned) of ``workspace_bytes`` >=
      :func:`q12drv.kernels.gdn_chunk.workspace_bytes`
      ``(n, meta.chunk_len, num_k_heads, num_v_heads, head_dim)``; the other algorithms ignore both;
    * ``"wgmma"`` (Hopper, sm_90): the split pair's precompute with the solve applied (records as tiles),
      then a sequential kernel on warpgroup MMA (:mod:`q12drv.kernels.gdn_wgmma`): the split pair's
      numerics up to the solve, not its bits. Needs a workspace as ``"split"`` does, of
      :func:`q12drv.kernels.gdn_wgmma.workspace_bytes`. A pass of few sequential CTAs and a long stream
      (:func:`q12drv.kernels.gdn_wgmma.uses_flow`: one stream of 8192 tokens or more) takes the flow form:
      the workspace's ready flags cleared, then the precompute running beside the sequential kernel
      (programmatic dependent launch), its records in fla-core's order ``V_new = U - W S`` (not the pair's bits:
      the same error against float64; 1 x 8192 0.36 ms against the pair's 0.40 on the H200). The workspace is
      checked against the form the pass takes (:func:`q12drv.kernels.gdn_wgmma.resolve_form` on this device):
      :func:`q12drv.kernels.gdn_wgmma.workspace_bytes` with ``form="any"`` (its default) fits all. Otherwise a pass
      whose grid fills the device at head_dim 128 (:func:`q12drv.kernels.gdn_wgmma.uses_wide`) takes the wide
      form: one CTA of two warpgroups per value head (the same bits, 4% faster at 8 x 2048). ``form="pair"``,
      ``"flow"`` or ``"wide"`` takes that form whatever the rules say (:data:`GDN_FORMS`; the flow form on a grid
      that fills the device leaves its precompute one CTA: correct, and slow);
    * ``"recurrent"``: ``gdn/recurrent.cu``, token by token in fp32.

    Same math and state contract; they agree to bf16 rounding (see :mod:`q12drv.kernels.gdn_chunk`
    for the error budget).
    """
    _check(device, meta)
    check_gdn_algo(algo, device.arch)
    d = _positive("head_dim", head_dim)
    check_gdn_form(algo, form, d)
    GDN_MODULES[algo].entry_name(d)
    hv, hk = _args.head_group("num_v_heads", num_v_heads, "num_k_heads", num_k_heads)
    taken = (_gdnw.resolve_form(form, meta.batch_size, meta.chunk_len, hv, d, device.sm_count) if algo == "wgmma"
             else "any")   # the workspace the form this pass takes needs
    ws = gdn_workspace(algo, meta.batch_size, meta.chunk_len, hk, hv, d, workspace, workspace_bytes, form=taken)
    enqueue_gdn(device, meta, algo, _ptr("h_state_ptrs", h_state_ptrs, 8), _ptr("q", q, 16), _ptr("k", k, 16),
                _ptr("v", v, 8), _ptr("g", g, 4), _ptr("beta", beta, 4), _ptr("o", o, 8), hk, hv, d, ws, stream,
                form=form)


def check_gdn_algo(algo, arch: str | None = None) -> None:
    """Raise ValueError unless ``algo`` is one of :data:`GDN_ALGOS` (and, given the device's ``arch``, runs
    there: ``"wgmma"`` needs Hopper, sm_90)."""
    if type(algo) is not str or algo not in GDN_MODULES:
        raise ValueError(f"algo must be one of {', '.join(map(repr, GDN_ALGOS))}, got {algo!r}")
    if algo == "wgmma" and arch is not None and arch not in ("sm_90", "sm_90a"):
        raise ValueError(f"algo='wgmma' runs on Hopper (sm_90) only, this device is {arch}: use algo='split' (the "
                         f"same workspace contract) or 'chunked'")


def check_gdn_form(algo: str, form, head_dim: int | None = None) -> None:
    """Raise ValueError unless ``form`` is one of :data:`GDN_FORMS`, ``"auto"`` for every ``algo`` but
    ``"wgmma"`` (the only algorithm with several forms), and (given ``head_dim``) ``"wide"`` only at 128."""
    if type(form) is not str or form not in GDN_FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, GDN_FORMS))}, got {form!r}")
    if form != "auto" and algo != "wgmma":
        raise ValueError(f"form={form!r} picks one of algo='wgmma''s forms; algo={algo!r} has one form: leave "
                         f"form='auto'")
    if form == "wide" and head_dim is not None:
        _gdnw.wide_entries(head_dim)


def gdn_workspace(algo: str, n: int, chunk_len: int, num_k_heads: int, num_v_heads: int, head_dim: int, workspace,
                  workspace_bytes, form: str = "any") -> int:
    """The checked workspace pointer for ``algo`` (0 when the algorithm needs none); ``form``: the wgmma pair's form
    the pass takes (:data:`q12drv.kernels.gdn_wgmma.WORKSPACE_FORMS`), ``"any"`` for the largest.

    Raises
    ------
    TypeError, ValueError
        ``"split"`` or ``"wgmma"`` without a workspace, a NULL or misaligned one, or one smaller than the
        pass needs.
    """
    if algo not in GDN_WORKSPACE_ALGOS:
        return 0
    need = gdn_workspace_bytes(algo, n, chunk_len, num_k_heads, num_v_heads, head_dim, form)
    sizer = f"{GDN_MODULES[algo].__name__.rsplit('.', 1)[1]}.workspace_bytes"
    if workspace is None or workspace_bytes is None:
        raise ValueError(f"algo={algo!r} needs workspace= (a device pointer) and workspace_bytes= (its size): this "
                         f"pass needs {need:,} bytes (q12drv.kernels.{sizer})")
    have = _args.count("workspace_bytes", workspace_bytes, 0, None)
    if have < need:
        taken = f" in its {form} form" if algo == "wgmma" and form != "any" else ""
        raise ValueError(f"workspace_bytes {have:,} is too small: algo={algo!r}{taken} needs {need:,} bytes for {n} "
                         f"stream(s) of up to {chunk_len} tokens, {num_k_heads} key / {num_v_heads} value heads "
                         f"({sizer})")
    return _ptr("workspace", workspace, 16)


def gdn_workspace_bytes(algo: str, n: int, chunk_len: int, num_k_heads: int, num_v_heads: int,
                        head_dim: int, form: str = "any") -> int:
    """Workspace bytes ``algo`` needs for ``n`` streams of at most ``chunk_len`` tokens (0 for the algorithms
    that need none). ``form`` (``"wgmma"``): :func:`q12drv.kernels.gdn_wgmma.workspace_bytes`'s, ``"any"`` (the
    largest, which every form fits in) by default; the other algorithms have one size."""
    if algo not in GDN_WORKSPACE_ALGOS:
        return 0
    if algo == "wgmma":
        return _gdnw.workspace_bytes(n, chunk_len, num_k_heads, num_v_heads, head_dim, form)
    return GDN_MODULES[algo].workspace_bytes(n, chunk_len, num_k_heads, num_v_heads, head_dim)


def enqueue_gdn(device: Device, meta: BatchedAttnMetadata, algo: str, h_state_ptrs: int, q: int, k: int, v: int,
                g: int, beta: int, o: int, num_k_heads: int, num_v_heads: int, head_dim: int, workspace: int,
                stream: Any, *, form: str = "auto") -> None:
    """:func:`gdn` with every argument already checked (``workspace``: from :func:`gdn_workspace`; ``form``: by
    :func:`check_gdn_form`)."""
    mc = meta_struct(meta)
    zero, launches = _gdn_launches(algo, meta.batch_size, meta.chunk_len, num_k_heads, num_v_heads, head_dim,
                                   device.sm_count, form)
    if zero is not None:
        device.memset(workspace + zero[0], 0, zero[1], stream)
    for entry, grid, block, smem, dependent in launches:
        launch = prepared(device, entry)
        a = launch.args
        a.h_state_ptrs, a.q, a.k, a.v, a.g, a.beta, a.o = h_state_ptrs, q, k, v, g, beta, o
        a.num_k_heads, a.num_v_heads = num_k_heads, num_v_heads
        if workspace:
            a.workspace = workspace
        a.m = mc
        (launch.launch_dependent if dependent else launch.launch)(grid, block, smem, stream)
