"""Section ``step``: one prefill step (admission, staging, one attention layer and one Gated DeltaNet layer,
Qwen3-Next-like: :data:`bench.inputs.QWEN3_NEXT`), batched against the per-stream fallback, 8 x 128 and 8 ragged
256..2048 tokens: wall-clock round trip (the step and a stream synchronize), medians over 50 repetitions after 5
warm-ups, the two modes interleaved. Also the 8 x 128 pass through Qwen3-Next's 48 layers (12 x (3 x (conv1d +
GDN) + 1 attention), every state table staged once), for information: there the per-layer work, not the per-pass
work, dominates."""

from __future__ import annotations

from bench import inputs
from bench.compare.context import Context, faster
from bench.timing import host_and_round_trip

__all__ = ["run"]


def run(ctx: Context) -> None:
    dev = ctx.dev
    res = {}
    for name in ("8x128", "ragged"):
        step = inputs.StepCase(dev, inputs.step_counts(name, ctx.gpu))
        try:
            # 50 repetitions after 5 warm-ups: with fewer (20 after 2) this median and the graph section's eager
            # step, the same pass, disagreed; with these they agree
            t = host_and_round_trip({"batched": lambda: step.run("batched"), "per_stream": lambda: step.run("per_stream")},
                                    ctx.reps(50, 1), dev.synchronize, warmup=5)
            res[name] = {"counts": step.counts, **t}
        finally:
            step.close()
        goal = 4 if name == "8x128" else 1.5
        ctx.row(f"step {name}: batched (stage+attn+GDN)", res[name]["batched"]["round_trip_us"], "per-stream fallback",
                res[name]["per_stream"]["round_trip_us"], faster(goal))
    # the same 8 x 128 pass through all 48 layers of Qwen3-Next (12 x (3 x (conv1d + GDN) + 1 attention)): what a
    # runtime's pass costs once the per-layer work, not the per-pass work, dominates
    step = inputs.StepCase(dev, inputs.step_counts("8x128", ctx.gpu))
    try:
        t = host_and_round_trip({"batched": lambda: step.run("batched", 12), "per_stream": lambda: step.run("per_stream", 12)},
                                ctx.reps(10, 1), dev.synchronize, warmup=1)
        res["8x128_48_layers"] = {"counts": step.counts, **t}
    finally:
        step.close()
    for mode in ("batched", "per_stream"):
        ctx.row(f"step 8x128 48 layers: {mode} host time", res["8x128_48_layers"][mode]["host_us"], "its round trip",
                res["8x128_48_layers"][mode]["round_trip_us"], note="info")
    ctx.row("step 8x128 48 layers: batched", res["8x128_48_layers"]["batched"]["round_trip_us"], "per-stream fallback",
            res["8x128_48_layers"]["per_stream"]["round_trip_us"],
            note="info: Qwen3-Next's 12 x (3 x (conv1d + GDN) + attn)")
    ctx.section("step", res)
