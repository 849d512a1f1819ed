"""Arena dumps: one self-describing ``.npz`` file per dump, written from a live arena, read back safely.

A dump holds, as numpy ``.npz`` members (every one a 1-D ``uint8`` array; nothing is pickled):

``header``
    UTF-8 JSON: the schema and its version, the scratch plan (every region and stacked field),
    the metadata blocks (the ``BatchedAttnMetadata`` scalars, host copies and field offsets), the
    arena's base, capacity, cursor and reservations, the device and driver, every live device
    allocation (what the pointer tables may point into), the per-stream inputs, the
    ``h_state_ptrs`` slot, the KV-cache block count if known, and a UTC timestamp.
``arena``
    The arena's ``capacity`` bytes.
``guard``
    The guard band past the capacity (:data:`~q12drv.core.arena.GUARD_BYTES` bytes).
``ring``
    Optional: the pinned staging ring's slots, concatenated (``header["ring"]`` says where each is).
``block_tables``
    Optional (schema 2): the host copies of the streams' block tables, int32, concatenated: stream b's
    entries for positions ``0 .. kv_len - 1`` at ``header["streams"][b]["block_table"]`` (offset and
    count, in entries). What inspect checks each KV slot against.

:func:`load_dump` trusts nothing in the file: the archive is read with ``allow_pickle=False``,
the header is parsed as JSON and validated (types, counts, and every offset and size against the
bytes actually present) before a single arena byte is looked at. Anything wrong raises
:class:`~q12drv.core.errors.DumpError` naming the file and the problem. The work and memory reading takes are
bounded: at most ``max_bytes`` unpacked (:data:`DEFAULT_MAX_BYTES`), no member unpacking more than
:data:`MAX_RATIO` times its size, no more streams, metadata blocks, regions or ring slots than the arena (or
ring) the file holds can hold. Schema version 1 dumps (no block tables) are still read.

What the bytes *mean* (are the sequence lengths monotone, do the slots collide, ...) is checked
by :mod:`q12drv.tools.inspect`; :mod:`q12drv.tools.diff` compares two dumps; :mod:`q12drv.tools.render` draws one.
"""

from __future__ import annotations

import bisect
import json
import os
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core.arena import GUARD_BYTES, GUARD_PATTERN, RING_KEYS, ScratchArena
from ..core.errors import DumpError
from ..core.layout import FieldSpec, Region, ScratchPlan, a8, h_state_slot_bytes, stacked_layout
from ..core.staging import BatchedAttnMetadata, StreamStageInfo

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "READ_VERSIONS",
    "DEFAULT_MAX_BYTES",
    "MAX_RATIO",
    "MAX_HEADER_BYTES",
    "max_streams",
    "Allocation",
    "DumpedStream",
    "DumpedMeta",
    "DumpedPlan",
    "HStateInfo",
    "RingSlotInfo",
    "ArenaDump",
    "dump_arena",
    "dump_pass",
    "write_dump",
    "load_dump",
]

#: The ``schema`` string every dump header carries.
SCHEMA = "q12drv.arena-dump"
#: The header layout version this module writes: 2 adds the streams' block tables (the ``block_tables`` member).
SCHEMA_VERSION = 2
#: The versions :func:`load_dump` reads (a version 1 dump has no block tables: the checks that need them skip).
READ_VERSIONS = (1, 2)
#: What :func:`load_dump` unpacks at most by default (``max_bytes``; the commands' ``--max-bytes``).
DEFAULT_MAX_BYTES = 256 << 20
#: The largest unpacked / packed size ratio a member may claim (deflate's limit is about 1032:1).
MAX_RATIO = 1100
#: The largest header member (JSON) read.
MAX_HEADER_BYTES = 4 << 20

_MEMBERS = ("header", "arena", "guard")
_OPTIONAL_MEMBERS = ("ring", "block_tables")
_NPY_NAMES = {f"{name}.npy": name for name in _MEMBERS + _OPTIONAL_MEMBERS}
#: Bytes of stacked metadata every stream takes at least (two u64 pointers, a kv_lens and a cu_seqlens entry).
_MIN_STREAM_BYTES = 24
_U64 = 1 << 64
_FIELD_DTYPES = ("<u4", "<i4", "<u8", "<i8")
_PTR_FIELDS = ("positions_stacked", "positions_h_stacked", "positions_w_stacked", "slot_stacked",
               "block_table_ptrs", "seq_len_ptrs", "cu_seqlens", "kv_lens")


# --- what a loaded dump holds ---------------------------------------------------------------

