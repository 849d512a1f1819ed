"""The FP8 (e4m3) KV write on the emulated driver: the host codec against ml_dtypes' float8_e4m3fn, the kernel's
model through ``ops.kv_write`` and ``Q12Pass.kv_write`` (batched == per stream) against an independent expectation
built with ml_dtypes, and bad input refused with nothing written."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from q12drv import AttentionShape, Q12Pass, ScratchArena, ops
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.core.fp8 import E4M3_MAX, from_e4m3_bits, to_e4m3_bits
from tests.helpers import make_streams

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn

HKV, D, BS = 2, 64, 16
SHAPE = AttentionShape(num_q_heads=4, num_kv_heads=HKV, head_dim=D, rotary_dim=D, kv_dtype="fp8_e4m3")
COUNTS, STARTS = [37, 5, 20], [0, 16, 3]


def test_the_codec_rounds_and_saturates_as_ml_dtypes_does():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(50_000).astype(np.float32) * s for s in (1e-3, 0.05, 1, 30, 300)] +
                       [np.array([0, -0.0, 448, 449, 463.9, 464, 1e4, -1e4, 2 ** -10, 2 ** -9 * 1.5, 2 ** -9 * 2.5,
                                  15.5, 0.0175], np.float32)])
    want = np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3).view(np.uint8)  # satfinite: clamp, then round
    assert np.array_equal(to_e4m3_bits(x), want)
    every = np.arange(256, dtype=np.uint8)
    theirs = every.view(E4M3).astype(np.float32)
    assert np.array_equal(from_e4m3_bits(every), theirs, equal_nan=True)
    assert to_e4m3_bits(np.array([np.nan], np.float32))[0] & 0x7F == 0x7F


def _expected(k_bits, scale, slots, num_slots):
    """The pools' bytes the write must leave: ml_dtypes' conversion of x * (1 / scale) (fp32), at each slot."""
    x = from_bf16_bits(k_bits).astype(np.float32).reshape(-1, HKV, D)
    inv = (np.float32(1) / scale.astype(np.float32)).astype(np.float32)
    q = np.clip(x * inv[None, :, None], -E4M3_MAX, E4M3_MAX).astype(E4M3).view(np.uint8)
    pool = np.zeros((num_slots, HKV, D), np.uint8)
    pool[slots] = q
    return pool


def _world(emu, seed: int, fill: int) -> SimpleNamespace:
    """Streams, their bf16 K and V, the scales (K's second head small enough to saturate) and two FP8 pools filled
    with ``fill``, in device memory; ``free()`` lets it all go."""
    rng = np.random.default_rng(seed)
    streams, tables = make_streams(emu, COUNTS, STARTS, block_size=BS)
    nb = int(max(s.block_table.max() for s in streams)) + 1
    t = sum(COUNTS)
    host = {"k": to_bf16_bits(rng.standard_normal((t, HKV, D)).astype(np.float32) * 4),
            "v": to_bf16_bits(rng.standard_normal((t, HKV, D)).astype(np.float32)),
            "ks": np.array([4 * 4 / 448, 1e-3], np.float32), "vs": np.array([0.01, 0.5], np.float32)}
    bufs = {n: emu.alloc(a.nbytes, n) for n, a in host.items()}
    for n, a in host.items():
        emu.upload(bufs[n].ptr, a)
    pools = [emu.alloc(nb * BS * HKV * D, "pool") for _ in range(2)]
    for p in pools:
        emu.memset(p.ptr, fill, p.nbytes)

    def free():
        for b in (*bufs.values(), *pools, tables):
            b.free()

    return SimpleNamespace(streams=streams, nb=nb, host=host, p={n: int(b.ptr) for n, b in bufs.items()},
                           kp=int(pools[0].ptr), vp=int(pools[1].ptr), pool_bytes=pools[0].nbytes, free=free)


def _pools(emu, w) -> tuple:
    return tuple(np.frombuffer(emu.download(p, w.pool_bytes), np.uint8).reshape(-1, HKV, D) for p in (w.kp, w.vp))


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_a_pass_writes_fp8_pools_as_ml_dtypes_quantizes(emu, mode):
    w = _world(emu, 1, 0)
    with ScratchArena(emu, 1 << 16) as arena:
        q12 = Q12Pass(arena, w.streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=D, mode=mode)
        q12.kv_write(w.p["k"], w.p["v"], w.kp, w.vp, SHAPE, num_blocks=w.nb, k_scale=w.p["ks"], v_scale=w.p["vs"])
        emu.synchronize()
    slots = np.concatenate([s.block_table[(s.proc_start + np.arange(s.proc_count)) // BS] * BS
                            + (s.proc_start + np.arange(s.proc_count)) % BS for s in w.streams])
    got_k, got_v = _pools(emu, w)
    assert np.array_equal(got_k, _expected(w.host["k"], w.host["ks"], slots, w.nb * BS))
    assert np.array_equal(got_v, _expected(w.host["v"], w.host["vs"], slots, w.nb * BS))
    assert (got_k[slots, 1] & 0x7F).max() == 0x7E  # the 1e-3 head saturates at +-448, never NaN
    # dequantized, an in-range head is within e4m3's half step (2**-4 relative) of the bf16 input
    x = from_bf16_bits(w.host["k"]).reshape(-1, HKV, D)[:, 0]
    back = from_e4m3_bits(got_k[slots, 0]) * w.host["ks"][0]
    assert np.all(np.abs(back - x) <= np.abs(x) * 2 ** -4 + 2 ** -9 * w.host["ks"][0])
    w.free()


def test_fp8_pools_are_refused_where_they_cannot_be_used_and_nothing_is_written(emu):
    w = _world(emu, 2, 0x5A)
    p, kp, vp, nb = w.p, w.kp, w.vp, w.nb
    with ScratchArena(emu, 1 << 16) as arena:
        q12 = Q12Pass(arena, w.streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=D)
        with pytest.raises(ValueError, match="needs k_scale and v_scale"):
            q12.kv_write(p["k"], p["v"], kp, vp, SHAPE, num_blocks=nb)
        with pytest.raises(ValueError, match=r"k_scale must be 4-byte aligned"):
            q12.kv_write(p["k"], p["v"], kp, vp, SHAPE, num_blocks=nb, k_scale=p["ks"] + 2, v_scale=p["vs"])
        with pytest.raises(ValueError, match="scales are for shape.kv_dtype='fp8_e4m3'"):
            q12.kv_write(p["k"], p["v"], kp, vp, AttentionShape(4, HKV, D, D), num_blocks=nb, k_scale=p["ks"],
                         v_scale=p["vs"])
        # the prefill kernels read bf16 pools: the layer and algo='auto' refuse FP8 ones, naming the decode kernel
        with pytest.raises(ValueError, match="an attention layer runs a prefill kernel, .* read by algo='decode'"):
            q12.attention_layer(p["k"], p["k"], p["v"], kp, vp, p["k"], SHAPE, num_blocks=nb)
        with pytest.raises(ValueError, match="algo='auto' runs a prefill kernel, .* read by algo='decode'"):
            q12.attention(p["k"], kp, vp, p["k"], SHAPE, num_blocks=nb, k_scale=p["ks"], v_scale=p["vs"])
        with pytest.raises(ValueError, match=r"shape.kv_dtype must be one of \('bf16', 'fp8_e4m3'\)"):
            q12.kv_write(p["k"], p["v"], kp, vp, AttentionShape(4, HKV, D, D, kv_dtype="fp8"), num_blocks=nb)
        with pytest.raises(ValueError, match="kv_dtype must be one of"):
            ops.kv_write(emu, q12.meta, p["k"], p["v"], kp, vp, num_kv_heads=HKV, head_dim=D, num_blocks=nb,
                         kv_dtype="e4m3")
        emu.synchronize()
    assert all(np.all(x == 0x5A) for x in _pools(emu, w))
    w.free()


def test_ops_kv_write_fp8_equals_the_reference(emu):
    from q12drv.kernels import kv_write as kw

    w = _world(emu, 3, 7)
    with ScratchArena(emu, 1 << 16) as arena:
        q12 = Q12Pass(arena, w.streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=D)
        ops.kv_write(emu, q12.meta, w.p["k"], w.p["v"], w.kp, w.vp, num_kv_heads=HKV, head_dim=D, num_blocks=w.nb,
                     kv_dtype="fp8_e4m3", k_scale=w.p["ks"], v_scale=w.p["vs"])
        slots = np.frombuffer(arena.read(q12.meta.slot_stacked - arena.base, 8 * sum(COUNTS)), np.int64)
        emu.synchronize()
    start = np.full((w.nb * BS, HKV, D), 7, np.uint8)
    want = kw.reference_fp8(w.host["k"], w.host["v"], slots, start, start, w.host["ks"], w.host["vs"])
    assert all(np.array_equal(got, x) for got, x in zip(_pools(emu, w), want))
    w.free()
