"""Inspect an arena dump: decode every region and field, then check what the bytes must satisfy.

Each check guards one property and reads only what it needs, so that one corrupted thing fails
one check. Checks that need the per-stream segmentation take it from the header's host copies
(``cu_seqlens_host``, ``kv_lens_host``), never from the device bytes they are not about. Each KV
slot is judged by the first slot check (in the order below) it fails, so that a wrong slot fails
the check named for what is wrong with it, and only that one.

===================  =========================================================================
check                what it guards
===================  =========================================================================
regions              plan regions and arena reservations inside the capacity, none overlapping;
                     every metadata field inside its block, fields not overlapping
layout               header fields, ``staged_bytes``, scalars and plan equal what
                     :mod:`q12drv.core.layout` computes from the counts; device pointers = base + offset;
                     the stream inputs' ``proc_start``/``proc_count`` equal the host copies
cu_seqlens           device ``cu_seqlens``: starts at 0, strictly increasing, ends at
                     ``total_tokens``, equals the host copy
kv_lens              device ``kv_lens[b]`` >= the segment length, equals the host copy
positions            text streams: T (= H = W) contiguous, ending at ``kv_lens[b] - 1``; streams
                     with MRoPE vision positions: T non-decreasing, T/H/W inside
                     ``[proc_start, kv_len)``
slot_skipped         no token's slot is negative (the kernel would skip its KV write: the stager
                     sends a missing block's tokens to the dummy block instead)
slots                ``slot % block_size == pos % block_size`` for every slot
blocks_in_cache      ``slot // block_size < num_blocks`` (SKIP when the dump does not know num_blocks)
slot_dummy           a token writes the dummy block only where its table entry is missing (< 0)
slot_unowned         every slot's block is in some stream's block table (or is the dummy block)
slot_table           every slot's block is the entry its own stream's table has for its position
slot_collisions      no two tokens write one KV slot (the dummy block excepted)
pointers             block-table, seq_len and written ``h_state_ptrs`` entries point into known
                     allocations with room for what they address
pads                 every field's pad bytes are zero
h_state_slot         the JIT slot sits at ``scratch_offset_bytes + staged_bytes`` (batched) and
                     overlaps no metadata
guard                the guard band past the capacity is intact
===================  =========================================================================

``slot_dummy``, ``slot_unowned`` and ``slot_table`` read the streams' block tables, which dumps of schema
version 2 carry: on a version 1 dump (or one written without the stream inputs) they SKIP and say why.
Every check's work is proportional to the bytes and entries the dump holds (vectorised over tokens and
streams), so a dump the reader accepts is inspected in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .dump import DEFAULT_MAX_BYTES, ArenaDump, DumpedMeta, load_dump
from ..core.layout import (h_state_entry_offset, h_state_slot_bytes, h_state_slot_offset, make_scratch_plan,
                           stacked_layout)

__all__ = ["CHECKS", "Finding", "CheckResult", "InspectReport", "run_checks", "inspect_dump",
           "decode_fields", "stream_summaries", "STREAMS_LISTED", "METAS_DECODED"]

_FINDINGS_LIMIT = 20
_PTR_DTYPE_FIELDS = ("block_table_ptrs", "seq_len_ptrs")
#: Streams the report lists one by one (the checks cover every stream; the listing says how many it left out).
STREAMS_LISTED = 256
#: Metadata blocks whose fields the report decodes (a per-stream pass has one block per stream).
METAS_DECODED = 64


@dataclass(frozen=True)
class Finding:
    """One offending item: what is wrong, the arena ``offset`` of the bytes (or None), the values."""

    message: str
    offset: int | None = None
    values: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"message": self.message, "offset": self.offset, "values": _jsonable(self.values)}


@dataclass
class CheckResult:
    """The outcome of one check: ``status`` is ``"PASS"``, ``"FAIL"`` or ``"SKIP"``.

    ``findings`` holds at most 20 offending items; ``total`` counts all of them.
    """

    name: str
    status: str
    summary: str
    findings: list
    total: int

    @property
    def ok(self) -> bool:
        return self.status != "FAIL"

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary, "total": self.total,
                "findings": [f.to_json() for f in self.findings]}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x)
    return x if x is None or isinstance(x, str) else str(x)


class _Collector:
    def __init__(self):
        self.findings: list = []
        self.total = 0
        self.skip: str | None = None

    def add(self, message: str, offset: int | None = None, **values) -> None:
        self.total += 1
        if len(self.findings) < _FINDINGS_LIMIT:
            self.findings.append(Finding(message, None if offset is None else int(offset), values))

    @property
    def full(self) -> bool:
        """No more findings are kept (later ones only count)."""
        return len(self.findings) >= _FINDINGS_LIMIT

    def each(self, items, count) -> Any:
        """The first of ``items`` worth a finding; the rest (``count`` in all) only count."""
        room = max(_FINDINGS_LIMIT - len(self.findings), 0)
        self.total += max(int(count) - room, 0)
        return items[:room]


def _segments(m: DumpedMeta):
    """(i, stream index, first row, last row + 1, proc_start, kv_len) per stream, from the host copies."""
    cu, kv = m.cu_seqlens_host, m.kv_lens_host
    for i, b in enumerate(m.streams):
        lo, hi = int(cu[i]), int(cu[i + 1])
        yield i, b, lo, hi, int(kv[i]) - (hi - lo), int(kv[i])


@dataclass(frozen=True)
class _Tokens:
    """A metadata block's tokens as arrays, from the host copies: ``sid`` (the stream's index in the block) and
    ``pos`` (its absolute position) per token; per stream ``lo``/``hi`` rows, ``start`` and ``kv``."""

    sid: np.ndarray
    pos: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    start: np.ndarray
    kv: np.ndarray


def _tokens(m: DumpedMeta) -> _Tokens:
    cu, kv = m.cu_seqlens_host, m.kv_lens_host
    lengths = np.diff(cu)
    start = kv - lengths
    sid = np.repeat(np.arange(m.batch_size), lengths)
    pos = np.arange(m.total_tokens, dtype=np.int64) + np.repeat(start - cu[:-1], lengths)
    return _Tokens(sid, pos, cu[:-1], cu[1:], start, kv)


def _first_per_stream(bad: np.ndarray, sid: np.ndarray) -> tuple:
    """``(streams, first token, count)`` of the streams with a bad token, in stream order."""
    idx = np.flatnonzero(bad)
    if not idx.size:
        return (), (), ()
    streams, first, counts = np.unique(sid[idx], return_index=True, return_counts=True)
    return streams, idx[first], counts


# --- the checks -----------------------------------------------------------------------------

def _overlaps(items):
    """Pairs (a, b) of overlapping non-empty items (each with .name, .offset, .end)."""
    out, cur = [], None
    for r in sorted((r for r in items if r.end > r.offset), key=lambda r: (r.offset, r.end)):
        if cur is not None and r.offset < cur.end:
            out.append((cur, r))
        if cur is None or r.end > cur.end:
            cur = r
    return out


def _check_regions(d: ArenaDump, c: _Collector) -> str:
    lists = [("reservation", d.reservations)] + ([("plan region", d.plan.regions)] if d.plan else [])
    for label, regions in lists:
        for r in regions:
            if r.end > d.capacity:
                c.add(f"{label} {r.name} [{r.offset:,}, {r.end:,}) ends past the capacity {d.capacity:,}", r.offset,
                      end=r.end, capacity=d.capacity)
        for a, b in _overlaps(regions):
            c.add(f"{label} {b.name} [{b.offset:,}, {b.end:,}) overlaps {a.name} [{a.offset:,}, {a.end:,})",
                  b.offset, **{a.name: [a.offset, a.end], b.name: [b.offset, b.end]})
    if d.plan is not None and d.plan.total_bytes > d.capacity:
        c.add(f"the plan needs {d.plan.total_bytes:,} bytes but the arena holds {d.capacity:,}", d.capacity,
              total_bytes=d.plan.total_bytes, capacity=d.capacity)
    nfields = 0
    for m in d.metas:
        for f in m.fields:
            nfields += 1
            if f.offset < m.scratch_offset_bytes or f.end > m.end:
                c.add(f"field {m.name}.{f.name} [{f.offset:,}, {f.end:,}) lies outside its block "
                      f"[{m.scratch_offset_bytes:,}, {m.end:,})", f.offset)
        for a, b in _overlaps(m.fields):
            c.add(f"field {m.name}.{b.name} [{b.offset:,}, {b.end:,}) overlaps {a.name} [{a.offset:,}, {a.end:,})",
                  b.offset)
    for a, b in _overlaps([_Span(m.name, m.scratch_offset_bytes, m.end) for m in d.metas]):
        c.add(f"metadata block {b.name} overlaps {a.name}", b.offset)
    nplan = len(d.plan.regions) if d.plan else 0
    return (f"{nplan} plan regions, {len(d.reservations)} reservations and {nfields} fields inside "
            f"{d.capacity:,} bytes, none overlapping")


@dataclass(frozen=True)
class _Span:
    name: str
    offset: int
    end: int


def _check_layout(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    inputs_all = np.array([(s.proc_start, s.proc_count) for s in d.streams], np.int64).reshape(-1, 2)
    for m in d.metas:
        try:
            ref = stacked_layout(m.batch_size, m.total_tokens, m.use_mrope)
        except ValueError as exc:
            c.add(f"{m.name}: q12drv.core.layout refuses its counts: {exc}", m.scratch_offset_bytes)
            continue
        if ref.staged_bytes != m.staged_bytes:
            c.add(f"{m.name}: staged_bytes {m.staged_bytes:,} but the layout gives {ref.staged_bytes:,}",
                  m.scratch_offset_bytes, header=m.staged_bytes, layout=ref.staged_bytes)
        want = {f.name: f for f in ref.shifted(m.scratch_offset_bytes)}
        have = {f.name: f for f in m.fields}
        if set(want) != set(have):
            c.add(f"{m.name}: fields {sorted(have)} but the layout has {sorted(want)}", m.scratch_offset_bytes)
        for name in want.keys() & have.keys():
            if want[name] != have[name]:
                c.add(f"{m.name}.{name}: header says {have[name]} but the layout gives {want[name]}",
                      have[name].offset)
        counts = np.diff(m.cu_seqlens_host)
        if m.chunk_len != int(counts.max()):
            c.add(f"{m.name}: chunk_len {m.chunk_len} but the longest segment is {int(counts.max())}", None)
        bad = np.flatnonzero(m.kv_lens_host < counts)
        for i in c.each(bad, bad.size):
            c.add(f"{m.name}: kv_lens_host[{i}] = {m.kv_lens_host[i]} < segment length {counts[i]}", None)
        need = int(-(-int(m.kv_lens_host.max()) // m.block_size))
        if m.max_blocks_per_seq < need:
            c.add(f"{m.name}: max_blocks_per_seq {m.max_blocks_per_seq} but kv_len {int(m.kv_lens_host.max())} "
                  f"needs {need} blocks of {m.block_size}", None)
        for name, ptr in m.device_ptrs.items():
            target = have.get(name) or (have.get("positions_stacked") if not m.use_mrope else None)
            if target is not None and ptr != d.base + target.offset:
                c.add(f"{m.name}.{name}: device pointer {ptr:#x} but base + offset = {d.base + target.offset:#x}",
                      target.offset, pointer=ptr, expected=d.base + target.offset)
        if d.streams:
            inputs = inputs_all[np.asarray(m.streams, np.int64)]
            host = np.stack([m.kv_lens_host - counts, counts], axis=1)
            bad = np.flatnonzero((inputs != host).any(axis=1))
            for i in c.each(bad, bad.size):
                c.add(f"stream {m.streams[i]}: inputs say proc_start {inputs[i, 0]}, proc_count {inputs[i, 1]} but "
                      f"{m.name}'s host copies give {host[i, 0]}, {host[i, 1]}", None)
    if d.plan is not None:
        p = d.plan
        try:
            ref = make_scratch_plan(p.counts, p.top_k, p.mrope, p.policy)
        except (TypeError, ValueError) as exc:
            c.add(f"plan: q12drv.core.layout refuses its inputs: {exc}", None)
            ref = None
        if ref is not None:
            for a, b in zip(p.regions, ref.regions):
                if (a.name, a.offset, a.nbytes, a.kind, a.stream) != (b.name, b.offset, b.nbytes, b.kind, b.stream):
                    c.add(f"plan region {a.name} [{a.offset:,}, +{a.nbytes:,}) but the layout gives {b.name} "
                          f"[{b.offset:,}, +{b.nbytes:,})", a.offset)
            if len(p.regions) != len(ref.regions):
                c.add(f"plan has {len(p.regions)} regions but the layout gives {len(ref.regions)}", None)
            if tuple(p.fields) != tuple(ref.fields):
                c.add("plan fields differ from the layout's stacked fields", p.regions[0].offset if p.regions else None)
            if (p.total_bytes, p.staged_bytes) != (ref.total_bytes, ref.staged_bytes):
                c.add(f"plan total/staged bytes {p.total_bytes:,}/{p.staged_bytes:,} but the layout gives "
                      f"{ref.total_bytes:,}/{ref.staged_bytes:,}", None)
            if d.mode == "batched":
                m = d.metas[0]
                if m.scratch_offset_bytes != ref.stacked.offset or tuple(np.diff(m.cu_seqlens_host)) != p.counts:
                    c.add(f"{m.name} at {m.scratch_offset_bytes:,} with counts {np.diff(m.cu_seqlens_host).tolist()[:16]} "
                          f"but the plan puts the stacked block at {ref.stacked.offset:,} for {list(p.counts)[:16]}",
                          m.scratch_offset_bytes)
            elif d.mode == "per_stream":
                for m in d.metas:
                    b = m.streams[0]
                    if b < len(ref.stream_blocks) and m.scratch_offset_bytes != ref.stream_blocks[b].offset:
                        c.add(f"{m.name} at {m.scratch_offset_bytes:,} but the plan puts stream {b}'s block at "
                              f"{ref.stream_blocks[b].offset:,}", m.scratch_offset_bytes)
    return f"{len(d.metas)} metadata block(s){' and the plan' if d.plan else ''} agree with q12drv.core.layout"


def _check_cu_seqlens(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    for m in d.metas:
        f = m.field("cu_seqlens")
        cu = d.values(f).astype(np.int64)
        if cu[0] != 0:
            c.add(f"{m.name}: cu_seqlens[0] = {cu[0]}, not 0", f.offset, index=0, value=cu[0])
        bad = np.flatnonzero(np.diff(cu) <= 0)
        for i in c.each(bad, bad.size):
            c.add(f"{m.name}: cu_seqlens[{i + 1}] = {cu[i + 1]} is not greater than cu_seqlens[{i}] = {cu[i]}",
                  f.element_offset(i + 1), index=i + 1, value=cu[i + 1], previous=cu[i])
        if cu[-1] != m.total_tokens:
            c.add(f"{m.name}: cu_seqlens[{m.batch_size}] = {cu[-1]} but total_tokens is {m.total_tokens}",
                  f.element_offset(m.batch_size), index=m.batch_size, value=cu[-1], total_tokens=m.total_tokens)
        bad = np.flatnonzero(cu != m.cu_seqlens_host)
        for i in c.each(bad, bad.size):
            c.add(f"{m.name}: cu_seqlens[{i}] = {cu[i]} but the host copy has {m.cu_seqlens_host[i]}",
                  f.element_offset(i), index=i, value=cu[i], host=m.cu_seqlens_host[i])
    n = sum(m.batch_size + 1 for m in d.metas)
    return f"{n} entries start at 0, increase, end at total_tokens and match the host copies"


def _check_kv_lens(d: ArenaDump, c: _Collector) -> str:
    # (the host copies against the stream inputs: the layout check; one wrong input fails one check)
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    for m in d.metas:
        f = m.field("kv_lens")
        kv = d.values(f).astype(np.int64)
        seg = np.diff(m.cu_seqlens_host)
        bad = np.flatnonzero(kv < seg)
        for i in c.each(bad, bad.size):
            c.add(f"stream {m.streams[i]}: kv_lens[{i}] = {kv[i]} < its segment length {seg[i]}", f.element_offset(i),
                  index=i, value=kv[i], segment=seg[i])
        bad = np.flatnonzero(kv != m.kv_lens_host)
        for i in c.each(bad, bad.size):
            c.add(f"stream {m.streams[i]}: kv_lens[{i}] = {kv[i]} but the host copy has {m.kv_lens_host[i]}",
                  f.element_offset(i), index=i, value=kv[i], host=m.kv_lens_host[i])
    return f"{sum(m.batch_size for m in d.metas)} entries cover their segments and match the host copies"


def _segment_all(mask: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per segment ``[lo, hi)``: whether ``mask`` is true throughout (true for an empty segment)."""
    false = np.concatenate(([0], np.cumsum(~mask)))
    return false[hi] == false[lo]


