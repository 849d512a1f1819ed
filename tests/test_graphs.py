"""CUDA graphs on the emulated driver: captured copies re-read pinned memory at replay, a pass
captured for fixed maxima and replayed with new metadata equals the eager pass, padding sentinels."""

import dataclasses

import numpy as np
import pytest

from q12drv import CapacityError, HostRaceError, Q12Error, ScratchArena, make_scratch_plan, open_device
from q12drv.core.bf16 import to_bf16_bits
from q12drv.prefill.graphs import PassGraph, capture
from q12drv.kernels.gdn import plan_gdn
from q12drv.prefill import AttentionShape, GdnConfig, GdnShape, Q12Pass
from q12drv.core.staging import unpack_metadata
from tests.helpers import LayerBuffers, make_streams

BS = 16
ATT = AttentionShape(4, 2, 64, 32, 1e4)
GDN = GdnShape(2, 4, 64)
FUSED = GdnConfig(schedule="fused")
MAX_STREAMS, MAX_TOKENS = 4, 96
BATCH_A = ([20, 7, 33], [0, 16, 5])
BATCH_B = ([10, 30, 1, 40], [3, 0, 64, 17])


def test_a_captured_copy_reads_the_host_buffer_at_replay(emu):
    pin = emu.pinned(64)
    dst = emu.alloc(64)
    pin.array[:] = 1
    with capture(emu) as graph:
        emu.driver.memcpy_htod_async(int(dst.ptr), pin.addr, 64, emu.stream.raw)
    emu.synchronize()
    assert emu.download(dst.ptr, 64) != bytes([1]) * 64  # captured, not run
    for value in (2, 3):
        pin.array[:] = value
        graph.launch()
        assert emu.download(dst.ptr, 64) == bytes([value]) * 64
    graph.destroy()


def test_a_failing_capture_block_ends_capture(emu):
    with pytest.raises(RuntimeError, match="boom"):
        with capture(emu):
            raise RuntimeError("boom")
    with capture(emu) as graph:  # the stream is not left capturing
        pass
    graph.launch()


def test_deferred_replay_catches_a_pinned_rewrite_under_a_pending_replay():
    with open_device("emu", deferred=True) as dev:
        pin = dev.pinned(64)
        dst = dev.alloc(64)
        with capture(dev) as graph:
            dev.driver.memcpy_htod_async(int(dst.ptr), pin.addr, 64, dev.stream.raw)
        graph.launch()
        pin.array[:] = 9  # rewritten before the replay ran
        with pytest.raises(HostRaceError):
            dev.synchronize()
        dev.driver._drain(dev.stream.raw)


