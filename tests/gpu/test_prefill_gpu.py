"""On the GPU through q12drv's own API: staging read-back, the prefill step against fp32 references,
batched == per stream bit for bit (every GDN config with a kernel, long and short streams together), perturbation
locality, and the JIT-slot misplacement guard."""

import dataclasses

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan, place_h_state_slot, stage_batched_attn_metadata
from q12drv.core.bf16 import to_bf16_bits
from q12drv.core.staging import verify_readback
from q12drv.tools.demo import layer_inputs
from q12drv.kernels import attention as attn_ref
from q12drv.kernels.gdn import GdnConfig
from q12drv.kernels.gdn.reference import reference as gdn_reference
from q12drv.kernels import rope as rope_ref
from q12drv.prefill import AttentionShape, GdnShape, Q12Pass
from tests.helpers import LayerBuffers, make_streams, rel_err, rel_err_bf16
from tests.test_prefill import check_state_rows

pytestmark = pytest.mark.gpu

LENGTHS = [1, 15, 16, 17, 63, 64, 65, 1100]


@pytest.mark.parametrize("mrope", [False, True])
def test_staging_reads_back_on_gpu(gpu, mrope):
    rng = np.random.default_rng()
    counts = [int(x) for x in rng.integers(1, 3000, size=8)]
    streams, _ = make_streams(gpu, counts, [int(x) for x in rng.integers(0, 5000, size=8)], rng=rng,
                              mrope_vision=(1, 5) if mrope else ())
    plan = make_scratch_plan(counts, 10, mrope, "exact")
    with ScratchArena(gpu, plan.total_bytes) as arena:
        for _ in range(3):
            arena.reset()
            for r in (plan.moe, *plan.stream_blocks):
                arena.reserve(r.name, r.nbytes, offset=r.offset)
            meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=mrope,
                                               scratch_offset_bytes=plan.stacked.offset, dummy_kv_block=0)
            slot = place_h_state_slot(arena, meta)
            for layer in range(12):
                slot.upload([0x7000_0000_0000 + 4096 * (layer * 8 + b) for b in range(8)])
        raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
        assert verify_readback(raw, meta, streams) == []
        assert list(np.frombuffer(arena.read(slot.offset, 64), np.uint64)) == [0x7000_0000_0000 + 4096 * (88 + b) for b in range(8)]
        assert arena.guard_intact()


def test_misplaced_jit_slot_is_refused(gpu):
    streams, _ = make_streams(gpu, [100, 200])
    with ScratchArena(gpu, 1 << 16) as arena:
        meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=True, scratch_offset_bytes=0,
                                           dummy_kv_block=0)
        wrong = dataclasses.replace(meta, staged_bytes=meta.staged_bytes - 16 * 300)  # the #110 heuristic
        with pytest.raises(ValueError, match="staged_bytes"):
            place_h_state_slot(arena, wrong)


