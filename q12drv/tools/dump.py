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

:func:`load_dump` trusts nothing in the file: the archive is read with ``allow_pickle=False``,
the header is parsed as JSON and validated (types, counts, and every offset and size against the
bytes actually present) before a single arena byte is looked at. Anything wrong raises
:class:`~q12drv.core.errors.DumpError` naming the file and the problem.

What the bytes *mean* (are the sequence lengths monotone, do the slots collide, ...) is checked
by :mod:`q12drv.tools.inspect`; :mod:`q12drv.tools.diff` compares two dumps; :mod:`q12drv.tools.render` draws one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core.arena import GUARD_BYTES, GUARD_PATTERN, ScratchArena
from ..core.errors import DumpError
from ..core.layout import FieldSpec, Region, ScratchPlan, a8, stacked_layout
from ..core.staging import BatchedAttnMetadata, StreamStageInfo

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
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
#: The header layout version this module writes and reads.
SCHEMA_VERSION = 1

_MEMBERS = ("header", "arena", "guard")
_OPTIONAL_MEMBERS = ("ring",)
_MAX_HEADER_BYTES = 64 << 20
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
    """One prefill stream's inputs as the stager saw them."""

    index: int
    proc_start: int
    proc_count: int
    block_table_dev: int
    seq_len_dev: int
    explicit_mrope: bool = False


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
        return self.offset + 8 * self.n


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
    h_state : HStateInfo or None
    num_blocks : int or None
        KV-cache blocks, when the writer knew it.
    ring_slots : tuple of RingSlotInfo
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
        """The known allocation holding ``[addr, addr + nbytes)``, or the one holding ``addr``, or None."""
        hit = None
        for a in self.allocations:
            if a.contains(addr, nbytes):
                return a
            if hit is None and a.contains(addr, 1):
                hit = a
        return hit

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


def _stream_json(b: int, s: StreamStageInfo) -> dict:
    return {"index": b, "proc_start": int(s.proc_start), "proc_count": int(s.proc_count),
            "block_table_dev": int(s.block_table_dev), "seq_len_dev": int(s.seq_len_dev),
            "explicit_mrope": s.mrope_positions is not None}


def _ring_bytes(arena: ScratchArena) -> tuple:
    ring = arena.find_attachment("ring:staging")
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


def write_dump(path, header: dict, arena_bytes, guard_bytes, ring_bytes=None) -> Path:
    """Write a dump file from its parts (atomically: a temporary file renamed over ``path``).

    Parameters
    ----------
    path : str or os.PathLike
        Written as given (no ``.npz`` suffix is added).
    header : dict
        JSON-serialisable header (see the module docstring); not validated here.
    arena_bytes, guard_bytes, ring_bytes : bytes or uint8 array
        The members; ``ring_bytes`` None leaves the ring out.

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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent.resolve()))
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, **members)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


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
        The stager's inputs, in batch order (lets inspect compare pointers and lengths with them).
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
        "streams": [_stream_json(b, s) for b, s in enumerate(streams)] if streams is not None else None,
        "h_state": h_state,
        "block_size": int(first.block_size) if first is not None else None,
        "dummy_kv_block": int(first.dummy_kv_block) if first is not None else None,
        "num_blocks": int(num_blocks) if num_blocks is not None else None,
        "ring": None,
    }
    ring = None
    if include_ring:
        header["ring"], ring = _ring_bytes(arena)
    return write_dump(path, header, raw, guard, ring)


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


def _sniff(v: _Validator, path: str) -> None:
    """Refuse what is plainly not a zip archive before numpy guesses at it (numpy falls back to pickle)."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
    except FileNotFoundError:
        raise v.error("no such file") from None
    except IsADirectoryError:
        raise v.error("is a directory, not a dump file") from None
    except OSError as exc:
        raise v.error(f"cannot be read ({exc.strerror or exc})") from None
    if not magic:
        raise v.error("is empty (0 bytes): truncated, not a dump")
    if magic.startswith(b"PK"):
        return
    if magic.startswith(b"\x93NUMPY"):
        raise v.error("holds a single .npy array, not a q12drv dump archive (header + arena)")
    if magic[:1] == b"\x80":
        raise v.error("is a Python pickle; dumps are .npz archives read with allow_pickle=False and never unpickled")
    raise v.error(f"not a q12drv arena dump: not an .npz (zip) archive (starts with {magic!r})")


