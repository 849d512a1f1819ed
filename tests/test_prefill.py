"""The prefill step on the emulated driver: batched == per stream, fallback with a reason, capacity."""

import contextlib

import numpy as np
import pytest

from q12drv import CapacityError, Q12Error, ScratchArena, make_scratch_plan
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels.gdn import GdnPlan, chunked_mma, chunked_wgmma
from q12drv.prefill import AttentionShape, GdnConfig, GdnShape, GdnTensors, Q12Pass
from tests.helpers import make_streams

SHAPE = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, rope_theta=1e4)
GSHAPE = GdnShape(num_k_heads=2, num_v_heads=4, head_dim=64)
FUSED = GdnConfig(schedule="fused")


def gdn_tensors(p) -> GdnTensors:
    return GdnTensors(p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"])


def run(dev, arena, streams, host, mode, chunks=None, num_blocks=None, policy="exact"):
    bufs = {k: dev.alloc(v.nbytes, k) for k, v in host.items()}
    for k, v in host.items():
        dev.upload(bufs[k].ptr, v)
    p = {k: int(b.ptr) for k, b in bufs.items()}
    q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4, head_dim=64,
                  chunks=chunks, mode=mode, policy=policy)
    q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
    n = len(streams)
    need = q12.gdn_workspace_bytes(GSHAPE)  # the default config: the device's fastest path, with its workspace
    ws = dev.alloc(max(need, 16), "gdn workspace")
    q12.gdn_layer([p["st"] + b * host["st"][0].nbytes for b in range(n)], gdn_tensors(p), GSHAPE,
                  workspace=int(ws.ptr), workspace_bytes=need)
    out = {k: dev.download(bufs[k].ptr, bufs[k].nbytes) for k in ("o", "kp", "vp", "go", "st", "q", "k")}
    for b in (*bufs.values(), ws):
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
        batched, a = run(emu, arena, streams, host, "auto", chunks, num_blocks, policy="seed")
        assert batched.mode == "batched" and batched.reason == ""
        # the same batch under the seed policy (chunk starts differ) runs per stream and says why
        refused, b = run(emu, arena, streams, host, "auto", None, num_blocks, policy="seed")
        assert refused.mode == "per_stream" and "chunk_start_mismatch" in refused.reason
        assert a == b
        assert not np.any(np.frombuffer(a["o"], np.uint16) == 0xFFFF)
        with pytest.raises(ValueError, match="refused"):
            run(emu, arena, streams, host, "batched", None, num_blocks, policy="seed")
        # the exact policy (the pass's default) batches the streams at their own offsets: the same bits
        mixed, c = run(emu, arena, streams, host, "auto", None, num_blocks)
        assert mixed.mode == "batched" and c == a


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


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_check_block_tables_finds_a_device_table_that_differs_from_the_host_one(emu, mode):
    streams, _ = make_streams(emu, [40, 7, 19], [0, 32, 5])
    with ScratchArena(emu, 1 << 18) as arena:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode=mode)
        q12.check_block_tables()  # as uploaded
        s = streams[1]
        emu.upload(s.block_table_dev + 4 * 2, np.array([s.block_table[2] + 1], np.int32))
        with pytest.raises(ValueError, match=rf"streams\[1\]: block_table_dev\[2\] is {s.block_table[2] + 1} but "
                                             rf"block_table\[2\] is {s.block_table[2]} \(1 of the 3 blocks"):
            q12.check_block_tables()


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


WORKSPACE_CONFIGS = {"mma two_pass": GdnConfig(schedule="two_pass", isa="mma"), "default": GdnConfig(),
                     "overlapped": GdnConfig(schedule="overlapped")}


