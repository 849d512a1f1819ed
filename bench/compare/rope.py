"""Section ``rope``: RoPE in place on Q and K (``ops.rope``, 8 x 8192 tokens, Hq 16, Hkv 2, D 256, partial rotary 64,
theta 1e7) against its byte floor (the rotary dims of every head read and written, and the positions, at the H200's
device-to-device copy rate) and eager torch (the Hugging Face formula); the same with a scaled table
(:class:`~q12drv.kernels.rope.RopeScaling`, linear factor 4: theta's inverse frequencies divided by 4), against the
floor, the plain kernel and eager torch on the same scaled frequencies; and full rotary at Qwen3-like heads (Hq 32,
Hkv 8, D 128, rotary 128) against its floor. Device time from events around 8 back-to-back calls, median of 50
after 3 warm-ups; both sides rotate among buffer sets that together exceed 3x L2 (cold L2)."""

from __future__ import annotations

import numpy as np

from bench import inputs
from bench.compare.context import Context, faster, torch_mod
from bench.timing import q12_events_us, torch_events_us

__all__ = ["run", "LINEAR_FACTOR"]

#: The scaled rows' linear factor (positions divided by it: inverse frequencies divided by it).
LINEAR_FACTOR = 4


def run(ctx: Context) -> None:
    from q12drv.kernels import ops
    from q12drv.kernels import rope as rk

    dev = ctx.dev
    counts = [8192] * 8 if ctx.gpu else [32] * 2
    hq, hkv, d, rd, theta = 16, 2, 256, 64, 1e7
    total = sum(counts)
    # The floor: only the rotary dims of each head must move (read + written), plus the positions.
    floor = rk.floor_bytes(total, hq, hkv, rd)
    res = {"tokens": total, "shape": [hq, hkv, d, rd], "floor_bytes": floor}
    with inputs.staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
        # L2 holds whole 32-byte sectors: the rotary prefix of a head row (128 B) is what a pass touches.
        n_sets = ctx.cold_sets(floor)
        sets = []
        for i in range(n_sets):
            q, _ = inputs.rand_bf16(dev, (total, hq, d), 3 + 10 * i)
            k, _ = inputs.rand_bf16(dev, (total, hkv, d), 4 + 10 * i)
            bufs += [q, k]
            sets.append((q, k))
        res["buffer_sets"] = n_sets
        turn = [0]

        def q12():
            q, k = sets[turn[0] % n_sets]
            turn[0] += 1
            ops.rope(dev, meta, q.ptr, k.ptr, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rotary_dim=rd, theta=theta)

        res["q12drv_us"] = q12_events_us(dev, q12, ctx.reps(50, 1))
        # Full rotary (Qwen3-like Hq 32 Hkv 8 D 128 rd 128): timing only, so the buffers are left
        # uninitialised (no host RNG for 1.3 GB; the kernel's speed does not depend on the values).
        fhq, fhkv, fd, frd, ftheta = 32, 8, 128, 128, 1e6
        ffloor = rk.floor_bytes(total, fhq, fhkv, frd)
        fsets = []
        for _ in range(ctx.cold_sets(ffloor)):
            fq, fk = dev.alloc(total * fhq * fd * 2), dev.alloc(total * fhkv * fd * 2)
            bufs += [fq, fk]
            fsets.append((fq, fk))

        def q12_full():
            q, k = fsets[turn[0] % len(fsets)]
            turn[0] += 1
            ops.rope(dev, meta, q.ptr, k.ptr, num_q_heads=fhq, num_kv_heads=fhkv, head_dim=fd, rotary_dim=frd,
                     theta=ftheta)

        res["full_rotary"] = {"shape": [fhq, fhkv, fd, frd], "floor_bytes": ffloor}
        res["full_rotary"]["q12drv_us"] = q12_events_us(dev, q12_full, ctx.reps(50, 1))
        # Scaled RoPE: the same problem and buffer sets, the frequencies from a table (made once, passed by value in
        # the launch) instead of theta.
        scaling = rk.RopeScaling(inv_freq=rk.inv_freq(rd, theta) / LINEAR_FACTOR)

        def q12_scaled():
            q, k = sets[turn[0] % n_sets]
            turn[0] += 1
            ops.rope(dev, meta, q.ptr, k.ptr, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rotary_dim=rd, theta=theta,
                     scaling=scaling)

        res["scaled"] = {"scaling": f"linear {LINEAR_FACTOR}", "floor_bytes": floor}
        res["scaled"]["q12drv_us"] = q12_events_us(dev, q12_scaled, ctx.reps(50, 1))
        ctx.section("rope", res)
        ctx.memory_rows(f"rope {total // 1024}k tokens: vs floor (rotary dims)", res, "q12drv_us", floor, 0.70)
        ctx.memory_rows(f"rope {total // 1024}k tokens: full rotary Hq32 Hkv8 D128 rd128", res["full_rotary"],
                        "q12drv_us", ffloor, None)
        ctx.memory_rows(f"rope {total // 1024}k tokens: scaled (linear x{LINEAR_FACTOR}) vs floor", res["scaled"],
                        "q12drv_us", floor, 0.70)
        ctx.row(f"rope {total // 1024}k tokens: scaled (linear x{LINEAR_FACTOR})", res["scaled"]["q12drv_us"],
                "q12drv RoPE from theta (no table)", res["q12drv_us"], note="info: what the table costs")
        if ctx.gpu:
            ctx.comparator("rope/torch", lambda: _torch(ctx, streams, total, hq, hkv, d, rd, theta, res, n_sets))


def _torch(ctx: Context, streams, total, hq, hkv, d, rd, theta, res, n_sets=1) -> None:
    """Eager torch, the Hugging Face formula (cos and sin from the positions each call, ``x * cos + rotate_half(x)
    * sin`` on the rotary dims, the rest concatenated back), on as many buffer sets as q12drv's: theta's
    frequencies, then the same divided by :data:`LINEAR_FACTOR` (transformers' linear scaling)."""
    torch = torch_mod()
    pos = torch.from_numpy(np.concatenate([np.arange(s.proc_start, s.proc_start + s.proc_count)
                                           for s in streams])).cuda()
    sets = [(torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
    inv_freq = 1.0 / (theta ** (torch.arange(0, rd, 2, device="cuda", dtype=torch.float32) / rd))
    turn = [0]

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def hf(inv_freq=inv_freq):
        tq, tk = sets[turn[0] % n_sets]
        turn[0] += 1
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(tq.dtype)[:, None, :], emb.sin().to(tq.dtype)[:, None, :]
        out = []
        for x in (tq, tk):
            xr, xp = x[..., :rd], x[..., rd:]
            out.append(torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1))
        return out

    res["torch_eager_us"] = torch_events_us(torch, hf, ctx.reps(50, 1))
    ctx.row(f"rope {total // 1024}k tokens (Hq16 Hkv2 D256 rd64)", res["q12drv_us"], "eager torch (HF formula)",
            res["torch_eager_us"], faster(3), note="device time, cold L2")
    scaled_inv_freq = inv_freq / LINEAR_FACTOR
    res["scaled"]["torch_eager_us"] = torch_events_us(torch, lambda: hf(scaled_inv_freq), ctx.reps(50, 1))
    ctx.row(f"rope {total // 1024}k tokens scaled (linear x{LINEAR_FACTOR})", res["scaled"]["q12drv_us"],
            f"eager torch (HF formula, inv_freq / {LINEAR_FACTOR})", res["scaled"]["torch_eager_us"], faster(3),
            note="device time, cold L2")
