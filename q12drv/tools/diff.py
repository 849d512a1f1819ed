"""Compare two arena dumps: which header entries, fields and regions differ, and where first.

Fields of the metadata blocks are compared element by element (decoded with their dtype); every
other region, the bytes no region covers, the guard band and the pinned ring byte by byte; the
streams' block tables entry by entry. Spans are matched by name, so two dumps with different layouts
still compare what they share. The header is compared key by key, except the timestamp. The work is
bounded by the bytes the dumps hold (:func:`~q12drv.tools.dump.load_dump` bounds what a region map may
claim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.layout import H_STATE_ENTRY_BYTES, Region, h_state_slot_bytes
from .dump import DEFAULT_MAX_BYTES, ArenaDump, load_dump

__all__ = ["Difference", "diff_dumps", "format_diff"]

_IGNORED_HEADER_KEYS = ("created_utc",)


@dataclass(frozen=True)
class Difference:
    """One thing that differs between dump A and dump B.

    Attributes
    ----------
    where : str
        ``"header.<path>"``, ``"field <block>.<name>"``, ``"pad <block>.<name>"``, ``"region <name>"``,
        ``"unmapped"``, ``"guard"`` or ``"ring"``.
    index : int or None
        First differing element (or byte) of the span.
    offset : int or None
        That element's byte offset in dump A (arena offset for arena spans).
    value_a, value_b
        The two values there.
    count : int
        How many elements differ (for a span of unequal length, the extra ones count too).
    size : int
        Elements in the span (in A).
    """

    where: str
    index: int | None
    offset: int | None
    value_a: Any
    value_b: Any
    count: int = 1
    size: int = 1
    as_hex: bool = False

    def to_json(self) -> dict:
        return {"where": self.where, "index": self.index, "offset": self.offset, "value_a": _plain(self.value_a),
                "value_b": _plain(self.value_b), "count": self.count, "size": self.size}

    def format(self) -> str:
        a, b = _show(self.value_a, self.as_hex), _show(self.value_b, self.as_hex)
        if self.index is None:
            return f"{self.where}: A={a} B={b}"
        at = f" @ {self.offset:,}" if self.offset is not None else ""
        return f"{self.where}: {self.count:,} of {self.size:,} differ; first [{self.index}]{at}: A={a} B={b}"


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    return x


def _show(x: Any, as_hex: bool = False) -> str:
    x = _plain(x)
    s = f"{x:#x}" if as_hex and isinstance(x, int) and not isinstance(x, bool) else repr(x)
    return s if len(s) <= 120 else s[:117] + "..."


def _json_diff(a: Any, b: Any, path: str, out: list) -> None:
    """Append the first differing leaf under each differing branch of two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in _IGNORED_HEADER_KEYS and path == "header":
                continue
            if k not in a or k not in b:
                out.append(Difference(f"{path}.{k}", None, None, a.get(k, "<absent>"), b.get(k, "<absent>")))
            else:
                _json_diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(Difference(f"{path} (length)", None, None, len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                _json_diff(x, y, f"{path}[{i}]", out)
                break
    elif a != b or type(a) is not type(b):
        address = path.endswith(("base", "_dev")) or ".device_ptrs." in path
        out.append(Difference(path, None, None, a, b, as_hex=address))


def _spans(d: ArenaDump) -> tuple:
    """``({name: (offset, nbytes, dtype)}, covered)``: every named arena span of ``d`` and the bytes they cover."""
    spans, covered = {}, np.zeros(d.capacity, bool)
    for m in d.metas:
        for f in m.fields:
            spans[f"field {m.name}.{f.name}"] = (f.offset, f.nbytes, f.dtype)
            if f.padded > f.nbytes:
                spans[f"pad {m.name}.{f.name}"] = (f.offset + f.nbytes, f.padded - f.nbytes, "u1")
            covered[f.offset:f.end] = True
    regions = list(d.region_map())
    names = {r.name for r in regions}
    if d.h_state is not None and "h_state_ptrs" not in names:
        regions.append(Region("h_state_ptrs", d.h_state.offset, h_state_slot_bytes(d.h_state.n), "jit_slot"))
    e = H_STATE_ENTRY_BYTES
    for r in regions:
        if r.nbytes and not covered[r.offset:r.end].all():
            dtype = "<u8" if r.name == "h_state_ptrs" and r.offset % e == 0 and r.nbytes % e == 0 else "u1"
            spans[f"region {r.name}"] = (r.offset, r.nbytes, dtype)
            covered[r.offset:r.end] = True
    return spans, covered


def _compare(where: str, a: np.ndarray, b: np.ndarray, base_offset: int | None, itemsize: int) -> Difference | None:
    n = min(a.size, b.size)
    neq = np.flatnonzero(a[:n] != b[:n])
    extra = abs(a.size - b.size)
    if not neq.size and not extra:
        return None
    i = int(neq[0]) if neq.size else n
    va = a[i] if i < a.size else "<absent>"
    vb = b[i] if i < b.size else "<absent>"
    off = None if base_offset is None else base_offset + i * itemsize
    return Difference(where, i, off, va, vb, int(neq.size) + extra, int(a.size), as_hex=a.dtype == np.dtype("<u8"))


def _table_owner(d: ArenaDump, i: int) -> str:
    """``"stream b entry j"`` for entry ``i`` of ``d``'s block_tables member."""
    owner = d.table_entry_owner(i)
    return f"entry {i}" if owner is None else f"stream {owner[0]} entry {owner[1]}"


def diff_dumps(a, b, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list:
    """Everything that differs between two dumps.

    Parameters
    ----------
    a, b : str, os.PathLike or ArenaDump
    max_bytes : int
        What loading each path may unpack at most (:func:`~q12drv.tools.dump.load_dump`).

    Returns
    -------
    list of Difference
        Empty when the dumps hold the same header (timestamp aside) and the same bytes.

    Raises
    ------
    DumpError
        Either file cannot be read (see :func:`~q12drv.tools.dump.load_dump`).
    """
    da = a if isinstance(a, ArenaDump) else load_dump(a, max_bytes=max_bytes)
    db = b if isinstance(b, ArenaDump) else load_dump(b, max_bytes=max_bytes)
    out: list = []
    _json_diff(da.header, db.header, "header", out)
    spans_a, covered_a = _spans(da)
    spans_b, covered_b = _spans(db)
    for name, (off, nbytes, dtype) in spans_a.items():
        if name not in spans_b:
            out.append(Difference(name, None, None, f"{nbytes} bytes at {off:,}", "<absent>"))
            continue
        off_b, nbytes_b, dtype_b = spans_b[name]
        if dtype_b != dtype:
            out.append(Difference(f"{name} (dtype)", None, None, dtype, dtype_b))
            continue
        d = _compare(name, da.read(off, nbytes).view(dtype), db.read(off_b, nbytes_b).view(dtype), off,
                     np.dtype(dtype).itemsize)
        if d is not None:
            out.append(d)
    for name in sorted(spans_b.keys() - spans_a.keys()):
        off, nbytes, _ = spans_b[name]
        out.append(Difference(name, None, None, "<absent>", f"{nbytes} bytes at {off:,}"))
    # bytes that neither dump maps to a span (arena offsets; a capacity difference counts as extra bytes)
    n = min(da.capacity, db.capacity)
    mask = ~(covered_a[:n] | covered_b[:n])
    idx = np.flatnonzero(mask & (da.arena[:n] != db.arena[:n]))
    extra = abs(da.capacity - db.capacity)
    if idx.size or extra:
        i = int(idx[0]) if idx.size else n
        out.append(Difference("unmapped", i, i, da.arena[i] if i < da.capacity else "<absent>",
                              db.arena[i] if i < db.capacity else "<absent>", int(idx.size) + extra, int(mask.sum())))
    d = _compare("guard", da.guard, db.guard, None, 1)
    if d is not None:
        out.append(d)
    if da.ring is not None or db.ring is not None:
        ra = da.ring if da.ring is not None else np.zeros(0, np.uint8)
        rb = db.ring if db.ring is not None else np.zeros(0, np.uint8)
        d = _compare("ring", ra, rb, None, 1)
        if d is not None:
            out.append(d)
    if da.block_tables is not None or db.block_tables is not None:
        ta = da.block_tables if da.block_tables is not None else np.zeros(0, np.int32)
        tb = db.block_tables if db.block_tables is not None else np.zeros(0, np.int32)
        d = _compare("block_tables", ta, tb, None, 4)
        if d is not None:
            out.append(Difference(f"block_tables ({_table_owner(da if d.index < ta.size else db, d.index)})",
                                  d.index, None, d.value_a, d.value_b, d.count, d.size))
    return out


def format_diff(diffs: list, path_a: str = "A", path_b: str = "B") -> str:
    """The differences as text, one per line, and a closing line."""
    lines = [f"A = {path_a}", f"B = {path_b}"]
    lines += [d.format() for d in diffs]
    lines.append("dumps are identical" if not diffs else
                 f"dumps differ in {len(diffs)} place{'s' if len(diffs) != 1 else ''}")
    return "\n".join(lines)
