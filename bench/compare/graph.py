"""Section ``graph``: the 8 x 128 step (one attention and one Gated DeltaNet layer) captured as a CUDA graph
(:class:`~q12drv.prefill.graphs.PassGraph`, stage copy or device expansion + layer kernels) and replayed with the
streams' metadata set anew, against the eager batched step and the per-stream fallback: round trips, medians over
50 repetitions, the three interleaved. The replay's outputs (o, the GDN output, the K pool, the states) are checked
against the eager pass's."""

from __future__ import annotations

from bench import inputs
from bench.compare.context import Context
from bench.timing import host_and_round_trip

__all__ = ["run"]


def run(ctx: Context) -> None:
    dev = ctx.dev
    res = {}
    step = inputs.StepCase(dev, inputs.step_counts("8x128", ctx.gpu))
    try:
        for expand in ("host", "device"):
            gp, arena = step.pass_graph(expand)
            try:
                step.reset()
                step.run("batched")
                dev.synchronize()
                eager = {k: step.read(k) for k in ("o", "go", "k_pool", "states")}
                step.reset()
                step.replay(gp)
                dev.synchronize()
                equal = all(step.read(k) == v for k, v in eager.items())
                t = host_and_round_trip({"eager": lambda: step.run("batched"), "replay": lambda: step.replay(gp),
                                         "per_stream": lambda: step.run("per_stream")}, ctx.reps(50, 2), dev.synchronize)
                res[expand] = {"replay_equals_eager": equal, **t}
            finally:
                gp.close()
                arena.close()
            ctx.row(f"graph ({expand} metadata): set_streams + replay", res[expand]["replay"]["round_trip_us"],
                    "eager batched step (Q12Pass)", res[expand]["eager"]["round_trip_us"],
                    note="info: 8x128 attn+GDN" + ("" if equal else "; REPLAY != EAGER"))
            ctx.row(f"graph ({expand} metadata): set_streams + replay", res[expand]["replay"]["round_trip_us"],
                    "per-stream fallback step", res[expand]["per_stream"]["round_trip_us"], note="info: 8x128 attn+GDN")
            if not equal:
                ctx.error(f"graph/{expand}", "replay results differ from the eager pass")
    finally:
        step.close()
    ctx.section("graph", res)