@pytest.mark.parametrize("name", list(WORKSPACE_CONFIGS))
def test_gdn_layer_config_and_workspace_are_checked_before_anything_is_enqueued(emu, name):
    config = WORKSPACE_CONFIGS[name]
    with two_streams(emu, 5) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        args = (states, gdn_tensors(p), GSHAPE)
        for bad, exc, msg in (("wy", TypeError, "expected a GdnConfig or a GdnPlan"),
                              (GdnConfig(math="recurrent", isa="mma"), ValueError, "has no kernel")):
            with pytest.raises(exc, match=msg):
                q12.gdn_layer(*args, config=bad)
        assert q12.h_slot.uploads == 0  # refused before the slot was rewritten
        for cfg in (FUSED, GdnConfig(math="recurrent")):
            q12.gdn_layer(*args, config=cfg)
            assert q12.gdn_workspace_bytes(GSHAPE, cfg) == 0
        assert q12.h_slot.uploads == 2
        need = q12.gdn_workspace_bytes(GSHAPE, config)
        plan = q12.gdn_plan(GSHAPE, config)
        sizer = {("two_pass", "mma"): lambda: chunked_mma.mma_workspace_bytes(2, 9, 2, 4, 64),
                 ("two_pass", "wgmma"): lambda: chunked_mma.t_workspace_bytes(2, 9, 2, 4),
                 ("overlapped", "wgmma"): lambda: chunked_wgmma.overlapped_workspace_bytes(2, 9, 2, 4, 64)}
        assert need == plan.workspace_bytes == sizer[(plan.schedule, plan.isa)]() > 0
        ws = emu.alloc(need, "gdn workspace")
        try:
            for kw, msg in (({}, f"needs workspace= .* of {need:,} bytes .* GdnConfig\\(schedule='fused'\\) runs "
                                 f"without one"),
                            (dict(workspace=int(ws.ptr), workspace_bytes=need - 1), f"too small: .* needs {need:,}"),
                            (dict(workspace=int(ws.ptr) + 8, workspace_bytes=need), "workspace must be 16-byte aligned"),
                            (dict(workspace=0, workspace_bytes=need), "workspace must be a non-NULL")):
                with pytest.raises(ValueError, match=msg):
                    q12.gdn_layer(*args, config=config, **kw)
            assert q12.h_slot.uploads == 2  # every refusal before the slot was rewritten
            q12.gdn_layer(*args, config=config, workspace=int(ws.ptr), workspace_bytes=need)
            assert q12.h_slot.uploads == 3
        finally:
            emu.synchronize()
            ws.free()


def _launched(emu, run) -> list:
    """The entries ``run()`` launches on the emulated driver, in order (a dependent launch is a launch there)."""
    launched = []
    drv = emu.driver
    real_launch = drv.launch
    drv.launch = lambda func, *a: (launched.append(func.name), real_launch(func, *a))[1]
    try:
        run()
        emu.synchronize()
    finally:
        drv.launch = real_launch
    return launched


def test_gdn_layer_every_config_gives_the_same_result_and_runs_its_plan(emu):
    """Every config with a kernel gives the reference's result on the emulator (the overlapped schedule's emulators
    check its flags: its sequential kernel refuses to run before its precompute completed them), and a pass launches
    exactly its plan's kernels, batched and per stream."""
    configs = [FUSED, GdnConfig(math="recurrent"), GdnConfig(schedule="two_pass", isa="mma"),
               GdnConfig(schedule="two_pass", isa="wgmma"), GdnConfig(schedule="overlapped"), GdnConfig()]
    with two_streams(emu, 7) as (arena, streams, host, p, num_blocks):
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        need = max(Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0,
                           top_k=4).gdn_workspace_bytes(GSHAPE, c) for c in configs)
        ws = emu.alloc(need, "gdn workspace")
        results = []
        try:
            for mode in ("batched", "per_stream"):
                for config in configs:
                    q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4,
                                  mode=mode)
                    for b, s0 in enumerate(host["st"]):  # every config from the same initial states
                        emu.upload(states[b], s0)
                    launched = _launched(emu, lambda: q12.gdn_layer(states, gdn_tensors(p), GSHAPE, config=config,
                                                                    workspace=int(ws.ptr), workspace_bytes=need))
                    plan = q12.gdn_plan(GSHAPE, config)
                    assert launched == [k.entry for k in plan.kernels] * (1 if mode == "batched" else 2), (mode, config)
                    results.append((emu.download(p["go"], host["go"].nbytes),
                                    [emu.download(st, host["st"][0].nbytes) for st in states]))
            assert all(r == results[0] for r in results)
        finally:
            emu.synchronize()
            ws.free()


