"""The prefill step on the emulated driver: batched == per stream, fallback with a reason, capacity."""

import contextlib

import numpy as np
import pytest

from q12drv import CapacityError, ScratchArena, make_scratch_plan
from q12drv.core.bf16 import to_bf16_bits
from q12drv.kernels import gdn_chunk, gdn_wgmma
from q12drv.prefill import AttentionShape, GdnShape, Q12Pass
from tests.helpers import make_streams

SHAPE = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, rope_theta=1e4)
GSHAPE = GdnShape(num_k_heads=2, num_v_heads=4, head_dim=64)


def run(dev, arena, streams, host, mode, chunks=None, num_blocks=None):
    bufs = {k: dev.alloc(v.nbytes, k) for k, v in host.items()}
    for k, v in host.items():
        dev.upload(bufs[k].ptr, v)
    p = {k: int(b.ptr) for k, b in bufs.items()}
    q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4, head_dim=64,
                  chunks=chunks, mode=mode)
    q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
    n = len(streams)
    q12.gdn_layer([p["st"] + b * host["st"][0].nbytes for b in range(n)], p["gq"], p["gk"], p["gv"], p["g"],
                  p["beta"], p["go"], GSHAPE)
    out = {k: dev.download(bufs[k].ptr, bufs[k].nbytes) for k in ("o", "kp", "vp", "go", "st", "q", "k")}
    for b in bufs.values():
        b.free()
    return q12, out


def inputs(rng, counts, num_blocks):
    t, n = sum(counts), len(counts)
    bf = lambda *s: to_bf16_bits(rng.standard_normal(s))  # noqa: E731
    return {"q": bf(t, 4, 64), "k": bf(t, 2, 64), "v": bf(t, 2, 64), "kp": bf(num_blocks, 16, 2, 64),
            "vp": bf(num_blocks, 16, 2, 64), "o": np.full((t, 4, 64), 0xFFFF, np.uint16),
            "gq": bf(t, 2, 64), "gk": bf(t, 2, 64), "gv": bf(t, 4, 64),
            "g": (-rng.random((t, 4)) * 0.3).astype(np.float32), "beta": rng.random((t, 4)).astype(np.float32),
            "go": np.full((t, 4, 64), 0xFFFF, np.uint16), "st": (rng.standard_normal((n, 4, 64, 64)) * 0.1).astype(np.float32)}


def test_batched_equals_per_stream_and_refusal_falls_back(emu):
    rng = np.random.default_rng(1)
    counts, starts = [1, 17, 40, 3], [0, 5, 16, 100]
    streams, _ = make_streams(emu, counts, starts, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    host = inputs(rng, counts, num_blocks)
    chunks = [(s + c, c, 0, False) for s, c in zip(starts, counts)]
    with ScratchArena(emu, make_scratch_plan(counts, 4, False).total_bytes) as arena:
        batched, a = run(emu, arena, streams, host, "auto", chunks, num_blocks)
        assert batched.mode == "batched" and batched.reason == ""
        # the same batch refused (chunk starts differ) runs per stream and says why
        refused, b = run(emu, arena, streams, host, "auto", None, num_blocks)
        assert refused.mode == "per_stream" and "chunk_start_mismatch" in refused.reason
        assert a == b
        assert not np.any(np.frombuffer(a["o"], np.uint16) == 0xFFFF)
        with pytest.raises(ValueError, match="refused"):
            run(emu, arena, streams, host, "batched", None, num_blocks)


def test_per_stream_path_uses_each_streams_own_block(emu):
    streams, _ = make_streams(emu, [300, 20], [0, 0])
    with ScratchArena(emu, 1 << 18) as arena:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0, top_k=4, mode="per_stream")
        assert [m.batch_size for m in q12.stream_meta] == [1, 1]
        assert [r.name for r in arena.regions][-1] == "h_state_ptrs"
        assert q12.stream_meta[1].scratch_offset_bytes == q12.plan.stream_blocks[1].offset


def test_arena_too_small_even_per_stream(emu):
    streams, _ = make_streams(emu, [300, 20])
    with ScratchArena(emu, 4096) as arena:
        with pytest.raises(CapacityError, match="per-stream"):
            Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)


def test_attention_refuses_a_missing_block_below_kv_len(emu):
    from q12drv import StreamStageInfo

    rng = np.random.default_rng(2)
    streams, _ = make_streams(emu, [20, 30], rng=rng)
    table = streams[1].block_table.copy()
    table[0] = -1
    streams[1] = StreamStageInfo(0, 30, table, streams[1].block_table_dev, streams[1].seq_len_dev)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    host = inputs(rng, [20, 30], num_blocks)
    with ScratchArena(emu, 1 << 18) as arena:
        with pytest.raises(ValueError, match="negative"):
            run(emu, arena, streams, host, "auto", None, num_blocks)