class World(LayerBuffers):
    """Inputs for one attention + one GDN layer over up to MAX_TOKENS rows, and buffers to run them on."""

    def __init__(self, dev, rng):
        self.batches = {}
        for name, (counts, starts) in (("A", BATCH_A), ("B", BATCH_B)):
            streams, tables = make_streams(dev, counts, starts, block_size=BS, num_blocks=40, rng=rng)
            self.batches[name] = (streams, tables)
        self.num_blocks = 40
        self.ws, self.ws_bytes = None, 0   # a GDN workspace, where a test gives one
        self.att = ATT  # the attention layer's shape (a test may give it a sliding window)
        t, hq, hkv, d = MAX_TOKENS, ATT.num_q_heads, ATT.num_kv_heads, ATT.head_dim
        hk, hv, dg = GDN.num_k_heads, GDN.num_v_heads, GDN.head_dim
        host = {
            "q": to_bf16_bits(rng.standard_normal((t, hq, d))), "k": to_bf16_bits(rng.standard_normal((t, hkv, d))),
            "v": to_bf16_bits(rng.standard_normal((t, hkv, d))), "o": np.zeros((t, hq, d), np.uint16),
            "k_pool": to_bf16_bits(rng.standard_normal((40, BS, hkv, d))),
            "v_pool": to_bf16_bits(rng.standard_normal((40, BS, hkv, d))),
            "gq": to_bf16_bits(rng.standard_normal((t, hk, dg))), "gk": to_bf16_bits(rng.standard_normal((t, hk, dg))),
            "gv": to_bf16_bits(rng.standard_normal((t, hv, dg))), "go": np.zeros((t, hv, dg), np.uint16),
            "g": (-np.exp(rng.standard_normal((t, hv))) * 0.1).astype(np.float32),
            "beta": (1 / (1 + np.exp(-rng.standard_normal((t, hv))))).astype(np.float32),
            "states": (rng.standard_normal((MAX_STREAMS, hv, dg, dg)) * 0.1).astype(np.float32),
        }
        super().__init__(dev, host)
        self.state_bytes = self.host["states"][0].nbytes

    def reset(self):
        self.upload()

    def read(self, real, n):
        out = {}
        for k in ("o", "go", "q", "k"):
            out[k] = self.dev.download_array(self.bufs[k].ptr, self.host[k].dtype, self.host[k].shape)[:real]
        for k in ("k_pool", "v_pool"):
            out[k] = self.dev.download_array(self.bufs[k].ptr, self.host[k].dtype, self.host[k].shape)
        out["states"] = self.dev.download_array(self.bufs["states"].ptr, np.float32, self.host["states"].shape)[:n]
        return out

    def eager(self, name):
        """The batched Q12Pass on fresh inputs: the reference a replay must equal."""
        streams, _ = self.batches[name]
        self.reset()
        counts = [s.proc_count for s in streams]
        plan = make_scratch_plan(counts, 0, False, "exact")
        with ScratchArena(self.dev, plan.total_bytes + 4096) as arena:
            chunks = [(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in streams]  # cached heads
            q12 = Q12Pass(arena, streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=ATT.head_dim,
                          chunks=chunks, policy="exact", mode="batched")
            q12.attention_layer(*self.attention_args(), self.att, num_blocks=self.num_blocks)
            q12.gdn_layer(*self.gdn_args(len(streams)), GDN, config=FUSED)
            self.dev.synchronize()
        return self.read(sum(counts), len(streams))

    def replay(self, gp, name):
        """Replay ``gp`` for batch ``name`` on fresh inputs; return what it wrote."""
        streams = self.batches[name][0]
        gp.set_streams(streams)
        gp.set_states(0, self.states(len(streams)))
        self.reset()
        gp.replay()
        self.dev.synchronize()
        return self.read(sum(s.proc_count for s in streams), len(streams))

    def body(self, gp, config=FUSED):
        gp.attention_layer(*self.attention_args(), self.att, num_blocks=self.num_blocks)
        # (a plan that needs one) the workspace sized for the graph's maxima (gp.gdn_plan), allocated before the capture
        ws = {} if self.ws is None else dict(workspace=int(self.ws.ptr), workspace_bytes=self.ws_bytes)
        gp.gdn_layer(0, self.gdn_tensors(), GDN, config=config, **ws)


def _assert_same(got, want):
    for k in want:
        assert np.array_equal(got[k], want[k]), f"{k}: replay != eager"


# the two-pass and overlapped schedules: their launches (and the overlapped flags' memset) and their workspace
# inside the capture (on the emulator their result is the fused one by construction; the GPU tests check the kernels)
CONFIGS = {"fused": FUSED, "mma-two-pass": GdnConfig(schedule="two_pass", isa="mma"),
           "wgmma-two-pass": GdnConfig(schedule="two_pass", isa="wgmma"), "overlapped": GdnConfig(schedule="overlapped")}


@pytest.mark.parametrize("deferred,config", [(False, "fused"), (True, "fused"), (False, "mma-two-pass"),
                                             (False, "wgmma-two-pass"), (False, "overlapped")],
                         ids=["immediate", "deferred", "mma-two-pass-capture", "wgmma-two-pass-capture",
                              "overlapped-capture"])
@pytest.mark.parametrize("expand", ["host", "device"])
def test_pass_graph_replay_with_new_metadata_equals_eager(expand, deferred, config):
    config = CONFIGS[config]
    with open_device("emu", deferred=deferred) as dev:
        w = World(dev, np.random.default_rng(7))
        w.ws_bytes = max(16, plan_gdn(config, GDN, MAX_STREAMS, 48, dev).workspace_bytes)
        w.ws = dev.alloc(w.ws_bytes, "gdn workspace")
        want = {name: w.eager(name) for name in ("A", "B")}
        arena = ScratchArena(dev, 1 << 20)
        gp = PassGraph(arena, max_streams=MAX_STREAMS, max_tokens=MAX_TOKENS, max_chunk=48, block_size=BS,
                       use_mrope=False, dummy_kv_block=0, num_ssm_layers=1, state_bytes=w.state_bytes, expand=expand)
        w.reset()
        streams_a = w.batches["A"][0]
        gp.set_streams(streams_a)
        gp.set_states(0, w.states(len(streams_a)))
        assert gp.gdn_plan(GDN, config).workspace_bytes <= w.ws_bytes
        gp.capture(lambda g: w.body(g, config))  # runs once eagerly, then records
        dev.synchronize()
        _assert_same(w.read(60, 3), want["A"])  # the capture's eager run
        meta_bytes = {}
        for name in ("A", "B", "A"):
            _assert_same(w.replay(gp, name), want[name])
            meta_bytes[name] = arena.read(gp.region.offset, gp.layout.staged_bytes)
        assert gp.replays == 3
        fields = unpack_metadata(meta_bytes["A"], gp.layout)
        assert list(fields["cu_seqlens"]) == [0, 20, 27, 60, 60] and list(fields["kv_lens"]) == [20, 23, 38, 0]
        assert (fields["slot_stacked"][60:] == -1).all() and (fields["positions_stacked"][60:] == 0).all()
        assert not fields["_pads"].any()
        gp.close()
        arena.close()


def test_pass_graph_uploads_every_ssm_layers_table_with_one_copy(emu, monkeypatch):
    """Three GDN layers, each with its own states: a replay copies the metadata and all three state tables (two
    copies, not one a layer) and equals the eager pass run with pointer lists; a closed graph refuses new states."""
    check_multi_layer_graph(emu, monkeypatch)


def check_multi_layer_graph(emu, monkeypatch) -> None:
    """:func:`test_pass_graph_uploads_every_ssm_layers_table_with_one_copy` on ``emu`` (any device)."""
    w = World(emu, np.random.default_rng(5))
    rng = np.random.default_rng(6)
    sb = w.state_bytes
    init = [(rng.standard_normal((MAX_STREAMS, sb // 4)) * 0.1).astype(np.float32) for _ in range(3)]
    states = [emu.alloc(MAX_STREAMS * sb, f"states {i}") for i in range(3)]
    tables = lambda n: [[int(s.ptr) + b * sb for b in range(n)] for s in states]  # noqa: E731

    def run(name, graph=None) -> list:
        streams = w.batches[name][0]
        w.reset()
        for s, a in zip(states, init):
            emu.upload(s.ptr, a)
        if graph is None:
            counts = [x.proc_count for x in streams]
            with ScratchArena(emu, make_scratch_plan(counts, 0, False, "exact").total_bytes + 4096) as arena:
                q12 = Q12Pass(arena, streams, block_size=BS, use_mrope=False, dummy_kv_block=0, mode="batched")
                for table in tables(len(streams)):
                    q12.gdn_layer(table, w.gdn_tensors(), GDN, config=FUSED)
        else:
            graph.set_streams(streams)
            if name == "B":  # every layer's table at once (as an array), or layer by layer
                graph.set_state_tables(np.array(tables(len(streams)), np.uint64))
            else:
                for i, table in enumerate(tables(len(streams))):
                    graph.set_states(i, table)
            graph.replay()
        emu.synchronize()
        return [emu.download(w.bufs["go"].ptr, w.bufs["go"].nbytes)] + [emu.download(s.ptr, len(streams) * sb)
                                                                       for s in states]

    want = {name: run(name) for name in ("A", "B")}
    with ScratchArena(emu, 1 << 20) as arena:
        gp = PassGraph(arena, max_streams=MAX_STREAMS, max_tokens=MAX_TOKENS, max_chunk=48, block_size=BS,
                       use_mrope=False, dummy_kv_block=0, num_ssm_layers=3, state_bytes=sb)
        assert gp.h_region.nbytes == 3 * 8 * MAX_STREAMS
        assert [gp.state_table(i) for i in range(3)] == [int(gp.h_region.ptr) + 8 * MAX_STREAMS * i for i in range(3)]
        gp.set_streams(w.batches["A"][0])
        for i, table in enumerate(tables(3)):
            gp.set_states(i, table)
        copies = []
        monkeypatch.setattr(emu.driver, "memcpy_htod_async", lambda *a, _f=emu.driver.memcpy_htod_async: (
            copies.append(a[2]), _f(*a))[1])
        gp.capture(lambda g: [g.gdn_layer(i, w.gdn_tensors(), GDN, config=FUSED) for i in range(3)])
        monkeypatch.undo()
        assert copies == [gp.layout.staged_bytes, 3 * 8 * MAX_STREAMS] * 2  # the eager run, then the capture
        for name in ("B", "A"):
            assert run(name, gp) == want[name]
        before = gp._tables.copy()
        for rows, error, match in ((tables(3)[:2], ValueError, "2 state tables for a pass made with num_ssm_layers=3"),
                                   ([*tables(3)[:2], [1, 2]], ValueError, r"rows\[2\] has 2 pointers"),
                                   ([*tables(3)[:2], [1, 0, 3]], ValueError, r"state_ptrs\[1\] must be a non-NULL"),
                                   ([[1] * 5] * 3, CapacityError, "more streams than the pass holds")):
            with pytest.raises(error, match=match):
                gp.set_state_tables(rows)
            assert np.array_equal(gp._tables, before)  # nothing written
        gp.close()
        with pytest.raises(Q12Error, match="closed"):
            gp.set_states(0, tables(3)[0])
    for s in states:
        s.free()


def test_pass_graph_runs_the_short_convolution_with_its_state_table(emu):
    """A captured short convolution (its per-stream states through a state table) replayed for two batches equals
    the eager pass's convolution, outputs and states."""
    check_graph_conv1d(emu)


def check_graph_conv1d(emu) -> None:
    """:func:`test_pass_graph_runs_the_short_convolution_with_its_state_table` on ``emu`` (any device)."""
    w = World(emu, np.random.default_rng(9))
    rng = np.random.default_rng(10)
    c, width = 32, 4
    x = to_bf16_bits(rng.standard_normal((MAX_TOKENS, c)))
    taps = to_bf16_bits(rng.standard_normal((c, width)) * 0.5)
    init = to_bf16_bits(rng.standard_normal((MAX_STREAMS, width - 1, c)))
    bufs = {k: emu.alloc(a.nbytes, k) for k, a in (("x", x), ("y", x), ("w", taps), ("states", init))}
    emu.upload(bufs["x"].ptr, x)
    emu.upload(bufs["w"].ptr, taps)
    p = {k: int(b.ptr) for k, b in bufs.items()}
    table = lambda n: [p["states"] + b * init[0].nbytes for b in range(n)]  # noqa: E731

    def outputs(n, real):
        return (emu.download(bufs["y"].ptr, real * c * 2), emu.download(bufs["states"].ptr, n * init[0].nbytes))

    want = {}
    for name in ("A", "B"):
        streams = w.batches[name][0]
        emu.upload(bufs["states"].ptr, init)
        with ScratchArena(emu, 1 << 16) as arena:
            q12 = Q12Pass(arena, streams, block_size=BS, use_mrope=False, dummy_kv_block=0, mode="batched")
            q12.conv1d(table(len(streams)), p["x"], p["y"], p["w"], channels=c, width=width)
        emu.synchronize()
        want[name] = outputs(len(streams), sum(s.proc_count for s in streams))
    with ScratchArena(emu, 1 << 20) as arena:
        gp = PassGraph(arena, max_streams=MAX_STREAMS, max_tokens=MAX_TOKENS, max_chunk=48, block_size=BS,
                       use_mrope=False, dummy_kv_block=0, num_ssm_layers=1, state_bytes=init[0].nbytes)
        gp.set_streams(w.batches["A"][0])
        gp.set_states(0, table(3))
        emu.upload(bufs["states"].ptr, init)
        gp.capture(lambda g: g.conv1d(0, p["x"], p["y"], p["w"], channels=c, width=width))
        for name in ("B", "A"):
            streams = w.batches[name][0]
            gp.set_streams(streams)
            gp.set_states(0, table(len(streams)))
            emu.upload(bufs["states"].ptr, init)
            gp.replay()
            emu.synchronize()
            assert outputs(len(streams), sum(s.proc_count for s in streams)) == want[name], name
        gp.close()
    for b in bufs.values():
        b.free()


def test_pass_graph_sliding_window_equals_eager():
    """A sliding-window layer in a captured pass: each replay equals the eager batched pass with the same window
    (and differs from full attention); a bad window is refused before the first launch."""
    with open_device("emu") as dev:
        w = World(dev, np.random.default_rng(8))
        full = w.eager("A")
        w.att = dataclasses.replace(ATT, sliding_window=6)
        want = {name: w.eager(name) for name in ("A", "B")}
        assert not np.array_equal(want["A"]["o"], full["o"])
        with ScratchArena(dev, 1 << 20) as arena, PassGraph(
                arena, max_streams=MAX_STREAMS, max_tokens=MAX_TOKENS, max_chunk=48, block_size=BS, use_mrope=False,
                dummy_kv_block=0, num_ssm_layers=1, state_bytes=w.state_bytes) as gp:
            w.reset()
            gp.set_streams(w.batches["A"][0])
            gp.set_states(0, w.states(3))
            with pytest.raises(ValueError, match="shape.sliding_window must be None"):
                gp.run_eager(lambda g: g.attention_layer(*w.attention_args(), dataclasses.replace(ATT, sliding_window=0),
                                                         num_blocks=w.num_blocks))
            dev.synchronize()
            assert np.array_equal(w.read(60, 3)["q"], w.host["q"][:60])  # no RoPE ran
            gp.capture(w.body)
            for name in ("A", "B"):
                _assert_same(w.replay(gp, name), want[name])


def test_pass_graph_refuses_what_does_not_fit(emu):
    streams, _ = make_streams(emu, [10, 10, 10, 10, 10], block_size=BS)
    with ScratchArena(emu, 1 << 16) as arena, PassGraph(arena, max_streams=4, max_tokens=40, max_chunk=10, block_size=BS,
                                                         use_mrope=False, dummy_kv_block=0) as gp:
        with pytest.raises(Q12Error, match="set_streams"):
            gp.replay()
        with pytest.raises(CapacityError):
            gp.set_streams(streams)  # 5 streams
        long, _ = make_streams(emu, [11], block_size=BS)
        with pytest.raises(CapacityError, match="max_chunk"):
            gp.set_streams(long)
        with pytest.raises(ValueError):
            gp.set_streams([])
        gp.set_streams(streams[:4])
        with pytest.raises(Q12Error, match="capture"):
            gp.replay()
        with pytest.raises(IndexError):
            gp.set_states(0, [1])


def test_pass_graph_device_expand_refuses_vision_positions(emu):
    streams, _ = make_streams(emu, [8, 8], block_size=BS, mrope_vision=(1,))
    with ScratchArena(emu, 1 << 16) as arena, PassGraph(arena, max_streams=2, max_tokens=16, block_size=BS,
                                                         use_mrope=True, dummy_kv_block=0, expand="device") as gp:
        with pytest.raises(ValueError, match="mrope_positions"):
            gp.set_streams(streams)


def test_pass_graph_host_padding_with_vision_positions(emu):
    streams, _ = make_streams(emu, [8, 5], starts=[16, 0], block_size=BS, mrope_vision=(1,))
    with ScratchArena(emu, 1 << 16) as arena, PassGraph(arena, max_streams=3, max_tokens=17, block_size=BS,
                                                         use_mrope=True, dummy_kv_block=0) as gp:
        gp.set_streams(streams)
        gp.capture(lambda gp: None)
        gp.replay()
        emu.synchronize()
        f = unpack_metadata(arena.read(gp.region.offset, gp.layout.staged_bytes), gp.layout)
        assert list(f["positions_stacked"][:8]) == list(range(16, 24))
        assert list(f["positions_h_stacked"][8:13]) == list(streams[1].mrope_positions[1])
        for name in ("positions_stacked", "positions_h_stacked", "positions_w_stacked"):
            assert (f[name][13:] == 0).all()
        assert (f["slot_stacked"][13:] == -1).all() and not f["_pads"].any()
        assert list(f["cu_seqlens"]) == [0, 8, 13, 13] and list(f["kv_lens"]) == [24, 5, 0]


def test_a_layer_that_uploads_state_pointers_refuses_a_foreign_graph_capture(emu):
    """gdn_layer and conv1d copy their state pointers from a pinned slot that later uploads reuse: captured by
    someone else's graph, a replay would read stale pointers. They refuse, naming PassGraph; nothing is captured, and
    outside the capture they run as before."""
    from bench.inputs import CONV_CHANNELS, CONV_WIDTH, StepCase, conv1d_inputs, step_counts
    from q12drv.core.errors import Q12Error

    step = StepCase(emu, step_counts("8x128", False))
    bufs: list = []
    try:
        q12 = step.run("batched")
        conv = conv1d_inputs(emu, step.counts, bufs)
        row = (CONV_WIDTH - 1) * CONV_CHANNELS * 2
        conv_states = [int(conv["states"].ptr) + b * row for b in range(len(step.counts))]
        x, y, w = (int(conv[k].ptr) for k in ("x", "y", "w"))
        layers = {"gdn_layer": lambda: q12.gdn_layer(step.state_ptrs, step.gdn_tensors, step.gdn, **step.gdn_kwargs()),
                  "conv1d": lambda: q12.conv1d(conv_states, x, y, w, channels=CONV_CHANNELS, width=CONV_WIDTH),
                  "h_slot.upload": lambda: q12.h_slot.upload(step.state_ptrs, q12.stream)}
        emu.synchronize()
        s = emu.new_stream()
        q12.stream = s
        for name, layer in layers.items():
            emu.driver.begin_capture(s.raw)
            with pytest.raises(Q12Error, match="capturing a CUDA graph.*q12drv.PassGraph"):
                layer()
            assert emu.driver.end_capture(s.raw)[1] == (), name  # nothing was captured
            layer()  # outside a capture, as before
        emu.synchronize()
    finally:
        for b in bufs:
            b.free()
        step.close()


def test_staging_on_a_foreign_graph_capture_is_refused(emu):
    """Staging copies the metadata from a pinned ring slot that later passes refill: under someone else's capture a
    replay would upload whatever the slot holds then. Refused, naming PassGraph; nothing captured; outside, staged."""
    from q12drv import Q12Pass, ScratchArena
    from q12drv.core.errors import Q12Error
    from tests.helpers import make_streams

    streams, tables = make_streams(emu, [5, 3])
    s = emu.new_stream()
    with ScratchArena(emu, 1 << 16) as arena:
        emu.driver.begin_capture(s.raw)
        with pytest.raises(Q12Error, match="capturing a CUDA graph: the pass's metadata.*q12drv.PassGraph"):
            Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, stream=s, expand="host")
        assert emu.driver.end_capture(s.raw)[1] == ()
        arena.reset()
        assert Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, stream=s).batched
    tables.free()
