"""Dumps that would exhaust the reader: each is a small file built here that made a command take minutes or
gigabytes before the reader bounded its work; now each is refused, or read, in seconds.

* a zip bomb (an arena member unpacking 512 MiB from about 0.5 MB), a member compressed beyond what deflate can do,
  one with another compression method;
* a header listing far more streams, metadata blocks or plan streams than the arena can hold;
* a dump with thousands of streams and thousands of allocations (the pointer checks once cost their product),
  read by inspect, diff and render.
"""

import copy
import io
import json
import os
import stat
import time
import zipfile

import numpy as np
import pytest

from q12drv import ScratchArena, open_device, stage_batched_attn_metadata
from q12drv.core.errors import DumpError
from q12drv.tools.cli import main
from q12drv.tools.diff import diff_dumps
from q12drv.tools.dump import DEFAULT_MAX_BYTES, MAX_RATIO, dump_arena, load_dump, max_streams, write_dump
from q12drv.tools.inspect import STREAMS_LISTED, inspect_dump
from tests.helpers import make_streams

#: What "in seconds" means on a loaded two-core test machine (the files below took minutes before).
SECONDS = 20


def _npy(nbytes: int) -> bytes:
    """A .npy header for a 1-D uint8 array of ``nbytes``."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False, "shape": (nbytes,)})
    return out.getvalue()


def _zip(path, members: dict, compression: dict | None = None) -> None:
    """``members`` deflated, but those named in ``compression`` (name -> zip method)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data, compress_type=(compression or {}).get(name, zipfile.ZIP_DEFLATED))


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "small.npz"
    with open_device("emu") as dev:
        streams, _ = make_streams(dev, [20, 30, 7])
        with ScratchArena(dev, 1 << 14) as arena:
            meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                               dummy_kv_block=0)
            dump_arena(arena, path, meta=meta, streams=streams, num_blocks=64)
    return path