def test_expand_device_and_host_stage_the_same_bytes(emu):
    rng = np.random.default_rng(3)
    counts, starts = [1, 17, 40, 3], [0, 5, 16, 100]
    streams, _ = make_streams(emu, counts, starts, rng=rng)
    plan = make_scratch_plan(counts, 4, True)
    images = {}
    with ScratchArena(emu, plan.total_bytes) as arena:
        for expand in ("host", "device", "auto"):
            q12 = Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0, top_k=4, expand=expand,
                          chunks=[(s + c, c, 0, False) for s, c in zip(starts, counts)])
            assert q12.expand == ("device" if expand == "auto" else expand)
            emu.synchronize()
            images[expand] = arena.read(q12.meta.scratch_offset_bytes, q12.meta.staged_bytes)
        assert images["host"] == images["device"] == images["auto"]
        per_stream = Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0, top_k=4,
                             mode="per_stream", expand="device")
        assert per_stream.expand == ""  # the fallback packs each stream's block on the host


def test_expand_device_refuses_vision_positions_and_auto_packs_them_on_the_host(emu):
    streams, _ = make_streams(emu, [5, 9], mrope_vision=(1,))
    with ScratchArena(emu, 1 << 16) as arena:
        before = (arena.cursor, arena.generation)
        with pytest.raises(ValueError, match=r"streams\[1\] carries mrope_positions"):
            Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0, expand="device")
        assert (arena.cursor, arena.generation) == before  # refused before the arena was touched
        assert Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0).expand == "host"
        with pytest.raises(ValueError, match="expand must be one of"):
            Q12Pass(arena, streams, block_size=16, use_mrope=True, dummy_kv_block=0, expand="gpu")


