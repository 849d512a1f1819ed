"""The FP8 (e4m3) KV write on the emulated driver: the host codec against ml_dtypes' float8_e4m3fn, the kernel's
model through ``ops.kv_write`` and ``Q12Pass.kv_write`` (batched == per stream) against an independent expectation
built with ml_dtypes, and bad input refused with nothing written."""

from __future__ import annotations

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


def _inputs(emu, rng):
    t = sum(COUNTS)
    k = to_bf16_bits(rng.standard_normal((t, HKV, D)).astype(np.float32) * 4)
    v = to_bf16_bits(rng.standard_normal((t, HKV, D)).astype(np.float32))
    scales = {"k": np.array([4 * 4 / 448, 1e-3], np.float32), "v": np.array([0.01, 0.5], np.float32)}  # 1e-3: saturates
    bufs = {n: emu.alloc(a.nbytes, n) for n, a in (("k", k), ("v", v), ("ks", scales["k"]), ("vs", scales["v"]))}
    for n, a in (("k", k), ("v", v), ("ks", scales["k"]), ("vs", scales["v"])):
        emu.upload(bufs[n].ptr, a)
    return k, v, scales, bufs


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_a_pass_writes_fp8_pools_as_ml_dtypes_quantizes(emu, mode):
    rng = np.random.default_rng(1)
    streams, tables = make_streams(emu, COUNTS, STARTS, block_size=BS)
    nb = int(max(s.block_table.max() for s in streams)) + 1
    k, v, scales, bufs = _inputs(emu, rng)
    pools = [emu.alloc(nb * BS * HKV * D, "pool") for _ in range(2)]
    for p in pools:
        emu.memset(p.ptr, 0, p.nbytes)
    with ScratchArena(emu, 1 << 16) as arena:
        q12 = Q12Pass(arena, streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=D, mode=mode)
        q12.kv_write(int(bufs["k"].ptr), int(bufs["v"].ptr), int(pools[0].ptr), int(pools[1].ptr), SHAPE,
                     num_blocks=nb, k_scale=int(bufs["ks"].ptr), v_scale=int(bufs["vs"].ptr))
        emu.synchronize()
    slots = np.concatenate([s.block_table[(s.proc_start + np.arange(s.proc_count)) // BS] * BS
                            + (s.proc_start + np.arange(s.proc_count)) % BS for s in streams])
    got_k = np.frombuffer(emu.download(pools[0].ptr, pools[0].nbytes), np.uint8).reshape(-1, HKV, D)
    got_v = np.frombuffer(emu.download(pools[1].ptr, pools[1].nbytes), np.uint8).reshape(-1, HKV, D)
    assert np.array_equal(got_k, _expected(k, scales["k"], slots, nb * BS))
    assert np.array_equal(got_v, _expected(v, scales["v"], slots, nb * BS))
    assert (got_k[slots, 1] & 0x7F).max() == 0x7E  # the 1e-3 head saturates at +-448, never NaN
    # dequantized, an in-range head is within e4m3's half step (2**-4 relative) of the bf16 input
    x = from_bf16_bits(k).reshape(-1, HKV, D)[:, 0]
    back = from_e4m3_bits(got_k[slots, 0]) * scales["k"][0]
    assert np.all(np.abs(back - x) <= np.abs(x) * 2 ** -4 + 2 ** -9 * scales["k"][0])
    for b in (*bufs.values(), *pools, tables):
        b.free()


def test_fp8_pools_are_refused_where_they_cannot_be_used_and_nothing_is_written(emu):
    rng = np.random.default_rng(2)
    streams, tables = make_streams(emu, COUNTS, STARTS, block_size=BS)
    nb = int(max(s.block_table.max() for s in streams)) + 1
    k, v, scales, bufs = _inputs(emu, rng)
    pool = emu.alloc(nb * BS * HKV * D * 2, "pool")
    emu.memset(pool.ptr, 0x5A, pool.nbytes)
    p = {n: int(b.ptr) for n, b in bufs.items()}
    with ScratchArena(emu, 1 << 16) as arena:
        q12 = Q12Pass(arena, streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=D)
        kp, vp = int(pool.ptr), int(pool.ptr) + nb * BS * HKV * D
        with pytest.raises(ValueError, match="needs k_scale and v_scale"):
            q12.kv_write(p["k"], p["v"], kp, vp, SHAPE, num_blocks=nb)
        with pytest.raises(ValueError, match=r"k_scale must be 4-byte aligned"):
            q12.kv_write(p["k"], p["v"], kp, vp, SHAPE, num_blocks=nb, k_scale=p["ks"] + 2, v_scale=p["vs"])
        with pytest.raises(ValueError, match="scales are for shape.kv_dtype='fp8_e4m3'"):
            q12.kv_write(p["k"], p["v"], kp, vp, AttentionShape(4, HKV, D, D), num_blocks=nb, k_scale=p["ks"],
                         v_scale=p["vs"])
        with pytest.raises(ValueError, match="no attention kernel reads FP8 pools yet"):
            q12.attention_layer(p["k"], p["k"], p["v"], kp, vp, p["k"], SHAPE, num_blocks=nb)
        with pytest.raises(ValueError, match="no attention kernel reads FP8 pools yet"):
            q12.attention(p["k"], kp, vp, p["k"], SHAPE, num_blocks=nb)
        with pytest.raises(ValueError, match=r"shape.kv_dtype must be one of \('bf16', 'fp8_e4m3'\)"):
            q12.kv_write(p["k"], p["v"], kp, vp, AttentionShape(4, HKV, D, D, kv_dtype="fp8"), num_blocks=nb)
        with pytest.raises(ValueError, match="kv_dtype must be one of"):
            ops.kv_write(emu, q12.meta, p["k"], p["v"], kp, vp, num_kv_heads=HKV, head_dim=D, num_blocks=nb,
                         kv_dtype="e4m3")
        emu.synchronize()
    assert emu.download(pool.ptr, pool.nbytes) == b"\x5a" * pool.nbytes
    for b in (*bufs.values(), pool, tables):
        b.free()


def test_ops_kv_write_fp8_equals_the_reference(emu):
    from q12drv.kernels import kv_write as kw

    rng = np.random.default_rng(3)
    streams, tables = make_streams(emu, COUNTS, STARTS, block_size=BS)
    nb = int(max(s.block_table.max() for s in streams)) + 1
    k, v, scales, bufs = _inputs(emu, rng)
    pools = [emu.alloc(nb * BS * HKV * D, "pool") for _ in range(2)]
    for p in pools:
        emu.memset(p.ptr, 7, p.nbytes)
    with ScratchArena(emu, 1 << 16) as arena:
        q12 = Q12Pass(arena, streams, block_size=BS, use_mrope=False, dummy_kv_block=0, head_dim=D)
        ops.kv_write(emu, q12.meta, bufs["k"].ptr, bufs["v"].ptr, pools[0].ptr, pools[1].ptr, num_kv_heads=HKV,
                     head_dim=D, num_blocks=nb, kv_dtype="fp8_e4m3", k_scale=bufs["ks"].ptr, v_scale=bufs["vs"].ptr)
        slots = np.frombuffer(arena.read(q12.meta.slot_stacked - arena.base, 8 * sum(COUNTS)), np.int64)
        emu.synchronize()
    start = np.full((nb * BS, HKV, D), 7, np.uint8)
    want_k, want_v = kw.reference_fp8(k.reshape(-1, HKV, D), v.reshape(-1, HKV, D), slots, start, start,
                                      scales["k"], scales["v"])
    assert np.array_equal(np.frombuffer(emu.download(pools[0].ptr, pools[0].nbytes), np.uint8), want_k.reshape(-1))
    assert np.array_equal(np.frombuffer(emu.download(pools[1].ptr, pools[1].nbytes), np.uint8), want_v.reshape(-1))
    for b in (*bufs.values(), *pools, tables):
        b.free()
