"""On the GPU through q12drv's own API: staging read-back, the prefill step against fp32 references,
batched == per stream bit for bit, perturbation locality, and the JIT-slot misplacement guard."""

import dataclasses

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan, open_device, place_h_state_slot, stage_batched_attn_metadata
from q12drv.core.staging import verify_readback
from q12drv.tools.demo import layer_inputs
from q12drv.kernels import attention as attn_ref
from q12drv.kernels import gdn as gdn_ref
from q12drv.kernels import rope as rope_ref
from q12drv.prefill import AttentionShape, GdnShape, Q12Pass
from tests.helpers import LayerBuffers, make_streams, rel_err, rel_err_bf16

pytestmark = pytest.mark.gpu

LENGTHS = [1, 15, 16, 17, 63, 64, 65, 1100]


@pytest.fixture(scope="module")
def gpu():
    dev = open_device("cuda")
    yield dev
    dev.close()


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


def run_pass(dev, arena, streams, host, mode, shape, gshape, num_blocks, mrope, bs, algo="chunked"):
    L = LayerBuffers(dev, host, guard=512)  # a 0xA5 guard band after each buffer
    L.upload()
    # the scheduler's view: one first chunk per stream, its head already in the prefix cache
    chunks = [(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in streams]
    q12 = Q12Pass(arena, streams, block_size=bs, use_mrope=mrope, dummy_kv_block=0, top_k=8, chunks=chunks,
                  head_dim=shape.head_dim, policy="exact", mode=mode)
    q12.attention_layer(*L.attention_args(), shape, num_blocks=num_blocks)
    ws = None
    if algo == "split":
        nbytes = q12.gdn_workspace_bytes(gshape)
        ws = dev.alloc(nbytes, "gdn workspace")
    q12.gdn_layer(*L.gdn_args(len(streams)), gshape, algo=algo,
                  workspace=None if ws is None else int(ws.ptr), workspace_bytes=None if ws is None else nbytes)
    dev.synchronize()
    if ws is not None:
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
        for mode in ("batched", "per_stream"):  # the split GDN pair: the fused kernel's bits, both ways
            split, _ = run_pass(gpu, arena, streams, host, mode, shape, gshape, num_blocks, mrope, bs, algo="split")
            for k in batched:
                assert np.array_equal(split[k], batched[k]), f"{k}: algo='split' ({mode}) != chunked"

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
        go_ref, st_ref = gdn_ref.reference(host["gq"], host["gk"], host["gv"], host["g"], host["beta"], cu, host["states"])
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