@contextlib.contextmanager
def two_streams(emu, seed):
    """Two streams (5 and 9 tokens), their inputs uploaded, an arena planned for them."""
    rng = np.random.default_rng(seed)
    counts = [5, 9]
    streams, _ = make_streams(emu, counts, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    host = inputs(rng, counts, num_blocks)
    with ScratchArena(emu, make_scratch_plan(counts, 4, False).total_bytes) as arena:
        bufs = {k: emu.alloc(v.nbytes, k) for k, v in host.items()}
        try:
            for k, v in host.items():
                emu.upload(bufs[k].ptr, v)
            yield arena, streams, host, {k: int(b.ptr) for k, b in bufs.items()}, num_blocks
        finally:
            emu.synchronize()
            for b in bufs.values():
                b.free()


def test_layer_shape_checks_are_remembered_only_for_immutable_shapes_that_passed(emu):
    from q12drv.prefill import q12pass as prefill

    with two_streams(emu, 4) as (arena, streams, host, p, num_blocks):
        bad = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=96, rotary_dim=32)
        listy = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, mrope_section=[0, 0, 0])
        args = (p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"])
        for _ in range(2):  # a refused shape is refused every time
            q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
            with pytest.raises(ValueError, match="head_dim"):
                q12.attention_layer(*args, bad, num_blocks=num_blocks)
            q12.attention_layer(*args, listy, num_blocks=num_blocks)
        assert all(v is not bad and v is not listy for v in prefill._SHAPES_OK.values())
        run(emu, arena, streams, host, "auto", None, num_blocks)
        assert any(v is SHAPE for v in prefill._SHAPES_OK.values()) and any(v is GSHAPE for v in prefill._SHAPES_OK.values())


@pytest.mark.parametrize("ws_algo", ["split", "wgmma"])
def test_gdn_layer_algo_is_checked_before_anything_is_enqueued(emu, ws_algo):
    with two_streams(emu, 5) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        args = (states, p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"], GSHAPE)
        with pytest.raises(ValueError, match="algo must be one of"):
            q12.gdn_layer(*args, algo="wy")
        assert q12.h_slot.uploads == 0  # refused before the slot was rewritten
        for algo in ("chunked", "recurrent"):
            q12.gdn_layer(*args, algo=algo)
        assert q12.h_slot.uploads == 2
        need = q12.gdn_workspace_bytes(GSHAPE, ws_algo)
        sizer = gdn_chunk.workspace_bytes if ws_algo == "split" else gdn_wgmma.workspace_bytes
        assert need == sizer(2, q12.meta.chunk_len, GSHAPE.num_k_heads, GSHAPE.num_v_heads, GSHAPE.head_dim) > 0
        assert q12.gdn_workspace_bytes(GSHAPE, "chunked") == 0
        ws = emu.alloc(need, "gdn workspace")
        try:
            for kw, msg in (({}, f"needs workspace= .* {need:,} bytes"),
                            (dict(workspace=int(ws.ptr), workspace_bytes=need - 1), f"too small: .* needs {need:,}"),
                            (dict(workspace=int(ws.ptr) + 8, workspace_bytes=need), "workspace must be 16-byte aligned"),
                            (dict(workspace=0, workspace_bytes=need), "workspace must be a non-NULL")):
                with pytest.raises(ValueError, match=msg):
                    q12.gdn_layer(*args, algo=ws_algo, **kw)
            assert q12.h_slot.uploads == 2  # every refusal before the slot was rewritten
            q12.gdn_layer(*args, algo=ws_algo, workspace=int(ws.ptr), workspace_bytes=need)
            assert q12.h_slot.uploads == 3
        finally:
            emu.synchronize()
            ws.free()


def test_gdn_layer_form_is_checked_and_every_form_gives_the_same_result(emu):
    """form= of the wgmma pair: a bad form, or a form for an algorithm with one, is refused before the slot is
    rewritten; "pair", "flow" and "auto" all give the reference's result (the emulators check the flow form's
    flags: its sequential kernel refuses to run before its precompute released them)."""
    with two_streams(emu, 7) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        args = (states, p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"], GSHAPE)
        need = q12.gdn_workspace_bytes(GSHAPE, "wgmma")
        ws = emu.alloc(need, "gdn workspace")
        try:
            kw = dict(workspace=int(ws.ptr), workspace_bytes=need)
            for algo, form, msg in (("wgmma", "fused", "form must be one of"), ("split", "flow", "has one form"),
                                    ("wgmma", "wide", "head_dim 128 only")):
                with pytest.raises(ValueError, match=msg):
                    q12.gdn_layer(*args, algo=algo, form=form, **kw)
            assert q12.h_slot.uploads == 0
            results, launched = [], []
            drv = emu.driver
            real_launch = drv.launch
            drv.launch = lambda func, *a: (launched.append(func.name), real_launch(func, *a))[1]
            try:
                for form in ("auto", "pair", "flow"):
                    for b, s0 in enumerate(host["st"]):  # every form from the same initial states
                        emu.upload(states[b], s0)
                    launched.clear()
                    q12.gdn_layer(*args, algo="wgmma", form=form, **kw)
                    emu.synchronize()
                    results.append((emu.download(p["go"], host["go"].nbytes),
                                    [emu.download(st, host["st"][0].nbytes) for st in states],
                                    tuple(launched)))
            finally:
                drv.launch = real_launch
            pair = tuple(gdn_wgmma.entries(GSHAPE.head_dim, 2))
            assert [r[2] for r in results] == [pair, pair, gdn_wgmma.flow_entries(GSHAPE.head_dim)]  # short streams
            assert results[0][:2] == results[1][:2] == results[2][:2]
        finally:
            emu.synchronize()
            ws.free()


def test_gdn_layer_refuses_wgmma_off_hopper(emu, monkeypatch):
    """algo='wgmma' needs sm_90: elsewhere it is refused, naming the device's architecture, before the slot is
    rewritten."""
    with two_streams(emu, 5) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        monkeypatch.setattr(emu, "arch", "sm_80")
        need = q12.gdn_workspace_bytes(GSHAPE, "wgmma")
        with pytest.raises(ValueError, match="Hopper .* this device is sm_80: use algo='split'"):
            q12.gdn_layer(states, p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"], GSHAPE, algo="wgmma",
                          workspace=int(p["st"]), workspace_bytes=need)
        assert q12.h_slot.uploads == 0


def test_gdn_layer_takes_state_pointers_as_a_numpy_array_too(emu):
    with two_streams(emu, 6) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        rest = (p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"], GSHAPE)
        for ptrs in (states, np.array(states, np.uint64)):  # the bulk path and the per-entry path
            q12.gdn_layer(ptrs, *rest)
            emu.synchronize()
            assert np.frombuffer(arena.read(q12.h_slot.offset, 16), np.uint64).tolist() == states


def test_attention_layer_algo_is_checked_before_anything_is_enqueued(emu):
    with two_streams(emu, 6) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        args = (p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE)
        with pytest.raises(ValueError, match="attention algo must be one of"):
            q12.attention_layer(*args, num_blocks=num_blocks, algo="flash")
        with pytest.raises(ValueError, match="no wgmma attention kernel for head_dim=64"):
            q12.attention_layer(*args, num_blocks=num_blocks, algo="wgmma")
        emu.synchronize()
        for name in ("q", "k", "o", "kp"):  # no RoPE, no KV write, no attention ran
            assert emu.download(p[name], host[name].nbytes) == host[name].tobytes(), name
