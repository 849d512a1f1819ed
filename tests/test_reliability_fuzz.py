"""Fuzzing (hypothesis): the planner, the stager, admission and a whole pass take any batch and either
stage it so that it decodes back to its inputs, or refuse it with a named error and nothing written;
the dump reader takes any mutated file (bit flips, truncations, header and member edits) and either
reads it (and then inspect, diff and the CLI work on it) or raises DumpError, never anything else.
"""

from __future__ import annotations

import copy
import json
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from q12drv import (
    CapacityError,
    DumpError,
    ScratchArena,
    StreamStageInfo,
    check_kernel_batched_eligible,
    make_scratch_plan,
    open_device,
    place_h_state_slot,
    q12_batched_scratch_bytes_varlen,
    stage_batched_attn_metadata,
)
from q12drv.core.admission import RULES
from q12drv.core.staging import verify_readback
from q12drv.tools.cli import main as cli_main
from q12drv.tools.diff import diff_dumps, format_diff
from q12drv.tools.dump import dump_arena, dump_pass, load_dump, write_dump
from q12drv.tools.inspect import inspect_dump
from q12drv.core.layout import a8, staged_bytes
from q12drv.prefill import Q12Pass
from tests.reliability import assert_same, snapshot

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
REFUSALS = (TypeError, ValueError, CapacityError, IndexError)

ints = st.integers(-3, 1 << 33)
weird = st.one_of(st.none(), st.floats(allow_nan=True), st.text(max_size=3), st.booleans(), st.just([1, 2]),
                  st.integers(-(1 << 70), 1 << 70))


@pytest.fixture(scope="module")
def dev():
    d = open_device("emu")
    yield d
    d.close()
    assert d.driver.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}


# --- planner ---------------------------------------------------------------------------------

@SETTINGS
@given(counts=st.lists(st.one_of(st.integers(-2, 5000), st.integers(1 << 28, 1 << 32), weird), max_size=12),
       top_k=st.one_of(st.integers(-2, 64), weird), mrope=st.one_of(st.booleans(), weird),
       policy=st.sampled_from(["seed", "exact", "other", None]))
def test_planner_plans_or_names_the_bad_argument(counts, top_k, mrope, policy):
    try:
        plan = make_scratch_plan(counts, top_k, mrope, policy)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        assert any(word in msg for word in ("counts", "top_k", "mrope", "policy", "total_tokens")), msg
        return
    # accepted: exactly the valid inputs, and the plan's invariants hold
    assert counts and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts)
    assert sum(counts) <= (1 << 31) - 1
    regions = plan.regions
    assert regions[0].offset == 0
    for a, b in zip(regions, regions[1:]):
        assert a.end == b.offset  # contiguous, no overlap, no gap
    assert plan.moe.offset % 64 == 0 and all(r.offset % 8 == 0 for r in regions)
    assert plan.stacked.nbytes == staged_bytes(len(counts), sum(counts), mrope)
    assert plan.jit_slot.offset == plan.stacked.end and plan.jit_slot.nbytes == 8 * len(counts)
    if policy == "seed":
        assert plan.total_bytes == q12_batched_scratch_bytes_varlen(len(counts), sum(counts), max(counts), top_k, mrope)
    else:
        assert plan.first_unfit_stream() is None
    for f, g in zip(plan.fields, plan.fields[1:]):
        assert f.end == g.offset and f.padded == a8(f.nbytes)


# --- stager: any batch stages and decodes back, or is refused with nothing written ---------------