@dataclass(frozen=True)
class Allocation:
    """A live device allocation at dump time: pointer tables may point into these."""

    name: str
    base: int
    size: int

    @property
    def end(self) -> int:
        return self.base + self.size

    def contains(self, addr: int, nbytes: int = 1) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies inside this allocation."""
        return self.base <= addr and addr + max(nbytes, 1) <= self.end


@dataclass(frozen=True)
class DumpedStream:
    """One prefill stream's inputs as the stager saw them.

    ``block_table``: the host copy's entries for positions ``0 .. kv_len - 1`` (int32, read-only), or None (a
    version 1 dump, or a writer that was not given the table).
    """

    index: int
    proc_start: int
    proc_count: int
    block_table_dev: int
    seq_len_dev: int
    explicit_mrope: bool = False
    block_table: np.ndarray | None = field(default=None, compare=False, repr=False)
    table_offset: int = field(default=-1, compare=False, repr=False)  # of block_table in the block_tables member


@dataclass(frozen=True)
class DumpedMeta:
    """One staged metadata block: the ``BatchedAttnMetadata`` scalars, host copies and field offsets.

    ``fields`` are at arena offsets; ``streams`` are the pass's stream indices this block covers
    (all of them for the stacked block, one for a per-stream block).
    """

    name: str
    streams: tuple
    batch_size: int
    chunk_len: int
    total_tokens: int
    max_blocks_per_seq: int
    staged_bytes: int
    scratch_offset_bytes: int
    use_mrope: bool
    block_size: int
    dummy_kv_block: int
    cu_seqlens_host: np.ndarray
    kv_lens_host: np.ndarray
    fields: tuple
    device_ptrs: dict

    @property
    def end(self) -> int:
        return self.scratch_offset_bytes + self.staged_bytes

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"metadata block {self.name!r} has no field {name!r}")

    def has_field(self, name: str) -> bool:
        return any(f.name == name for f in self.fields)


@dataclass(frozen=True)
class DumpedPlan:
    """The scratch plan recorded in a dump (see :class:`~q12drv.core.layout.ScratchPlan`)."""

    policy: str
    counts: tuple
    top_k: int
    mrope: bool
    total_bytes: int
    staged_bytes: int
    regions: tuple
    fields: tuple

    def region(self, name: str) -> Region | None:
        return next((r for r in self.regions if r.name == name), None)


@dataclass(frozen=True)
class HStateInfo:
    """The ``h_state_ptrs`` JIT slot: arena ``offset``, ``n`` entries, ``uploads`` (None: unknown)."""

    offset: int
    n: int
    uploads: int | None

    @property
    def end(self) -> int:
        return self.offset + h_state_slot_bytes(self.n)


@dataclass(frozen=True)
class RingSlotInfo:
    """One pinned staging-ring slot inside the ``ring`` member."""

    index: int
    offset: int
    nbytes: int
    pending: bool


@dataclass(frozen=True, eq=False)
class ArenaDump:
    """A validated arena dump (see :func:`load_dump`).

    Attributes
    ----------
    path : str
    header : dict
        The parsed JSON header (validated).
    arena, guard, ring : numpy.ndarray
        Read-only ``uint8`` arrays (``ring`` is None unless the dump has one).
    plan : DumpedPlan or None
    metas : tuple of DumpedMeta
        The staged metadata blocks (one stacked block, or one block per stream).
    mode : str or None
        ``"batched"``, ``"per_stream"`` or None (no metadata).
    streams : tuple of DumpedStream
        Empty when the writer was not given the stream inputs.
    reservations : tuple of Region
        The arena's live reservations (kind ``"reserved"``).
    allocations : tuple of Allocation
        Sorted by base, none overlapping.
    h_state : HStateInfo or None
    num_blocks : int or None
        KV-cache blocks, when the writer knew it.
    ring_slots : tuple of RingSlotInfo
    block_tables : numpy.ndarray or None
        The ``block_tables`` member as int32 (each stream's ``block_table`` is a view of it).
    """

    path: str
    header: dict
    arena: np.ndarray
    guard: np.ndarray
    ring: np.ndarray | None
    plan: DumpedPlan | None
    metas: tuple
    mode: str | None
    streams: tuple
    reservations: tuple
    allocations: tuple
    h_state: HStateInfo | None
    num_blocks: int | None
    ring_slots: tuple
    block_tables: np.ndarray | None = None

    @property
    def has_block_tables(self) -> bool:
        """Whether every stream's block table is in the dump (what the slot-ownership checks need)."""
        return bool(self.streams) and all(s.block_table is not None for s in self.streams)

    @property
    def version(self) -> int:
        return self.header["version"]

    @property
    def created_utc(self) -> str:
        return self.header["created_utc"]

    @property
    def base(self) -> int:
        return self.header["arena"]["base"]

    @property
    def capacity(self) -> int:
        return self.header["arena"]["capacity"]

    @property
    def cursor(self) -> int:
        return self.header["arena"]["cursor"]

    @property
    def guard_pattern(self) -> int:
        return self.header["arena"]["guard_pattern"]

    @property
    def device_name(self) -> str:
        return self.header["device"]["name"]

    @property
    def driver_name(self) -> str:
        return self.header["device"]["driver"]

    def region_map(self) -> tuple:
        """The plan's regions when the dump has a plan, else the arena's reservations."""
        return self.plan.regions if self.plan is not None else self.reservations

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` arena bytes at ``offset`` (a read-only view); bounds-checked."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise DumpError(f"{self.path}: read of {nbytes} bytes at offset {offset} is outside the "
                            f"{self.capacity}-byte arena")
        return self.arena[offset:offset + nbytes]

    def values(self, f: FieldSpec) -> np.ndarray:
        """The decoded elements of field ``f`` (a read-only view)."""
        return self.read(f.offset, f.nbytes).view(f.dtype)

    def pad(self, f: FieldSpec) -> np.ndarray:
        """The pad bytes after field ``f`` (zero in a correct block)."""
        return self.read(f.offset + f.nbytes, f.padded - f.nbytes)

    def allocation_of(self, addr: int, nbytes: int = 1) -> Allocation | None:
        """The known allocation holding ``addr`` (whether or not ``[addr, addr + nbytes)`` fits in it), or None.

        A binary search: the allocations are sorted and never overlap (:func:`load_dump` checks it)."""
        i = bisect.bisect_right(self._alloc_bases, addr) - 1
        if i >= 0 and self.allocations[i].contains(addr, 1):
            return self.allocations[i]
        return None

    def allocation_indices(self, addrs: np.ndarray) -> np.ndarray:
        """:meth:`allocation_of` for many addresses at once: the index into :attr:`allocations` of each
        address's allocation, -1 where none holds it."""
        addrs = np.asarray(addrs, np.uint64)
        if not self.allocations:
            return np.full(addrs.shape, -1, np.int64)
        bases = np.array(self._alloc_bases, np.uint64)
        ends = np.array([a.end for a in self.allocations], np.uint64)
        i = np.searchsorted(bases, addrs, side="right").astype(np.int64) - 1
        inside = (i >= 0) & (addrs < ends[np.maximum(i, 0)])
        return np.where(inside, i, -1)

    @property
    def _alloc_bases(self) -> list:
        bases = self.__dict__.get("_bases")
        if bases is None:
            bases = [a.base for a in self.allocations]
            object.__setattr__(self, "_bases", bases)  # a memo of the (immutable) allocations, not state
        return bases

    def table_entry_owner(self, i: int) -> tuple | None:
        """``(stream, entry)`` of entry ``i`` of the ``block_tables`` member: whose table it is and where in it
        (None when no stream's table holds it)."""
        refs = self.__dict__.get("_table_refs")
        if refs is None:
            refs = sorted((s.table_offset, s.index) for s in self.streams if s.block_table is not None)
            object.__setattr__(self, "_table_refs", refs)  # a memo of the (immutable) streams, not state
        k = bisect.bisect_right(refs, (i, len(self.streams))) - 1
        if k < 0 or i - refs[k][0] >= self.streams[refs[k][1]].block_table.size:
            return None
        return refs[k][1], i - refs[k][0]

    def describe_ptr(self, addr: int) -> str:
        """``"'name'+0x40"`` for an address inside a known allocation, else ``"unknown"``."""
        a = self.allocation_of(addr)
        if a is None:
            return "NULL" if addr == 0 else "unknown"
        return f"{a.name!r}+{addr - a.base:#x}"


# --- writing ----------------------------------------------------------------------------------

def _field_json(f: FieldSpec) -> dict:
    return {"name": f.name, "dtype": f.dtype, "count": f.count, "shape": [f.count], "offset": f.offset,
            "nbytes": f.nbytes, "padded": f.padded}


def _region_json(r) -> dict:
    return {"name": r.name, "offset": int(r.offset), "nbytes": int(r.nbytes), "kind": getattr(r, "kind", "reserved"),
            "stream": getattr(r, "stream", None)}


def _plan_json(plan: ScratchPlan) -> dict:
    return {
        "policy": plan.policy,
        "counts": [int(c) for c in plan.counts],
        "top_k": int(plan.top_k),
        "mrope": bool(plan.mrope),
        "total_bytes": int(plan.total_bytes),
        "staged_bytes": int(plan.staged_bytes),
        "regions": [_region_json(r) for r in plan.regions],
        "fields": [_field_json(f) for f in plan.fields],
    }


def _meta_json(name: str, meta: BatchedAttnMetadata, stream_ids: Sequence[int]) -> dict:
    layout = meta.layout or stacked_layout(meta.batch_size, meta.total_tokens, meta.use_mrope)
    return {
        "name": name,
        "streams": [int(b) for b in stream_ids],
        "batch_size": int(meta.batch_size),
        "chunk_len": int(meta.chunk_len),
        "total_tokens": int(meta.total_tokens),
        "max_blocks_per_seq": int(meta.max_blocks_per_seq),
        "staged_bytes": int(meta.staged_bytes),
        "scratch_offset_bytes": int(meta.scratch_offset_bytes),
        "use_mrope": bool(meta.use_mrope),
        "block_size": int(meta.block_size),
        "dummy_kv_block": int(meta.dummy_kv_block),
        "cu_seqlens_host": [int(x) for x in meta.cu_seqlens_host],
        "kv_lens_host": [int(x) for x in meta.kv_lens_host],
        "fields": [_field_json(f) for f in layout.shifted(meta.scratch_offset_bytes)],
        "device_ptrs": {k: int(getattr(meta, k)) for k in _PTR_FIELDS},
    }


def _stream_json(b: int, s: StreamStageInfo, table_ref: dict | None) -> dict:
    return {"index": b, "proc_start": int(s.proc_start), "proc_count": int(s.proc_count),
            "block_table_dev": int(s.block_table_dev), "seq_len_dev": int(s.seq_len_dev),
            "explicit_mrope": s.mrope_positions is not None, "block_table": table_ref}


def _table_entries(s: StreamStageInfo, block_size: int) -> np.ndarray | None:
    """Stream ``s``'s block-table entries for positions ``0 .. kv_len - 1`` as int32, or None when the host copy
    is not a 1-D integer table that long with entries within int32 (the stager refuses such a stream anyway)."""
    table = np.asarray(s.block_table)
    need = -(-(int(s.proc_start) + int(s.proc_count)) // block_size)
    if table.ndim != 1 or table.dtype.kind not in "iu" or table.size < need:
        return None
    table = table[:need]
    if table.size and (int(table.min()) < -(1 << 31) or int(table.max()) >= 1 << 31):
        return None
    return table.astype("<i4")


def _tables(streams: Sequence[StreamStageInfo], block_size: int | None) -> tuple:
    """``(refs, member)``: each stream's ``{"offset", "count"}`` into the ``block_tables`` member (None where its
    table cannot be stored, or every one when ``block_size`` is unknown) and the member's bytes (None if empty)."""
    if block_size is None:
        return [None] * len(streams), None
    refs, parts, at = [], [], 0
    for s in streams:
        entries = _table_entries(s, block_size)
        if entries is None:
            refs.append(None)
            continue
        refs.append({"offset": at, "count": int(entries.size)})
        parts.append(entries)
        at += entries.size
    if not parts:
        return refs, None
    return refs, np.concatenate(parts).astype("<i4").view(np.uint8)


def _ring_bytes(arena: ScratchArena) -> tuple:
    ring = arena.find_attachment(RING_KEYS["staging"])
    chunks, slots, off = [], [], 0
    if ring is not None:
        for slot in ring.slots:
            if slot.buffer is None:
                continue
            data = slot.array.tobytes()
            slots.append({"index": slot.index, "offset": off, "nbytes": len(data), "pending": bool(slot.pending)})
            chunks.append(data)
            off += len(data)
    return {"name": "staging", "slots": slots}, np.frombuffer(b"".join(chunks), np.uint8)


def write_dump(path, header: dict, arena_bytes, guard_bytes, ring_bytes=None, block_tables=None) -> Path:
    """Write a dump file from its parts (atomically: a temporary file renamed over ``path``), readable by its
    owner's group and others as any file the user writes (mode 0666 less the umask; 0644 under the usual umask).

    Parameters
    ----------
    path : str or os.PathLike
        Written as given (no ``.npz`` suffix is added).
    header : dict
        JSON-serialisable header (see the module docstring); not validated here.
    arena_bytes, guard_bytes, ring_bytes, block_tables : bytes or uint8 array
        The members; ``ring_bytes`` or ``block_tables`` None leaves that member out.

    Returns
    -------
    pathlib.Path
    """
    path = Path(path)
    members = {
        "header": np.frombuffer(json.dumps(header, sort_keys=True).encode("utf-8"), np.uint8),
        "arena": np.frombuffer(bytes(arena_bytes), np.uint8),
        "guard": np.frombuffer(bytes(guard_bytes), np.uint8),
    }
    if ring_bytes is not None:
        members["ring"] = np.frombuffer(bytes(ring_bytes), np.uint8)
    if block_tables is not None:
        members["block_tables"] = np.frombuffer(bytes(block_tables), np.uint8)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent.resolve()))
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600: a dump is shared as any file the user writes
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, **members)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    """The process's umask: from /proc where there is one (reading it with os.umask means setting it)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def dump_arena(arena: ScratchArena, path, *, plan: ScratchPlan | None = None, meta=None,
               streams: Sequence[StreamStageInfo] | None = None, num_blocks: int | None = None,
               h_slot=None, include_ring: bool = False, mode: str | None = None) -> Path:
    """Write ``arena``'s bytes, its guard band and everything that describes them to ``path``.

    Synchronizes the device's default stream (the read-back waits for pending work).

    Parameters
    ----------
    arena : ScratchArena
        Open.
    path : str or os.PathLike
        The ``.npz`` file to write (overwritten).
    plan : ScratchPlan, optional
        The pass's region map.
    meta : BatchedAttnMetadata or sequence of them, optional
        The stacked metadata of a batched pass, or each stream's own metadata (per-stream pass).
    streams : sequence of StreamStageInfo, optional
        The stager's inputs, in batch order (lets inspect compare pointers and lengths with them, and every
        KV slot with the stream's block table, whose entries below ``kv_len`` the dump stores).
    num_blocks : int, optional
        Blocks in the KV cache (lets inspect check that every slot lies inside it).
    h_slot : HStateSlot, optional
        The ``h_state_ptrs`` slot; default: the arena's ``"h_state_ptrs"`` reservation, if any.
    include_ring : bool
        Also store the pinned staging ring's slots.
    mode : {"batched", "per_stream"}, optional
        Default: ``"batched"`` for one metadata block, ``"per_stream"`` for a sequence.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments (a closed arena, wrong types, a non-positive ``num_blocks``).
    """
    if not isinstance(arena, ScratchArena) or arena.closed:
        raise ValueError(f"dump_arena needs an open ScratchArena, got {arena!r}")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer))
                                   or int(num_blocks) < 1):
        raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")
    if plan is not None and not isinstance(plan, ScratchPlan):
        raise TypeError(f"plan must be a ScratchPlan, got {type(plan).__name__}")
    if meta is None:
        metas = []
    elif isinstance(meta, BatchedAttnMetadata):
        metas = [("stacked_metadata", meta, range(meta.batch_size))]
        mode = mode or "batched"
    else:
        metas = []
        for b, m in enumerate(meta):
            if not isinstance(m, BatchedAttnMetadata):
                raise TypeError(f"meta[{b}] must be a BatchedAttnMetadata, got {type(m).__name__}")
            metas.append((f"stream_block[{b}]", m, [b]))
        mode = mode or "per_stream"
    if mode not in (None, "batched", "per_stream"):
        raise ValueError(f"mode must be 'batched', 'per_stream' or None, got {mode!r}")
    streams = list(streams) if streams is not None else None
    for b, s in enumerate(streams or ()):
        if not isinstance(s, StreamStageInfo):
            raise TypeError(f"streams[{b}] must be a StreamStageInfo, got {type(s).__name__}")

    dev = arena.device
    raw = arena.read(0, arena.capacity)
    guard = dev.download(int(arena.base) + arena.capacity, GUARD_BYTES)
    if h_slot is not None:
        h_state = {"offset": int(h_slot.offset), "n": int(h_slot.n), "uploads": int(h_slot.uploads)}
    else:
        r = next((r for r in arena.regions if r.name == "h_state_ptrs"), None)
        h_state = None if r is None else {"offset": r.offset, "n": r.nbytes // 8, "uploads": None}
    first = metas[0][1] if metas else None
    refs, tables = _tables(streams or (), int(first.block_size) if first is not None else None)
    header = {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {"name": dev.name, "driver": dev.driver.name, "arch": dev.arch},
        "arena": {
            "base": int(arena.base),
            "capacity": int(arena.capacity),
            "cursor": int(arena.cursor),
            "guard_bytes": GUARD_BYTES,
            "guard_pattern": GUARD_PATTERN,
            "reservations": [_region_json(r) for r in arena.regions],
        },
        "allocations": [{"name": buf.name, "base": int(buf.ptr), "size": int(buf.nbytes)} for buf in dev.buffers],
        "plan": _plan_json(plan) if plan is not None else None,
        "mode": mode if metas else None,
        "metadata": [_meta_json(name, m, ids) for name, m, ids in metas],
        "streams": [_stream_json(b, s, r) for b, (s, r) in enumerate(zip(streams, refs))] if streams is not None
        else None,
        "h_state": h_state,
        "block_size": int(first.block_size) if first is not None else None,
        "dummy_kv_block": int(first.dummy_kv_block) if first is not None else None,
        "num_blocks": int(num_blocks) if num_blocks is not None else None,
        "ring": None,
    }
    ring = None
    if include_ring:
        header["ring"], ring = _ring_bytes(arena)
    return write_dump(path, header, raw, guard, ring, tables)


def dump_pass(q12pass, path, *, num_blocks: int | None = None, include_ring: bool = False) -> Path:
    """Dump a :class:`~q12drv.prefill.Q12Pass`: its arena, plan, metadata, streams and JIT slot.

    Parameters
    ----------
    q12pass : Q12Pass
    path : str or os.PathLike
    num_blocks : int, optional
        KV-cache blocks (lets inspect check every slot against the cache).
    include_ring : bool
        Also store the pinned staging ring's slots.

    Returns
    -------
    pathlib.Path
    """
    meta = q12pass.meta if q12pass.batched else list(q12pass.stream_meta)
    return dump_arena(q12pass.arena, path, plan=q12pass.plan, meta=meta, streams=q12pass.streams,
                      num_blocks=num_blocks, h_slot=q12pass.h_slot, include_ring=include_ring,
                      mode=q12pass.mode)


# --- reading ----------------------------------------------------------------------------------

class _Validator:
    """Typed access to the untrusted header; every failure is a DumpError naming the file and key."""

    def __init__(self, path: str):
        self.path = path

    def error(self, msg: str) -> DumpError:
        return DumpError(f"{self.path}: {msg}")

    def get(self, d: dict, key: str, where: str, *, optional: bool = False):
        if key not in d:
            if optional:
                return None
            raise self.error(f"header {where} has no {key!r}")
        return d[key]

    def obj(self, d: dict, key: str, where: str, *, optional: bool = False) -> dict | None:
        v = self.get(d, key, where, optional=optional)
        if v is None and optional:
            return None
        if not isinstance(v, dict):
            raise self.error(f"header {where}.{key} must be an object, got {type(v).__name__}")
        return v

    def list_(self, d: dict, key: str, where: str, *, optional: bool = False) -> list | None:
        v = self.get(d, key, where, optional=optional)
        if v is None and optional:
            return None
        if not isinstance(v, list):
            raise self.error(f"header {where}.{key} must be a list, got {type(v).__name__}")
        return v

    def int_(self, d: dict, key: str, where: str, *, lo: int = 0, hi: int = _U64 - 1, optional: bool = False):
        v = self.get(d, key, where, optional=optional)
        if v is None and optional:
            return None
        return self.check_int(v, f"{where}.{key}", lo, hi)

    def check_int(self, v, what: str, lo: int = 0, hi: int = _U64 - 1) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(f"header {what} must be an integer, got {type(v).__name__} {v!r:.40}")
        if not lo <= v <= hi:
            raise self.error(f"header {what} = {v} is outside [{lo}, {hi}]")
        return v

    def bool_(self, d: dict, key: str, where: str) -> bool:
        v = self.get(d, key, where)
        if not isinstance(v, bool):
            raise self.error(f"header {where}.{key} must be true or false, got {v!r:.40}")
        return v

    def str_(self, d: dict, key: str, where: str) -> str:
        v = self.get(d, key, where)
        if not isinstance(v, str):
            raise self.error(f"header {where}.{key} must be a string, got {type(v).__name__}")
        return v

    def ints(self, d: dict, key: str, where: str, *, length: int, lo: int = 0, hi: int = _U64 - 1) -> tuple:
        v = self.list_(d, key, where)
        if len(v) != length:
            raise self.error(f"header {where}.{key} has {len(v)} entries but should have {length}")
        return tuple(self.check_int(x, f"{where}.{key}[{i}]", lo, hi) for i, x in enumerate(v))

    def span(self, what: str, offset: int, nbytes: int, limit: int, limit_name: str) -> None:
        if offset + nbytes > limit:
            raise self.error(f"{what} spans [{offset}, {offset + nbytes}) but the {limit_name} holds only {limit} bytes")


def _open_regular(v: _Validator, path: str):
    """A binary file object of ``path``, refused unless it is a regular file (a named pipe, or a symlink to one,
    would block the reader forever; a device or socket is no dump either). Opened without blocking and checked on
    the open descriptor, so the file cannot be swapped for a pipe in between."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise v.error("no such file") from None
    except IsADirectoryError:
        raise v.error("is a directory, not a dump file") from None
    except OSError as exc:
        raise v.error(f"cannot be read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else
                    "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise v.error(f"is {kind}, not a dump file: a dump is a regular .npz file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _sniff(v: _Validator, fh) -> None:
    """Refuse what is plainly not a zip archive before reading it as one."""
    magic = fh.read(6)
    fh.seek(0)
    if not magic:
        raise v.error("is empty (0 bytes): truncated, not a dump")
    if magic.startswith(b"PK"):
        return
    if magic.startswith(b"\x93NUMPY"):
        raise v.error("holds a single .npy array, not a q12drv dump archive (header + arena)")
    if magic[:1] == b"\x80":
        raise v.error("is a Python pickle; dumps are .npz archives read with allow_pickle=False and never unpickled")
    raise v.error(f"not a q12drv arena dump: not an .npz (zip) archive (starts with {magic!r})")


def _read_npy(v: _Validator, zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> np.ndarray:
    """One member: its .npy header read first (an object dtype or a shape its bytes cannot hold is refused before
    anything is allocated), then exactly the bytes it declares, as a read-only 1-D uint8 array."""
    fmt = np.lib.format
    try:
        with zf.open(info) as fh:
            try:
                major, _ = fmt.read_magic(fh)
                read = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
                shape, fortran, dtype = read(fh)
            except Exception as exc:
                raise v.error(f"member {name!r} has no readable .npy header ({type(exc).__name__}: {exc})") from None
            if dtype.hasobject:
                raise v.error(f"member {name!r} holds pickled Python objects; dumps are read with allow_pickle=False "
                              f"and never unpickled")
            nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if nbytes > info.file_size:
                raise v.error(f"member {name!r} claims shape {shape} ({nbytes:,} bytes) but holds only "
                              f"{info.file_size:,}")
            if dtype != np.uint8 or len(shape) != 1:
                raise v.error(f"member {name!r} must be a 1-D uint8 array, got {dtype} {shape}")
            data = fh.read(nbytes + 1)  # one more: the end of the member is reached and its CRC checked
    except DumpError:
        raise
    except Exception as exc:  # zlib.error, zipfile.BadZipFile (CRC), EOFError, OSError: truncated or corrupted
        raise v.error(f"member {name!r} is unreadable ({type(exc).__name__}: {exc}); truncated or corrupted file?") \
            from None
    if len(data) != nbytes:
        raise v.error(f"member {name!r} holds {len(data) - nbytes:+,} bytes more than its .npy header says "
                      f"({nbytes:,}); truncated or not a dump?")
    arr = np.frombuffer(data, np.uint8)
    arr.setflags(write=False)  # (frombuffer of bytes is read-only already)
    return arr


def _read_members(path: str, max_bytes: int) -> dict:
    v = _Validator(path)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    with _open_regular(v, path) as fh:
        _sniff(v, fh)
        size_on_disk = os.fstat(fh.fileno()).st_size
        try:
            zf = zipfile.ZipFile(fh)
        except Exception as exc:  # zipfile.BadZipFile, EOFError, OSError...: a truncated or foreign file
            raise v.error(f"not a readable .npz archive ({type(exc).__name__}: {exc}); truncated or not a "
                          f"dump?") from None
        with zf:
            infos = zf.infolist()
            if len(infos) > len(_NPY_NAMES):
                raise v.error(f"holds {len(infos)} members; a dump has at most {len(_NPY_NAMES)} "
                              f"({', '.join(_NPY_NAMES)})")
            found = {}
            for info in infos:
                name = _NPY_NAMES.get(info.filename)
                if name is None:
                    if info.filename in _MEMBERS + _OPTIONAL_MEMBERS:
                        raise v.error(f"member {info.filename!r} must be named {info.filename + '.npy'!r}: not a "
                                      f"q12drv dump archive")
                    raise v.error(f"unexpected member {info.filename!r} in the dump archive")
                if name in found:
                    raise v.error(f"member {info.filename!r} appears twice in the archive")
                found[name] = info
            missing = [m for m in _MEMBERS if m not in found]
            if missing:
                raise v.error(f"not a q12drv arena dump: member(s) {', '.join(missing)} missing (found: "
                              f"{', '.join(found) or 'none'})")
            total = 0
            for name, info in found.items():
                packed = min(info.compress_size, size_on_disk)
                if info.file_size > MAX_RATIO * packed + 4096:
                    raise v.error(f"member {name!r} claims to unpack {info.file_size:,} bytes from {packed:,}, more "
                                  f"than {MAX_RATIO}:1 (deflate cannot do better than about 1032:1): a zip bomb or a "
                                  f"lying archive")
                if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                    raise v.error(f"member {name!r} uses zip compression method {info.compress_type}; dumps use "
                                  f"deflate (or none)")
                if name == "header" and info.file_size > MAX_HEADER_BYTES:
                    raise v.error(f"header member is {info.file_size:,} bytes (at most {MAX_HEADER_BYTES:,} allowed)")
                total += info.file_size
            if total > max_bytes:
                raise v.error(f"the members unpack to {total:,} bytes, more than the {max_bytes:,} allowed: raise the "
                              f"limit with --max-bytes {total} (load_dump(..., max_bytes=...)) if you trust the file")
            return {name: _read_npy(v, zf, info, name) for name, info in found.items()}


def _parse_header(path: str, raw: np.ndarray) -> dict:
    v = _Validator(path)
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise v.error(f"header is not UTF-8 text ({exc})") from None
    except ValueError as exc:
        raise v.error(f"header is not valid JSON ({exc})") from None
    except RecursionError:
        raise v.error("header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise v.error(f"header must be a JSON object, got {type(header).__name__}")
    schema = header.get("schema")
    if schema != SCHEMA:
        raise v.error(f"not a q12drv arena dump: header schema is {schema!r}, expected {SCHEMA!r}")
    version = header.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise v.error(f"dump schema version {version!r} is not supported (this q12drv reads versions "
                      f"{', '.join(map(str, READ_VERSIONS))})")
    return header


def max_streams(capacity: int) -> int:
    """The most streams whose stacked metadata an arena of ``capacity`` bytes can hold (each stream takes at least
    its two u64 pointers, its kv_lens entry and its cu_seqlens entry: 24 bytes). A dump claiming more is refused
    before any per-stream work: the bound that keeps the reader's work proportional to what the arena holds."""
    return capacity // _MIN_STREAM_BYTES


def _bounded_total(v: _Validator, what: str, sizes, limit: int, limit_name: str) -> None:
    """Refuse ``sizes`` adding up to more than twice ``limit``: in a consistent dump they do not overlap (at most
    ``limit``); the slack keeps a slightly corrupted dump inspectable while the work stays bounded by ``limit``."""
    total = sum(sizes)
    if total > 2 * limit:
        raise v.error(f"{what} add up to {total:,} bytes, more than twice the {limit:,}-byte {limit_name}: they "
                      f"overlap wholesale (not a dump q12drv wrote)")


def _parse_field(v: _Validator, d, where: str, capacity: int) -> FieldSpec:
    if not isinstance(d, dict):
        raise v.error(f"header {where} must be an object")
    name = v.str_(d, "name", where)
    dtype = v.str_(d, "dtype", where)
    if dtype not in _FIELD_DTYPES:
        raise v.error(f"header {where} ({name}) has dtype {dtype!r}; expected one of {', '.join(_FIELD_DTYPES)}")
    count = v.int_(d, "count", where, hi=capacity)
    offset = v.int_(d, "offset", where, hi=capacity)
    nbytes = v.int_(d, "nbytes", where, hi=capacity)
    padded = v.int_(d, "padded", where, hi=capacity)
    if nbytes != count * np.dtype(dtype).itemsize:
        raise v.error(f"header {where} ({name}) says {count} x {dtype} but nbytes {nbytes}")
    if padded != a8(nbytes):
        raise v.error(f"header {where} ({name}) has padded {padded} but nbytes {nbytes} pads to {a8(nbytes)}")
    v.span(f"field {name} ({where})", offset, padded, capacity, "arena")
    return FieldSpec(name, dtype, count, offset, nbytes, padded)


def _parse_region(v: _Validator, d, where: str, capacity: int) -> Region:
    if not isinstance(d, dict):
        raise v.error(f"header {where} must be an object")
    name = v.str_(d, "name", where)
    offset = v.int_(d, "offset", where, hi=capacity)
    nbytes = v.int_(d, "nbytes", where, hi=capacity)
    kind = d.get("kind", "reserved")
    stream = d.get("stream")
    if not isinstance(kind, str) or not (stream is None or (isinstance(stream, int) and not isinstance(stream, bool))):
        raise v.error(f"header {where} ({name}) has a bad kind or stream")
    v.span(f"region {name} ({where})", offset, nbytes, capacity, "arena")
    return Region(name, offset, nbytes, kind, stream)


def _parse_regions(v: _Validator, raw: list, where: str, capacity: int) -> tuple:
    regions = tuple(_parse_region(v, r, f"{where}[{i}]", capacity) for i, r in enumerate(raw))
    _bounded_total(v, f"the {where} regions", (r.nbytes for r in regions), capacity, "arena")
    return regions


def _parse_plan(v: _Validator, d: dict, capacity: int) -> DumpedPlan:
    policy = v.str_(d, "policy", "plan")
    counts = v.list_(d, "counts", "plan")
    regions_raw = v.list_(d, "regions", "plan")
    if len(counts) > max_streams(capacity) or len(regions_raw) != len(counts) + 3:
        raise v.error(f"header plan lists {len(counts):,} streams and {len(regions_raw):,} regions; a plan of n streams "
                      f"has n + 3 regions, and a {capacity:,}-byte arena holds at most {max_streams(capacity):,} "
                      f"streams")
    counts = tuple(v.check_int(c, f"plan.counts[{i}]", 1, (1 << 31) - 1) for i, c in enumerate(counts))
    regions = _parse_regions(v, regions_raw, "plan.regions", capacity)
    fields = tuple(_parse_field(v, f, f"plan.fields[{i}]", capacity)
                   for i, f in enumerate(v.list_(d, "fields", "plan")))
    return DumpedPlan(policy, counts, v.int_(d, "top_k", "plan", hi=1 << 20), v.bool_(d, "mrope", "plan"),
                      v.int_(d, "total_bytes", "plan"), v.int_(d, "staged_bytes", "plan"), regions, fields)


def _parse_meta(v: _Validator, d, i: int, capacity: int, nstreams: int | None) -> DumpedMeta:
    where = f"metadata[{i}]"
    if not isinstance(d, dict):
        raise v.error(f"header {where} must be an object")
    name = v.str_(d, "name", where)
    n = v.int_(d, "batch_size", where, lo=1, hi=max(max_streams(capacity), 1))
    total = v.int_(d, "total_tokens", where, hi=capacity)
    bs = v.int_(d, "block_size", where, lo=1, hi=1 << 30)
    offset = v.int_(d, "scratch_offset_bytes", where, hi=capacity)
    staged = v.int_(d, "staged_bytes", where, hi=capacity)
    v.span(f"metadata block {name}", offset, staged, capacity, "arena")
    streams = v.list_(d, "streams", where)
    if len(streams) != n:
        raise v.error(f"header {where} ({name}) lists {len(streams)} streams for batch_size {n}")
    hi = (nstreams - 1) if nstreams is not None else capacity
    streams = tuple(v.check_int(b, f"{where}.streams[{j}]", 0, hi) for j, b in enumerate(streams))
    cu = np.array(v.ints(d, "cu_seqlens_host", where, length=n + 1, hi=(1 << 31) - 1), np.int64)
    kv = np.array(v.ints(d, "kv_lens_host", where, length=n, hi=(1 << 31) - 1), np.int64)
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
        raise v.error(f"header {where} ({name}): cu_seqlens_host {cu.tolist()[:16]} is not a segmentation "
                      f"of total_tokens {total} (must start at 0, never decrease, end at total_tokens)")
    fields = tuple(_parse_field(v, f, f"{where}.fields[{j}]", capacity)
                   for j, f in enumerate(v.list_(d, "fields", where)))
    names = [f.name for f in fields]
    use_mrope = v.bool_(d, "use_mrope", where)
    want = {"positions_stacked": total, "slot_stacked": total, "block_table_ptrs": n, "seq_len_ptrs": n,
            "cu_seqlens": n + 1, "kv_lens": n}
    if use_mrope:
        want.update(positions_h_stacked=total, positions_w_stacked=total)
    for fname, count in want.items():
        if names.count(fname) != 1:
            raise v.error(f"header {where} ({name}) must have exactly one field {fname!r}")
        f = fields[names.index(fname)]
        if f.count != count:
            raise v.error(f"header {where} field {fname} has {f.count} entries but the block's counts "
                          f"(batch_size {n}, total_tokens {total}) need {count}")
    dptr = v.obj(d, "device_ptrs", where)
    ptrs = {k: v.int_(dptr, k, f"{where}.device_ptrs") for k in _PTR_FIELDS}
    for fname, dtype in (("positions_stacked", "<u4"), ("slot_stacked", "<i8"), ("block_table_ptrs", "<u8"),
                         ("seq_len_ptrs", "<u8"), ("cu_seqlens", "<i4"), ("kv_lens", "<i4")):
        if fields[names.index(fname)].dtype != dtype:
            raise v.error(f"header {where} field {fname} has dtype {fields[names.index(fname)].dtype}, expected {dtype}")
    return DumpedMeta(
        name=name, streams=streams, batch_size=n,
        chunk_len=v.int_(d, "chunk_len", where, hi=capacity), total_tokens=total,
        max_blocks_per_seq=v.int_(d, "max_blocks_per_seq", where), staged_bytes=staged,
        scratch_offset_bytes=offset, use_mrope=use_mrope, block_size=bs,
        dummy_kv_block=v.int_(d, "dummy_kv_block", where, hi=(1 << 31) - 1),
        cu_seqlens_host=cu, kv_lens_host=kv, fields=fields, device_ptrs=ptrs,
    )


def _parse_stream(v: _Validator, d, i: int, tables: np.ndarray | None) -> DumpedStream:
    where = f"streams[{i}]"
    if not isinstance(d, dict):
        raise v.error(f"header {where} must be an object")
    explicit = d.get("explicit_mrope", False)
    if not isinstance(explicit, bool):
        raise v.error(f"header {where}.explicit_mrope must be true or false")
    table, at = None, -1
    ref = v.obj(d, "block_table", where, optional=True)
    if ref is not None:
        if tables is None:
            raise v.error(f"header {where}.block_table refers to a block_tables member the archive lacks")
        at = v.int_(ref, "offset", f"{where}.block_table", hi=tables.size)
        count = v.int_(ref, "count", f"{where}.block_table", hi=tables.size - at)
        table = tables[at:at + count]
    return DumpedStream(i, v.int_(d, "proc_start", where, hi=(1 << 31) - 1),
                        v.int_(d, "proc_count", where, hi=(1 << 31) - 1),
                        v.int_(d, "block_table_dev", where), v.int_(d, "seq_len_dev", where), explicit, table, at)


def _parse_allocations(v: _Validator, raw: list) -> tuple:
    """The live allocations, sorted by base; refused when two overlap (the driver never hands out overlapping
    memory), which makes looking an address up a binary search."""
    out = []
    for i, a in enumerate(raw):
        if not isinstance(a, dict):
            raise v.error(f"header allocations[{i}] must be an object")
        alloc = Allocation(v.str_(a, "name", f"allocations[{i}]"), v.int_(a, "base", f"allocations[{i}]"),
                           v.int_(a, "size", f"allocations[{i}]"))
        if alloc.end >= _U64:
            raise v.error(f"header allocations[{i}] ({alloc.name}) ends past a 64-bit address")
        out.append(alloc)
    out.sort(key=lambda a: (a.base, a.end))
    for a, b in zip(out, out[1:]):
        if b.base < a.end:
            raise v.error(f"header allocations {a.name!r} [{a.base:#x}, {a.end:#x}) and {b.name!r} [{b.base:#x}, "
                          f"{b.end:#x}) overlap; device allocations never do")
    return tuple(out)


def load_dump(path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> ArenaDump:
    """Read and validate an arena dump written by :func:`dump_arena` / :func:`dump_pass`.

    Parameters
    ----------
    path : str or os.PathLike
        A regular file (a named pipe, a device or a directory is refused before it is read).
    max_bytes : int
        Refuse archives whose members unpack to more than this (default :data:`DEFAULT_MAX_BYTES`, 256 MiB; the
        commands' ``--max-bytes``). Independently, a member may not claim to unpack more than :data:`MAX_RATIO`
        times its compressed size, and the header at most :data:`MAX_HEADER_BYTES`.

    Returns
    -------
    ArenaDump

    Raises
    ------
    DumpError
        Missing, truncated or foreign file; pickled members; an unsupported schema version; a
        header of the wrong types, one whose offsets and sizes do not fit the bytes present, or one
        that lists more streams, regions or allocations than the arena can hold.
    """
    path = os.fspath(path)
    members = _read_members(path, max_bytes)
    header = _parse_header(path, members["header"])
    v = _Validator(path)
    for key in ("created_utc",):
        v.str_(header, key, "(top level)")
    dev = v.obj(header, "device", "(top level)")
    v.str_(dev, "name", "device")
    v.str_(dev, "driver", "device")
    ar = v.obj(header, "arena", "(top level)")
    capacity = v.int_(ar, "capacity", "arena", lo=1)
    base = v.int_(ar, "base", "arena")
    if base + capacity > _U64:
        raise v.error(f"header arena base {base:#x} + capacity {capacity} overflows a 64-bit address")
    if members["arena"].size != capacity:
        raise v.error(f"header says the arena is {capacity:,} bytes but the file holds {members['arena'].size:,}")
    v.int_(ar, "cursor", "arena", hi=capacity)
    guard_bytes = v.int_(ar, "guard_bytes", "arena", hi=1 << 20)
    v.int_(ar, "guard_pattern", "arena", hi=255)
    if members["guard"].size != guard_bytes:
        raise v.error(f"header says the guard band is {guard_bytes} bytes but the file holds {members['guard'].size}")
    reservations = _parse_regions(v, v.list_(ar, "reservations", "arena"), "arena.reservations", capacity)
    allocations = _parse_allocations(v, v.list_(header, "allocations", "(top level)"))
    tables = None
    if "block_tables" in members:
        raw = members["block_tables"]
        if header["version"] < 2 or raw.size % 4:
            raise v.error(f"the block_tables member ({raw.size:,} bytes) must hold int32 entries of a version 2 dump")
        tables = raw.view("<i4")
    streams_raw = v.list_(header, "streams", "(top level)", optional=True)
    if streams_raw is not None and len(streams_raw) > max_streams(capacity):
        raise v.error(f"header lists {len(streams_raw):,} streams but a {capacity:,}-byte arena holds the metadata of "
                      f"at most {max_streams(capacity):,}")
    streams = tuple(_parse_stream(v, s, i, tables) for i, s in enumerate(streams_raw)) if streams_raw is not None else ()
    nstreams = len(streams) if streams_raw is not None else None
    plan_raw = v.obj(header, "plan", "(top level)", optional=True)
    plan = _parse_plan(v, plan_raw, capacity) if plan_raw is not None else None
    metas_raw = v.list_(header, "metadata", "(top level)")
    if len(metas_raw) > max_streams(capacity):
        raise v.error(f"header lists {len(metas_raw):,} metadata blocks; a {capacity:,}-byte arena holds at most "
                      f"{max_streams(capacity):,}")
    metas = tuple(_parse_meta(v, m, i, capacity, nstreams) for i, m in enumerate(metas_raw))
    _bounded_total(v, "the metadata blocks", (m.staged_bytes for m in metas), capacity, "arena")
    if streams_raw is not None and metas and len(streams) != sum(m.batch_size for m in metas):
        raise v.error(f"header lists {len(streams)} stream inputs but its metadata covers "
                      f"{sum(m.batch_size for m in metas)} streams")
    mode = header.get("mode")
    if mode not in (None, "batched", "per_stream") or (mode is None) != (not metas):
        raise v.error(f"header mode {mode!r} does not match {len(metas)} metadata block(s)")
    hs = v.obj(header, "h_state", "(top level)", optional=True)
    h_state = None
    if hs is not None:
        h_state = HStateInfo(v.int_(hs, "offset", "h_state", hi=capacity), v.int_(hs, "n", "h_state", hi=capacity),
                             v.int_(hs, "uploads", "h_state", optional=True))
        v.span("the h_state_ptrs slot", h_state.offset, h_state_slot_bytes(h_state.n), capacity, "arena")
    num_blocks = v.int_(header, "num_blocks", "(top level)", lo=1, hi=(1 << 31) - 1, optional=True)
    ring_raw = v.obj(header, "ring", "(top level)", optional=True)
    ring_slots = ()
    if (ring_raw is None) != ("ring" not in members):
        raise v.error("header ring and the ring member must be both present or both absent")
    if ring_raw is not None:
        slots = []
        for i, s in enumerate(v.list_(ring_raw, "slots", "ring")):
            if not isinstance(s, dict):
                raise v.error(f"header ring.slots[{i}] must be an object")
            info = RingSlotInfo(v.int_(s, "index", f"ring.slots[{i}]"), v.int_(s, "offset", f"ring.slots[{i}]"),
                                v.int_(s, "nbytes", f"ring.slots[{i}]"), bool(s.get("pending", False)))
            v.span(f"ring slot {info.index}", info.offset, info.nbytes, members["ring"].size, "ring member")
            slots.append(info)
        _bounded_total(v, "the ring slots", (s.nbytes for s in slots), members["ring"].size, "ring member")
        ring_slots = tuple(slots)
    return ArenaDump(path=path, header=header, arena=members["arena"], guard=members["guard"],
                     ring=members.get("ring"), plan=plan, metas=metas, mode=mode, streams=streams,
                     reservations=reservations, allocations=allocations, h_state=h_state,
                     num_blocks=num_blocks, ring_slots=ring_slots, block_tables=tables)
