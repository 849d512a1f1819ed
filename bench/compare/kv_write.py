"""Section ``kv_write``: the paged KV write (``ops.kv_write``, 8 x 8192 tokens, Hkv 2, D 256, blocks of 16) against
its byte floor (K and V read and written at the H200's device-to-device copy rate) and torch ``index_copy_`` into
the same slots. Device time from events around 8 back-to-back calls (:func:`bench.timing.q12_events_us`), median of
50 after 3 warm-ups; both sides rotate among buffer sets that together exceed 3x L2 (cold L2). Then the same write
into FP8 (e4m3) pools, per-head scales, against its floor (bf16 read, one byte a value written)."""

from __future__ import annotations

import numpy as np

from bench import inputs
from bench.compare.context import Context, faster, torch_mod
from bench.timing import q12_events_us, torch_events_us

__all__ = ["run"]


def run(ctx: Context) -> None:
    from q12drv.kernels import ops

    dev = ctx.dev
    counts = [8192] * 8 if ctx.gpu else [64] * 2
    hkv, d, bs = 2, 256, 16
    total = sum(counts)
    row_elems = hkv * d
    floor = 2 * 2 * total * row_elems * 2  # K and V, read + written (the slots' 8 B/token not counted)
    res = {"tokens": total, "row_bytes": row_elems * 2, "floor_bytes": floor}
    with inputs.staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
        pool_bytes = num_blocks * bs * row_elems * 2
        n_sets = ctx.cold_sets(2 * total * row_elems * 2 + 2 * pool_bytes)
        sets = []
        for i in range(n_sets):
            k, _ = inputs.rand_bf16(dev, (total, hkv, d), 1 + 10 * i)
            v, _ = inputs.rand_bf16(dev, (total, hkv, d), 2 + 10 * i)
            kp, vp = dev.alloc(pool_bytes), dev.alloc(pool_bytes)
            bufs += [k, v, kp, vp]
            sets.append((k, v, kp, vp))
        res["buffer_sets"] = n_sets
        turn = [0]

        def q12():
            k, v, kp, vp = sets[turn[0] % n_sets]
            turn[0] += 1
            ops.kv_write(dev, meta, k.ptr, v.ptr, kp.ptr, vp.ptr, num_kv_heads=hkv, head_dim=d, num_blocks=num_blocks)

        res["q12drv_us"] = q12_events_us(dev, q12, ctx.reps(50, 1))
        ctx.section("kv_write", res)
        ctx.memory_rows(f"kv_write {total // 1024}k tokens: vs D2D floor", res, "q12drv_us", floor, 0.75)
        # FP8 pools: the same bf16 K and V read, one byte a value written, each head scaled
        scales = dev.alloc(8 * hkv)
        bufs.append(scales)
        dev.upload(scales.ptr, np.full(2 * hkv, 0.05, np.float32))

        def q12_fp8():
            k, v, kp, vp = sets[turn[0] % n_sets]
            turn[0] += 1
            ops.kv_write(dev, meta, k.ptr, v.ptr, kp.ptr, vp.ptr, num_kv_heads=hkv, head_dim=d, num_blocks=num_blocks,
                         kv_dtype="fp8_e4m3", k_scale=scales.ptr, v_scale=int(scales.ptr) + 4 * hkv)

        res["fp8_us"] = q12_events_us(dev, q12_fp8, ctx.reps(50, 1))
        res["fp8_floor_bytes"] = 2 * total * row_elems * (2 + 1)
        ctx.memory_rows(f"kv_write fp8 {total // 1024}k tokens: vs D2D floor", res, "fp8_us", res["fp8_floor_bytes"],
                        0.75)
        if ctx.gpu:
            ctx.comparator("kv_write/torch",
                           lambda: _torch(ctx, arena, meta, total, hkv, d, num_blocks, bs, res, n_sets))


def _torch(ctx: Context, arena, meta, total, hkv, d, num_blocks, bs, res, n_sets=1) -> None:
    """torch ``index_copy_`` of K and V into pools at the slots q12drv staged, as many buffer sets as q12drv's."""
    torch = torch_mod()
    slots = np.frombuffer(arena.read(int(meta.slot_stacked) - int(arena.base), 8 * total), np.int64).copy()
    ts = torch.from_numpy(slots).cuda()
    sets = []
    for _ in range(n_sets):  # as many buffer sets as q12drv rotates among: same cold L2
        tk = torch.randn(total, hkv * d, device="cuda", dtype=torch.bfloat16)
        tv = torch.randn(total, hkv * d, device="cuda", dtype=torch.bfloat16)
        tkp = torch.zeros(num_blocks * bs, hkv * d, device="cuda", dtype=torch.bfloat16)
        sets.append((tk, tv, tkp, torch.zeros_like(tkp)))
    turn = [0]

    def ref():
        tk, tv, tkp, tvp = sets[turn[0] % n_sets]
        turn[0] += 1
        tkp.index_copy_(0, ts, tk)
        tvp.index_copy_(0, ts, tv)

    res["torch_index_copy_us"] = torch_events_us(torch, ref, ctx.reps(50, 1))
    ctx.row(f"kv_write {total // 1024}k tokens (K+V)", res["q12drv_us"], "torch index_copy_ (K, V)",
            res["torch_index_copy_us"], faster(1.5), note="device time, cold L2")