def test_gdn_layer_refuses_wgmma_off_hopper(emu, monkeypatch):
    """isa='wgmma' needs sm_90: elsewhere it is refused, naming the device's architecture, before the slot is
    rewritten; the default there is the mma two-pass schedule."""
    with two_streams(emu, 5) as (arena, streams, host, p, num_blocks):
        monkeypatch.setattr(emu, "arch", "sm_80")
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        for config in (GdnConfig(isa="wgmma"), GdnConfig(schedule="overlapped")):
            with pytest.raises(ValueError, match=r"needs warpgroup MMA \(Hopper, sm_90\), this device is sm_80: use "
                                                 r"isa='mma'"):
                q12.gdn_layer(states, gdn_tensors(p), GSHAPE, config=config, workspace=int(p["st"]),
                              workspace_bytes=1 << 20)
        assert q12.h_slot.uploads == 0
        plan = q12.gdn_plan(GSHAPE)
        assert (plan.schedule, plan.isa) == ("two_pass", "mma")


def test_gdn_layer_takes_a_plan_that_covers_the_pass(emu):
    """A plan made for at least the pass (its streams, its longest stream, this shape, this architecture) runs as
    is; a smaller one, or one of another shape, is refused before the slot is rewritten."""
    with two_streams(emu, 8) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        from q12drv.kernels.gdn import plan_gdn

        big = plan_gdn(FUSED, GSHAPE, 4, 64, emu)
        assert isinstance(big, GdnPlan) and q12.gdn_workspace_bytes(GSHAPE, big) == 0
        for plan, msg in ((plan_gdn(FUSED, GSHAPE, 1, 64, emu), r"covers 1 stream\(s\) of at most 64 tokens"),
                          (plan_gdn(FUSED, GSHAPE, 2, 8, emu), r"at most 8 tokens, this launch has 2 of up to 9"),
                          (plan_gdn(FUSED, GdnShape(1, 4, 64), 2, 9, emu), "the plan was made for")):
            with pytest.raises(ValueError, match=msg):
                q12.gdn_layer(states, gdn_tensors(p), GSHAPE, config=plan)
        assert q12.h_slot.uploads == 0
        q12.gdn_layer(states, gdn_tensors(p), GSHAPE, config=big)
        assert q12.h_slot.uploads == 1


def test_gdn_layer_takes_state_pointers_as_a_numpy_array_too(emu):
    with two_streams(emu, 6) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        states = [p["st"] + b * host["st"][0].nbytes for b in range(2)]
        for ptrs in (states, np.array(states, np.uint64)):  # the bulk path and the per-entry path
            q12.gdn_layer(ptrs, gdn_tensors(p), GSHAPE, config=FUSED)
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


# --- each layer op alone, with the batched / per-stream decision made by the pass ---------------------

