"""LayerLaunch (a kernel's launch with everything but the layer's pointers fixed for a pass): it writes the very
argument block the per-call launchers write, and refuses a layout it cannot pack."""

import ctypes

import pytest

from q12drv import ScratchArena, make_scratch_plan
from q12drv.kernels import ops, registry
from q12drv.kernels import rope as _rope
from q12drv.kernels.conv1d import conv1d_launch, enqueue_conv1d
from q12drv.kernels.gdn import GdnConfig, GdnShape, enqueue_gdn, plan_gdn
from q12drv.kernels.gdn.launch import GdnLaunch
from q12drv.kernels.layer_launch import LayerLaunch
from q12drv.kernels.meta import meta_struct
from q12drv.prefill import Q12Pass
from tests.helpers import make_streams

PTRS = [0x7F00_0000_0000 + 0x10000 * i for i in range(6)]


@pytest.fixture
def meta(emu):
    """A batched pass's staged metadata (three streams)."""
    streams, tables = make_streams(emu, [5, 17, 9], [0, 3, 16])
    with ScratchArena(emu, make_scratch_plan([5, 17, 9], 0, False).total_bytes) as arena:
        yield Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=64,
                      mode="batched").meta
    tables.free()


def _fired(emu, entries, run) -> list:
    """``(entry, grid, block, smem, argument bytes)`` of each launch of ``entries`` that ``run()`` makes, in order (the
    thread's blocks as the driver would read them; nothing runs)."""
    seen = []
    for entry in entries:
        launch = registry.prepared(emu, entry)

        def fire(grid, block, smem, stream, launch=launch, entry=entry):
            seen.append((entry, tuple(grid), tuple(block), smem, bytes(launch.args)))

        launch.fire = fire
        launch._fire_dependent = fire
    run()
    return seen


def _block(emu, entry: str, values: dict) -> bytes:
    """The argument block of ``entry`` with every parameter set by name (``Launch.set``), from a zeroed block: the
    kernel's signature written out independently of the launchers."""
    launch = registry.prepared(emu, entry)
    ctypes.memset(ctypes.addressof(launch.args), 0, ctypes.sizeof(launch.args))
    return bytes(launch.set(**values).args)


def test_the_per_call_and_the_per_pass_launchers_write_every_argument_by_name(emu, meta):
    """Each op's per-call launcher (``enqueue_*``, its launch kept for the metadata) and its per-pass twin
    (``*_launch``, a LayerLaunch) write the argument block that setting every parameter by name writes, whatever a
    launch before them left there, with the same geometry."""
    raw = emu.stream.raw
    m = meta_struct(meta)
    scaling = _rope.RopeScaling(tuple(_rope.inv_freq(32, 1e4) / 8), attention_factor=1.25)
    kv = dict(zip(("k", "v", "k_pool", "v_pool"), PTRS))
    cases = [
        ("q12_kv_write", {**kv, "m": m, "row_elems": 128, "num_slots": 4096},
         lambda: ops.enqueue_kv_write(emu, meta, *PTRS[:4], 128, 4096, None),
         lambda: ops.kv_write_launch(emu, meta, 128, 4096).launch(raw, tuple(PTRS[:4]))),
        ("q12_kv_write", {**kv, "m": m, "row_elems": 128, "num_slots": 8192},  # another launch for other values
         lambda: ops.enqueue_kv_write(emu, meta, *PTRS[:4], 128, 8192, None),
         lambda: ops.kv_write_launch(emu, meta, 128, 8192).launch(raw, tuple(PTRS[:4]))),
        ("q12_kv_write_fp8", {**dict(zip(("k", "v", "k_pool", "v_pool", "k_scale", "v_scale"), PTRS)), "m": m,
                              "head_dim": 64, "row_elems": 128, "num_slots": 4096},
         lambda: ops.enqueue_kv_write_fp8(emu, meta, *PTRS, 64, 128, 4096, None),
         lambda: ops.kv_write_fp8_launch(emu, meta, 64, 128, 4096).launch(raw, tuple(PTRS))),
        ("q12_conv1d_w4", {**dict(zip(("state_ptrs", "x", "y", "w", "bias"), PTRS)), "m": m, "channels": 64,
                           "x_stride": 64, "y_stride": 72, "state_stride": 80, "silu": 1},
         lambda: enqueue_conv1d(emu, meta, "q12_conv1d_w4", *PTRS[:5], 64, 64, 72, 80, True, None),
         lambda: conv1d_launch(emu, meta, "q12_conv1d_w4", 64, 64, 72, 80, True).launch(raw, (*PTRS[1:5], PTRS[0]))),
        ("q12_attn_prefill_d64", {**dict(zip(("q", "k_pool", "v_pool", "o"), PTRS)), "m": m, "num_q_heads": 4,
                                  "num_kv_heads": 2, "block_size": meta.block_size, "scale": 0.125, "window_left": 7},
         lambda: ops.enqueue_attention(emu, meta, "q12_attn_prefill_d64", *PTRS[:4], 4, 2, 64, 0.125, None, 7),
         lambda: ops.attention_launch(emu, meta, "q12_attn_prefill_d64", 4, 2, 64, 0.125, 7).launch(
             raw, tuple(PTRS[:4]))),
    ]
    for table in (_rope.NO_TABLE, scaling.table(), _rope.NO_TABLE):  # a table after none, then none after one
        cases.append(("q12_rope", {"q": PTRS[0], "k": PTRS[1], "m": m, "num_q_heads": 4, "num_kv_heads": 2,
                                   "head_dim": 64, "rotary_dim": 32, "theta": 1e4, "mrope_mode": 0, "sec_t": 0,
                                   "sec_h": 0, "sec_w": 0, "table": table},
                      lambda t=table: ops.enqueue_rope(emu, meta, *PTRS[:2], 4, 2, 64, 32, 1e4, 0, (0, 0, 0), None,
                                                       t),
                      lambda t=table: ops.rope_launch(emu, meta, 4, 2, 64, 32, 1e4, 0, (0, 0, 0), t).launch(
                          raw, tuple(PTRS[:2]))))
    for entry, values, per_call, layer in cases:
        want = _block(emu, entry, values)
        for run in (per_call, layer, per_call):  # (the per-call one twice: its kept launch)
            registry.prepared(emu, entry).args.m.batch_size = 999  # a stale block: the launcher rewrites it all
            fired = _fired(emu, [entry], run)
            assert len(fired) == 1 and fired[0][4] == want, entry
        assert _fired(emu, [entry], per_call)[0][:4] == _fired(emu, [entry], layer)[0][:4]  # the same geometry