def _check_positions(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    text = vision = 0
    for m in d.metas:
        tk = _tokens(m)
        ft = m.field("positions_stacked")
        fh = m.field("positions_h_stacked") if m.use_mrope else ft
        fw = m.field("positions_w_stacked") if m.use_mrope else ft
        T, H, W = (d.values(f).astype(np.int64) for f in (ft, fh, fw))
        if not m.use_mrope:
            is_text = np.ones(m.batch_size, bool)
        elif d.streams:  # the inputs say whether the caller gave vision positions
            is_text = ~np.array([d.streams[b].explicit_mrope for b in m.streams], bool)
        else:
            is_text = _segment_all((H == T) & (W == T), tk.lo, tk.hi)
        text += int(is_text.sum())
        vision += int((~is_text).sum())
        text_tok = is_text[tk.sid]
        for f, arr in ((ft, T),) + (((fh, H), (fw, W)) if m.use_mrope else ()):
            streams, first, counts = _first_per_stream(text_tok & (arr != tk.pos), tk.sid)
            for i, j, k in c.each(list(zip(streams, first, counts)), len(streams)):
                b = m.streams[i]
                c.add(f"stream {b}: {f.name}[{j}] = {arr[j]} but text positions run {tk.start[i]}..{tk.kv[i] - 1} "
                      f"(expected {tk.pos[j]}; {k} wrong)", f.element_offset(j), index=j, value=arr[j],
                      expected=tk.pos[j])
        if text_tok.all():
            continue
        vis_tok = ~text_tok
        lo_t, hi_t = tk.start[tk.sid], tk.kv[tk.sid]
        for f, arr in ((ft, T), (fh, H), (fw, W)):
            streams, first, counts = _first_per_stream(vis_tok & ((arr < lo_t) | (arr >= hi_t)), tk.sid)
            for i, j, k in c.each(list(zip(streams, first, counts)), len(streams)):
                c.add(f"stream {m.streams[i]}: {f.name}[{j}] = {arr[j]} lies outside [{tk.start[i]}, {tk.kv[i]}) "
                      f"({k} outside)", f.element_offset(j), index=j, value=arr[j])
        back = np.zeros(T.size, bool)
        if T.size > 1:
            back[1:] = (np.diff(T) < 0) & (tk.sid[1:] == tk.sid[:-1])
        streams, first, _ = _first_per_stream(vis_tok & back, tk.sid)
        for i, j in c.each(list(zip(streams, first)), len(streams)):
            c.add(f"stream {m.streams[i]}: {ft.name}[{j}] = {T[j]} goes back from {T[j - 1]}", ft.element_offset(j),
                  index=j, value=T[j], previous=T[j - 1])
    return f"{text} text stream(s) contiguous up to kv_len - 1, {vision} MRoPE vision stream(s) within bounds"


# --- KV slots: every token's slot, judged by the first of these it fails ----------------------------------

_OK, _SKIPPED, _OFFSET, _CACHE, _DUMMY, _UNOWNED, _TABLE = range(7)


@dataclass(frozen=True)
class _SlotVerdicts:
    """Per metadata block: its tokens, their slots and blocks, and each token's verdict (the first slot check
    it fails: ``_SKIPPED`` .. ``_TABLE``; ``_OK``); ``judged``: the tokens whose table entry the dump has
    (the others cannot fail slot_dummy, slot_unowned or slot_table); ``expected``: that entry's block."""

    tokens: _Tokens
    slots: np.ndarray
    blocks: np.ndarray
    code: np.ndarray
    judged: np.ndarray
    expected: np.ndarray


_VERDICTS: dict = {}


def _tables_reason(d: ArenaDump) -> str | None:
    """Why the slot-ownership checks cannot run on ``d`` (None: they can, for the streams whose table it has)."""
    if d.version < 2:
        return (f"schema version {d.version} dumps store no block tables (re-dump with this q12drv to check each "
                f"slot against its stream's table)")
    if not d.streams:
        return "the dump has no stream inputs, so no block tables (dump with streams=...)"
    if all(s.block_table is None for s in d.streams):
        return "the dump stores no stream's block table"
    return None


def _slot_verdicts(d: ArenaDump) -> list:
    hit = _VERDICTS.get(id(d))
    if hit is not None and hit[0] is d:
        return hit[1]
    tables = d.block_tables if _tables_reason(d) is None else None
    owned = None
    if tables is not None:
        nstreams = len(d.streams)
        t_off = np.full(nstreams, -1, np.int64)
        t_cnt = np.zeros(nstreams, np.int64)
        for b, s in enumerate(d.streams):
            if s.block_table is not None:
                t_off[b] = s.table_offset
                t_cnt[b] = s.block_table.size
        owned = _owned_blocks(d, tables)
    out = []
    for m in d.metas:
        tk = _tokens(m)
        S = d.values(m.field("slot_stacked")).astype(np.int64)
        bs = m.block_size
        code = np.zeros(S.size, np.int8)
        code[S < 0] = _SKIPPED
        blocks = np.where(S >= 0, S // bs, -1)
        code[(code == _OK) & (S % bs != tk.pos % bs)] = _OFFSET
        if d.num_blocks is not None:
            code[(code == _OK) & (blocks >= d.num_blocks)] = _CACHE
        judged = np.zeros(S.size, bool)
        expected = np.full(S.size, -1, np.int64)
        if tables is not None:
            b_tok = np.asarray(m.streams, np.int64)[tk.sid]
            j = tk.pos // bs
            judged = (t_off[b_tok] >= 0) & (tk.pos >= 0) & (j < t_cnt[b_tok])
            entry = np.zeros(S.size, np.int64)
            entry[judged] = tables[t_off[b_tok][judged] + j[judged]]
            expected = np.where(entry < 0, m.dummy_kv_block, entry)
            live = judged & (code == _OK)
            dummy = blocks == m.dummy_kv_block
            code[live & dummy & (expected != m.dummy_kv_block)] = _DUMMY
            live = judged & (code == _OK)
            code[live & ~dummy & ~_member(blocks, owned)] = _UNOWNED
            live = judged & (code == _OK)
            code[live & (blocks != expected)] = _TABLE
        out.append((m, _SlotVerdicts(tk, S, blocks, code, judged, expected)))
    if len(_VERDICTS) >= 4:
        _VERDICTS.clear()
    _VERDICTS[id(d)] = (d, out)
    return out


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is in ``sorted_set`` (sorted, unique): a binary search each."""
    if not sorted_set.size:
        return np.zeros(values.shape, bool)
    k = np.minimum(np.searchsorted(sorted_set, values), sorted_set.size - 1)
    return sorted_set[k] == values


def _owned_blocks(d: ArenaDump, tables: np.ndarray) -> np.ndarray:
    """The blocks some slot points into that some stream's table holds (sorted): each table entry looked up among
    the slots' blocks (at most the arena's tokens) in one pass, not a sort of every entry."""
    blocks = [d.values(m.field("slot_stacked")).astype(np.int64) // m.block_size for m in d.metas]
    blocks = np.unique(np.concatenate(blocks)) if blocks else np.zeros(0, np.int64)
    blocks = blocks[(blocks >= 0) & (blocks < 1 << 31)]  # what an int32 table entry can be
    if not blocks.size:
        return blocks
    lo, hi = int(blocks[0]), int(blocks[-1])
    if hi - lo < 1 << 24:  # a bitmap of the slots' blocks: one indexed load per entry
        mark = np.zeros(hi - lo + 1, bool)
        mark[blocks - lo] = True
        near = tables[(tables >= lo) & (tables <= hi)]
        return np.unique(near[mark[near - lo]]).astype(np.int64)
    return np.unique(tables[_member(tables.astype(np.int64), blocks)]).astype(np.int64)


def _slot_findings(d: ArenaDump, c: _Collector, verdict: int, describe) -> int:
    """Findings for the tokens whose verdict is ``verdict`` (one per stream: its first, with the count); returns
    how many tokens have it. ``describe(m, v, i, j, k)``: the message for stream ``i``'s first such token ``j``."""
    n = 0
    for m, v in _slot_verdicts(d):
        bad = v.code == verdict
        n += int(bad.sum())
        f = m.field("slot_stacked")
        streams, first, counts = _first_per_stream(bad, v.tokens.sid)
        for i, j, k in c.each(list(zip(streams, first, counts)), len(streams)):
            c.add(describe(m, v, i, j, k), f.element_offset(j), index=j, value=v.slots[j], position=v.tokens.pos[j],
                  stream=m.streams[i])
    return n


def _judge(d: ArenaDump, c: _Collector, needs_tables: bool = False) -> bool:
    """Whether a slot check can run on ``d`` (else ``c`` says why it skips)."""
    reason = ("no metadata in this dump" if not d.metas else
              _tables_reason(d) if needs_tables else None)
    c.skip = reason
    return reason is None


def _slot_check(verdict: int, needs_tables: bool, describe, summary):
    """A slot check: the findings of the tokens whose verdict is ``verdict`` (``describe(d, m, v, i, j, k)``: the
    message for stream ``i``'s first such token ``j`` of ``k``), then ``summary(d)``."""
    def check(d: ArenaDump, c: _Collector) -> str:
        if not _judge(d, c, needs_tables):
            return ""
        _slot_findings(d, c, verdict, lambda m, v, i, j, k: describe(d, m, v, i, j, k))
        return summary(d)

    return check


_check_slot_skipped = _slot_check(_SKIPPED, False, lambda d, m, v, i, j, k: (
    f"stream {m.streams[i]}: slot_stacked[{j}] = {v.slots[j]} is negative: the KV write of position "
    f"{v.tokens.pos[j]} would be skipped ({k} such tokens)"),
    lambda d: f"{sum(m.total_tokens for m in d.metas)} tokens, every one with a KV slot (none negative)")

_check_slots = _slot_check(_OFFSET, False, lambda d, m, v, i, j, k: (
    f"stream {m.streams[i]}: slot_stacked[{j}] = {v.slots[j]} is at {v.slots[j] % m.block_size} in its block "
    f"but position {v.tokens.pos[j]} is at {v.tokens.pos[j] % m.block_size} (block_size {m.block_size}; "
    f"{k} wrong)"),
    lambda d: f"{sum(int((v.slots >= 0).sum()) for _, v in _slot_verdicts(d))} slots agree with their positions "
              f"mod block_size")


def _check_blocks_in_cache(d: ArenaDump, c: _Collector) -> str:
    if not _judge(d, c):
        return ""
    if d.num_blocks is None:
        c.skip = "num_blocks unknown (dump with num_blocks=..., or inspect --num-blocks N)"
        return ""
    for m in d.metas:
        if m.dummy_kv_block >= d.num_blocks:
            c.add(f"{m.name}: dummy_kv_block {m.dummy_kv_block} is outside the cache of {d.num_blocks} blocks", None)
    _slot_findings(d, c, _CACHE, lambda m, v, i, j, k: (
        f"{m.name}: slot_stacked[{j}] = {v.slots[j]} is in block {v.blocks[j]}, outside the cache of "
        f"{d.num_blocks} blocks ({k} such slots in stream {m.streams[i]})"))
    hi = max((int(v.blocks.max(initial=-1)) for _, v in _slot_verdicts(d)), default=-1)
    return f"every slot's block < num_blocks {d.num_blocks} (highest {hi})"


_check_slot_dummy = _slot_check(_DUMMY, True, lambda d, m, v, i, j, k: (
    f"stream {m.streams[i]}: slot_stacked[{j}] = {v.slots[j]} writes the dummy block {m.dummy_kv_block}, but "
    f"position {v.tokens.pos[j]}'s table entry is block {v.expected[j]} ({k} such tokens)"),
    lambda d: f"{sum(int((v.judged & (v.blocks == m.dummy_kv_block)).sum()) for m, v in _slot_verdicts(d))} "
              f"token(s) write the dummy block, each where its table entry is missing")

_check_slot_unowned = _slot_check(_UNOWNED, True, lambda d, m, v, i, j, k: (
    f"stream {m.streams[i]}: slot_stacked[{j}] = {v.slots[j]} is in block {v.blocks[j]}, which no stream's "
    f"block table holds (position {v.tokens.pos[j]}'s entry is {v.expected[j]}; {k} such tokens)"),
    lambda d: f"{sum(len(s.block_table) for s in d.streams if s.block_table is not None)} table entries hold "
              f"every slot's block")


def _holder(d: ArenaDump, block: int) -> str:
    """Whose table holds ``block``: ``"stream b's"`` (the first), or ``"no stream's"``."""
    hits = np.flatnonzero(d.block_tables == block)
    owner = d.table_entry_owner(int(hits[0])) if hits.size else None
    return "no stream's" if owner is None else f"stream {owner[0]}'s"


_check_slot_table = _slot_check(_TABLE, True, lambda d, m, v, i, j, k: (
    f"stream {m.streams[i]}: slot_stacked[{j}] = {v.slots[j]} is in block {v.blocks[j]} "
    f"({_holder(d, v.blocks[j])}) but its table has block {v.expected[j]} for position {v.tokens.pos[j]} "
    f"({k} such tokens)"),
    lambda d: f"{sum(int(v.judged.sum()) for _, v in _slot_verdicts(d))} slots in the block their stream's table "
              f"gives for their position")


def _check_slot_collisions(d: ArenaDump, c: _Collector) -> str:
    if not _judge(d, c):
        return ""
    slots, stream, row, offs = [], [], [], []
    for m, v in _slot_verdicts(d):
        keep = np.flatnonzero((v.code == _OK) & (v.blocks != m.dummy_kv_block))
        f = m.field("slot_stacked")
        slots.append(v.slots[keep])
        stream.append(np.asarray(m.streams, np.int64)[v.tokens.sid[keep]])
        row.append(keep)
        offs.append(f.element_offset(keep))
    slots, stream, row, offs = (np.concatenate(x) for x in (slots, stream, row, offs))
    order = np.argsort(slots, kind="stable")
    ss = slots[order]
    dup = np.flatnonzero(ss[1:] == ss[:-1])
    for k in c.each(dup, dup.size):
        a, b = order[k], order[k + 1]
        c.add(f"slot {ss[k]} is written by stream {stream[a]} (row {row[a]}) and stream {stream[b]} (row {row[b]})",
              offs[b], slot=ss[k], streams=[stream[a], stream[b]], rows=[row[a], row[b]])
    return f"{slots.size} written slots, all distinct"


def expected_h_state_offset(d: ArenaDump) -> int | None:
    """Where the ``h_state_ptrs`` slot belongs: after the stacked block (batched), after the last
    per-stream block (per stream, with a plan), else None."""
    if d.mode == "batched":
        return h_state_slot_offset(d.metas[0].scratch_offset_bytes, d.metas[0].staged_bytes)
    if d.mode == "per_stream" and d.plan is not None:
        p = d.plan
        try:
            return make_scratch_plan(p.counts, p.top_k, p.mrope, p.policy).per_stream_jit_slot.offset
        except (TypeError, ValueError):  # a plan the layout refuses: the layout check says so
            return None
    return None


def _check_pointers(d: ArenaDump, c: _Collector) -> str:
    if not d.metas and d.h_state is None:
        c.skip = "no metadata in this dump"
        return ""
    n = 0
    ends = np.array([a.end for a in d.allocations], np.uint64)  # each < 2**64 (load_dump checks it)
    table_in = np.array([s.block_table_dev for s in d.streams], np.uint64)
    seq_in = np.array([s.seq_len_dev for s in d.streams], np.uint64)
    for m in d.metas:
        ft, fs = m.field("block_table_ptrs"), m.field("seq_len_ptrs")
        need_t = 4 * np.maximum(1, -(-m.kv_lens_host // m.block_size))
        inputs = None
        if d.streams:
            ids = np.asarray(m.streams, np.int64)
            inputs = (table_in[ids], seq_in[ids])
        for f, what, need, want in ((ft, "block table", need_t, inputs and inputs[0]),
                                    (fs, "seq_len", np.full(m.batch_size, 4, np.int64), inputs and inputs[1])):
            ptrs = d.values(f).astype(np.uint64)
            n += ptrs.size
            a = d.allocation_indices(ptrs)
            known = a >= 0
            unknown = ~known if f is ft else ~known & (ptrs != 0)  # a NULL seq_len pointer: none given
            room = np.zeros(ptrs.size, bool)
            if ptrs.size and d.allocations:  # ptr < end inside an allocation: end - ptr cannot wrap
                room = known & (ends[np.maximum(a, 0)] - ptrs >= need.astype(np.uint64))
            short = known & ~room
            misaligned = room & (ptrs % np.uint64(4) != 0)
            for i in c.each(np.flatnonzero(unknown), unknown.sum()):
                c.add(f"stream {m.streams[i]}: {f.name}[{i}] = {int(ptrs[i]):#x} points into no known allocation",
                      f.element_offset(i), index=i, value=int(ptrs[i]))
            for i in c.each(np.flatnonzero(short), short.sum()):
                al = d.allocations[a[i]]
                c.add(f"stream {m.streams[i]}: {f.name}[{i}] = {int(ptrs[i]):#x}: its {what} needs {int(need[i])} "
                      f"bytes but {al.name!r} ends {al.end - int(ptrs[i])} bytes after it", f.element_offset(i),
                      index=i, value=int(ptrs[i]), allocation=al.name)
            for i in c.each(np.flatnonzero(misaligned), misaligned.sum()):
                c.add(f"stream {m.streams[i]}: {f.name}[{i}] = {int(ptrs[i]):#x} is not 4-byte aligned",
                      f.element_offset(i), index=i, value=int(ptrs[i]))
            if want is not None:
                differ = np.flatnonzero(ptrs != want)
                for i in c.each(differ, differ.size):
                    c.add(f"stream {m.streams[i]}: {f.name}[{i}] = {int(ptrs[i]):#x} but the stream's input says "
                          f"{int(want[i]):#x}", f.element_offset(i), index=i, value=int(ptrs[i]), expected=int(want[i]))
    note = ""
    h = d.h_state
    if h is not None and h.uploads:
        at = expected_h_state_offset(d)
        at = h.offset if at is None else at
        if at + h_state_slot_bytes(h.n) <= d.capacity:
            entries = d.read(at, h_state_slot_bytes(h.n)).view("<u8")
            n += entries.size
            unknown = np.flatnonzero(d.allocation_indices(entries) < 0)
            for b in c.each(unknown, unknown.size):
                c.add(f"h_state_ptrs[{b}] = {int(entries[b]):#x} points into no known allocation",
                      at + h_state_entry_offset(int(b)), index=b, value=int(entries[b]))
    elif h is not None:
        note = (" (h_state_ptrs never uploaded: not checked)" if h.uploads == 0 else
                " (h_state_ptrs uploads unknown: not checked)")
    return f"{n} pointers resolve to known allocations{note}"


def _check_pads(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    nbytes = 0
    for m in d.metas:
        for f in m.fields:
            pad = d.pad(f)
            nbytes += pad.size
            nz = np.flatnonzero(pad)
            if nz.size:
                j = int(nz[0])
                c.add(f"{m.name}.{f.name}: pad byte {j} after the field is {pad[j]:#04x}, not 0 ({nz.size} non-zero)",
                      f.offset + f.nbytes + j, field=f.name, value=pad[j])
    return f"{nbytes} pad bytes, all zero"


def _check_h_state_slot(d: ArenaDump, c: _Collector) -> str:
    h = d.h_state
    if h is None:
        c.skip = "no h_state_ptrs slot in this dump"
        return ""
    want = expected_h_state_offset(d)
    if want is not None and h.offset != want:
        m = d.metas[0]
        rule = ("scratch_offset_bytes + staged_bytes" if d.mode == "batched" else "the end of the per-stream blocks")
        c.add(f"the h_state_ptrs slot is at {h.offset:,} but belongs at {rule} = {want:,}", h.offset,
              slot_offset=h.offset, expected=want, scratch_offset_bytes=m.scratch_offset_bytes,
              staged_bytes=m.staged_bytes)
    for m in d.metas:
        if m.scratch_offset_bytes >= h.end or m.end <= h.offset:
            continue  # (the common case: the slot is clear of the whole block)
        for f in m.fields:
            if h.offset < f.end and f.offset < h.end:
                c.add(f"the h_state_ptrs slot [{h.offset:,}, {h.end:,}) overlaps {m.name}.{f.name} "
                      f"[{f.offset:,}, {f.end:,})", max(h.offset, f.offset), field=f.name)
    nstreams = sum(m.batch_size for m in d.metas) if d.metas else None
    if nstreams is not None and h.n != nstreams:
        c.add(f"the h_state_ptrs slot has {h.n} entries for {nstreams} streams", h.offset, entries=h.n,
              streams=nstreams)
    if h.end > d.capacity:
        c.add(f"the h_state_ptrs slot ends at {h.end:,}, past the capacity {d.capacity:,}", h.offset)
    where = "= scratch_offset_bytes + staged_bytes" if d.mode == "batched" else "clear of the metadata"
    return f"{h.n} entries at {h.offset:,} {where}"


def _check_guard(d: ArenaDump, c: _Collector) -> str:
    bad = np.flatnonzero(d.guard != d.guard_pattern)
    if bad.size:
        j = int(bad[0])
        c.add(f"guard byte {j} past the capacity is {d.guard[j]:#04x}, not {d.guard_pattern:#04x} "
              f"({bad.size} of {d.guard.size} overwritten)", d.capacity + j, index=j, value=d.guard[j],
              expected=d.guard_pattern, overwritten=bad.size)
    return f"{d.guard.size} bytes past the capacity hold {d.guard_pattern:#04x}"


#: (name, function) of every check, in report order (the slot checks in the order a slot is judged by).
CHECKS: tuple = (
    ("regions", _check_regions),
    ("layout", _check_layout),
    ("cu_seqlens", _check_cu_seqlens),
    ("kv_lens", _check_kv_lens),
    ("positions", _check_positions),
    ("slot_skipped", _check_slot_skipped),
    ("slots", _check_slots),
    ("blocks_in_cache", _check_blocks_in_cache),
    ("slot_dummy", _check_slot_dummy),
    ("slot_unowned", _check_slot_unowned),
    ("slot_table", _check_slot_table),
    ("slot_collisions", _check_slot_collisions),
    ("pointers", _check_pointers),
    ("pads", _check_pads),
    ("h_state_slot", _check_h_state_slot),
    ("guard", _check_guard),
)


def run_checks(d: ArenaDump) -> list:
    """Run every check of :data:`CHECKS` on a loaded dump.

    Returns
    -------
    list of CheckResult
        In :data:`CHECKS` order.
    """
    results = []
    try:
        for name, fn in CHECKS:
            c = _Collector()
            try:
                summary = fn(d, c)
            except Exception as exc:  # a header that passed loading but still defeats a check: report, don't crash
                c.add(f"the check could not run: {type(exc).__name__}: {exc}")
                summary = ""
            if c.total:
                status = "FAIL"
                summary = f"{c.total} problem{'s' if c.total != 1 else ''}"
            elif c.skip:
                status, summary = "SKIP", c.skip
            else:
                status = "PASS"
            results.append(CheckResult(name, status, summary, c.findings, c.total))
    finally:
        _VERDICTS.pop(id(d), None)
    return results


# --- decoding for the report ---------------------------------------------------------------

def _fmt_values(d: ArenaDump, name: str, values: np.ndarray) -> list:
    if name in _PTR_DTYPE_FIELDS:
        return [f"{int(x):#x} ({d.describe_ptr(int(x))})" for x in values]
    return [int(x) for x in values]


def decode_fields(d: ArenaDump, edge: int = 3) -> list:
    """Every field of the first :data:`METAS_DECODED` metadata blocks: its spec and its first and last ``edge``
    entries."""
    out = []
    for m in d.metas[:METAS_DECODED]:
        for f in m.fields:
            vals = d.values(f)
            if vals.size <= 2 * edge:
                first, last = _fmt_values(d, f.name, vals), []
            else:
                first, last = _fmt_values(d, f.name, vals[:edge]), _fmt_values(d, f.name, vals[-edge:])
            out.append({"block": m.name, "name": f.name, "dtype": f.dtype, "count": f.count, "offset": f.offset,
                        "nbytes": f.nbytes, "padded": f.padded, "first": first, "last": last})
    return out


def _range(a: np.ndarray) -> list | None:
    return [int(a.min()), int(a.max())] if a.size else None


def stream_summaries(d: ArenaDump, limit: int = STREAMS_LISTED) -> list:
    """Per stream (the first ``limit``): rows, proc_start, kv_len, position and slot ranges, blocks touched,
    pointer targets."""
    out = []
    for m in d.metas:
        if len(out) >= limit:
            break
        T = d.values(m.field("positions_stacked"))
        H = d.values(m.field("positions_h_stacked")) if m.use_mrope else T
        W = d.values(m.field("positions_w_stacked")) if m.use_mrope else T
        S = d.values(m.field("slot_stacked"))
        bt, sl = d.values(m.field("block_table_ptrs")), d.values(m.field("seq_len_ptrs"))
        for i, b, lo, hi, start, kv in _segments(m):
            if len(out) >= limit:
                break
            s = S[lo:hi]
            live = s[s >= 0]
            blocks = np.unique(live // m.block_size)
            entry = {
                "stream": b, "block": m.name, "rows": [lo, hi], "proc_start": start, "kv_len": kv,
                "positions": {"T": _range(T[lo:hi])},
                "slots": _range(live), "skipped": int((s < 0).sum()), "blocks": [int(x) for x in blocks],
                "block_table": {"addr": int(bt[i]), "target": d.describe_ptr(int(bt[i]))},
                "seq_len": {"addr": int(sl[i]), "target": d.describe_ptr(int(sl[i]))},
            }
            if m.use_mrope:
                entry["positions"].update(H=_range(H[lo:hi]), W=_range(W[lo:hi]))
            out.append(entry)
    return out


def _h_state_entries(d: ArenaDump) -> list:
    h = d.h_state
    if h is None:
        return []
    n = min(h.n, STREAMS_LISTED)
    entries = d.read(h.offset, h_state_slot_bytes(n)).view("<u8")
    return [{"addr": int(p), "target": d.describe_ptr(int(p))} for p in entries]


@dataclass
class InspectReport:
    """Everything ``q12drv inspect`` prints: the decoded dump and the check results."""

    dump: ArenaDump
    checks: list
    fields: list
    streams: list
    h_state: list

    @property
    def ok(self) -> bool:
        """True when no check failed (SKIP is not a failure)."""
        return all(r.ok for r in self.checks)

    def check(self, name: str) -> CheckResult:
        for r in self.checks:
            if r.name == name:
                return r
        raise KeyError(f"no check {name!r}; checks: {', '.join(r.name for r in self.checks)}")

    @property
    def failed(self) -> list:
        """Names of the failing checks."""
        return [r.name for r in self.checks if r.status == "FAIL"]

    def to_json(self) -> dict:
        d = self.dump
        return _jsonable({
            "path": d.path, "ok": self.ok, "schema_version": d.version, "created_utc": d.created_utc,
            "device": d.device_name, "driver": d.driver_name, "base": d.base, "capacity": d.capacity,
            "cursor": d.cursor, "mode": d.mode, "num_blocks": d.num_blocks,
            "regions": [{"name": r.name, "kind": r.kind, "offset": r.offset, "nbytes": r.nbytes, "stream": r.stream}
                        for r in d.region_map()],
            "fields": self.fields, "streams": self.streams, "streams_total": _nstreams(d),
            "metadata_blocks_total": len(d.metas), "h_state_ptrs": self.h_state,
            "checks": [r.to_json() for r in self.checks],
        })

    def format(self) -> str:
        """The human-readable report."""
        d = self.dump
        L = [f"arena dump {d.path} (schema {d.version}, written {d.created_utc})",
             f"device: {d.device_name} (driver {d.driver_name}); arena base {d.base:#x}, capacity {d.capacity:,} "
             f"bytes, cursor {d.cursor:,}; guard band {d.guard.size} bytes"]
        if d.metas:
            m = d.metas[0]
            L.append(f"mode: {d.mode}, {sum(x.batch_size for x in d.metas)} streams, "
                     f"{sum(x.total_tokens for x in d.metas)} tokens, MRoPE {'on' if m.use_mrope else 'off'}, "
                     f"block_size {m.block_size}, dummy block {m.dummy_kv_block}, num_blocks "
                     f"{d.num_blocks if d.num_blocks is not None else 'unknown'}")
        L += ["", "region map:", f"  {'region':<24}{'kind':<14}{'offset':>12}{'bytes':>12}{'end':>12}"]
        regions = d.region_map()
        for r in regions[:STREAMS_LISTED]:
            L.append(f"  {r.name:<24}{r.kind:<14}{r.offset:>12,}{r.nbytes:>12,}{r.end:>12,}")
        if len(regions) > STREAMS_LISTED:
            L.append(f"  ... and {len(regions) - STREAMS_LISTED:,} more regions (--json lists them all)")
        if d.h_state is not None and not any(r.name == "h_state_ptrs" for r in d.region_map()):
            h = d.h_state
            L.append(f"  {'h_state_ptrs':<24}{'jit_slot':<14}{h.offset:>12,}{h_state_slot_bytes(h.n):>12,}{h.end:>12,}")
        L.append(f"  {'capacity':<24}{'':<14}{'':>12}{d.capacity:>12,}")
        block = None
        for f in self.fields:
            if f["block"] != block:
                block = f["block"]
                L += ["", f"fields of {block}:",
                      f"  {'field':<22}{'dtype':<6}{'count':>7}{'offset':>10}{'bytes':>8}{'pad':>4}  first ... last"]
            values = _short(f["first"]) + (f" ... {_short(f['last'])}" if f["last"] else "")
            L.append(f"  {f['name']:<22}{f['dtype']:<6}{f['count']:>7,}{f['offset']:>10,}{f['nbytes']:>8,}"
                     f"{f['padded'] - f['nbytes']:>4}  {values}")
        if len(d.metas) > METAS_DECODED:
            L += ["", f"(the fields of {len(d.metas) - METAS_DECODED:,} more metadata blocks are not decoded here; "
                      f"the checks cover them all)"]
        if self.streams:
            L += ["", "streams:"]
            for s in self.streams:
                pos = " ".join(f"{k} {v[0]}..{v[1]}" for k, v in s["positions"].items() if v)
                slots = f"{s['slots'][0]}..{s['slots'][1]}" if s["slots"] else "none"
                blocks = s["blocks"]
                shown = ",".join(str(x) for x in blocks[:6]) + (",..." if len(blocks) > 6 else "")
                L.append(f"  [{s['stream']}] rows [{s['rows'][0]}, {s['rows'][1]}) proc_start {s['proc_start']} "
                         f"kv_len {s['kv_len']}; positions {pos}; slots {slots} ({s['skipped']} negative); "
                         f"{len(blocks)} blocks {{{shown}}}")
                L.append(f"      block_table -> {s['block_table']['target']}, seq_len -> {s['seq_len']['target']}")
            if _nstreams(d) > len(self.streams):
                L.append(f"  ... and {_nstreams(d) - len(self.streams):,} more streams (the checks cover them all)")
        if self.h_state:
            h = d.h_state
            ups = "uploads unknown" if h.uploads is None else f"uploaded {h.uploads} times"
            L += ["", f"h_state_ptrs slot at {h.offset:,} ({h.n} entries, {ups}):"]
            L.append("  " + ", ".join(e["target"] for e in self.h_state) + (" ..." if h.n > len(self.h_state) else ""))
        L += ["", "checks:"]
        for r in self.checks:
            L.append(f"  {r.status} {r.name:<16} {r.summary}")
            for f in r.findings:
                at = f"@ {f.offset:,} ({d.base + f.offset:#x}): " if f.offset is not None else ""
                L.append(f"       {at}{f.message}")
            if r.total > len(r.findings):
                L.append(f"       ... and {r.total - len(r.findings)} more")
        counts = {s: sum(r.status == s for r in self.checks) for s in ("PASS", "FAIL", "SKIP")}
        L.append(f"inspect: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
                 f"{'' if self.ok else ' -- FAILED: ' + ', '.join(self.failed)}")
        return "\n".join(L)


def _nstreams(d: ArenaDump) -> int:
    return sum(m.batch_size for m in d.metas)


def _short(values: list) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def inspect_dump(source, *, num_blocks: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> InspectReport:
    """Load (if given a path), decode and check an arena dump.

    Parameters
    ----------
    source : str, os.PathLike or ArenaDump
    num_blocks : int, optional
        KV-cache block count, overriding the dump's (enables ``blocks_in_cache``).
    max_bytes : int
        What loading a path may unpack at most (:func:`~q12drv.tools.dump.load_dump`).

    Returns
    -------
    InspectReport

    Raises
    ------
    DumpError
        The file cannot be read or its header is malformed (see :func:`~q12drv.tools.dump.load_dump`).
    """
    d = source if isinstance(source, ArenaDump) else load_dump(source, max_bytes=max_bytes)
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        d = replace(d, num_blocks=int(num_blocks))
    return InspectReport(d, run_checks(d), decode_fields(d), stream_summaries(d), _h_state_entries(d))
