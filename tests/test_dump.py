"""Arena dumps: write, read back safely, inspect (each check fails alone), diff, render, CLI and scripts."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan, open_device, place_h_state_slot, stage_batched_attn_metadata
from q12drv.tools.cli import main
from q12drv.tools.demo import DemoConfig, run_demo
from q12drv.tools.diff import diff_dumps
from q12drv.tools.dump import dump_arena, dump_pass, load_dump, write_dump
from q12drv.core.errors import DumpError, Q12Error
from q12drv.tools.inspect import CHECKS, inspect_dump
from tests.helpers import make_streams

REPO = Path(__file__).resolve().parents[1]
ALL_CHECKS = [name for name, _ in CHECKS]


@pytest.fixture(scope="module")
def demo_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("dumps") / "demo.npz"
    lines = []
    with open_device("emu") as dev:
        assert run_demo(dev, DemoConfig(), kernels=False, out=lines.append, dump=path)
    assert any(line.startswith("dump: wrote") for line in lines)
    return path


def rewrite(src, dst, *, header=None, arena=None, guard=None, tables=None):
    """Copy dump ``src`` to ``dst`` with ``header(h)``, ``arena(a)``, ``guard(g)``, ``tables(t)`` (the block tables,
    int32) applied to writable copies."""
    d = load_dump(src)
    h, a, g = copy.deepcopy(d.header), d.arena.copy(), d.guard.copy()
    t = None if d.block_tables is None else d.block_tables.copy()
    for fn, obj in ((header, h), (arena, a), (guard, g), (tables, t)):
        if fn is not None:
            fn(obj)
    write_dump(dst, h, a, g, d.ring, None if t is None else t.view(np.uint8))
    return dst


def stage_as_planned(arena, plan, streams):
    """Reserve ``plan``'s MoE area and per-stream blocks, stage ``streams`` at its stacked offset (block size 16,
    dummy block 0) and place the JIT slot: ``(meta, slot)``."""
    for r in (plan.moe, *plan.stream_blocks):
        arena.reserve(r.name, r.nbytes, offset=r.offset)
    meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=plan.mrope,
                                       scratch_offset_bytes=plan.stacked.offset, dummy_kv_block=0)
    return meta, place_h_state_slot(arena, meta)


def field_of(path, name):
    return load_dump(path).metas[0].field(name)


def put(arena, f, index, value):
    arena[f.offset:f.offset + f.nbytes].view(f.dtype)[index] = value


# --- a clean dump ------------------------------------------------------------------------------

def test_demo_dump_inspects_clean(demo_dump, capsys):
    assert main(["inspect", str(demo_dump)]) == 0
    out = capsys.readouterr().out
    for name in ALL_CHECKS:
        assert f"PASS {name}" in out
    assert "FAIL" not in out and "SKIP" not in out
    assert "stacked_metadata" in out and "h_state_ptrs" in out and "'demo block tables + seq_lens'+0x0" in out
    report = inspect_dump(demo_dump)
    assert report.ok and [r.status for r in report.checks] == ["PASS"] * len(ALL_CHECKS)
    d = report.dump
    assert d.mode == "batched" and d.num_blocks is not None and d.metas[0].batch_size == 8
    assert d.h_state.offset == d.metas[0].scratch_offset_bytes + d.metas[0].staged_bytes
    assert {a.name for a in d.allocations} >= {"q12 scratch arena", "demo block tables + seq_lens", "demo h_state stand-ins"}


def test_inspect_json(demo_dump, capsys):
    assert main(["inspect", "--json", str(demo_dump)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    assert [c["name"] for c in result["checks"]] == ALL_CHECKS
    assert all(c["status"] == "PASS" for c in result["checks"])
    assert len(result["streams"]) == 8 and result["streams"][0]["positions"]["T"] == [512, 548]
    assert result["streams"][0]["block_table"]["target"].startswith("'demo block tables")


def test_header_is_json_not_pickle(demo_dump):
    with np.load(demo_dump, allow_pickle=False) as npz:
        assert set(npz.files) == {"header", "arena", "guard", "block_tables"}
        assert all(npz[k].dtype == np.uint8 for k in npz.files)
        header = json.loads(npz["header"].tobytes().decode("utf-8"))
    assert header["schema"] == "q12drv.arena-dump" and header["version"] == 2
    meta = header["metadata"][0]
    for key in ("batch_size", "chunk_len", "total_tokens", "max_blocks_per_seq", "staged_bytes", "scratch_offset_bytes",
                "use_mrope", "block_size", "dummy_kv_block", "cu_seqlens_host", "kv_lens_host"):
        assert key in meta
    assert header["created_utc"].endswith("+00:00")
    assert {"proc_start", "proc_count", "block_table_dev", "seq_len_dev"} <= set(header["streams"][0])


# --- each corruption fails its check, and only that one ---------------------------------------

def _swap_cu(a, path):
    f = field_of(path, "cu_seqlens")
    v = a[f.offset:f.offset + f.nbytes].view(f.dtype)
    v[2], v[3] = int(v[3]), int(v[2])


def _collide(a, path):
    # stream 0 row 0 and stream 1 row 37 both sit at position 512: same offset inside a block
    f = field_of(path, "slot_stacked")
    v = a[f.offset:f.offset + f.nbytes].view(f.dtype)
    v[0] = v[37]


def _guard(g, path):
    g[17] = 0


# The dump every field is corrupted in: 3 streams (stream 0 with MRoPE vision positions) in a 64-block cache of
# which they own 15 (the others are in nobody's table), stream 2's block 8 evicted (entry -1: its tokens write
# the dummy block 0), the JIT slot uploaded. Rows: stream 0 0..36 (positions 16..52), stream 1 37..41 (0..4),
# stream 2 42..105 (100..163).
FIELD_COUNTS, FIELD_STARTS, FIELD_CACHE = (37, 5, 64), (16, 0, 100), 64


@pytest.fixture(scope="module")
def field_dump(tmp_path_factory):
    import dataclasses

    path = tmp_path_factory.mktemp("fields") / "fields.npz"
    with open_device("emu") as dev:
        streams, _tables_buf = make_streams(dev, list(FIELD_COUNTS), list(FIELD_STARTS), num_blocks=FIELD_CACHE,
                                            mrope_vision=(0,))
        evicted = streams[2].block_table.copy()
        evicted[8] = -1
        streams[2] = dataclasses.replace(streams[2], block_table=evicted)
        plan = make_scratch_plan(list(FIELD_COUNTS), 4, True, "exact")
        states = dev.alloc(3 * 4096, "states")
        with ScratchArena(dev, plan.total_bytes) as arena:
            meta, slot = stage_as_planned(arena, plan, streams)
            slot.upload([int(states.ptr) + 4096 * b for b in range(3)])
            dump_arena(arena, path, plan=plan, meta=meta, streams=streams, h_slot=slot, num_blocks=FIELD_CACHE)
    d = load_dump(path)
    assert inspect_dump(d).ok, inspect_dump(d).format()
    assert d.streams[2].block_table[8] == -1
    return path


def _f(d, name):
    return d.metas[0].field(name)


def _set(a, d, name, index, value):
    f = _f(d, name)
    a[f.offset:f.offset + f.nbytes].view(f.dtype)[index] = value


def _get(d, name, index):
    return int(d.values(_f(d, name))[index])


def _unowned(d):
    owned = set(d.block_tables.tolist()) | {0}
    return min(b for b in range(1, FIELD_CACHE) if b not in owned)


def _slot5(block):
    """Row 5 (stream 0, position 21: offset 5 in its block) moved into ``block`` at the right offset."""
    return lambda a, d: _set(a, d, "slot_stacked", 5, block(d) * 16 + 5)


def _share_a_block(t, a, d):
    # the caller's tables overlap: stream 1's block 0 is stream 0's block 1, and the stager followed them (its
    # slots agree with its table), so stream 1's positions 0..4 write the slots of stream 0's positions 16..20
    t0, t1 = d.streams[0], d.streams[1]
    t[t1.table_offset] = t[t0.table_offset + 1]
    for r in range(5):
        _set(a, d, "slot_stacked", 37 + r, int(t[t0.table_offset + 1]) * 16 + r)


def _swap_entries(t, d):
    # stream 2's table entries for its blocks 6 and 7 swapped: both still its own, each token now in the wrong one
    o = d.streams[2].table_offset
    t[o + 6], t[o + 7] = int(t[o + 7]), int(t[o + 6])


def _overlap_reservation(h, d):
    h["arena"]["reservations"][2]["offset"] -= 8


#: (what is corrupted, member(s), edit, the one check that must fail). Every metadata field, the JIT slot's
#: entries, the pads, the guard band, the stream inputs (pointers, counts, block tables) and the header's own
#: numbers; the KV slot in each way it can be wrong.
FIELD_CORRUPTIONS = [
    ("positions_stacked", "arena", lambda a, d: _set(a, d, "positions_stacked", 40, 9999), "positions"),
    ("positions_h_stacked (text stream, in range)", "arena", lambda a, d: _set(a, d, "positions_h_stacked", 45, 110),
     "positions"),
    ("positions_w_stacked (vision stream)", "arena", lambda a, d: _set(a, d, "positions_w_stacked", 3, 60), "positions"),
    ("slot_stacked -1", "arena", lambda a, d: _set(a, d, "slot_stacked", 5, -1), "slot_skipped"),
    ("slot_stacked INT64_MIN", "arena", lambda a, d: _set(a, d, "slot_stacked", 5, -(1 << 63)), "slot_skipped"),
    ("slot_stacked at the wrong offset", "arena", lambda a, d: _set(a, d, "slot_stacked", 5, _get(d, "slot_stacked", 5) + 1),
     "slots"),
    ("slot_stacked past the cache", "arena", _slot5(lambda d: FIELD_CACHE + 3), "blocks_in_cache"),
    ("slot_stacked in the dummy block", "arena", _slot5(lambda d: 0), "slot_dummy"),
    ("slot_stacked in a block no stream owns", "arena", _slot5(_unowned), "slot_unowned"),
    ("slot_stacked in another stream's block", "arena", _slot5(lambda d: int(d.streams[2].block_table[7])),
     "slot_table"),
    ("slot_stacked of an evicted block not in the dummy block", "arena",
     lambda a, d: _set(a, d, "slot_stacked", 42 + 28, int(d.streams[1].block_table[0]) * 16 + 0), "slot_table"),
    ("block tables overlap (two streams write one slot)", "tables+arena", _share_a_block, "slot_collisions"),
    ("block table entries swapped", "tables", _swap_entries, "slot_table"),
    ("block_table_ptrs", "arena", lambda a, d: _set(a, d, "block_table_ptrs", 1, 0xDEAD0000), "pointers"),
    ("seq_len_ptrs", "arena", lambda a, d: _set(a, d, "seq_len_ptrs", 2, _get(d, "seq_len_ptrs", 2) + 8), "pointers"),
    ("cu_seqlens", "arena", lambda a, d: _set(a, d, "cu_seqlens", 2, 41), "cu_seqlens"),
    ("kv_lens", "arena", lambda a, d: _set(a, d, "kv_lens", 1, 3), "kv_lens"),
    ("a pad byte", "arena", lambda a, d: a.__setitem__(_f(d, "kv_lens").offset + _f(d, "kv_lens").nbytes + 1, 7),
     "pads"),
    ("an h_state_ptrs entry", "arena",
     lambda a, d: a[d.h_state.offset + 8:d.h_state.offset + 16].view("<u8").__setitem__(0, 0xBAD000), "pointers"),
    ("the guard band", "guard", lambda g, d: g.__setitem__(17, 0), "guard"),
    ("header: a stream's proc_count", "header",
     lambda h, d: h["streams"][1].update(proc_count=h["streams"][1]["proc_count"] + 1), "layout"),
    ("header: a stream's block_table_dev", "header",
     lambda h, d: h["streams"][0].update(block_table_dev=h["streams"][0]["block_table_dev"] + 16), "pointers"),
    ("header: chunk_len", "header", lambda h, d: h["metadata"][0].update(chunk_len=65), "layout"),
    ("header: max_blocks_per_seq", "header", lambda h, d: h["metadata"][0].update(max_blocks_per_seq=2), "layout"),
    ("header: an overlapping reservation", "header", _overlap_reservation, "regions"),
    ("header: the JIT slot's offset", "header",
     lambda h, d: h["h_state"].update(offset=_f(d, "slot_stacked").offset), "h_state_slot"),
    ("header: num_blocks", "header", lambda h, d: h.update(num_blocks=5), "blocks_in_cache"),
]


def test_every_check_has_a_field_corruption():
    assert {c[3] for c in FIELD_CORRUPTIONS} == set(ALL_CHECKS)


@pytest.mark.parametrize("what,member,edit,check", FIELD_CORRUPTIONS, ids=[c[0] for c in FIELD_CORRUPTIONS])
def test_one_corruption_fails_one_check(field_dump, tmp_path, capsys, what, member, edit, check):
    d = load_dump(field_dump)
    if member == "tables+arena":
        tables = d.block_tables.copy()
        bad = rewrite(field_dump, tmp_path / "bad.npz", tables=lambda t: t.__setitem__(slice(None), tables),
                      arena=lambda a: edit(tables, a, d))
    else:
        bad = rewrite(field_dump, tmp_path / "bad.npz", **{member: lambda x: edit(x, d)})
    report = inspect_dump(bad)
    assert report.failed == [check], report.format()
    result = report.check(check)
    assert result.findings and not any("could not run" in f.message for f in result.findings)
    assert main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {check}" in out and out.count("FAIL ") == 1


def test_the_demo_dump_corrupted_fails_one_check(demo_dump, tmp_path):
    # the same on the demo's dump (8 streams, no free block in its cache): a slot of stream 0 written where
    # stream 1 writes fails slot_table (not also slot_collisions: a slot is judged by its first failing check)
    bad = rewrite(demo_dump, tmp_path / "bad.npz", arena=lambda a: _collide(a, demo_dump))
    assert inspect_dump(bad).failed == ["slot_table"]
    bad = rewrite(demo_dump, tmp_path / "bad2.npz", arena=lambda a: _swap_cu(a, demo_dump))
    assert inspect_dump(bad).failed == ["cu_seqlens"]


def test_version_1_dumps_are_read_with_the_checks_they_support(field_dump, tmp_path, capsys):
    # a version 1 dump has no block tables: the checks that need them skip and say why; the others run
    def to_v1(h):
        h["version"] = 1
        for s in h["streams"]:
            del s["block_table"]

    d = load_dump(field_dump)
    header = copy.deepcopy(d.header)
    to_v1(header)
    old = write_dump(tmp_path / "v1.npz", header, d.arena, d.guard)
    report = inspect_dump(old)
    assert report.dump.version == 1 and report.ok
    status = {r.name: r for r in report.checks}
    for name in ("slot_dummy", "slot_unowned", "slot_table"):
        assert status[name].status == "SKIP" and "schema version 1" in status[name].summary
    assert all(r.status == "PASS" for n, r in status.items() if n not in ("slot_dummy", "slot_unowned", "slot_table"))
    assert main(["inspect", str(old)]) == 0
    assert "SKIP slot_table" in capsys.readouterr().out
    bad = rewrite(old, tmp_path / "v1bad.npz", arena=lambda a: _set(a, d, "slot_stacked", 5, -1))
    assert inspect_dump(bad).failed == ["slot_skipped"]


def test_a_dump_without_stream_inputs_says_why_it_skips(emu, tmp_path):
    streams, _ = make_streams(emu, [20, 30])
    with ScratchArena(emu, 1 << 14) as arena:
        meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                           dummy_kv_block=0)
        report = inspect_dump(dump_arena(arena, tmp_path / "no_streams.npz", meta=meta))
    assert report.ok and report.check("slot_table").status == "SKIP"
    assert "no stream inputs" in report.check("slot_table").summary


def test_cu_seqlens_finding_names_offset_and_values(demo_dump, tmp_path):
    bad = rewrite(demo_dump, tmp_path / "bad.npz", arena=lambda a: _swap_cu(a, demo_dump))
    f = field_of(demo_dump, "cu_seqlens")
    finding = inspect_dump(bad).check("cu_seqlens").findings[0]
    assert finding.offset == f.offset + 4 * 3
    assert finding.values["value"] == 166 and finding.values["previous"] == 167


def test_text_stream_h_position_in_range_is_still_caught(demo_dump, tmp_path):
    bad = rewrite(demo_dump, tmp_path / "bad.npz",
                  arena=lambda a: put(a, field_of(demo_dump, "positions_h_stacked"), 40, 600))  # stream 1, in range
    report = inspect_dump(bad)
    assert report.failed == ["positions"]
    assert "positions_h_stacked[40] = 600" in report.check("positions").findings[0].message


def test_guard_overwritten_on_the_device(emu, tmp_path):
    streams, _ = make_streams(emu, [20, 30, 7])
    plan = make_scratch_plan([s.proc_count for s in streams], 4, False, "exact")
    with ScratchArena(emu, plan.total_bytes) as arena:
        meta, slot = stage_as_planned(arena, plan, streams)
        assert inspect_dump(dump_arena(arena, tmp_path / "ok.npz", plan=plan, meta=meta, streams=streams, h_slot=slot)).ok
        emu.memset(int(arena.base) + arena.capacity + 100, 0, 3)
        emu.synchronize()
        report = inspect_dump(dump_arena(arena, tmp_path / "bad.npz", plan=plan, meta=meta, streams=streams, h_slot=slot))
        assert report.failed == ["guard"]
        finding = report.check("guard").findings[0]
        assert finding.offset == arena.capacity + 100 and finding.values["overwritten"] == 3


def test_arena_module_does_not_import_dump():
    code = "import sys, q12drv.core.arena, q12drv.prefill; print('q12drv.tools.dump' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert res.stdout.strip() == "False", res.stderr


# --- Q12Pass dumps: batched and per stream; the pinned ring ------------------------------------

@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_q12pass_dump_inspects_clean(emu, tmp_path, mode):
    from q12drv.prefill import Q12Pass

    streams, _ = make_streams(emu, [33, 1, 70], starts=[16, 16, 16], mrope_vision=(2,))
    plan = make_scratch_plan([s.proc_count for s in streams], 4, True, "exact")
    with ScratchArena(emu, plan.total_bytes + 4096) as arena:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0, top_k=4, policy="exact",
                      mode=mode)
        path = dump_pass(q12, tmp_path / "pass.npz", num_blocks=64, include_ring=True)
    report = inspect_dump(path)
    assert report.ok, report.format()
    assert report.dump.mode == mode and len(report.dump.metas) == (1 if mode == "batched" else 3)
    assert report.check("positions").summary.endswith("1 MRoPE vision stream(s) within bounds")
    assert "never uploaded" in report.check("pointers").summary
    d = report.dump
    assert d.ring is not None and d.ring_slots
    staged = [bytes(d.read(m.scratch_offset_bytes, m.staged_bytes)) for m in d.metas]
    ring_prefixes = [bytes(d.ring[s.offset:s.offset + len(staged[-1])]) for s in d.ring_slots]
    assert staged[-1] in ring_prefixes
    pytest.importorskip("matplotlib")
    from q12drv.tools.render import render_dump

    assert render_dump(path, tmp_path / "pass.png").stat().st_size > 1000


def test_bare_arena_dump_skips_what_it_cannot_know(emu, tmp_path, capsys):
    with ScratchArena(emu, 4096) as arena:
        arena.reserve("scratch", 1000)
        path = dump_arena(arena, tmp_path / "bare.npz")
    report = inspect_dump(path)
    assert report.ok and report.dump.mode is None and report.dump.plan is None
    statuses = {r.name: r.status for r in report.checks}
    assert statuses["guard"] == statuses["regions"] == "PASS" and statuses["cu_seqlens"] == "SKIP"
    assert main(["inspect", str(path)]) == 0
    assert "scratch" in capsys.readouterr().out


def test_num_blocks_override(demo_dump, capsys):
    assert inspect_dump(demo_dump, num_blocks=10).failed == ["blocks_in_cache"]
    assert main(["inspect", "--num-blocks", "10", str(demo_dump)]) == 1
    assert "FAIL blocks_in_cache" in capsys.readouterr().out


# --- untrusted files ---------------------------------------------------------------------------

def _expect_dump_error(path, pattern, capsys):
    with pytest.raises(DumpError, match=pattern) as info:
        load_dump(path)
    assert isinstance(info.value, Q12Error) and str(path) in str(info.value)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("q12drv inspect: ") and "Traceback" not in err


def test_truncated_file(demo_dump, tmp_path, capsys):
    raw = demo_dump.read_bytes()
    for n, name in ((len(raw) // 2, "half.npz"), (len(raw) - 30, "tail.npz"), (0, "empty.npz")):
        p = tmp_path / name
        p.write_bytes(raw[:n])
        _expect_dump_error(p, "truncated|not a readable|unreadable|empty", capsys)


def test_corrupted_member_bytes(demo_dump, tmp_path, capsys):
    raw = bytearray(demo_dump.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(64)
    p = tmp_path / "crc.npz"
    p.write_bytes(bytes(raw))
    _expect_dump_error(p, "unreadable|not a readable|JSON|header", capsys)


def test_missing_and_foreign_files(tmp_path, capsys):
    _expect_dump_error(tmp_path / "nope.npz", "no such file", capsys)
    p = tmp_path / "text.npz"
    p.write_text("hello")
    _expect_dump_error(p, "not a", capsys)
    p = tmp_path / "single.npy"
    np.save(p, np.zeros(4, np.uint8))
    _expect_dump_error(p, "single .npy array", capsys)


@pytest.mark.parametrize("edit, pattern", [
    (lambda h: h.update(version=99), "schema version 99 is not supported"),
    (lambda h: h.update(schema="something-else"), "not a q12drv arena dump"),
    (lambda h: h["arena"].update(capacity=h["arena"]["capacity"] + 64), "arena is .* bytes but the file holds"),
    (lambda h: h["metadata"][0]["fields"][3].update(offset=h["arena"]["capacity"] - 8), "spans .* holds only"),
    (lambda h: h["plan"]["regions"][0].update(nbytes=10 ** 9), "outside|spans"),
    (lambda h: h["metadata"][0]["fields"][0].update(count=7), "says 7 x"),
    (lambda h: h["metadata"][0].update(cu_seqlens_host=[0, 5]), "entries but should have"),
    (lambda h: h["h_state"].update(offset=h["arena"]["capacity"] - 8), "h_state_ptrs slot spans"),
    (lambda h: h["metadata"][0].update(batch_size="8"), "must be an integer"),
    (lambda h: h["arena"]["reservations"][0].update(offset=-1), "outside"),
    (lambda h: h.pop("arena"), "has no 'arena'"),
    (lambda h: h.update(metadata=[{}]), "has no"),
    (lambda h: h["metadata"][0]["fields"][0].update(dtype="|O"), "has dtype"),
])
def test_lying_headers(demo_dump, tmp_path, capsys, edit, pattern):
    _expect_dump_error(rewrite(demo_dump, tmp_path / "lie.npz", header=edit), pattern, capsys)


def test_pickled_objects_are_refused(demo_dump, tmp_path, capsys):
    d = load_dump(demo_dump)
    p = tmp_path / "pickled.npz"
    with open(p, "wb") as fh:
        np.savez(fh, header=np.array([d.header], dtype=object), arena=d.arena, guard=d.guard)
    _expect_dump_error(p, "pickled", capsys)
    p = tmp_path / "pickle.bin"
    import pickle

    p.write_bytes(pickle.dumps({"header": d.header}))
    _expect_dump_error(p, "pickled", capsys)


def test_npy_header_lying_about_its_shape(tmp_path, capsys):
    import io
    import zipfile

    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "|u1", "fortran_order": False, "shape": (10 ** 12,)})
    member.write(b"x" * 10)
    p = tmp_path / "shape.npz"
    with zipfile.ZipFile(p, "w") as zf:
        for name in ("header", "arena", "guard"):
            zf.writestr(f"{name}.npy", member.getvalue())
    _expect_dump_error(p, "claims shape", capsys)


def test_header_not_json(demo_dump, tmp_path, capsys):
    d = load_dump(demo_dump)
    p = tmp_path / "notjson.npz"
    with open(p, "wb") as fh:
        np.savez(fh, header=np.frombuffer(b"{not json", np.uint8), arena=d.arena, guard=d.guard)
    _expect_dump_error(p, "not valid JSON", capsys)
    with open(p, "wb") as fh:
        np.savez(fh, header=np.frombuffer(b"\xff\xfe", np.uint8), arena=d.arena, guard=d.guard)
    _expect_dump_error(p, "not UTF-8", capsys)


# --- diff ----------------------------------------------------------------------------------------

def test_diff_against_itself_is_empty(demo_dump, capsys):
    assert diff_dumps(demo_dump, demo_dump) == []
    assert main(["diff", str(demo_dump), str(demo_dump)]) == 0
    assert "dumps are identical" in capsys.readouterr().out


def test_diff_names_field_and_first_index(demo_dump, tmp_path, capsys):
    f = field_of(demo_dump, "slot_stacked")
    bad = rewrite(demo_dump, tmp_path / "bad.npz", arena=lambda a: put(a, f, 7, 123456))
    diffs = diff_dumps(demo_dump, bad)
    assert len(diffs) == 1
    (d,) = diffs
    assert d.where == "field stacked_metadata.slot_stacked" and d.index == 7 and d.count == 1
    assert d.offset == f.offset + 8 * 7 and d.value_b == 123456 and d.value_a != 123456
    assert main(["diff", str(demo_dump), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "slot_stacked" in out and "first [7]" in out and "B=123456" in out
    assert main(["diff", "--json", str(demo_dump), str(bad)]) == 1
    js = json.loads(capsys.readouterr().out)
    assert js["identical"] is False and js["differences"][0]["index"] == 7


def test_diff_guard_and_header(demo_dump, tmp_path):
    bad = rewrite(demo_dump, tmp_path / "bad.npz", guard=lambda g: g.__setitem__(3, 1),
                  header=lambda h: h.update(num_blocks=h["num_blocks"] + 1))
    where = [d.where for d in diff_dumps(demo_dump, bad)]
    assert where == ["header.num_blocks", "guard"]


# --- render --------------------------------------------------------------------------------------

def _png_stats(path):
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    pixels = (img[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    colours = np.unique(pixels, axis=0)
    red = np.sum((pixels[:, 0] > 180) & (pixels[:, 1] < 80) & (pixels[:, 2] < 80))
    return img.shape, len(colours), int(red)


def test_render_writes_a_picture(demo_dump, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "map.png"
    assert main(["render", str(demo_dump), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shape, ncolours, red = _png_stats(out)
    assert shape[0] >= 400 and shape[1] >= 800 and ncolours > 8
    bad = rewrite(demo_dump, tmp_path / "bad.npz", guard=lambda g: _guard(g, demo_dump),
                  arena=lambda a: _collide(a, demo_dump))
    out_bad = tmp_path / "bad.png"
    assert main(["render", str(bad), "-o", str(out_bad)]) == 0
    _, _, red_bad = _png_stats(out_bad)
    assert red_bad > red + 100  # failing checks are highlighted in red


# --- the demo flag and the scripts -----------------------------------------------------------------

def test_demo_cli_dump_flag(tmp_path, capsys):
    p = tmp_path / "cli.dump"  # any name: no .npz suffix is added
    assert main(["demo", "--driver", "emu", "--no-kernels", "--dump", str(p)]) == 0
    out = capsys.readouterr().out
    assert f"dump: wrote {p}" in out and out.strip().endswith("demo: all checks passed")
    assert p.exists() and inspect_dump(p).ok


def test_scripts_are_thin_wrappers(demo_dump, tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "inspect_arena_dump.py"), str(demo_dump)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and f"inspect: {len(ALL_CHECKS)} passed, 0 failed" in res.stdout, res.stderr
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "diff_arena_dumps.py"), str(demo_dump),
                          str(tmp_path / "missing.npz")], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("diff_arena_dumps.py: ") and "no such file" in res.stderr


def test_diff_names_the_block_table_entry(field_dump, tmp_path):
    d = load_dump(field_dump)
    bad = rewrite(field_dump, tmp_path / "bad.npz", tables=lambda t: _swap_entries(t, d))
    where = [x.where for x in diff_dumps(field_dump, bad)]
    assert where == ["block_tables (stream 2 entry 6)"]
