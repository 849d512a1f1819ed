"""Section ``conv1d``: the short convolution (``q12drv.kernels.conv1d.conv1d``: causal depthwise conv1d + SiLU over
the packed streams, each stream's ``[W - 1, C]`` bf16 state read and rewritten in place) at Qwen3-Next's channel
count (C = 2 Hk dk + Hv dv = 8192, width 4), 8 x 2048 tokens and the GDN section's ragged batch.

Against its byte floor (x and the states read, y and the states written: :func:`bench.inputs.conv1d_floor_bytes`)
at the H200's 4.8 TB/s HBM bandwidth, the row's note saying what fraction of it the kernel reaches (the goal:
>= 70%); and against torch's ``F.conv1d`` per stream, in bf16 (torch's native dtype for the layer, as transformers'
Qwen3-Next runs it), depthwise (``groups=C``) on each stream's state rows and new rows already concatenated
channels-first (``[1, C, W - 1 + L]``: the concatenation and the layout change are outside the timed region), SiLU,
and the stream's last ``W - 1`` inputs copied into its state. Device time from events around 8 back-to-back calls,
median of 50 after 3 warm-ups; both sides rotate among buffer sets that together exceed 3x L2 (cold L2).
"""

from __future__ import annotations

from bench import inputs
from bench.compare.context import HBM_TBPS, Context, torch_mod
from bench.timing import q12_events_us, torch_events_us

__all__ = ["run"]


def run(ctx: Context) -> None:
    from q12drv.kernels import conv1d as conv

    dev = ctx.dev
    c, w = inputs.CONV_CHANNELS, inputs.CONV_WIDTH
    cases = inputs.CONV_CASES if ctx.gpu else inputs.CONV_EMU_CASES
    res = ctx.section("conv1d", {"channels": c, "width": w, "cases": {}})
    for key, counts in cases.items():
        n, total = len(counts), sum(counts)
        floor = inputs.conv1d_floor_bytes(total, n, c, w)
        r = res["cases"][key] = {"counts": list(counts), "tokens": total, "floor_bytes": floor}
        with inputs.staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
            n_sets = ctx.cold_sets(floor)
            sets = [inputs.conv1d_inputs(dev, counts, bufs, channels=c, width=w)]
            sets += [inputs.conv1d_inputs(dev, counts, bufs, channels=c, width=w, like=sets[0])
                     for _ in range(n_sets - 1)]
            r["buffer_sets"] = n_sets
            turn = [0]

            def q12():
                x = sets[turn[0] % n_sets]
                turn[0] += 1
                conv.conv1d(dev, meta, x["state_ptrs"].ptr, x["x"].ptr, x["y"].ptr, x["w"].ptr, channels=c, width=w)

            r["q12drv_us"] = q12_events_us(dev, q12, ctx.reps(50, 1))
            ctx.memory_rows(f"conv1d {key} C{c} W{w}: vs floor", r, "q12drv_us", floor, 0.70, tbps=HBM_TBPS,
                            of=f"the {HBM_TBPS} TB/s floor")
            if ctx.gpu:
                ctx.comparator(f"conv1d/torch {key}", lambda: _torch(ctx, key, counts, c, w, r, n_sets))


def _torch(ctx: Context, key: str, counts, c: int, w: int, r: dict, n_sets: int) -> None:
    """torch's depthwise ``F.conv1d`` (bf16) + SiLU per stream and the state copy, as many buffer sets as q12drv's."""
    torch = torch_mod()
    F = torch.nn.functional
    weight = (0.5 * torch.randn(c, 1, w, device="cuda", dtype=torch.float32)).to(torch.bfloat16)
    sets = []
    for _ in range(n_sets):  # each stream's state rows then its new rows, channels-first, concatenated here
        seqs = [torch.randn(1, c, w - 1 + length, device="cuda", dtype=torch.bfloat16) for length in counts]
        states = [torch.empty(1, c, w - 1, device="cuda", dtype=torch.bfloat16) for _ in counts]
        sets.append((seqs, states))
    turn = [0]

    def ref():
        seqs, states = sets[turn[0] % n_sets]
        turn[0] += 1
        out = []
        for seq, state in zip(seqs, states):
            out.append(F.silu(F.conv1d(seq, weight, groups=c)))
            state.copy_(seq[:, :, -(w - 1):])
        return out

    r["torch_us"] = torch_events_us(torch, ref, ctx.reps(50, 1))
    ctx.row(f"conv1d {key} C{c} W{w}", r["q12drv_us"], "torch F.conv1d bf16 + SiLU per stream", r["torch_us"],
            note="device time, cold L2; streams concatenated with their states untimed")
