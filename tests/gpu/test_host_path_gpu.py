"""On the GPU: the device-side expansion writes the host stager's bytes, and a pass captured as a CUDA
graph and replayed with new metadata equals the eager pass bit for bit (same checks as the emulated
tests in tests/test_kernel_expand.py and tests/test_graphs.py, through the real driver)."""

import functools

import numpy as np
import pytest

from q12drv import ScratchArena, StreamStageInfo, stage_batched_attn_metadata
from q12drv.prefill.graphs import PassGraph, capture
from q12drv.kernels import expand
from q12drv.kernels.gdn import GdnConfig, plan_gdn
from q12drv.kernels.meta import TAIL_STREAMS
from q12drv.kernels.ops import prepared
from tests.helpers import make_streams
from tests.test_graphs import (BS, GDN, MAX_STREAMS, MAX_TOKENS, World, _assert_same, check_graph_conv1d,
                               check_multi_layer_graph)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mrope", [False, True])
def test_device_expansion_writes_the_host_bytes(gpu, mrope):
    rng = np.random.default_rng()
    many = TAIL_STREAMS + 1  # past the launch-parameter tail: one pinned copy of it instead
    for counts, starts, bs in (([2048] * 8, [0] * 8, 16), ([1, 15, 16, 17, 63, 1100], [0, 3, 16, 100, 7, 5000], 16),
                               ([333, 4097], [64, 1], 64), ([1], [0], 1), ([3] * 7, [5] * 7, 16),
                               (list(rng.integers(1, 90, many)), list(rng.integers(0, 300, many)), 16),
                               (list(rng.integers(1, 90, TAIL_STREAMS)), list(rng.integers(0, 300, TAIL_STREAMS)), 16)):
        streams, _ = make_streams(gpu, counts, starts, block_size=bs, rng=rng)
        s = streams[-1]
        t = s.block_table.copy()
        t[-1] = -1  # an evicted block, in both copies of the table
        gpu.upload(s.block_table_dev, t)
        streams[-1] = StreamStageInfo(s.proc_start, s.proc_count, t, s.block_table_dev, s.seq_len_dev)
        with ScratchArena(gpu, 1 << 22) as a1, ScratchArena(gpu, 1 << 22) as a2:
            gpu.memset(int(a2.base), 0xA5, 1 << 22)  # poison: every byte of the block, pads too, must be written
            m1 = stage_batched_attn_metadata(a1, streams, block_size=bs, use_mrope=mrope, scratch_offset_bytes=128,
                                             dummy_kv_block=3)
            m2 = expand.stage_on_device(a2, streams, block_size=bs, use_mrope=mrope, scratch_offset_bytes=128,
                                        dummy_kv_block=3)
            assert a1.read(128, m1.staged_bytes) == a2.read(128, m2.staged_bytes)
            assert a2.guard_intact()


def test_bind_and_capture_a_launch(gpu):
    # the arena-tail entry (what CUDA graphs replay) over the tail the launch-parameter entry wrote
    launch = prepared(gpu, "q12_expand_meta")
    streams, _ = make_streams(gpu, [40, 7])
    with ScratchArena(gpu, 1 << 16) as arena:
        meta = expand.stage_on_device(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                      dummy_kv_block=0)
        gpu.synchronize()
        want = arena.read(0, meta.staged_bytes)
        gpu.memset(int(arena.base), 0, meta.layout.tail_offset)  # wipe the per-token fields
        expand.enqueue_expand(launch, meta, gpu.stream)  # sets this entry's arguments, and rewrites them
        gpu.synchronize()
        assert arena.read(0, meta.staged_bytes) == want
        gpu.memset(int(arena.base), 0, meta.layout.tail_offset)
        fire = launch.bind(*expand.geometry(2, 40)[:2], 0, gpu.stream)
        with capture(gpu) as graph:
            fire()
        graph.launch()
        gpu.synchronize()
        assert arena.read(0, meta.staged_bytes) == want
        graph.destroy()


@pytest.mark.parametrize("expand_mode", ["host", "device"])
def test_pass_graph_replay_equals_eager(gpu, expand_mode):
    w = World(gpu, np.random.default_rng(11))
    want = {name: w.eager(name) for name in ("A", "B")}
    with ScratchArena(gpu, 1 << 20) as arena:
        gp = PassGraph(arena, max_streams=MAX_STREAMS, max_tokens=MAX_TOKENS, max_chunk=48, block_size=BS,
                       use_mrope=False, dummy_kv_block=0, num_ssm_layers=1, state_bytes=w.state_bytes,
                       expand=expand_mode)
        try:
            streams = w.batches["A"][0]
            w.reset()
            gp.set_streams(streams)
            gp.set_states(0, w.states(len(streams)))
            gp.capture(w.body)
            for name in ("B", "A", "B"):
                streams = w.batches[name][0]
                gp.set_streams(streams)
                gp.set_states(0, w.states(len(streams)))
                w.reset()
                gp.replay()
                gpu.synchronize()
                _assert_same(w.read(sum(s.proc_count for s in streams), len(streams)), want[name])
        finally:
            gp.close()