@st.composite
def batches(draw):
    """A batch of streams (as plain dicts), valid most of the time, with one corruption sometimes."""
    n = draw(st.integers(1, 6))
    bs = draw(st.sampled_from([1, 16, 64]))
    mrope = draw(st.booleans())
    streams = []
    for b in range(n):
        start = draw(st.integers(0, 3000))
        count = draw(st.integers(1, 200))
        need = -(-(start + count) // bs)
        table = draw(st.lists(st.integers(-1, 500), min_size=need, max_size=need + 3))
        mp = None
        if mrope and draw(st.booleans()):
            mp = draw(st.sampled_from(["text", "vision"]))
        streams.append(dict(proc_start=start, proc_count=count, block_table=np.array(table, np.int32),
                            mrope=mp))
    corruption = draw(st.sampled_from([None] * 6 + [
        "zero_count", "negative_start", "short_table", "null_table_ptr", "odd_seq_ptr", "huge_start",
        "mrope_shape", "mrope_overflow", "float_count", "table_2d", "table_float", "ptr_overflow", "empty",
        "block_size", "dummy", "mrope_flag"]))
    victim = draw(st.integers(0, n - 1))
    return dict(streams=streams, block_size=bs, mrope=mrope, corruption=corruption, victim=victim,
                dummy=draw(st.integers(0, 5)))


def build_streams(dev, spec):
    """StreamStageInfo list (with device-resident tables) and keyword arguments for the stager."""
    infos = []
    bufs = []
    for s in spec["streams"]:
        table = s["block_table"]
        buf = dev.alloc(max(table.nbytes, 4) + 8, "fuzz table")
        bufs.append(buf)
        if table.size:
            dev.upload(buf.ptr, table)
        mp = None
        if s["mrope"] is not None:
            c, p0 = s["proc_count"], s["proc_start"]
            mp = (np.stack([np.arange(p0, p0 + c)] * 3) if s["mrope"] == "text" else
                  np.stack([np.full(c, p0), p0 + np.arange(c) // 3, p0 + np.arange(c) % 3])).astype(np.int64)
        infos.append(dict(proc_start=s["proc_start"], proc_count=s["proc_count"], block_table=table,
                          block_table_dev=int(buf.ptr), seq_len_dev=int(buf.ptr) + max(table.nbytes, 4),
                          mrope_positions=mp))
    kw = dict(block_size=spec["block_size"], use_mrope=spec["mrope"], dummy_kv_block=spec["dummy"])
    v = infos[spec["victim"]]
    c = spec["corruption"]
    if c == "zero_count":
        v["proc_count"] = 0
    elif c == "negative_start":
        v["proc_start"] = -5
    elif c == "short_table":
        v["block_table"] = v["block_table"][: max(0, -(-(v["proc_start"] + v["proc_count"]) // kw["block_size"]) - 1)]
    elif c == "null_table_ptr":
        v["block_table_dev"] = 0
    elif c == "odd_seq_ptr":
        v["seq_len_dev"] += 2  # a u32 needs 4-byte alignment (NULL is allowed: none given)
    elif c == "huge_start":
        v["proc_start"] = (1 << 31) - 2
    elif c == "mrope_shape":
        v["mrope_positions"] = np.zeros((3, v["proc_count"] + 1), np.int64)
    elif c == "mrope_overflow":
        v["mrope_positions"] = np.full((3, v["proc_count"]), 1 << 32, np.int64)
    elif c == "float_count":
        v["proc_count"] = float(v["proc_count"])
    elif c == "table_2d":
        v["block_table"] = v["block_table"].reshape(1, -1)
    elif c == "table_float":
        v["block_table"] = v["block_table"].astype(np.float64)
    elif c == "ptr_overflow":
        v["block_table_dev"] = 1 << 64
    elif c == "block_size":
        kw["block_size"] = 24
    elif c == "dummy":
        kw["dummy_kv_block"] = -1
    elif c == "mrope_flag":
        kw["use_mrope"] = "yes"
    streams = [] if c == "empty" else [StreamStageInfo(**i) for i in infos]
    return streams, kw, bufs


@SETTINGS
@given(spec=batches(), slack=st.integers(-256, 4096))
def test_stager_stages_and_decodes_back_or_refuses_cleanly(dev, spec, slack):
    streams, kw, bufs = build_streams(dev, spec)
    counts = [s["proc_count"] for s in spec["streams"]]
    n = len(counts)
    need = staged_bytes(n, sum(counts), spec["mrope"]) + 8 * n
    with ScratchArena(dev, max(64, 64 + need + slack)) as arena:
        arena.reserve("moe", 64)
        arena.read(0, 8)  # let the guard memset finish before the snapshot
        before = snapshot(dev, arena)
        try:
            meta = stage_batched_attn_metadata(arena, streams, scratch_offset_bytes=arena.cursor, **kw)
        except REFUSALS as exc:
            assert str(exc)
            if isinstance(exc, CapacityError):
                assert exc.needed > exc.available and exc.region in str(exc)
            assert_same(before, snapshot(dev, arena))
        else:
            assert spec["corruption"] is None, spec["corruption"]
            raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
            assert verify_readback(raw, meta, streams) == []
            assert arena.cursor == meta.scratch_offset_bytes + meta.staged_bytes
            try:
                slot = place_h_state_slot(arena, meta)
            except CapacityError as exc:  # the metadata fitted, its JIT slot does not: nothing reserved
                assert exc.region == "h_state_ptrs" and arena.cursor == meta.scratch_offset_bytes + meta.staged_bytes
            else:
                assert slot.offset == meta.scratch_offset_bytes + meta.staged_bytes == arena.cursor - 8 * n
            assert arena.guard_intact()
    for b in bufs:
        b.free()


# --- admission + a whole pass ---------------------------------------------------------------------

@SETTINGS
@given(spec=batches(), same_start=st.booleans(), mode=st.sampled_from(["auto", "batched", "per_stream"]),
       policy=st.sampled_from(["seed", "exact"]), top_k=st.integers(0, 12), slack=st.integers(-512, 1 << 14))
def test_a_pass_stages_its_batch_or_refuses_with_nothing_written(dev, spec, same_start, mode, policy, top_k, slack):
    streams, kw, bufs = build_streams(dev, spec)
    counts = [s["proc_count"] for s in spec["streams"]]
    chunks = [(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in streams] if same_start else None
    exact = make_scratch_plan([max(1, int(c)) for c in counts], top_k, spec["mrope"], "exact").total_bytes
    with ScratchArena(dev, max(64, exact + slack)) as arena:
        arena.read(0, 8)
        before = snapshot(dev, arena)
        try:
            q12 = Q12Pass(arena, streams, top_k=top_k, chunks=chunks, policy=policy, mode=mode, **kw)
        except REFUSALS as exc:
            assert str(exc)
            assert_same(before, snapshot(dev, arena))
        else:
            assert spec["corruption"] is None, spec["corruption"]
            assert (mode == "batched") <= q12.batched
            if q12.batched:
                assert q12.admission.rule is None and q12.plan.total_bytes <= arena.capacity
                raw = arena.read(q12.meta.scratch_offset_bytes, q12.meta.staged_bytes)
                assert verify_readback(raw, q12.meta, streams) == []
                assert q12.h_slot.offset == q12.meta.scratch_offset_bytes + q12.meta.staged_bytes
            else:
                assert q12.reason
                for b, meta in enumerate(q12.stream_meta):
                    raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
                    assert verify_readback(raw, meta, [streams[b]]) == []
            arena.check_consistent()
            assert arena.guard_intact()
    for b in bufs:
        b.free()


@SETTINGS
@given(tuples=st.lists(st.tuples(st.one_of(st.integers(0, 3000), weird), st.one_of(st.integers(0, 3000), weird),
                                 st.sampled_from([0, 16, 512]), st.booleans()), max_size=10),
       n_off=st.sampled_from([0, 0, 0, 1, -1]), arena_cap=st.integers(-1, 1 << 15), head_dim=st.sampled_from([64, 256, 512, -1]),
       scratch_cap=st.integers(-1, 1 << 20), top_k=st.integers(-1, 16), mrope=st.booleans(),
       chunk_zero=st.booleans(), varlen=st.booleans(), policy=st.sampled_from(["seed", "exact"]))
def test_admission_decides_or_names_the_malformed_argument(tuples, n_off, arena_cap, head_dim, scratch_cap, top_k,
                                                           mrope, chunk_zero, varlen, policy):
    try:
        a = check_kernel_batched_eligible(tuples, len(tuples) + n_off, arena_cap, False, head_dim, scratch_cap,
                                          top_k, mrope, chunk_zero, varlen, policy)
    except (TypeError, ValueError) as exc:
        assert str(exc)
        return
    assert n_off == 0
    if a:
        assert a.rule is None and a.reason == "" and a.plan.total_bytes == a.scratch_needed <= scratch_cap
        assert a.plan.first_unfit_stream() is None
        assert sum(t[1] for t in tuples) <= arena_cap
    else:
        assert a.rule in RULES and a.reason


# --- state tables: any rows stage and read back, or are refused with nothing written ------------------

@pytest.fixture(scope="module")
def three_streams(dev):
    from tests.helpers import make_streams

    streams, tables = make_streams(dev, [3, 1, 6], [0, 5, 2])
    yield streams
    tables.free()


entry = st.one_of(st.integers(1, 1 << 48).map(lambda p: p * 4), st.integers(-5, 1 << 65), weird)


@SETTINGS
@given(rows=st.one_of(st.lists(st.lists(entry, min_size=2, max_size=4), max_size=6),
                      st.lists(st.lists(st.integers(1, 1 << 40).map(lambda p: p * 16), min_size=3, max_size=3),
                               min_size=1, max_size=6)),
       as_array=st.booleans(), spare=st.integers(-24, 48))
def test_state_rows_stage_and_read_back_or_are_refused_with_nothing_written(dev, three_streams, rows, as_array, spare):
    """Any rows given to ``Q12Pass.stage_states`` (three streams; lists of ints of any size or type, or an integer
    array) are staged, each table reading back as given at its row's address, or refused with a named error and the
    arena, its rings and every buffer untouched."""
    n = len(three_streams)
    if as_array:
        try:
            rows = np.array(rows, np.int64)
        except (ValueError, TypeError, OverflowError):  # not an integer table: given as lists
            pass
    with ScratchArena(dev, max(64, Q12Pass.arena_bytes([3, 1, 6]) + spare)) as arena:
        try:
            q12 = Q12Pass(arena, three_streams, block_size=16, use_mrope=False, dummy_kv_block=0)  # or per stream
        except CapacityError:
            return  # the arena is too small for the pass itself
        before = snapshot(dev, arena)
        try:
            staged = q12.stage_states(rows)
        except REFUSALS as exc:
            event(f"refused: {type(exc).__name__}")
            assert str(exc)
            assert_same(before, snapshot(dev, arena))
        else:
            event("staged")
            assert len(staged) == len(rows) and all(len(r) == n for r in rows)
            for row, want in zip(staged, rows):
                got = np.frombuffer(arena.read(row.ptr - int(arena.base), 8 * n), np.uint64)
                assert got.tolist() == [int(p) for p in want] and row.dtype is None
            assert arena.cursor == before["arena"][0] + 8 * n * len(rows)


# --- the dump reader ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_dump(tmp_path_factory):
    """A small batched pass with MRoPE vision positions and an uploaded JIT slot, dumped with its ring."""
    from tests.reliability import World

    path = tmp_path_factory.mktemp("fuzz-dumps") / "good.npz"
    with open_device("emu") as d:
        w = World.build(d, run_layers=False)
        w.q12.h_slot.upload(w.state_ptrs())
        dump_pass(w.q12, path, num_blocks=w.num_blocks, include_ring=True)
        w.close()
    assert inspect_dump(path).ok
    return path


def read_everything(path) -> None:
    """Load ``path``; if it loads, inspect, format, diff and JSON it: only DumpError may escape."""
    try:
        d = load_dump(path)
    except DumpError as exc:
        assert str(exc).startswith(str(path))
        return
    report = inspect_dump(d)
    report.format()
    json.dumps(report.to_json())
    format_diff(diff_dumps(d, d))


def _tables(d):
    """The dump's block tables member (bytes), as write_dump takes it."""
    return None if d.block_tables is None else d.block_tables.view(np.uint8)


def _npz_members(path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _write_members(path, members: dict) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


@SETTINGS
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flipped_files_raise_only_dump_error(good_dump, tmp_path_factory, flips):
    raw = bytearray(good_dump.read_bytes())
    for where, bit in flips:
        raw[int(where * len(raw))] ^= 1 << bit
    p = tmp_path_factory.mktemp("flip") / "f.npz"
    p.write_bytes(bytes(raw))
    read_everything(p)


@SETTINGS
@given(where=st.floats(0, 1, exclude_max=True), stored=st.booleans())
def test_truncated_files_raise_only_dump_error(good_dump, tmp_path_factory, where, stored):
    src = good_dump
    if stored:  # an uncompressed archive: truncations land in member data, not only in deflate streams
        src = tmp_path_factory.mktemp("stored") / "stored.npz"
        _write_members(src, _npz_members(good_dump))
    raw = src.read_bytes()
    p = tmp_path_factory.mktemp("trunc") / "t.npz"
    p.write_bytes(raw[: int(where * len(raw))])
    read_everything(p)


@SETTINGS
@given(flips=st.lists(st.tuples(st.sampled_from(["header.npy", "arena.npy", "guard.npy", "ring.npy",
                                                 "block_tables.npy"]),
                                st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=6))
def test_member_bytes_flipped_behind_a_valid_zip_raise_only_dump_error(good_dump, tmp_path_factory, flips):
    # Flips inside the members, re-zipped with fresh CRCs: the reader sees well-formed zip entries
    # holding corrupted .npy headers, JSON and arena bytes.
    members = {k: bytearray(v) for k, v in _npz_members(good_dump).items()}
    for name, where, bit in flips:
        data = members[name]
        data[int(where * len(data))] ^= 1 << bit
    p = tmp_path_factory.mktemp("member") / "m.npz"
    _write_members(p, {k: bytes(v) for k, v in members.items()})
    read_everything(p)


def _paths(obj, prefix=()):
    """Every path into a JSON object (dict keys and list indices)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from _paths(v, prefix + (i,))


json_values = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.integers(-3, 300),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
                        st.lists(st.integers(-2, 10), max_size=4), st.just({}), st.just([]),
                        st.just([[0]]), st.just({"name": 1}))


@SETTINGS
@given(data=st.data())
def test_header_edits_raise_only_dump_error(good_dump, tmp_path_factory, data):
    d = load_dump(good_dump)
    header = copy.deepcopy(d.header)
    paths = [p for p in _paths(header) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = header
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = data.draw(st.sampled_from(["set", "set", "set", "delete", "nudge"]))
            if action == "delete" and isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif action == "nudge" and isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
                parent[path[-1]] += data.draw(st.sampled_from([-8, -1, 1, 8, 1 << 32]))
            else:
                parent[path[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced part of the path
    p = tmp_path_factory.mktemp("hdr") / "h.npz"
    write_dump(p, header, d.arena, d.guard, d.ring, _tables(d))
    read_everything(p)


@SETTINGS
@given(arena_len=st.integers(-64, 64), guard_len=st.integers(-8, 8), ring=st.sampled_from(["keep", "drop", "short"]),
       poison=st.integers(0, 255), where=st.floats(0, 1, exclude_max=True))
def test_member_edits_raise_only_dump_error(good_dump, tmp_path_factory, arena_len, guard_len, ring, poison, where):
    d = load_dump(good_dump)
    arena = d.arena.copy()
    if arena_len >= 0:
        arena = np.concatenate([arena, np.full(arena_len, poison, np.uint8)])
    else:
        arena = arena[:arena_len]
    if arena.size:
        arena[int(where * arena.size)] = poison
    guard = d.guard[: max(0, d.guard.size + guard_len)] if guard_len < 0 else np.concatenate(
        [d.guard, np.full(guard_len, poison, np.uint8)])
    r = {"keep": d.ring, "drop": None, "short": None if d.ring is None else d.ring[: d.ring.size // 2]}[ring]
    t = {"keep": _tables(d), "drop": None, "short": _tables(d)[: _tables(d).size // 2 + 1]}[ring]
    p = tmp_path_factory.mktemp("mem") / "e.npz"
    write_dump(p, copy.deepcopy(d.header), arena, guard, r, t)
    read_everything(p)


def test_fuzzed_dumps_through_the_cli(good_dump, tmp_path, capsys):
    # A handful of corruptions through `q12drv inspect`: exit 0/1/2, never a traceback.
    raw = bytearray(good_dump.read_bytes())
    rng = np.random.default_rng(7)
    for i in range(12):
        bad = bytearray(raw)
        for _ in range(i % 4 + 1):
            bad[int(rng.integers(len(bad)))] ^= 1 << int(rng.integers(8))
        p = tmp_path / f"c{i}.npz"
        p.write_bytes(bytes(bad[: len(bad) - (i * 37 if i % 3 == 0 else 0)]))
        rc = cli_main(["inspect", str(p)])
        err = capsys.readouterr().err
        assert rc in (0, 1, 2) and "Traceback" not in err


def test_read_everything_lets_other_exceptions_through(good_dump, monkeypatch):
    # The fuzz tests can fail: an exception other than DumpError from the reader propagates.
    import q12drv.tools.dump as dump_mod

    monkeypatch.setattr(dump_mod, "_parse_header", lambda path, raw: {}["boom"])
    with pytest.raises(KeyError):
        read_everything(good_dump)


def test_npy_members_with_hostile_headers(good_dump, tmp_path):
    # .npy headers claiming object dtypes, fortran order, huge or negative shapes, or garbage.
    members = _npz_members(good_dump)
    hostile = [
        b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (4,), }" + b" " * 49 + b"\n",
        b"\x93NUMPY\x01\x00v\x00{'descr': '|u1', 'fortran_order': True, 'shape': (-4,), }" + b" " * 48 + b"\n",
        b"\x93NUMPY\x01\x00v\x00{'descr': '<u8', 'fortran_order': False, 'shape': (1, 2), }" + b" " * 46 + b"\n",
        b"\x93NUMPY\x09\x00v\x00garbage",
        b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 100,
        b"",
    ]
    for i, h in enumerate(hostile):
        for name in ("header.npy", "arena.npy"):
            m = dict(members)
            m[name] = h + b"\x00" * 16
            p = tmp_path / f"h{i}-{name}.npz"
            _write_members(p, m)
            with pytest.raises(DumpError):
                load_dump(p)
