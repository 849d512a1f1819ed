"""Launchers: one function per kernel, taking staged metadata and raw device pointers.

Each launcher validates the shapes it is given, computes the launch geometry from host-known
values (never from device memory), writes the arguments into the kernel's pre-packed argument
block and enqueues one launch. The metadata struct is built once per staged
:class:`~q12drv.core.staging.BatchedAttnMetadata` and passed by value. A kernel's arguments are listed once, in its
``*_launch`` function: a :class:`~q12drv.kernels.layer_launch.LayerLaunch` with all but the layer's pointers fixed,
which a pass makes once per shape and each ``enqueue_*`` (a launch of checked arguments) keeps per metadata object
(:func:`~q12drv.kernels.layer_launch.for_metadata`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..core.device import Device
from ..core.staging import BatchedAttnMetadata
from . import attention as _attn
from . import attention_decode as _dec
from . import attention_wgmma as _attnw
from . import kv_write as _kvw
from . import args as _args
from . import rope as _rope
from .conv1d import conv1d
from .gdn import gdn
from .layer_launch import LayerLaunch, for_metadata
from .meta import meta_struct
from .registry import ENTRIES, SOURCES, prepared, struct_types

__all__ = ["kv_write", "rope", "rope_table", "attention", "gdn", "conv1d", "ATTN_ALGOS", "attention_entry",
           "attention_head_dims", "enqueue_kv_write", "enqueue_kv_write_fp8", "enqueue_rope", "enqueue_attention",
           "kv_write_launch", "kv_write_fp8_launch", "rope_launch", "attention_launch", "LayerLaunch", "prepared", "KV_DTYPES", "SOURCES", "ENTRIES", "struct_types"]

def _positive(name: str, value) -> int:
    return _args.count(name, value)  # an int in [1, 2**31 - 1] (TypeError/ValueError)


# Launch geometry and parameter checks are pure functions of a few ints: each distinct input is
# computed (and checked) once. Only successful results are cached; a bad input raises every time.
_kvw_geometry = lru_cache(maxsize=1024, typed=True)(_kvw.geometry)
_kvw_fp8_geometry = lru_cache(maxsize=1024, typed=True)(_kvw.geometry_fp8)
_rope_geometry = lru_cache(maxsize=1024, typed=True)(_rope.geometry)
_rope_params = lru_cache(maxsize=256, typed=True)(_rope.check_params)


#: Attention kernels (``ops.attention(..., algo=)``): ``"mma"`` (``attention/mma.cu``, mma.sync, any sm_90
#: build, head dims 64/128/256), ``"wgmma"`` (``attention/wgmma.cu``, sm_90a, head dims 128/256),
#: ``"decode"`` (``attention/decode.cu``: split-KV decode, streams of at most 8 new tokens, head dims 64/128/256; two
#: launches and a workspace, so :func:`attention` and ``Q12Pass.attention`` only) and ``"auto"``: wgmma where it
#: exists (Hopper, head dims 128 and 256; faster on every measured case, bench/RESULTS.md), mma.sync elsewhere (decode
#: batches too: where one split suffices the wgmma kernel reads them faster, docs/kernels/attention_decode.md).
ATTN_ALGOS = ("auto", "mma", "wgmma", "decode")
_ATTN_MODULES = {"mma": _attn, "wgmma": _attnw}


def attention_head_dims(arch: str = "sm_90") -> frozenset:
    """The head dims an attention kernel exists for on a device of ``arch`` (what admission checks)."""
    dims = set(_attn.HEAD_DIMS)
    if arch in ("sm_90", "sm_90a"):
        dims |= set(_attnw.HEAD_DIMS)
    return frozenset(dims)


def attention_entry(algo: str, head_dim: int, arch: str = "sm_90") -> str:
    """The attention entry of ``algo`` for ``head_dim`` on a device of ``arch``.

    Raises
    ------
    ValueError
        An unknown ``algo``, or a head dim that ``algo`` has no kernel for.
    """
    if algo == "auto":
        algo = "wgmma" if head_dim in _attnw.HEAD_DIMS and arch in ("sm_90", "sm_90a") else "mma"
    if algo == "decode":
        raise ValueError("algo='decode' is a split launch and a merge with a workspace, not one kernel: run it through "
                         "ops.attention or Q12Pass.attention (after Q12Pass.rope and .kv_write), not attention_layer")
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


#: ``(device, meta)``: a q12drv Device and current staged metadata (TypeError, Q12Error).
_check = _args.check_launch


#: The KV-cache element types: bf16, or FP8 e4m3 with per-head fp32 scales (written by ``q12_kv_write_fp8``, read by
#: ``algo="decode"``).
KV_DTYPES = _args.KV_DTYPES


def kv_write(device: Device, meta: BatchedAttnMetadata, k: int, v: int, k_pool: int, v_pool: int, *,
             num_kv_heads: int, head_dim: int, num_blocks: int, stream: Any = None, kv_dtype: str = "bf16",
             k_scale: Any = None, v_scale: Any = None) -> None:
    """Write the packed new keys/values ``[T, Hkv, D]`` (bf16) into the paged pools at ``slot_stacked``.

    Tokens with a negative slot are skipped; slots at or past ``num_blocks * block_size`` are
    never written. ``kv_dtype`` (:data:`KV_DTYPES`) is the pools': ``"fp8_e4m3"`` pools (1 byte an element) take
    each value as ``e4m3(x / scale[h])`` (round to nearest even, saturating at +-448), ``k_scale`` and ``v_scale``
    the fp32 scale of each KV head (``[Hkv]``, device memory); a reader dequantizes ``q * scale``.
    """
    _check(device, meta)
    hkv, d = _positive("num_kv_heads", num_kv_heads), _positive("head_dim", head_dim)
    row = hkv * d
    if row % 8 or row > _args.I32_MAX:
        raise ValueError(f"num_kv_heads * head_dim = {row} must be a multiple of 8 (16-byte rows) and fit an int32")
    slots = _positive("num_blocks", num_blocks) * meta.block_size
    fp8 = _args.check_kv_scales(kv_dtype, k_scale, v_scale)
    if fp8:
        _kvw.check_fp8_head_dim(d)
    a = _args.ALIGN["kv_write_fp8" if fp8 else "kv_write"]
    t = int(meta.total_tokens)
    k, v = (device.pointer(x, name, dtype="bf16", shape=(t, hkv, d), align=a[name]) for name, x in (("k", k), ("v", v)))
    kp, vp, ks, vs = _args.check_kv_pools(device, kv_dtype, k_pool, v_pool, k_scale, v_scale, hkv, a)
    if fp8:
        enqueue_kv_write_fp8(device, meta, k, v, kp, vp, ks, vs, d, row, slots, stream)
    else:
        enqueue_kv_write(device, meta, k, v, kp, vp, row, slots, stream)


#: The KV writes' per-layer pointer parameters, in their order (bf16 pools, then FP8 pools with their scales).
_KV_PTRS, _KV_FP8_PTRS = ("k", "v", "k_pool", "v_pool"), ("k", "v", "k_pool", "v_pool", "k_scale", "v_scale")


def enqueue_kv_write(device: Device, meta: BatchedAttnMetadata, k: int, v: int, k_pool: int, v_pool: int,
                     row_elems: int, num_slots: int, stream: Any) -> None:
    """:func:`kv_write` with every argument already checked (ints in range): geometry, pack, launch."""
    launch = for_metadata(meta, (device, "q12_kv_write", row_elems, num_slots),
                          lambda: kv_write_launch(device, meta, row_elems, num_slots))
    launch.launch(device.as_stream(stream), (k, v, k_pool, v_pool))


def kv_write_launch(device: Device, meta: BatchedAttnMetadata, row_elems: int, num_slots: int) -> LayerLaunch:
    """:func:`enqueue_kv_write` for every layer of a pass: its launch with all but ``(k, v, k_pool, v_pool)`` fixed
    (checked ints, as there); call it with those."""
    grid, block, smem = _kvw_geometry(meta.total_tokens, row_elems, num_sms=device.sm_count)
    return LayerLaunch(device, "q12_kv_write", grid, block, smem, _KV_PTRS, m=meta_struct(meta), row_elems=row_elems,
                       num_slots=num_slots)


def enqueue_kv_write_fp8(device: Device, meta: BatchedAttnMetadata, k: int, v: int, k_pool: int, v_pool: int,
                         k_scale: int, v_scale: int, head_dim: int, row_elems: int, num_slots: int,
                         stream: Any) -> None:
    """:func:`kv_write` into FP8 pools with every argument already checked: geometry, pack, launch."""
    launch = for_metadata(meta, (device, "q12_kv_write_fp8", head_dim, row_elems, num_slots),
                          lambda: kv_write_fp8_launch(device, meta, head_dim, row_elems, num_slots))
    launch.launch(device.as_stream(stream), (k, v, k_pool, v_pool, k_scale, v_scale))


def kv_write_fp8_launch(device: Device, meta: BatchedAttnMetadata, head_dim: int, row_elems: int,
                        num_slots: int) -> LayerLaunch:
    """:func:`enqueue_kv_write_fp8` for every layer of a pass: its launch with all but ``(k, v, k_pool, v_pool,
    k_scale, v_scale)`` fixed."""
    grid, block, smem = _kvw_fp8_geometry(meta.total_tokens, row_elems, num_sms=device.sm_count)
    return LayerLaunch(device, "q12_kv_write_fp8", grid, block, smem, _KV_FP8_PTRS, m=meta_struct(meta),
                       head_dim=head_dim, row_elems=row_elems, num_slots=num_slots)


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
    bf16 = lambda name, value: device.pointer(value, name, dtype="bf16", align=2)  # noqa: E731
    enqueue_rope(device, meta, bf16("q", q), bf16("k", k), hq, hkv, d, rd, theta, mode, secs, stream,
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


#: RoPE's per-layer pointer parameters.
_ROPE_PTRS = ("q", "k")


def enqueue_rope(device: Device, meta: BatchedAttnMetadata, q: int, k: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, rotary_dim: int, theta: float, mrope_mode: int, sections: tuple, stream: Any,
                 table=_rope.NO_TABLE) -> None:
    """:func:`rope` with every argument already checked (ints, a float, 3 section ints, ``table`` from
    :func:`rope_table`): geometry, pack, launch."""
    args = (num_q_heads, num_kv_heads, head_dim, rotary_dim, theta, mrope_mode, tuple(sections), table)
    launch = for_metadata(meta, (device, "q12_rope", *args[:-1], id(table)), lambda: rope_launch(device, meta, *args),
                          keep=table)
    launch.launch(device.as_stream(stream), (q, k))


def rope_launch(device: Device, meta: BatchedAttnMetadata, num_q_heads: int, num_kv_heads: int, head_dim: int,
                rotary_dim: int, theta: float, mrope_mode: int, sections: tuple, table=_rope.NO_TABLE) -> LayerLaunch:
    """:func:`enqueue_rope` for every layer of a pass: its launch with all but ``(q, k)`` fixed."""
    grid, block, smem = _rope_geometry(meta.total_tokens, num_q_heads, num_kv_heads, head_dim, rotary_dim,
                                       num_sms=device.sm_count)
    return LayerLaunch(device, "q12_rope", grid, block, smem, _ROPE_PTRS, m=meta_struct(meta),
                       num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
                       theta=theta, mrope_mode=mrope_mode, sec_t=sections[0], sec_h=sections[1], sec_w=sections[2],
                       table=table)


def attention(device: Device, meta: BatchedAttnMetadata, q: int, k_pool: int, v_pool: int, o: int, *,
              num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
              algo: str = "auto", window_left: int | None = None, stream: Any = None, num_splits: int | None = None,
              workspace=None, workspace_bytes: int | None = None, kv_dtype: str = "bf16", k_scale: Any = None,
              v_scale: Any = None) -> None:
    """Batched varlen paged causal attention: O ``[T, Hq, D]`` from Q and the paged K/V pools.

    ``algo`` (:data:`ATTN_ALGOS`): ``"auto"`` (default: wgmma on Hopper for head dims 128 and 256,
    else mma.sync), ``"mma"`` (mma.sync, head dims 64/128/256), ``"wgmma"`` (Hopper's warpgroup
    MMA, compiled for sm_90a; head dims 128/256) or ``"decode"`` (split-KV decode attention,
    :mod:`~q12drv.kernels.attention_decode`: every stream at most 8 new tokens, else refused; its keys split
    ``num_splits`` ways, default planned from the batch; with splits it needs ``workspace`` and
    ``workspace_bytes``, :meth:`~q12drv.kernels.attention_decode.DecodePlan.workspace_bytes_for`; the other algos
    ignore these three). ``"auto"`` runs ``"decode"`` where the decode kernel takes the batch and either the pools
    are FP8 or a ``workspace`` is given and the decode plan splits the keys
    (:func:`~q12drv.kernels.attention_decode.auto_runs`: few long streams, where it is several times faster; the
    wgmma kernel where streams x kv heads fill the SMs); otherwise a prefill kernel. The kernels agree to bf16
    rounding.

    ``kv_dtype`` (:data:`KV_DTYPES`): the pools' element type. FP8 pools (``"fp8_e4m3"``, as :func:`kv_write` writes
    them, with the same ``k_scale`` and ``v_scale``: each KV head's fp32 scale, ``[Hkv]``) are read by
    ``algo="decode"`` only (streams of at most 8 new tokens; ``"auto"`` runs it); the other algos refuse them.

    ``window_left``: sliding window in FlashAttention's convention (``window_size=(window_left, 0)``): the query
    at position ``p`` sees the keys ``p - window_left .. p``; transformers' ``sliding_window = W`` is
    ``window_left = W - 1`` (``AttentionShape(sliding_window=W)`` converts). None or -1: full causal. Every
    kernel honours it.
    """
    if algo == "auto" and (workspace is not None or kv_dtype == _args.FP8_E4M3):
        _check(device, meta)
        algo = _dec.auto_algo(device, meta, num_q_heads, num_kv_heads, head_dim, window_left, num_splits, kv_dtype)
    if algo == "decode":
        _dec.attention(device, meta, q, k_pool, v_pool, o, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, scale=scale, window_left=window_left, num_splits=num_splits,
                       workspace=workspace, workspace_bytes=workspace_bytes, stream=stream, kv_dtype=kv_dtype,
                       k_scale=k_scale, v_scale=v_scale)
        return
    if _args.check_kv_scales(kv_dtype, k_scale, v_scale):
        raise ValueError(f"kv_dtype='fp8_e4m3': algo={algo!r} runs a prefill kernel, which reads bf16 pools; "
                         f"algo='decode' reads FP8 pools (passes whose every stream has at most {_dec.MAX_Q_LEN} new "
                         f"tokens)")
    _check(device, meta)
    if scale is not None:
        _args.positive_float("scale", scale)
    window = _attn.window_argument(window_left)
    d = _positive("head_dim", head_dim)
    entry = attention_entry(algo, d, device.arch)
    hq, hkv = _args.head_group("num_q_heads", num_q_heads, "num_kv_heads", num_kv_heads)
    bf16 = lambda name, value: device.pointer(value, name, dtype="bf16", align=16)  # noqa: E731
    enqueue_attention(device, meta, entry, bf16("q", q), bf16("k_pool", k_pool), bf16("v_pool", v_pool), bf16("o", o),
                      hq, hkv, d, float(d ** -0.5 if scale is None else scale), stream, window)


#: The prefill attention kernels' per-layer pointer parameters, in their order.
_ATTN_PTRS = ("q", "k_pool", "v_pool", "o")


def enqueue_attention(device: Device, meta: BatchedAttnMetadata, entry: str, q: int, k_pool: int, v_pool: int, o: int,
                      num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, stream: Any,
                      window_left: int = _attn.NO_WINDOW) -> None:
    """:func:`attention` with every argument already checked and ``entry`` its kernel: geometry, pack, launch.
    ``window_left`` is the kernels' argument (:func:`~q12drv.kernels.attention.window_argument`: ``>= 0``,
    :data:`~q12drv.kernels.attention.NO_WINDOW` for none)."""
    args = (entry, num_q_heads, num_kv_heads, head_dim, scale, window_left)
    launch = for_metadata(meta, (device, *args), lambda: attention_launch(device, meta, *args))
    launch.launch(device.as_stream(stream), (q, k_pool, v_pool, o))


def attention_launch(device: Device, meta: BatchedAttnMetadata, entry: str, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, scale: float, window_left: int = _attn.NO_WINDOW) -> LayerLaunch:
    """:func:`enqueue_attention` for every layer of a pass: its launch with all but ``(q, k_pool, v_pool, o)``
    fixed."""
    grid, block, smem = _attn_geometry(entry, meta.batch_size, meta.chunk_len, num_q_heads, num_kv_heads, head_dim)
    return LayerLaunch(device, entry, grid, block, smem, _ATTN_PTRS, m=meta_struct(meta), num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, block_size=meta.block_size, scale=scale, window_left=window_left)