def _check_npy_header(v: _Validator, zf, name: str, size: int) -> None:
    """Read a member's .npy header only: refuse object dtypes and shapes the member's bytes cannot hold."""
    fmt = np.lib.format
    try:
        with zf.open(f"{name}.npy") as fh:
            major, _ = fmt.read_magic(fh)
            read = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
            shape, _, dtype = read(fh)
    except Exception as exc:
        raise v.error(f"member {name!r} has no readable .npy header ({type(exc).__name__}: {exc})") from None
    if dtype.hasobject:
        raise v.error(f"member {name!r} holds pickled Python objects; dumps are read with allow_pickle=False "
                      f"and never unpickled")
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if nbytes > size:
        raise v.error(f"member {name!r} claims shape {shape} ({nbytes:,} bytes) but holds only {size:,}")


def _read_members(path: str, max_bytes: int) -> dict:
    v = _Validator(path)
    _sniff(v, path)
    try:
        npz = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise v.error("no such file") from None
    except ValueError as exc:
        if "pickle" in str(exc):
            raise v.error("holds pickled Python objects; dumps are read with allow_pickle=False and "
                          "never unpickled") from None
        raise v.error(f"not a q12drv arena dump ({exc})") from None
    except Exception as exc:  # OSError, EOFError, zipfile.BadZipFile, ...: a truncated or foreign file
        raise v.error(f"not a readable .npz archive ({type(exc).__name__}: {exc}); truncated or not a dump?") from None
    if isinstance(npz, np.ndarray):
        raise v.error("holds a single .npy array, not a q12drv dump archive (header + arena)")
    with npz:
        names = list(npz.files)
        missing = [m for m in _MEMBERS if m not in names]
        if missing:
            raise v.error(f"not a q12drv arena dump: member(s) {', '.join(missing)} missing (found: "
                          f"{', '.join(names) or 'none'})")
        extra = [m for m in names if m not in _MEMBERS + _OPTIONAL_MEMBERS]
        if extra:
            raise v.error(f"unexpected member(s) {', '.join(extra)} in the dump archive")
        zf = getattr(npz, "zip", None)
        if zf is not None:
            total = 0
            for name in names:
                size = zf.getinfo(f"{name}.npy").file_size
                if name == "header" and size > _MAX_HEADER_BYTES:
                    raise v.error(f"header member is {size:,} bytes (at most {_MAX_HEADER_BYTES:,} allowed)")
                _check_npy_header(v, zf, name, size)
                total += size
            if total > max_bytes:
                raise v.error(f"the members unpack to {total:,} bytes, more than the {max_bytes:,} allowed "
                              f"(pass a larger max_bytes to load it)")
        out = {}
        for name in names:
            try:
                arr = npz[name]
            except ValueError as exc:
                if "pickle" in str(exc) or "object" in str(exc).lower():
                    raise v.error(f"member {name!r} holds pickled Python objects; dumps are read with "
                                  f"allow_pickle=False and never unpickled") from None
                raise v.error(f"member {name!r} is unreadable ({exc})") from None
            except Exception as exc:
                raise v.error(f"member {name!r} is unreadable ({type(exc).__name__}: {exc}); truncated "
                              f"or corrupted file?") from None
            if arr.dtype != np.uint8 or arr.ndim != 1:
                raise v.error(f"member {name!r} must be a 1-D uint8 array, got {arr.dtype} {arr.shape}")
            arr.setflags(write=False)
            out[name] = arr
    return out


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
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise v.error(f"dump schema version {version!r} is not supported (this q12drv reads version "
                      f"{SCHEMA_VERSION})")
    return header


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