def run_pass(dev, arena, streams, host, mode, shape, gshape, num_blocks, mrope, bs, config=GdnConfig()):
    L = LayerBuffers(dev, host, guard=512)  # a 0xA5 guard band after each buffer
    L.upload()
    # the scheduler's view: one first chunk per stream, its head already in the prefix cache
    chunks = [(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in streams]
    q12 = Q12Pass(arena, streams, block_size=bs, use_mrope=mrope, dummy_kv_block=0, top_k=8, chunks=chunks,
                  head_dim=shape.head_dim, policy="exact", mode=mode)
    q12.attention_layer(*L.attention_args(), shape, num_blocks=num_blocks)
    nbytes = q12.gdn_workspace_bytes(gshape, config)
    ws = dev.alloc(max(16, nbytes), "gdn workspace")
    q12.gdn_layer(*L.gdn_args(len(streams)), gshape, config=config, workspace=int(ws.ptr), workspace_bytes=nbytes)
    dev.synchronize()
    ws.free()
    return {k: L.get(k) for k in ("o", "k_pool", "v_pool", "go", "states", "q", "k")}, q12


@pytest.mark.parametrize("d,bs,mrope", [(256, 16, False), (128, 64, True), (64, 16, False)])
def test_prefill_step_against_references_and_batched_equals_per_stream(gpu, d, bs, mrope):
    rng = np.random.default_rng()
    counts = LENGTHS
    starts = [0, 32, 0, 7, 0, 100, 0, 1000]  # some streams have earlier chunks cached
    n = len(counts)
    streams, tables = make_streams(gpu, counts, starts, block_size=bs, rng=rng)
    num_blocks = int(max(int(s.block_table.max()) for s in streams)) + 1
    hq, hkv, hk, hv, dg = 16, 2, 4, 8, 128
    total = sum(counts)
    rd = 64 if d > 64 else 32  # partial rotary; interleaved MRoPE sections sum to rd / 2
    shape = AttentionShape(hq, hkv, d, rd, 1e6, 2 if mrope else 0, (11, 11, 10) if mrope else (0, 0, 0))
    gshape = GdnShape(hk, hv, dg)
    host = layer_inputs(rng, total, n, num_blocks, bs, shape, gshape)
    plan = make_scratch_plan(counts, 8, mrope, "exact")
    with ScratchArena(gpu, plan.total_bytes + 4096) as arena:
        batched, p1 = run_pass(gpu, arena, streams, host, "batched", shape, gshape, num_blocks, mrope, bs)
        per_stream, p2 = run_pass(gpu, arena, streams, host, "per_stream", shape, gshape, num_blocks, mrope, bs)
        assert p1.mode == "batched" and p2.mode == "per_stream"
        for k in batched:
            assert np.array_equal(batched[k], per_stream[k]), f"{k}: batched != per stream"
        assert not np.any(batched["o"] == 0xFFFF) and not np.any(batched["go"] == 0xFFFF)
        fused = {}
        for mode in ("batched", "per_stream"):  # the mma two-pass schedule: the fused kernel's bits, both ways
            for config in (GdnConfig(schedule="fused"), GdnConfig(schedule="two_pass", isa="mma")):
                got, _ = run_pass(gpu, arena, streams, host, mode, shape, gshape, num_blocks, mrope, bs, config)
                fused.setdefault("want", got)
                for k in batched:
                    assert np.array_equal(got[k], fused["want"][k]), f"{k}: {config} ({mode}) != the fused kernel"

        # references (fp32) from the host inputs
        cu = np.concatenate([[0], np.cumsum(counts)])
        pos = np.concatenate([np.arange(s.proc_start, s.proc_start + s.proc_count) for s in streams])
        q_ref, k_ref = rope_ref.reference(host["q"], host["k"], pos, shape.rotary_dim, shape.rope_theta,
                                          shape.mrope_mode, shape.mrope_section, pos, pos)
        assert rel_err_bf16(batched["q"], q_ref) < 1e-2
        kp = host["k_pool"].copy(); vp = host["v_pool"].copy()
        slots = np.concatenate([s.block_table[np.arange(s.proc_start, s.proc_start + s.proc_count) // bs].astype(np.int64) * bs
                                + np.arange(s.proc_start, s.proc_start + s.proc_count) % bs for s in streams])
        kp.reshape(-1, hkv, d)[slots] = batched["k"]
        vp.reshape(-1, hkv, d)[slots] = host["v"]
        assert np.array_equal(batched["k_pool"], kp) and np.array_equal(batched["v_pool"], vp)
        kv_lens = np.array([s.proc_start + s.proc_count for s in streams])
        o_ref = attn_ref.reference(batched["q"], kp, vp, cu, kv_lens, [s.block_table for s in streams], hq, hkv, bs, d ** -0.5)
        assert rel_err_bf16(batched["o"], o_ref) < 1e-2
        go_ref, st_ref = gdn_reference(host["gq"], host["gk"], host["gv"], host["g"], host["beta"], cu, host["states"])
        assert rel_err_bf16(batched["go"], go_ref) < 1e-2
        assert rel_err(batched["states"], st_ref) < 1e-3

        # perturb one stream's input: only that stream's outputs and state move
        victim = 3
        host2 = {k: v.copy() for k, v in host.items()}
        host2["q"][cu[victim + 1] - 1] ^= 0x0040
        host2["gv"][cu[victim]] ^= 0x0040
        perturbed, _ = run_pass(gpu, arena, streams, host2, "batched", shape, gshape, num_blocks, mrope, bs)
        rows = np.zeros(total, bool); rows[cu[victim]:cu[victim + 1]] = True
        assert np.array_equal(perturbed["o"][~rows], batched["o"][~rows])
        assert not np.array_equal(perturbed["o"][rows], batched["o"][rows])
        assert np.array_equal(perturbed["go"][~rows], batched["go"][~rows])
        others = [b for b in range(n) if b != victim]
        assert np.array_equal(perturbed["states"][others], batched["states"][others])
        assert not np.array_equal(perturbed["states"][victim], batched["states"][victim])


@pytest.mark.parametrize("algo", ["mma", "wgmma"])
@pytest.mark.parametrize("d,bs", [(128, 16), (256, 64)])
def test_sliding_window_through_the_pass(gpu, algo, d, bs):
    """A sliding-window layer through Q12Pass.attention (q12drv's own launch packing of window_left): batched ==
    per stream bit for bit, the fp32 reference with window_left = sliding_window - 1, and a full layer on the same
    pass differs."""
    rng = np.random.default_rng()
    counts, starts = [1, 300, 1100, 17], [0, 2000, 64, 900]
    streams, _tables = make_streams(gpu, counts, starts, block_size=bs, rng=rng)
    num_blocks = int(max(int(s.block_table.max()) for s in streams)) + 1
    hq, hkv, t = 16, 2, sum(counts)
    host = {"q": to_bf16_bits(rng.standard_normal((t, hq, d), dtype=np.float32)),
            "kp": to_bf16_bits(rng.standard_normal((num_blocks, bs, hkv, d), dtype=np.float32)),
            "vp": to_bf16_bits(rng.standard_normal((num_blocks, bs, hkv, d), dtype=np.float32))}
    bufs = {k: gpu.alloc(a.nbytes, k) for k, a in host.items()}
    o = gpu.alloc(t * hq * d * 2, "o")
    sliding = AttentionShape(hq, hkv, d, 64, 1e6, sliding_window=200)
    outs = {}
    try:
        for k, a in host.items():
            gpu.upload(bufs[k].ptr, a)
        with ScratchArena(gpu, make_scratch_plan(counts, 0, False, "exact").total_bytes + 4096) as arena:
            for mode in ("batched", "per_stream"):
                q12 = Q12Pass(arena, streams, block_size=bs, use_mrope=False, dummy_kv_block=0, head_dim=d,
                              mode=mode)
                for name, shape in (("sliding", sliding), ("full", dataclasses.replace(sliding, sliding_window=None))):
                    gpu.memset(o.ptr, 0xFF, o.nbytes)
                    q12.attention(int(bufs["q"].ptr), int(bufs["kp"].ptr), int(bufs["vp"].ptr), int(o.ptr), shape,
                                  num_blocks=num_blocks, algo=algo)
                    gpu.synchronize()
                    outs[mode, name] = gpu.download_array(o.ptr, np.uint16, (t, hq, d))
    finally:
        for b in (*bufs.values(), o):
            b.free()
    assert np.array_equal(outs["batched", "sliding"], outs["per_stream", "sliding"]), "batched != per stream"
    assert not np.any(outs["batched", "sliding"] == 0xFFFF)
    cu = np.concatenate([[0], np.cumsum(counts)])
    kv = np.array(starts) + np.array(counts)
    want = attn_ref.reference(host["q"], host["kp"], host["vp"], cu, kv, [s.block_table for s in streams], hq, hkv, bs,
                              d ** -0.5, window_left=199)
    for b in range(len(counts)):
        s = slice(cu[b], cu[b + 1])
        assert rel_err_bf16(outs["batched", "sliding"][s], want[s]) < 1e-2, f"stream {b}"
    assert rel_err_bf16(outs["batched", "full"], want) > 1e-2  # the window mattered


#: Every GDN config with a kernel on the H200 (the default last: the rules' choice for each batch).
GDN_CONFIGS = [GdnConfig(math="recurrent"), GdnConfig(schedule="fused"), GdnConfig(schedule="two_pass", isa="mma"),
               GdnConfig(schedule="two_pass", isa="wgmma"), GdnConfig(schedule="overlapped"), GdnConfig()]


@pytest.mark.parametrize("counts", [[8192, 64], [8192, 64, 1, 700, 2048, 65, 3, 129]], ids=["long+short", "ragged"])
@pytest.mark.parametrize("config", GDN_CONFIGS, ids=lambda c: f"{c.math}-{c.schedule}-{c.isa}")
def test_gdn_batched_equals_per_stream_for_every_config(gpu, counts, config):
    """One long stream beside short ones, Qwen3-Next's GDN heads: the pass plans once from its whole batch and runs
    that plan batched and per stream, so o and every final state are the same bits both ways, for every config
    (alone, the 8192-token stream would take the overlapped schedule, the batch does not: planning per launch gave
    outputs a bf16 ulp apart)."""
    rng = np.random.default_rng()
    n, total = len(counts), sum(counts)
    streams, _ = make_streams(gpu, counts, [0] * n, block_size=64, rng=rng)
    shape = AttentionShape(16, 2, 128, 64, 1e6)
    gshape = GdnShape(16, 32, 128)
    num_blocks = int(max(int(s.block_table.max()) for s in streams)) + 1
    host = layer_inputs(rng, total, n, num_blocks, 64, shape, gshape)
    plan = make_scratch_plan(counts, 8, False, "exact")
    with ScratchArena(gpu, plan.total_bytes + 4096) as arena:
        batched, p1 = run_pass(gpu, arena, streams, host, "batched", shape, gshape, num_blocks, False, 64, config)
        per_stream, p2 = run_pass(gpu, arena, streams, host, "per_stream", shape, gshape, num_blocks, False, 64, config)
        assert p1.mode == "batched" and p2.mode == "per_stream"
        assert p1.gdn_plan(gshape, config) == p2.gdn_plan(gshape, config)
        assert not np.any(batched["go"] == 0xFFFF), "GDN output rows left unwritten"
        for k in ("go", "states"):
            assert np.array_equal(batched[k], per_stream[k]), f"{k}: batched != per stream ({config})"


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_state_rows_staged_once_give_the_bits_of_pointer_lists_on_gpu(gpu, mode, monkeypatch):
    """Every convolution and GDN layer's state table staged with one copy (``Q12Pass.stage_states``): the same bits
    as pointer lists copied layer by layer, through the real driver and kernels."""
    check_state_rows(gpu, mode, monkeypatch, [5, 300, 1, 77, 1024], [0, 40, 7, 100, 3])