@pytest.mark.parametrize("config", [GdnConfig(math="recurrent"), GdnConfig(schedule="two_pass", isa="mma")])
def test_the_gdn_launchers_write_every_argument_by_name(emu, meta, config):
    """``enqueue_gdn`` and the per-pass ``GdnLaunch`` write each kernel of the plan the block that setting every
    parameter by name writes, with the same geometry."""
    shape = GdnShape(num_k_heads=2, num_v_heads=4, head_dim=64)
    plan = plan_gdn(config, shape, meta.batch_size, meta.chunk_len, emu)
    entries = [k.entry for k in plan.launches(meta.batch_size, meta.chunk_len)[1]]
    ws = 0x7E00_0000_0000 if plan.workspace_bytes else 0
    ptrs = (PTRS[0] - 4096, *PTRS)
    values = {**dict(zip(("h_state_ptrs", "q", "k", "v", "g", "beta", "o"), ptrs)), "m": meta_struct(meta),
              "num_k_heads": 2, "num_v_heads": 4, "workspace": ws}
    want = [_block(emu, e, values) for e in entries]
    per_call = _fired(emu, entries, lambda: enqueue_gdn(emu, meta, plan, *ptrs, ws, None))
    layer = _fired(emu, entries, lambda: GdnLaunch(emu, meta, plan, ws).launch(emu.stream.raw, ptrs))
    assert [f[4] for f in per_call] == [f[4] for f in layer] == want and len(want) == len(entries)
    assert [f[:4] for f in per_call] == [f[:4] for f in layer]


def test_a_layer_launch_refuses_what_it_cannot_pack(emu, meta):
    grid, block = (1, 1, 1), (128, 1, 1)
    fixed = dict(m=meta_struct(meta), row_elems=128, num_slots=4096)
    for pointers in (("k", "k_pool"), ("v", "k"), ("row_elems",), ("nope",), ()):
        with pytest.raises(ValueError, match="not consecutive pointer parameters"):
            LayerLaunch(emu, "q12_kv_write", grid, block, 0, pointers, **fixed)
    with pytest.raises(ValueError, match="fixed arguments .* must be exactly"):
        LayerLaunch(emu, "q12_kv_write", grid, block, 0, ("k", "v", "k_pool", "v_pool"), m=fixed["m"], row_elems=128)
    with pytest.raises(OverflowError, match="row_elems=4294967296 does not fit"):
        LayerLaunch(emu, "q12_kv_write", grid, block, 0, ("k", "v", "k_pool", "v_pool"),
                    **{**fixed, "row_elems": 1 << 32})


def test_a_per_call_launchers_launches_go_with_their_metadata():
    """``for_metadata`` keeps a launch while its metadata lives, builds it once, and drops it when the metadata is
    freed (a cache of dead metadata's launches held memory until it filled: 150 KB over 1,500 staged passes)."""
    from q12drv.kernels import layer_launch

    class Meta:  # any weakly referenceable object stands for staged metadata
        pass

    built = []
    make = lambda: built.append(1) or object()  # noqa: E731
    a, b = Meta(), Meta()
    first = layer_launch.for_metadata(a, ("k", 1), make)
    assert layer_launch.for_metadata(a, ("k", 1), make) is first and len(built) == 1
    layer_launch.for_metadata(a, ("k", 2), make)
    layer_launch.for_metadata(b, ("k", 1), make)
    keys = lambda m: {k for k in layer_launch._FOR_META if k[0] == id(m)}  # noqa: E731
    assert len(keys(a)) == 2 and len(keys(b)) == 1
    ida = id(a)
    del a
    assert not {k for k in layer_launch._FOR_META if k[0] == ida} and len(keys(b)) == 1