def _parse_plan(v: _Validator, d: dict, capacity: int) -> DumpedPlan:
    policy = v.str_(d, "policy", "plan")
    counts = v.list_(d, "counts", "plan")
    counts = tuple(v.check_int(c, f"plan.counts[{i}]", 1, (1 << 31) - 1) for i, c in enumerate(counts))
    regions = tuple(_parse_region(v, r, f"plan.regions[{i}]", capacity)
                    for i, r in enumerate(v.list_(d, "regions", "plan")))
    fields = tuple(_parse_field(v, f, f"plan.fields[{i}]", capacity)
                   for i, f in enumerate(v.list_(d, "fields", "plan")))
    return DumpedPlan(policy, counts, v.int_(d, "top_k", "plan", hi=1 << 20), v.bool_(d, "mrope", "plan"),
                      v.int_(d, "total_bytes", "plan"), v.int_(d, "staged_bytes", "plan"), regions, fields)


def _parse_meta(v: _Validator, d, i: int, capacity: int, nstreams: int | None) -> DumpedMeta:
    where = f"metadata[{i}]"
    if not isinstance(d, dict):
        raise v.error(f"header {where} must be an object")
    name = v.str_(d, "name", where)
    n = v.int_(d, "batch_size", where, lo=1, hi=capacity)
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


def _parse_stream(v: _Validator, d, i: int) -> DumpedStream:
    where = f"streams[{i}]"
    if not isinstance(d, dict):
        raise v.error(f"header {where} must be an object")
    explicit = d.get("explicit_mrope", False)
    if not isinstance(explicit, bool):
        raise v.error(f"header {where}.explicit_mrope must be true or false")
    return DumpedStream(i, v.int_(d, "proc_start", where, hi=(1 << 31) - 1),
                        v.int_(d, "proc_count", where, hi=(1 << 31) - 1),
                        v.int_(d, "block_table_dev", where), v.int_(d, "seq_len_dev", where), explicit)


def load_dump(path, *, max_bytes: int = 1 << 34) -> ArenaDump:
    """Read and validate an arena dump written by :func:`dump_arena` / :func:`dump_pass`.

    Parameters
    ----------
    path : str or os.PathLike
    max_bytes : int
        Refuse archives whose members unpack to more than this (default 16 GiB).

    Returns
    -------
    ArenaDump

    Raises
    ------
    DumpError
        Missing, truncated or foreign file; pickled members; an unsupported schema version; a
        header of the wrong types or one whose offsets and sizes do not fit the bytes present.
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
    reservations = tuple(_parse_region(v, r, f"arena.reservations[{i}]", capacity)
                         for i, r in enumerate(v.list_(ar, "reservations", "arena")))
    allocations = []
    for i, a in enumerate(v.list_(header, "allocations", "(top level)")):
        if not isinstance(a, dict):
            raise v.error(f"header allocations[{i}] must be an object")
        allocations.append(Allocation(v.str_(a, "name", f"allocations[{i}]"), v.int_(a, "base", f"allocations[{i}]"),
                                      v.int_(a, "size", f"allocations[{i}]")))
    streams_raw = v.list_(header, "streams", "(top level)", optional=True)
    streams = tuple(_parse_stream(v, s, i) for i, s in enumerate(streams_raw)) if streams_raw is not None else ()
    nstreams = len(streams) if streams_raw is not None else None
    plan_raw = v.obj(header, "plan", "(top level)", optional=True)
    plan = _parse_plan(v, plan_raw, capacity) if plan_raw is not None else None
    metas = tuple(_parse_meta(v, m, i, capacity, nstreams)
                  for i, m in enumerate(v.list_(header, "metadata", "(top level)")))
    mode = header.get("mode")
    if mode not in (None, "batched", "per_stream") or (mode is None) != (not metas):
        raise v.error(f"header mode {mode!r} does not match {len(metas)} metadata block(s)")
    hs = v.obj(header, "h_state", "(top level)", optional=True)
    h_state = None
    if hs is not None:
        h_state = HStateInfo(v.int_(hs, "offset", "h_state", hi=capacity), v.int_(hs, "n", "h_state", hi=capacity),
                             v.int_(hs, "uploads", "h_state", optional=True))
        v.span("the h_state_ptrs slot", h_state.offset, 8 * h_state.n, capacity, "arena")
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
        ring_slots = tuple(slots)
    return ArenaDump(path=path, header=header, arena=members["arena"], guard=members["guard"],
                     ring=members.get("ring"), plan=plan, metas=metas, mode=mode, streams=streams,
                     reservations=reservations, allocations=tuple(allocations), h_state=h_state,
                     num_blocks=num_blocks, ring_slots=ring_slots)
