"""Inspect an arena dump: decode every region and field, then check what the bytes must satisfy.

Each check guards one property and reads only what it needs, so that one corrupted thing fails
one check. Checks that need the per-stream segmentation take it from the header's host copies
(``cu_seqlens_host``, ``kv_lens_host``), never from the device bytes they are not about.

===================  =========================================================================
check                what it guards
===================  =========================================================================
regions              plan regions and arena reservations inside the capacity, none overlapping;
                     every metadata field inside its block, fields not overlapping
layout               header fields, ``staged_bytes``, scalars and plan equal what
                     :mod:`q12drv.core.layout` computes from the counts; device pointers = base + offset
cu_seqlens           device ``cu_seqlens``: starts at 0, strictly increasing, ends at
                     ``total_tokens``, equals the host copy
kv_lens              device ``kv_lens[b]`` >= the segment length, equals the host copy (and
                     ``proc_start + proc_count`` of the stream inputs)
positions            text streams: T (= H = W) contiguous, ending at ``kv_lens[b] - 1``; streams
                     with MRoPE vision positions: T non-decreasing, T/H/W inside
                     ``[proc_start, kv_len)``
slots                ``slot % block_size == pos % block_size`` for every written slot (< 0: skipped)
slot_collisions      no two tokens write one KV slot (the dummy block excepted)
blocks_in_cache      ``slot // block_size < num_blocks`` (SKIP when the dump does not know num_blocks)
pointers             block-table, seq_len and written ``h_state_ptrs`` entries point into known
                     allocations with room for what they address
pads                 every field's pad bytes are zero
h_state_slot         the JIT slot sits at ``scratch_offset_bytes + staged_bytes`` (batched) and
                     overlaps no metadata
guard                the guard band past the capacity is intact
===================  =========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dump import ArenaDump, DumpedMeta, load_dump
from ..core.layout import a8, make_scratch_plan, stacked_layout

__all__ = ["CHECKS", "Finding", "CheckResult", "InspectReport", "run_checks", "inspect_dump",
           "decode_fields", "stream_summaries"]

_FINDINGS_LIMIT = 20
_PTR_DTYPE_FIELDS = ("block_table_ptrs", "seq_len_ptrs")


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


def _segments(m: DumpedMeta):
    """(i, stream index, first row, last row + 1, proc_start, kv_len) per stream, from the host copies."""
    cu, kv = m.cu_seqlens_host, m.kv_lens_host
    for i, b in enumerate(m.streams):
        lo, hi = int(cu[i]), int(cu[i + 1])
        yield i, b, lo, hi, int(kv[i]) - (hi - lo), int(kv[i])


def _elem_offset(f, i: int) -> int:
    return f.offset + i * np.dtype(f.dtype).itemsize


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
        for i in bad[:3]:
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
        for i, b, lo, hi, start, kv in _segments(m):
            if b < len(d.streams):
                s = d.streams[b]
                if (s.proc_start, s.proc_count) != (start, hi - lo):
                    c.add(f"stream {b}: inputs say proc_start {s.proc_start}, proc_count {s.proc_count} but "
                          f"{m.name}'s host copies give {start}, {hi - lo}", None)
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
                    c.add(f"{m.name} at {m.scratch_offset_bytes:,} with counts {np.diff(m.cu_seqlens_host).tolist()} "
                          f"but the plan puts the stacked block at {ref.stacked.offset:,} for {list(p.counts)}",
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
        for i in np.flatnonzero(np.diff(cu) <= 0):
            c.add(f"{m.name}: cu_seqlens[{i + 1}] = {cu[i + 1]} is not greater than cu_seqlens[{i}] = {cu[i]}",
                  _elem_offset(f, i + 1), index=i + 1, value=cu[i + 1], previous=cu[i])
        if cu[-1] != m.total_tokens:
            c.add(f"{m.name}: cu_seqlens[{m.batch_size}] = {cu[-1]} but total_tokens is {m.total_tokens}",
                  _elem_offset(f, m.batch_size), index=m.batch_size, value=cu[-1], total_tokens=m.total_tokens)
        for i in np.flatnonzero(cu != m.cu_seqlens_host):
            c.add(f"{m.name}: cu_seqlens[{i}] = {cu[i]} but the host copy has {m.cu_seqlens_host[i]}",
                  _elem_offset(f, i), index=i, value=cu[i], host=m.cu_seqlens_host[i])
    n = sum(m.batch_size + 1 for m in d.metas)
    return f"{n} entries start at 0, increase, end at total_tokens and match the host copies"


def _check_kv_lens(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    for m in d.metas:
        f = m.field("kv_lens")
        kv = d.values(f).astype(np.int64)
        for i, b, lo, hi, start, kv_host in _segments(m):
            off = _elem_offset(f, i)
            if kv[i] < hi - lo:
                c.add(f"stream {b}: kv_lens[{i}] = {kv[i]} < its segment length {hi - lo}", off, index=i,
                      value=kv[i], segment=hi - lo)
            if kv[i] != kv_host:
                c.add(f"stream {b}: kv_lens[{i}] = {kv[i]} but the host copy has {kv_host}", off, index=i,
                      value=kv[i], host=kv_host)
            if b < len(d.streams):
                s = d.streams[b]
                if kv[i] != s.proc_start + s.proc_count:
                    c.add(f"stream {b}: kv_lens[{i}] = {kv[i]} but proc_start + proc_count = "
                          f"{s.proc_start + s.proc_count}", off, index=i, value=kv[i],
                          expected=s.proc_start + s.proc_count)
    return f"{sum(m.batch_size for m in d.metas)} entries cover their segments and match the host copies"


def _check_positions(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    text = vision = 0
    for m in d.metas:
        ft = m.field("positions_stacked")
        fh = m.field("positions_h_stacked") if m.use_mrope else ft
        fw = m.field("positions_w_stacked") if m.use_mrope else ft
        T, H, W = (d.values(f).astype(np.int64) for f in (ft, fh, fw))
        for i, b, lo, hi, start, kv in _segments(m):
            t, h, w = T[lo:hi], H[lo:hi], W[lo:hi]
            if not m.use_mrope:
                is_text = True
            elif b < len(d.streams):  # the inputs say whether the caller gave vision positions
                is_text = not d.streams[b].explicit_mrope
            else:
                is_text = np.array_equal(h, t) and np.array_equal(w, t)
            if is_text:
                text += 1
                want = np.arange(start, kv, dtype=np.int64)
                for f, arr in ((ft, t),) + (((fh, h), (fw, w)) if m.use_mrope else ()):
                    bad = np.flatnonzero(arr != want)
                    if bad.size:
                        j = int(bad[0])
                        c.add(f"stream {b}: {f.name}[{lo + j}] = {arr[j]} but text positions run "
                              f"{start}..{kv - 1} (expected {want[j]}; {bad.size} wrong)",
                              _elem_offset(f, lo + j), index=lo + j, value=arr[j], expected=want[j])
                continue
            vision += 1
            for f, arr in ((ft, t), (fh, h), (fw, w)):
                bad = np.flatnonzero((arr < start) | (arr >= kv))
                if bad.size:
                    j = int(bad[0])
                    c.add(f"stream {b}: {f.name}[{lo + j}] = {arr[j]} lies outside [{start}, {kv}) "
                          f"({bad.size} outside)", _elem_offset(f, lo + j), index=lo + j, value=arr[j])
            back = np.flatnonzero(np.diff(t) < 0)
            if back.size:
                j = int(back[0]) + 1
                c.add(f"stream {b}: {ft.name}[{lo + j}] = {t[j]} goes back from {t[j - 1]}",
                      _elem_offset(ft, lo + j), index=lo + j, value=t[j], previous=t[j - 1])
    return f"{text} text stream(s) contiguous up to kv_len - 1, {vision} MRoPE vision stream(s) within bounds"


def _check_slots(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    written = skipped = 0
    for m in d.metas:
        f = m.field("slot_stacked")
        S = d.values(f)
        bs = m.block_size
        for i, b, lo, hi, start, kv in _segments(m):
            s = S[lo:hi]
            pos = np.arange(start, kv, dtype=np.int64)
            live = s >= 0
            skipped += int((~live).sum())
            written += int(live.sum())
            bad = np.flatnonzero(live & (s % bs != pos % bs))
            if bad.size:
                j = int(bad[0])
                c.add(f"stream {b}: slot_stacked[{lo + j}] = {s[j]} is at {s[j] % bs} in its block but position "
                      f"{pos[j]} is at {pos[j] % bs} (block_size {bs}; {bad.size} wrong)", _elem_offset(f, lo + j),
                      index=lo + j, value=s[j], position=pos[j], block_size=bs)
    return f"{written} slots agree with their positions mod block_size ({skipped} skipped)"


def _check_slot_collisions(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    slots, stream, row, offs = [], [], [], []
    for m in d.metas:
        f = m.field("slot_stacked")
        S = d.values(f)
        for i, b, lo, hi, start, kv in _segments(m):
            s = S[lo:hi]
            keep = np.flatnonzero((s >= 0) & (s // m.block_size != m.dummy_kv_block))
            slots.append(s[keep])
            stream.append(np.full(keep.size, b))
            row.append(lo + keep)
            offs.append(f.offset + 8 * (lo + keep))
    if not slots:
        return "no slots"
    slots, stream, row, offs = (np.concatenate(x) for x in (slots, stream, row, offs))
    order = np.argsort(slots, kind="stable")
    ss = slots[order]
    for k in np.flatnonzero(ss[1:] == ss[:-1]):
        a, b = order[k], order[k + 1]
        c.add(f"slot {ss[k]} is written by stream {stream[a]} (row {row[a]}) and stream {stream[b]} (row {row[b]})",
              offs[b], slot=ss[k], streams=[stream[a], stream[b]], rows=[row[a], row[b]])
    return f"{slots.size} written slots, all distinct"


def _check_blocks_in_cache(d: ArenaDump, c: _Collector) -> str:
    if not d.metas:
        c.skip = "no metadata in this dump"
        return ""
    if d.num_blocks is None:
        c.skip = "num_blocks unknown (dump with num_blocks=..., or inspect --num-blocks N)"
        return ""
    hi = 0
    for m in d.metas:
        f = m.field("slot_stacked")
        S = d.values(f)
        if m.dummy_kv_block >= d.num_blocks:
            c.add(f"{m.name}: dummy_kv_block {m.dummy_kv_block} is outside the cache of {d.num_blocks} blocks", None)
        blocks = np.where(S >= 0, S // m.block_size, -1)
        hi = max(hi, int(blocks.max(initial=-1)))
        bad = np.flatnonzero(blocks >= d.num_blocks)
        for j in bad[:5]:
            c.add(f"{m.name}: slot_stacked[{j}] = {S[j]} is in block {blocks[j]}, outside the cache of "
                  f"{d.num_blocks} blocks", _elem_offset(f, int(j)), index=j, value=S[j], block=blocks[j])
        if bad.size > 5:
            c.total += int(bad.size) - 5
    return f"every slot's block < num_blocks {d.num_blocks} (highest {hi})"


def expected_h_state_offset(d: ArenaDump) -> int | None:
    """Where the ``h_state_ptrs`` slot belongs: after the stacked block (batched), after the last
    per-stream block (per stream, with a plan), else None."""
    if d.mode == "batched":
        return d.metas[0].end
    if d.mode == "per_stream" and d.plan is not None:
        blocks = [r for r in d.plan.regions if r.kind == "stream_block"]
        if blocks:
            return a8(max(r.end for r in blocks))
    return None


def _check_pointers(d: ArenaDump, c: _Collector) -> str:
    if not d.metas and d.h_state is None:
        c.skip = "no metadata in this dump"
        return ""
    n = 0
    for m in d.metas:
        ft, fs = m.field("block_table_ptrs"), m.field("seq_len_ptrs")
        tables, seqs = d.values(ft), d.values(fs)
        for i, b, lo, hi, start, kv in _segments(m):
            need = 4 * max(1, -(-kv // m.block_size))
            s = d.streams[b] if b < len(d.streams) else None
            for f, ptr, size, what, want in ((ft, int(tables[i]), need, "block table", s and s.block_table_dev),
                                             (fs, int(seqs[i]), 4, "seq_len", s and s.seq_len_dev)):
                n += 1
                off = _elem_offset(f, i)
                a = d.allocation_of(ptr, size)
                if a is None:
                    c.add(f"stream {b}: {f.name}[{i}] = {ptr:#x} points into no known allocation", off, index=i,
                          value=ptr)
                elif not a.contains(ptr, size):
                    c.add(f"stream {b}: {f.name}[{i}] = {ptr:#x}: its {what} needs {size} bytes but {a.name!r} ends "
                          f"{a.end - ptr} bytes after it", off, index=i, value=ptr, allocation=a.name)
                elif ptr % 4:
                    c.add(f"stream {b}: {f.name}[{i}] = {ptr:#x} is not 4-byte aligned", off, index=i, value=ptr)
                if want is not None and ptr != want:
                    c.add(f"stream {b}: {f.name}[{i}] = {ptr:#x} but the stream's input says {want:#x}", off,
                          index=i, value=ptr, expected=want)
    note = ""
    h = d.h_state
    if h is not None and h.uploads:
        at = expected_h_state_offset(d)
        at = h.offset if at is None else at
        if at + 8 * h.n <= d.capacity:
            entries = d.read(at, 8 * h.n).view("<u8")
            for b, ptr in enumerate(entries):
                n += 1
                if d.allocation_of(int(ptr)) is None:
                    c.add(f"h_state_ptrs[{b}] = {int(ptr):#x} points into no known allocation", at + 8 * b, index=b,
                          value=int(ptr))
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


#: (name, function) of every check, in report order.
CHECKS: tuple = (
    ("regions", _check_regions),
    ("layout", _check_layout),
    ("cu_seqlens", _check_cu_seqlens),
    ("kv_lens", _check_kv_lens),
    ("positions", _check_positions),
    ("slots", _check_slots),
    ("slot_collisions", _check_slot_collisions),
    ("blocks_in_cache", _check_blocks_in_cache),
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
    return results


# --- decoding for the report ---------------------------------------------------------------

def _fmt_values(d: ArenaDump, name: str, values: np.ndarray) -> list:
    if name in _PTR_DTYPE_FIELDS:
        return [f"{int(x):#x} ({d.describe_ptr(int(x))})" for x in values]
    return [int(x) for x in values]


def decode_fields(d: ArenaDump, edge: int = 3) -> list:
    """Every field of every metadata block: its spec and its first and last ``edge`` entries."""
    out = []
    for m in d.metas:
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


def stream_summaries(d: ArenaDump) -> list:
    """Per stream: rows, proc_start, kv_len, position and slot ranges, blocks touched, pointer targets."""
    out = []
    for m in d.metas:
        T = d.values(m.field("positions_stacked"))
        H = d.values(m.field("positions_h_stacked")) if m.use_mrope else T
        W = d.values(m.field("positions_w_stacked")) if m.use_mrope else T
        S = d.values(m.field("slot_stacked"))
        bt, sl = d.values(m.field("block_table_ptrs")), d.values(m.field("seq_len_ptrs"))
        for i, b, lo, hi, start, kv in _segments(m):
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
    return [{"addr": int(p), "target": d.describe_ptr(int(p))} for p in d.read(h.offset, 8 * h.n).view("<u8")]


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
            "fields": self.fields, "streams": self.streams, "h_state_ptrs": self.h_state,
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
        for r in d.region_map():
            L.append(f"  {r.name:<24}{r.kind:<14}{r.offset:>12,}{r.nbytes:>12,}{r.end:>12,}")
        if d.h_state is not None and not any(r.name == "h_state_ptrs" for r in d.region_map()):
            h = d.h_state
            L.append(f"  {'h_state_ptrs':<24}{'jit_slot':<14}{h.offset:>12,}{8 * h.n:>12,}{h.end:>12,}")
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
        if self.streams:
            L += ["", "streams:"]
            for s in self.streams:
                pos = " ".join(f"{k} {v[0]}..{v[1]}" for k, v in s["positions"].items() if v)
                slots = f"{s['slots'][0]}..{s['slots'][1]}" if s["slots"] else "none"
                blocks = s["blocks"]
                shown = ",".join(str(x) for x in blocks[:6]) + (",..." if len(blocks) > 6 else "")
                L.append(f"  [{s['stream']}] rows [{s['rows'][0]}, {s['rows'][1]}) proc_start {s['proc_start']} "
                         f"kv_len {s['kv_len']}; positions {pos}; slots {slots} ({s['skipped']} skipped); "
                         f"{len(blocks)} blocks {{{shown}}}")
                L.append(f"      block_table -> {s['block_table']['target']}, seq_len -> {s['seq_len']['target']}")
        if self.h_state:
            h = d.h_state
            ups = "uploads unknown" if h.uploads is None else f"uploaded {h.uploads} times"
            L += ["", f"h_state_ptrs slot at {h.offset:,} ({h.n} entries, {ups}):"]
            L.append("  " + ", ".join(e["target"] for e in self.h_state))
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


def _short(values: list) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def inspect_dump(source, *, num_blocks: int | None = None) -> InspectReport:
    """Load (if given a path), decode and check an arena dump.

    Parameters
    ----------
    source : str, os.PathLike or ArenaDump
    num_blocks : int, optional
        KV-cache block count, overriding the dump's (enables ``blocks_in_cache``).

    Returns
    -------
    InspectReport

    Raises
    ------
    DumpError
        The file cannot be read or its header is malformed (see :func:`~q12drv.tools.dump.load_dump`).
    """
    d = source if isinstance(source, ArenaDump) else load_dump(source)
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        from dataclasses import replace

        d = replace(d, num_blocks=int(num_blocks))
    return InspectReport(d, run_checks(d), decode_fields(d), stream_summaries(d), _h_state_entries(d))
