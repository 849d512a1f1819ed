"""The metadata a pass stages, as the seed names it, and the objects that describe staged bytes.

:class:`StreamStageInfo` is what the stager takes per stream; :class:`BatchedAttnMetadata` what it returns (device
addresses of every field, host copies of ``cu_seqlens`` and ``kv_lens``). The templates here turn a layout placed at
an arena offset into those addresses once per place, so a pass builds its metadata object without recomputing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import Q12Error
from ..layout import StackedLayout
from ..ptr import DevicePtr

@dataclass(frozen=True, eq=False)
class StreamStageInfo:
    """What the stager needs of one prefill stream.

    Parameters
    ----------
    proc_start : int
        Absolute position of the first token this pass processes (tokens already in the KV cache).
    proc_count : int
        Tokens this pass processes (>= 1).
    block_table : array_like of int
        Host copy of the stream's int32 physical block ids, logical block i -> physical id; it must
        cover every position up to ``proc_start + proc_count - 1``. A negative entry means "no
        block" (evicted): that position's KV write goes to the dummy block.
    block_table_dev : int
        Device address of the same table (int32), read by the attention kernel.
    seq_len_dev : int, optional
        Device address of the stream's u32 seq_len, stored in the seed's ``seq_len_ptrs`` for a runtime whose own
        kernels read it. No q12drv kernel reads it: ``0`` (the default) stores a NULL entry.
    mrope_positions : array_like, optional
        ``[3, proc_count]`` T/H/W positions (vision tokens); default: all three equal the
        token positions (text).
    """

    proc_start: int
    proc_count: int
    block_table: Any
    block_table_dev: int
    seq_len_dev: int = 0
    mrope_positions: Any = None


@dataclass(frozen=True)
class BatchedAttnMetadata:
    """Device-side metadata of one batched (or single-stream) prefill pass, fields as the seed names them.

    Device fields are absolute :class:`~q12drv.core.ptr.DevicePtr` addresses inside the arena.
    ``staged_bytes`` is the exact footprint from ``scratch_offset_bytes``: the cursor advance.
    ``cu_seqlens_host`` and ``kv_lens_host`` are read-only int32 arrays; in an object made by
    :func:`metadata_of_pass` (an :class:`~q12drv.kernels.expand.ExpandPlan` pass) they are made on first
    access, from the integers of that pass the object keeps.

    ``arena`` and ``generation`` say where and when the metadata was staged (the arena's
    :attr:`~q12drv.core.arena.ScratchArena.generation` then): after ``arena.reset()`` or ``arena.close()``
    its bytes may belong to another pass, and :meth:`require_current` (which every launcher calls) refuses
    it. An object made by hand, without an arena, cannot be checked.
    """

    positions_stacked: DevicePtr
    positions_h_stacked: DevicePtr
    positions_w_stacked: DevicePtr
    slot_stacked: DevicePtr
    block_table_ptrs: DevicePtr
    seq_len_ptrs: DevicePtr
    batch_size: int
    chunk_len: int
    total_tokens: int
    cu_seqlens: DevicePtr
    cu_seqlens_host: np.ndarray
    kv_lens: DevicePtr
    kv_lens_host: np.ndarray
    max_blocks_per_seq: int
    staged_bytes: int
    scratch_offset_bytes: int = 0
    use_mrope: bool = False
    block_size: int = 0
    dummy_kv_block: int = 0
    layout: StackedLayout | None = field(default=None, repr=False)
    arena: Any = field(default=None, repr=False, compare=False)
    generation: int | None = field(default=None, repr=False, compare=False)

    def require_current(self) -> None:
        """Raise :class:`~q12drv.core.errors.Q12Error` when the arena this metadata was staged in has been
        closed, or reset since (its offsets may now hold another pass's bytes); nothing to check without one."""
        arena = self.arena
        if arena is None:
            return
        if arena.closed:
            raise Q12Error("this metadata's ScratchArena is closed: its device addresses are freed; stage the "
                           "pass again in an open arena")
        if arena.generation != self.generation:
            raise Q12Error(f"this metadata is stale: its arena was reset since it was staged (generation "
                           f"{self.generation}, now {arena.generation}), and offset {self.scratch_offset_bytes:,} "
                           f"may now hold another pass's bytes; launch with the newest pass's metadata")

    @property
    def counts(self) -> np.ndarray:
        """Per-stream token counts (``diff(cu_seqlens_host)``)."""
        return np.diff(self.cu_seqlens_host)

    def __getattr__(self, name: str):
        # only reached for an attribute the instance lacks: the host copies of a metadata object built
        # by metadata_of_pass, made on first access from the pass's own integers (kept in the object)
        d = self.__dict__
        ints = d.get("_host_ints") if name in _HOST_COPIES else None
        if ints is not None:
            d["cu_seqlens_host"], d["kv_lens_host"] = host_copies(*ints)
            return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_HOST_COPIES = ("cu_seqlens_host", "kv_lens_host")


def host_copies(cu: list, kv: list) -> tuple:
    """The host copies of ``cu_seqlens`` and ``kv_lens`` (int32 lists): one read-only int32 array cut in two."""
    ints = np.array(cu + kv, np.int32)
    ints.setflags(write=False)
    return ints[:len(cu)], ints[len(cu):]


_META_CACHE_MAX = 256


assert not hasattr(BatchedAttnMetadata, "__post_init__"), "metadata_at would skip __post_init__"


def metadata_at(arena, offset: int, layout: StackedLayout, cu: np.ndarray, kv: np.ndarray, *, chunk_len: int,
                max_blocks_per_seq: int, block_size: int, use_mrope: bool, dummy_kv_block: int) -> BatchedAttnMetadata:
    """The :class:`BatchedAttnMetadata` describing ``layout`` at arena ``offset`` (``layout.n`` streams,
    ``layout.total_tokens`` tokens) with host copies ``cu`` and ``kv`` (made read-only)."""
    fields = _template(arena, offset, layout, block_size, use_mrope, dummy_kv_block)
    cu.setflags(write=False)
    kv.setflags(write=False)
    meta = object.__new__(BatchedAttnMetadata)  # the frozen dataclass without its per-field __setattr__
    d = meta.__dict__
    d.update(fields)
    d["cu_seqlens_host"] = cu
    d["kv_lens_host"] = kv
    d["chunk_len"] = int(chunk_len)
    d["max_blocks_per_seq"] = int(max_blocks_per_seq)
    d["arena"] = arena
    d["generation"] = arena.generation
    return meta


def _template(arena, offset: int, layout: StackedLayout, block_size: int, use_mrope: bool, dummy_kv_block: int) -> dict:
    """:func:`_metadata_template` for ``layout`` at arena ``offset``, memoised (the dict is shared: never write it)."""
    base = int(arena.base) + offset
    # the offset too, not only the address: two arenas (or one arena before and after it grows) can put different
    # offsets at the same address, and the fields hold the offset
    key = (base, offset, layout.n, layout.total_tokens, layout.mrope, block_size, bool(use_mrope), int(dummy_kv_block))
    fields = _META_TEMPLATES.get(key)
    if fields is None:
        if len(_META_TEMPLATES) >= _META_CACHE_MAX:
            _META_TEMPLATES.clear()
        fields = _META_TEMPLATES[key] = _metadata_template(base, offset, layout, block_size, use_mrope, dummy_kv_block)
    return fields


def pass_fields(arena, offset: int, layout: StackedLayout, *, max_blocks_per_seq: int, block_size: int, use_mrope: bool,
                dummy_kv_block: int) -> dict:
    """What every pass staged as ``layout`` at arena ``offset`` shares: each :class:`BatchedAttnMetadata`
    field but ``chunk_len`` and the host copies, for :func:`metadata_of_pass`. Memoised per place and
    settings: the dict is shared, never write it.

    Parameters
    ----------
    arena : ScratchArena
    offset : int
        Arena offset of the stacked block.
    layout : StackedLayout
        ``layout.n`` streams, ``layout.total_tokens`` tokens.
    max_blocks_per_seq, block_size, use_mrope, dummy_kv_block
        As :func:`metadata_at` takes them.
    """
    key = (id(arena), int(arena.base) + offset, offset, layout.n, layout.total_tokens, layout.mrope,
           int(max_blocks_per_seq), block_size, bool(use_mrope), int(dummy_kv_block))
    fields = _PASS_FIELDS.get(key)
    if fields is None or fields["arena"] is not arena:
        # built compact, with every key metadata_of_pass sets already in: its copy never grows
        fields = {k: v for k, v in _template(arena, offset, layout, block_size, use_mrope, dummy_kv_block).items()
                  if k not in _HOST_COPIES}
        fields["max_blocks_per_seq"] = int(max_blocks_per_seq)
        fields["arena"] = arena  # held: the key's id(arena) cannot be reused while the entry lives
        fields["_host_ints"] = None
        if len(_PASS_FIELDS) >= _META_CACHE_MAX:
            _PASS_FIELDS.clear()
        _PASS_FIELDS[key] = fields
    return fields


#: pass_fields per (arena, absolute address and offset of the block, layout, settings).
_PASS_FIELDS: dict = {}


def metadata_of_pass(fields: dict, chunk_len: int, cu: list, kv: list) -> BatchedAttnMetadata:
    """A new :class:`BatchedAttnMetadata` from :func:`pass_fields` and one pass's integers.

    Parameters
    ----------
    fields : dict
        :func:`pass_fields` of the layout and place the pass was staged at (copied, not kept).
    chunk_len : int
        The pass's longest per-stream count.
    cu, kv : list of int
        The pass's ``cu_seqlens`` (n + 1 entries) and ``kv_lens`` (n), checked by the caller. The object
        keeps them: hand it lists nobody changes afterwards. Its ``cu_seqlens_host`` and ``kv_lens_host``
        are made from them on first access (read-only int32 arrays, as :func:`metadata_at`'s), so a pass
        that never reads them does not pay for them, and they stay this pass's whatever comes after it.

    Returns
    -------
    BatchedAttnMetadata
    """
    d = fields.copy()
    d["chunk_len"] = chunk_len
    d["generation"] = d["arena"].generation
    d["_host_ints"] = (cu, kv)
    meta = _new_object(BatchedAttnMetadata)  # the frozen dataclass without its __init__ and per-field __setattr__
    _set_dict(meta, d)
    return meta


_new_object = object.__new__


_set_dict = BatchedAttnMetadata.__dict__["__dict__"].__set__  # the instance dict, given whole


_META_TEMPLATES: dict = {}


def _metadata_template(base: int, offset: int, layout: StackedLayout, block_size: int, use_mrope: bool,
                       dummy_kv_block: int) -> dict:
    """Every :class:`BatchedAttnMetadata` field that follows from where the layout sits (all but the
    host copies, ``chunk_len`` and ``max_blocks_per_seq``)."""
    ptr = {f.name: DevicePtr(base + f.offset) for f in layout.fields}
    positions = ptr["positions_stacked"]
    fields = dict(
        positions_stacked=positions,
        positions_h_stacked=ptr.get("positions_h_stacked", positions),
        positions_w_stacked=ptr.get("positions_w_stacked", positions),
        slot_stacked=ptr["slot_stacked"],
        block_table_ptrs=ptr["block_table_ptrs"],
        seq_len_ptrs=ptr["seq_len_ptrs"],
        batch_size=layout.n,
        chunk_len=0,
        total_tokens=layout.total_tokens,
        cu_seqlens=ptr["cu_seqlens"],
        cu_seqlens_host=None,
        kv_lens=ptr["kv_lens"],
        kv_lens_host=None,
        max_blocks_per_seq=0,
        staged_bytes=layout.staged_bytes,
        scratch_offset_bytes=offset,
        use_mrope=bool(use_mrope),
        block_size=block_size,
        dummy_kv_block=int(dummy_kv_block),
        layout=layout,
        arena=None,
        generation=None,
    )
    if fields.keys() != BatchedAttnMetadata.__dataclass_fields__.keys():
        raise AssertionError(f"metadata template fields {sorted(fields)} != {sorted(BatchedAttnMetadata.__dataclass_fields__)}")
    return fields


def unpack_metadata(raw: bytes | np.ndarray, layout: StackedLayout) -> dict:
    """Decode staged bytes back into arrays, one per field (the inverse of :func:`pack_metadata`).

    Parameters
    ----------
    raw : bytes or uint8 array
        At least ``layout.staged_bytes`` bytes starting at the block's first field.

    Returns
    -------
    dict
        field name -> numpy array (copies), plus ``"_pads"``: the pad bytes of every field
        concatenated (all zero in a correct block).
    """
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray)) else np.asarray(raw, np.uint8)
    if buf.size < layout.staged_bytes:
        raise ValueError(f"{buf.size} bytes given but the layout spans {layout.staged_bytes}")
    out = {f.name: buf[f.offset:f.offset + f.nbytes].view(f.dtype).copy() for f in layout.fields}
    out["_pads"] = np.concatenate([buf[f.offset + f.nbytes:f.end] for f in layout.fields])
    return out