def test_the_ops_alone_equal_the_layer_batched_and_per_stream(emu):
    rng = np.random.default_rng(7)
    counts, starts = [5, 33, 1, 17], [0, 40, 7, 100]
    streams, _keep = make_streams(emu, counts, starts, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    host = inputs(rng, counts, num_blocks)
    results = {}
    with ScratchArena(emu, 1 << 18) as arena:
        for mode in ("batched", "per_stream"):
            for how in ("layer", "ops"):
                bufs = {k: emu.alloc(v.nbytes, k) for k, v in host.items()}
                for key, val in host.items():
                    emu.upload(bufs[key].ptr, val)
                p = {key: int(b.ptr) for key, b in bufs.items()}
                q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64,
                              mode=mode)
                if how == "layer":
                    q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
                else:  # a runtime with its own steps between them calls each op alone
                    q12.rope(p["q"], p["k"], SHAPE)
                    q12.kv_write(p["k"], p["v"], p["kp"], p["vp"], SHAPE, num_blocks=num_blocks)
                    q12.attention(p["q"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
                results[mode, how] = {k: emu.download(bufs[k].ptr, bufs[k].nbytes) for k in ("o", "kp", "vp", "q")}
                for b in bufs.values():
                    b.free()
    first = results["batched", "layer"]
    assert all(r == first for r in results.values())
    assert not np.any(np.frombuffer(first["o"], np.uint16) == 0xFFFF)


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_layers_of_one_pass_each_read_and_write_their_own_buffers(emu, mode):
    """A runtime's step: one pass, every layer's own activations and pools (the ops' launches are made on a shape's
    first layer and then only take each layer's pointers); each layer equals that layer run alone in a pass of its
    own, and the GDN layers likewise (their own tensors and states, one workspace)."""
    rng = np.random.default_rng(11)
    counts, starts = [5, 33, 1, 17], [0, 40, 7, 100]
    streams, _keep = make_streams(emu, counts, starts, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    layers = [inputs(rng, counts, num_blocks) for _ in range(3)]
    n = len(counts)
    config = GdnConfig(schedule="two_pass", isa="mma")

    def step(arena, which: list) -> list:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64, mode=mode)
        need = q12.gdn_workspace_bytes(GSHAPE, config)
        ws = emu.alloc(need, "gdn workspace")
        out = []
        for i in which:
            host = layers[i]
            bufs = {k: emu.alloc(v.nbytes, k) for k, v in host.items()}
            for k, v in host.items():
                emu.upload(bufs[k].ptr, v)
            p = {k: int(b.ptr) for k, b in bufs.items()}
            if i == 1:  # the ops alone in the middle layer
                q12.rope(p["q"], p["k"], SHAPE)
                q12.kv_write(p["k"], p["v"], p["kp"], p["vp"], SHAPE, num_blocks=num_blocks)
                q12.attention(p["q"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
            else:
                q12.attention_layer(p["q"], p["k"], p["v"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
            q12.gdn_layer([p["st"] + b * host["st"][0].nbytes for b in range(n)], gdn_tensors(p), GSHAPE,
                          config=config, workspace=int(ws.ptr), workspace_bytes=need)
            out.append({k: emu.download(bufs[k].ptr, bufs[k].nbytes) for k in ("o", "kp", "vp", "q", "go", "st")})
            for b in bufs.values():
                b.free()
        ws.free()
        return out

    with ScratchArena(emu, 1 << 18) as arena:
        together = step(arena, [0, 1, 2])
        alone = [step(arena, [i])[0] for i in range(3)]
    assert together == alone
    assert together[0]["o"] != together[2]["o"] and together[0]["go"] != together[2]["go"]


def test_a_gdn_layer_checks_a_workspace_that_differs_from_the_last_layers(emu):
    from q12drv.kernels import registry

    config = GdnConfig(schedule="overlapped")  # a workspace, and a range of it zeroed before the launches
    with two_streams(emu, 5) as (arena, streams, host, p, num_blocks):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, top_k=4)
        args = ([p["st"] + b * host["st"][0].nbytes for b in range(2)], gdn_tensors(p), GSHAPE)
        need = q12.gdn_workspace_bytes(GSHAPE, config)
        ws = emu.alloc(2 * need + 16, "gdn workspace")
        try:
            q12.gdn_layer(*args, config=config, workspace=int(ws.ptr), workspace_bytes=need)
            with pytest.raises(ValueError, match=f"too small: .* needs {need:,}"):
                q12.gdn_layer(*args, config=config, workspace=int(ws.ptr), workspace_bytes=need - 1)
            with pytest.raises(ValueError, match="workspace must be 16-byte aligned"):
                q12.gdn_layer(*args, config=config, workspace=int(ws.ptr) + 8, workspace_bytes=need)
            with pytest.raises(ValueError, match="needs workspace="):
                q12.gdn_layer(*args, config=config)
            launched = []
            real = emu.driver.memset_d8_async
            emu.driver.memset_d8_async = lambda dst, *a: (launched.append(dst), real(dst, *a))[1]
            try:
                zero, kernels = q12.gdn_plan(GSHAPE, config).launches(2, 9)
                for ws_ptr in (int(ws.ptr) + need + 16 - (int(ws.ptr) + need) % 16, int(ws.ptr)):
                    q12.gdn_layer(*args, config=config, workspace=ws_ptr, workspace_bytes=need)
                    assert launched[-1] == ws_ptr + zero[0]  # the plan's launches use this workspace
                    assert all(registry.prepared(emu, k.entry).args.workspace == ws_ptr for k in kernels)
            finally:
                emu.driver.memset_d8_async = real
            assert q12.h_slot.uploads == 3  # the refused layers wrote nothing
        finally:
            emu.synchronize()
            ws.free()


def test_a_pass_resolves_a_foreign_stream_once_and_refuses_a_destroyed_one(emu):
    with two_streams(emu, 6) as (arena, streams, host, p, num_blocks):
        other = emu.new_stream()

        class TorchLike:  # a framework's stream: resolved through Device.as_stream
            cuda_stream = other.handle

        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64)
        resolved, as_stream = [], emu.as_stream
        emu.as_stream = lambda s=None: (resolved.append(s), as_stream(s))[1]
        try:
            torch_like = TorchLike()
            for st, times in ((torch_like, 1), (other.handle, 2), (other, 2), (None, 2)):
                q12.stream = st
                for _ in range(3):
                    q12.attention(p["q"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
                assert sum(1 for s in resolved if s is not None and not isinstance(s, type(other))) == times
            other.synchronize()
            q12.stream = other
            other.destroy()
            with pytest.raises(ValueError, match="destroyed"):
                q12.attention(p["q"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=num_blocks)
        finally:
            emu.as_stream = as_stream


def test_the_pass_runs_the_short_convolution_through_its_pointer_slot(emu):
    from q12drv.kernels import conv1d as conv

    rng = np.random.default_rng(8)
    counts, starts = [9, 1, 40], [3, 0, 64]
    c, width = 24, 4
    streams, _keep = make_streams(emu, counts, starts, rng=rng)
    x = to_bf16_bits(rng.standard_normal((sum(counts), c)))
    w = to_bf16_bits(rng.standard_normal((c, width)) * 0.5)
    s0 = [to_bf16_bits(rng.standard_normal((width - 1, c))) for _ in counts]
    outs = {}
    with ScratchArena(emu, 1 << 18) as arena:
        for mode in ("batched", "per_stream"):
            xb, yb, wb = emu.alloc(x.nbytes), emu.alloc(x.nbytes), emu.alloc(w.nbytes)
            sb = [emu.alloc(s.nbytes) for s in s0]
            emu.upload(xb.ptr, x)
            emu.upload(wb.ptr, w)
            for b, s in zip(sb, s0):
                emu.upload(b.ptr, s)
            q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode=mode)
            q12.conv1d([int(b.ptr) for b in sb], int(xb.ptr), int(yb.ptr), int(wb.ptr), channels=c, width=width)
            outs[mode] = (emu.download(yb.ptr, x.nbytes), [emu.download(b.ptr, s0[0].nbytes) for b in sb])
            with pytest.raises(ValueError, match="state_ptrs needs exactly 3 pointers"):
                q12.conv1d([int(sb[0].ptr)], int(xb.ptr), int(yb.ptr), int(wb.ptr), channels=c, width=width)
            with pytest.raises(TypeError, match="width is needed when w is a raw address"):
                q12.conv1d([int(b.ptr) for b in sb], int(xb.ptr), int(yb.ptr), int(wb.ptr), channels=c)
            with pytest.raises(ValueError, match="overlap"):  # past stream 0's 9 rows: the batch's rows count
                q12.conv1d([int(b.ptr) for b in sb], int(xb.ptr), int(xb.ptr) + 10 * c * 2, int(wb.ptr), channels=c,
                           width=width)
            # a layer like the first (its launch remembered) still has its own pointers checked
            states = [int(b.ptr) for b in sb]
            for args, error, match in (((int(xb.ptr) + 2, int(yb.ptr), int(wb.ptr)), ValueError, "x must be 16-byte"),
                                       ((int(xb.ptr), int(yb.ptr) + 8, int(wb.ptr)), ValueError, "y must be 16-byte"),
                                       ((int(xb.ptr), int(yb.ptr), 0), ValueError, "w must be a non-NULL"),
                                       ((float(xb.ptr), int(yb.ptr), int(wb.ptr)), TypeError, "x must be"),
                                       ((int(yb.ptr), int(yb.ptr), int(wb.ptr)), ValueError, "overlap")):
                with pytest.raises(error, match=match):
                    q12.conv1d(states, *args, channels=c, width=width)
            with pytest.raises(ValueError, match="bias must be 2-byte aligned"):
                q12.conv1d(states, int(xb.ptr), int(yb.ptr), int(wb.ptr), channels=c, width=width,
                           bias=int(wb.ptr) + 1)
            assert emu.download(yb.ptr, x.nbytes) == outs[mode][0]  # none of them wrote
    assert outs["batched"] == outs["per_stream"]
    want, _ = conv.reference(from_bf16_bits(x), from_bf16_bits(w), [from_bf16_bits(s) for s in s0],
                             np.concatenate([[0], np.cumsum(counts)]))
    got = from_bf16_bits(np.frombuffer(outs["batched"][0], np.uint16).reshape(x.shape))
    assert np.allclose(got, want, rtol=1e-2, atol=1e-2)


def test_sliding_window_layers_batched_and_per_stream(emu):
    """A model mixing sliding-window and full layers: each layer's shape carries its window (transformers'
    ``sliding_window``, ``window_left = W - 1`` for the kernels); batched and per stream give the reference's bits;
    a window that covers every context is the full layer; a bad window is refused before anything is enqueued."""
    from q12drv.kernels import attention as attn

    rng = np.random.default_rng(9)
    counts, starts = [5, 33, 1, 17], [0, 40, 7, 100]
    streams, _keep = make_streams(emu, counts, starts, rng=rng)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    host = inputs(rng, counts, num_blocks)
    cu = np.concatenate([[0], np.cumsum(counts)])
    kv = np.array(starts) + np.array(counts)
    tables = [s.block_table for s in streams]
    sliding = AttentionShape(4, 2, 64, 32, 1e4, sliding_window=8)
    wide = AttentionShape(4, 2, 64, 32, 1e4, sliding_window=int(kv.max()))  # every key of every row
    outs = {}
    with ScratchArena(emu, 1 << 18) as arena:
        bufs = {k: emu.alloc(v.nbytes, k) for k, v in host.items()}
        try:
            for k, v in host.items():
                emu.upload(bufs[k].ptr, v)
            p = {k: int(b.ptr) for k, b in bufs.items()}
            for mode in ("batched", "per_stream"):
                q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode=mode)
                for name, shape in (("sliding", sliding), ("full", SHAPE), ("wide", wide)):
                    q12.attention(p["q"], p["kp"], p["vp"], p["o"], shape, num_blocks=num_blocks)
                    outs[mode, name] = emu.download(p["o"], host["o"].nbytes)
                emu.upload(p["o"], host["o"])
                for bad in (0, -1, 4.0, True):
                    with pytest.raises(ValueError, match="shape.sliding_window must be None"):
                        q12.attention(p["q"], p["kp"], p["vp"], p["o"], AttentionShape(4, 2, 64, 32, 1e4,
                                      sliding_window=bad), num_blocks=num_blocks)
                emu.synchronize()
                assert emu.download(p["o"], host["o"].nbytes) == host["o"].tobytes()  # nothing was written
        finally:
            emu.synchronize()
            for b in bufs.values():
                b.free()
    for name, window in (("sliding", 7), ("full", None)):
        want = attn.reference(host["q"], host["kp"], host["vp"], cu, kv, tables, 4, 2, 16, 64**-0.5,
                              window_left=window).tobytes()
        assert outs["batched", name] == outs["per_stream", name] == want, name
    assert outs["batched", "wide"] == outs["batched", "full"] != outs["batched", "sliding"]


def test_a_layer_op_checked_once_still_refuses_a_bad_pointer_a_new_block_count_or_a_stale_pass(emu):
    """The attention ops remember a (shape, num_blocks) they checked; a later call with the same ones still has its
    pointers checked, another block count is checked again, and a pass whose arena was reset is refused."""
    from q12drv.core.errors import Q12Error

    with two_streams(emu, 4) as (arena, streams, host, p, nb):
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64)
        q12.attention(p["q"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=nb)  # checked, remembered
        with pytest.raises(ValueError, match=r"q must be 16-byte aligned"):
            q12.attention(p["q"] + 2, p["kp"], p["vp"], p["o"], SHAPE, num_blocks=nb)
        with pytest.raises(TypeError, match="q must be a device pointer"):
            q12.attention(float(p["q"]), p["kp"], p["vp"], p["o"], SHAPE, num_blocks=nb)
        with pytest.raises(ValueError, match="past the pools' num_blocks=1"):
            q12.kv_write(p["k"], p["v"], p["kp"], p["vp"], SHAPE, num_blocks=1)
        Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64)  # resets the arena
        with pytest.raises(Q12Error, match="stale"):
            q12.attention(p["q"], p["kp"], p["vp"], p["o"], SHAPE, num_blocks=nb)


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_state_rows_staged_once_give_the_bits_of_pointer_lists_with_one_copy(emu, mode, monkeypatch):
    """``stage_states``: every GDN and short-convolution layer's state-pointer table staged with one copy for the
    pass; each layer given its row copies nothing and computes what it computes from a pointer list."""
    check_state_rows(emu, mode, monkeypatch, [5, 33, 1, 17], [0, 40, 7, 100])


def check_state_rows(emu, mode, monkeypatch, counts, starts) -> None:
    """:func:`test_state_rows_staged_once_give_the_bits_of_pointer_lists_with_one_copy` on ``emu`` (any device)."""
    rng = np.random.default_rng(21)
    streams, _keep = make_streams(emu, counts, starts, rng=rng)
    n, c, width, t = len(counts), 24, 4, sum(counts)
    layers = [inputs(rng, counts, 4) for _ in range(3)]
    x = to_bf16_bits(rng.standard_normal((t, c)))
    w = to_bf16_bits(rng.standard_normal((c, width)) * 0.5)
    conv0 = to_bf16_bits(rng.standard_normal((n, width - 1, c)))
    names = ("gq", "gk", "gv", "g", "beta", "go", "st")

    def run_pass(arena, staged: bool) -> tuple:
        bufs = [{k: emu.alloc(h[k].nbytes, k) for k in names} for h in layers]
        for h, b in zip(layers, bufs):
            for k in names:
                emu.upload(b[k].ptr, h[k])
        xb, yb, wb, cb = emu.alloc(x.nbytes), emu.alloc(x.nbytes), emu.alloc(w.nbytes), emu.alloc(conv0.nbytes)
        for buf, a in ((xb, x), (wb, w), (cb, conv0)):
            emu.upload(buf.ptr, a)
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64, mode=mode)
        p = [{k: int(v.ptr) for k, v in b.items()} for b in bufs]
        tables = [[int(cb.ptr) + s * conv0[0].nbytes for s in range(n)]]
        tables += [[q["st"] + s * layers[0]["st"][0].nbytes for s in range(n)] for q in p]
        copies = []
        monkeypatch.setattr(emu.driver, "memcpy_htod_async", lambda *a, _f=emu.driver.memcpy_htod_async: (
            copies.append(a[2]), _f(*a))[1])
        rows = q12.stage_states(tables) if staged else tables
        q12.conv1d(rows[0], int(xb.ptr), int(yb.ptr), int(wb.ptr), channels=c, width=width)
        for i, q in enumerate(p):
            q12.gdn_layer(rows[1 + i], gdn_tensors(q), GSHAPE, config=FUSED)
        monkeypatch.undo()
        out = [emu.download(yb.ptr, x.nbytes), emu.download(cb.ptr, conv0.nbytes)]
        out += [emu.download(b[k].ptr, b[k].nbytes) for b in bufs for k in ("go", "st")]
        for buf in (xb, yb, wb, cb, *(v for b in bufs for v in b.values())):
            buf.free()
        return out, copies

    with ScratchArena(emu, Q12Pass.arena_bytes(counts, state_rows=4)) as arena:
        lists, list_copies = run_pass(arena, staged=False)
        rows, row_copies = run_pass(arena, staged=True)
    assert rows == lists
    assert list_copies == [8 * n] * 4 and row_copies == [8 * n * 4]  # a copy a layer, against one for the pass


def test_stage_states_refuses_bad_rows_a_small_arena_and_another_pass_with_nothing_written(emu):
    counts = [3, 5]
    streams, _keep = make_streams(emu, counts, [0, 9])
    st = emu.alloc(2 * 4 * 64 * 64 * 4)
    good = [int(st.ptr), int(st.ptr) + 4 * 64 * 64 * 4]
    need = Q12Pass.arena_bytes(counts, state_rows=2)
    assert need == Q12Pass.arena_bytes(counts) + 2 * 8 * len(counts)
    with ScratchArena(emu, need - 1) as arena:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode="batched")
        cursor, regions = arena.cursor, arena.regions
        for rows, error, match in (([good, good[:1]], ValueError, r"rows\[1\] needs exactly 2 pointers"),
                                   ([good, [good[0], 0]], ValueError, r"rows\[1\]\[1\]"),
                                   ([], TypeError, "non-empty sequence"),
                                   ("rows", TypeError, "non-empty sequence"),
                                   ([good, good], CapacityError, r"state_rows=2")):
            with pytest.raises(error, match=match):
                q12.stage_states(rows)
            assert (arena.cursor, arena.regions) == (cursor, regions)
        with pytest.raises(ValueError, match=r"rows\[0\]\[1\]"):  # an integer array: the same checks
            q12.stage_states(np.array([[good[0], 0]], np.uint64))
        assert (arena.cursor, arena.regions) == (cursor, regions)
        (row,) = q12.stage_states(np.array([good], np.uint64))  # one table fits
        assert arena.cursor == cursor + 8 * len(counts) and row.index == 0 and row.dtype is None
        assert np.array_equal(np.frombuffer(arena.read(row.ptr - int(arena.base), 16), np.uint64), good)
        tensors = GdnTensors(*([int(st.ptr)] * 6))
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode="batched")
        (odd,) = q12.stage_states([[good[0] + 4, good[1]]])
        with pytest.raises(ValueError, match="not 16-byte aligned, as the short convolution.s states need"):
            q12.conv1d(odd, int(st.ptr), int(st.ptr) + 4096, int(st.ptr), channels=8, width=4)
        host_states = [np.zeros((4, 64, 64), np.float32) for _ in counts]  # tensors (host arrays: adopted on emu)
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode="batched")
        (f32,) = q12.stage_states([host_states])
        assert f32.dtype == "f32"
        with pytest.raises(ValueError, match="staged from f32 tensors; the short convolution's states are bf16"):
            q12.conv1d(f32, int(st.ptr), int(st.ptr) + 4096, int(st.ptr), channels=8, width=4)
        with pytest.raises(ValueError, match=r"rows\[0\] mixes tensors of \['f32', 'i32'\]"):
            q12.stage_states([[host_states[0], np.zeros(4, np.int32)]])
        later = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, mode="batched")
        with pytest.raises(Q12Error, match="staged for another pass"):
            later.gdn_layer(odd, tensors, GSHAPE, config=FUSED)
    st.free()