def test_pass_graph_with_the_wgmma_two_pass_schedule_replays_its_eager_bits(gpu):
    """A captured pass whose GDN layer is the wgmma two-pass schedule (its sequential kernel launched with PDL: a
    programmatic edge in the graph), replayed with new metadata, equals the same pass run eagerly, bit for bit."""
    w = World(gpu, np.random.default_rng(12))
    config = GdnConfig(schedule="two_pass", isa="wgmma")
    w.ws_bytes = plan_gdn(config, GDN, MAX_STREAMS, 48, gpu).workspace_bytes
    w.ws = gpu.alloc(w.ws_bytes, "gdn workspace")
    body = functools.partial(w.body, config=config)
    with ScratchArena(gpu, 1 << 20) as arena:
        gp = PassGraph(arena, max_streams=MAX_STREAMS, max_tokens=MAX_TOKENS, max_chunk=48, block_size=BS,
                       use_mrope=False, dummy_kv_block=0, num_ssm_layers=1, state_bytes=w.state_bytes, expand="device")
        try:
            def run(name, how):
                streams = w.batches[name][0]
                gp.set_streams(streams)
                gp.set_states(0, w.states(len(streams)))
                w.reset()
                how()
                gpu.synchronize()
                return w.read(sum(s.proc_count for s in streams), len(streams))

            want = {name: run(name, lambda: gp.run_eager(body)) for name in ("A", "B")}
            run("A", lambda: gp.capture(body))
            for name in ("B", "A", "B"):
                _assert_same(run(name, gp.replay), want[name])
        finally:
            gp.close()


def test_expand_plan_stages_every_pass_as_the_host_stager_does(gpu):
    rng = np.random.default_rng()
    n, bs = 8, 16
    streams, _ = make_streams(gpu, [4096] * n, [0] * n, block_size=bs, rng=rng)
    with ScratchArena(gpu, 1 << 22) as a1, ScratchArena(gpu, 1 << 22) as a2:
        plan = expand.ExpandPlan(a2, streams, block_size=bs, use_mrope=True, scratch_offset_bytes=128,
                                 dummy_kv_block=3)
        metas = []
        for i in range(8):
            counts = [int(c) for c in rng.integers(1, 2048, n)]
            if i % 2:  # the previous pass's total again with other counts: the argument block's short rewrite
                prev = metas[-1][1]
                counts = prev[1:] + prev[:1]
                hi, lo = counts.index(max(counts)), counts.index(min(counts))
                if counts[hi] > 1 and hi != lo:  # one token moves: another chunk_len, the same total
                    counts[hi] -= 1
                    counts[lo] += 1
            starts = [int(rng.integers(0, 4096 - c + 1)) for c in counts]
            a1.reset()
            a2.reset()
            gpu.memset(int(a2.base), 0xA5, 1 << 22)  # poison: every byte of the block must be written
            pass_streams = [StreamStageInfo(p, c, s.block_table, s.block_table_dev, s.seq_len_dev)
                            for p, c, s in zip(starts, counts, streams)]
            m1 = stage_batched_attn_metadata(a1, pass_streams, block_size=bs, use_mrope=True,
                                             scratch_offset_bytes=128, dummy_kv_block=3)
            m2 = plan.stage(starts, counts)  # no wait in between: the next pass is enqueued right behind
            assert a1.read(128, m1.staged_bytes) == a2.read(128, m2.staged_bytes)
            assert a2.guard_intact()
            metas.append((m2, counts, m1))
        for m2, counts, m1 in metas:  # each pass's metadata still describes its own pass
            assert m2.counts.tolist() == counts and m2.kv_lens_host.tolist() == m1.kv_lens_host.tolist()
            assert (m2.chunk_len, m2.total_tokens) == (m1.chunk_len, m1.total_tokens)


def test_q12pass_through_an_expand_plan_stages_what_it_stages_without(gpu):
    from q12drv.prefill import Q12Pass

    rng = np.random.default_rng()
    streams, _ = make_streams(gpu, [4096] * 8, [0] * 8, block_size=16, rng=rng)
    with ScratchArena(gpu, 1 << 22) as arena:
        plan = None
        for starts, counts in (([0] * 8, [2048] * 8), ([2048] * 8, [int(c) for c in rng.integers(1, 2048, 8)])):
            pass_streams = [StreamStageInfo(p, c, s.block_table, s.block_table_dev, s.seq_len_dev)
                            for p, c, s in zip(starts, counts, streams)]
            plan = plan or expand.ExpandPlan(arena, pass_streams, block_size=16, use_mrope=True,
                                             scratch_offset_bytes=0, dummy_kv_block=0)
            images = []
            for use in (None, plan):
                gpu.memset(int(arena.base), 0xA5, 1 << 22)
                q12 = Q12Pass(arena, pass_streams, block_size=16, use_mrope=True, dummy_kv_block=0, top_k=8,
                              policy="exact", mode="batched", expand_plan=use)
                assert q12.expand == ("plan" if use else "device")
                images.append(arena.read(q12.meta.scratch_offset_bytes, q12.meta.staged_bytes))
            assert images[0] == images[1]


def test_pass_graph_uploads_every_ssm_layers_table_with_one_copy(gpu, monkeypatch):
    """Three GDN layers with their own states in one captured pass: one copy of every table, replay == eager."""
    check_multi_layer_graph(gpu, monkeypatch)


def test_pass_graph_runs_the_short_convolution_with_its_state_table(gpu):
    """The captured short convolution replayed for two batches equals the eager pass's, on the GPU."""
    check_graph_conv1d(gpu)