def _refused(path, pattern, capsys, argv=("inspect",)):
    t0 = time.perf_counter()
    with pytest.raises(DumpError, match=pattern):
        load_dump(path)
    assert main([*argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert time.perf_counter() - t0 < SECONDS
    return err


def test_a_zip_bomb_is_refused_before_it_is_unpacked(tmp_path, capsys):
    # 512 MiB of zeros deflate to about 0.5 MB; the reader refuses it from the sizes the zip directory declares
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr("header.npy", _npy(2) + b"{}")
        with zf.open("arena.npy", "w", force_zip64=True) as fh:
            fh.write(_npy(1 << 29))
            chunk = bytes(16 << 20)
            for _ in range(32):
                fh.write(chunk)
        zf.writestr("guard.npy", _npy(0))
    assert path.stat().st_size < 2 << 20
    err = _refused(path, "raise the limit with --max-bytes", capsys)
    assert f"more than the {DEFAULT_MAX_BYTES:,} allowed" in err


def test_max_bytes_is_a_cli_option(small_dump, capsys):
    # a real dump above a lowered limit: the refusal names the option, which then admits it
    size = sum(i.file_size for i in zipfile.ZipFile(small_dump).infolist())
    assert main(["inspect", "--max-bytes", str(size - 1), str(small_dump)]) == 2
    assert "--max-bytes" in capsys.readouterr().err
    assert main(["inspect", "--max-bytes", str(size), str(small_dump)]) == 0
    for cmd in (["diff", str(small_dump), str(small_dump)], ["render", str(small_dump), "-o", "x.png"]):
        assert main([cmd[0], "--max-bytes", "1000", *cmd[1:]]) == 2
        assert "--max-bytes" in capsys.readouterr().err
    with pytest.raises(DumpError, match="more than the 1,000 allowed"):
        load_dump(small_dump, max_bytes=1000)


def test_a_member_compressed_beyond_deflate_is_refused(tmp_path, capsys):
    # bzip2 packs 64 MiB of zeros into about 50 bytes: no dump member can claim such a ratio
    path = tmp_path / "ratio.npz"
    _zip(path, {"header.npy": _npy(2) + b"{}", "arena.npy": _npy(64 << 20) + bytes(64 << 20), "guard.npy": _npy(0)},
         {"arena.npy": zipfile.ZIP_BZIP2})
    _refused(path, f"more than {MAX_RATIO}:1", capsys)
    path = tmp_path / "method.npz"  # the same method on incompressible bytes: refused by its method
    _zip(path, {"header.npy": _npy(2) + b"{}", "arena.npy": _npy(4096) + os.urandom(4096), "guard.npy": _npy(0)},
         {"arena.npy": zipfile.ZIP_BZIP2})
    _refused(path, "compression method 12", capsys)


def test_a_member_named_without_npy_is_refused(small_dump, tmp_path, capsys):
    with zipfile.ZipFile(small_dump) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    members["header"] = members.pop("header.npy")
    path = tmp_path / "header.npz"
    _zip(path, members)
    _refused(path, "member 'header' must be named 'header.npy'", capsys)
    members["header.npy"] = members.pop("header")
    path = tmp_path / "twice.npz"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        with pytest.warns(UserWarning, match="Duplicate name"):
            zf.writestr("guard.npy", members["guard.npy"])
    _refused(path, "appears twice", capsys)


def _rewrite_header(src, dst, edit):
    d = load_dump(src)
    header = copy.deepcopy(d.header)
    edit(header, d)
    tables = None if d.block_tables is None else d.block_tables.view(np.uint8)
    return write_dump(dst, header, d.arena, d.guard, d.ring, tables)


def test_a_plan_of_millions_of_streams_is_refused_at_once(small_dump, tmp_path, capsys):
    # a million streams in the plan: 3 MB of JSON that packs to a few KB (laying such a plan out took
    # gigabytes)
    def edit(h, d):
        h["plan"] = {"policy": "exact", "counts": [1] * 1_000_000, "top_k": 0, "mrope": False, "total_bytes": 0,
                     "staged_bytes": 0, "regions": [], "fields": []}

    path = _rewrite_header(small_dump, tmp_path / "plan.npz", edit)
    assert path.stat().st_size < 1 << 20
    _refused(path, "holds at most", capsys)


def test_more_streams_or_blocks_than_the_arena_holds_are_refused(small_dump, tmp_path, capsys):
    cap = load_dump(small_dump).capacity
    many = max_streams(cap) + 1

    def streams(h, d):
        h["streams"] = [dict(h["streams"][0], index=i, block_table=None) for i in range(many)]

    _refused(_rewrite_header(small_dump, tmp_path / "streams.npz", streams), "holds the metadata of at most", capsys)

    def blocks(h, d):
        h["metadata"] = h["metadata"] * many

    _refused(_rewrite_header(small_dump, tmp_path / "blocks.npz", blocks), "metadata blocks", capsys)

    def overlapping(h, d):  # every reservation spans the whole arena
        h["arena"]["reservations"] = [{"name": f"r{i}", "offset": 0, "nbytes": cap, "kind": "reserved",
                                       "stream": None} for i in range(3)]

    _refused(_rewrite_header(small_dump, tmp_path / "regions.npz", overlapping), "overlap wholesale", capsys)

    def batch(h, d):  # one metadata block claiming more streams than fit
        h["metadata"][0]["batch_size"] = many

    _refused(_rewrite_header(small_dump, tmp_path / "batch.npz", batch), "batch_size = .* is outside", capsys)

    def plan_regions(h, d):  # a plan whose regions each span the arena
        h["plan"] = {"policy": "exact", "counts": [1], "top_k": 0, "mrope": False, "total_bytes": cap,
                     "staged_bytes": 0, "fields": [],
                     "regions": [{"name": f"r{i}", "offset": 0, "nbytes": cap, "kind": "moe"} for i in range(4)]}

    _refused(_rewrite_header(small_dump, tmp_path / "plan_regions.npz", plan_regions), "overlap wholesale", capsys)

    def metadata(h, d):  # three metadata blocks each claiming the whole arena
        m = dict(h["metadata"][0], staged_bytes=cap, scratch_offset_bytes=0)
        h["metadata"] = [m, m, m]

    _refused(_rewrite_header(small_dump, tmp_path / "metas.npz", metadata), "the metadata blocks add up", capsys)

    def inputs(h, d):  # more stream inputs than the metadata covers
        h["streams"].append(dict(h["streams"][0], index=3))

    _refused(_rewrite_header(small_dump, tmp_path / "inputs.npz", inputs), "covers 3 streams", capsys)

    def allocations(h, d):
        h["allocations"].append(dict(h["allocations"][0], name="twin"))

    _refused(_rewrite_header(small_dump, tmp_path / "alloc.npz", allocations), "overlap; device allocations never do",
             capsys)


def test_ring_slots_overlapping_wholesale_are_refused(small_dump, tmp_path, capsys):
    d = load_dump(small_dump)
    header = copy.deepcopy(d.header)
    header["ring"] = {"name": "staging", "slots": [{"index": i, "offset": 0, "nbytes": 64, "pending": False}
                                                   for i in range(3)]}
    path = write_dump(tmp_path / "ring.npz", header, d.arena, d.guard, bytes(64), d.block_tables.view(np.uint8))
    _refused(path, "the ring slots add up to 192 bytes, more than twice the 64-byte ring member", capsys)


def test_a_header_past_its_cap_is_refused_before_it_is_parsed(small_dump, tmp_path, capsys):
    d = load_dump(small_dump)
    header = copy.deepcopy(d.header)
    header["padding"] = " " * (5 << 20)
    path = write_dump(tmp_path / "big_header.npz", header, d.arena, d.guard, None, d.block_tables.view(np.uint8))
    _refused(path, r"header member is [\d,]+ bytes \(at most 4,194,304 allowed\)", capsys)


@pytest.fixture(scope="module")
def wide_dump(tmp_path_factory):
    """2,000 one-token streams and 20,000 allocations: about 0.5 MB on disk; inspect took 104 s on it before
    allocations were looked up by binary search."""
    path = tmp_path_factory.mktemp("wide") / "wide.npz"
    n = 2000
    with open_device("emu") as dev:
        streams, _ = make_streams(dev, [1] * n, starts=[i % 16 for i in range(n)], num_blocks=4 * n)
        with ScratchArena(dev, 1 << 17) as arena:
            meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                               dummy_kv_block=0)
            dump_arena(arena, path, meta=meta, streams=streams, num_blocks=4 * n)

    def edit(h, d):  # listed first, below every real one: each pointer lookup once walked all 20,000 (104 s)
        h["allocations"] = [{"name": f"pool {i}", "base": 4096 * (i + 1), "size": 4096} for i in range(20000)] + \
            h["allocations"]

    _rewrite_header(path, path, edit)
    assert path.stat().st_size < 2 << 20
    return path


def test_thousands_of_streams_and_allocations_inspect_in_seconds(wide_dump, tmp_path, capsys):
    t0 = time.perf_counter()
    report = inspect_dump(wide_dump)
    assert report.ok, report.format()
    assert len(report.streams) == STREAMS_LISTED and report.to_json()["streams_total"] == 2000
    assert "1,744 more streams" in report.format()
    assert main(["inspect", str(wide_dump)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(wide_dump)]) == 0
    assert json.loads(capsys.readouterr().out)["streams_total"] == 2000
    assert main(["diff", str(wide_dump), str(wide_dump)]) == 0
    assert time.perf_counter() - t0 < SECONDS


def test_thousands_of_streams_render_in_seconds(wide_dump, tmp_path):
    pytest.importorskip("matplotlib")
    t0 = time.perf_counter()
    assert main(["render", str(wide_dump), "-o", str(tmp_path / "wide.png")]) == 0
    assert time.perf_counter() - t0 < SECONDS
    assert (tmp_path / "wide.png").stat().st_size > 1000


def test_a_corrupted_wide_dump_reports_every_stream_bounded(wide_dump, tmp_path):
    # every stream's slot wrong: one finding per stream up to the limit, the rest counted, in seconds
    d = load_dump(wide_dump)
    f = d.metas[0].field("slot_stacked")
    arena = d.arena.copy()
    arena[f.offset:f.offset + f.nbytes].view("<i8")[:] = -1
    path = tmp_path / "neg.npz"
    write_dump(path, copy.deepcopy(d.header), arena, d.guard, None, d.block_tables.view(np.uint8))
    t0 = time.perf_counter()
    report = inspect_dump(path)
    assert report.failed == ["slot_skipped"]
    result = report.check("slot_skipped")
    assert result.total == 2000 and len(result.findings) == 20
    assert diff_dumps(wide_dump, path)[0].where == "field stacked_metadata.slot_stacked"
    assert time.perf_counter() - t0 < SECONDS


def test_dumps_are_readable_by_the_group(small_dump, tmp_path):
    # mkstemp makes its file 0600; a dump is written as any file the user writes (0666 less the umask)
    old = os.umask(0o022)
    try:
        path = _rewrite_header(small_dump, tmp_path / "mode.npz", lambda h, d: None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_huge_block_table_member_inspects_in_seconds(small_dump, tmp_path):
    # 62 million table entries (250 MiB of zeros, 256 KB packed) as one stream's table: inspect and diff look at
    # each entry once, never sort them all
    d = load_dump(small_dump)
    header = copy.deepcopy(d.header)
    tables = np.zeros((250 << 20) // 4, np.int32)
    tables[:d.block_tables.size] = d.block_tables
    header["streams"][2]["block_table"] = {"offset": 0, "count": int(tables.size)}
    path = write_dump(tmp_path / "tables.npz", header, d.arena, d.guard, None, tables.view(np.uint8))
    assert path.stat().st_size < 1 << 20
    t0 = time.perf_counter()
    report = inspect_dump(path)
    assert report.failed == ["slot_table"]  # stream 2's table is now stream 0's entries followed by zeros
    assert diff_dumps(path, path) == []
    assert time.perf_counter() - t0 < SECONDS
