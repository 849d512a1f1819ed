"""Section ``graph``: the 8 x 128 step (one attention and one Gated DeltaNet layer) captured as a CUDA graph
(:class:`~q12drv.prefill.graphs.PassGraph`, stage copy or device expansion + layer kernels) and replayed with the
streams' metadata set anew, against the eager batched step and the per-stream fallback: round trips, medians over
50 repetitions, the three interleaved. The replay's outputs (o, the GDN output, the K pool, the states) are checked
against the eager pass's.

Then the same 8 x 128 pass through Qwen3-Next's 48 layers (12 x (3 x (conv1d + GDN) + 1 attention), device
expansion) captured whole: its replay's round trip (the graph launch and a stream synchronize) against its device
time (events recorded around the replay), the goal being device time plus a few microseconds; and the host time of
giving it a new batch (``set_streams`` and every state table, ``set_state_tables``), work a runtime does while the
previous step runs."""

from __future__ import annotations

from bench import inputs
from bench.compare.context import Context
from bench.timing import host_and_round_trip, q12_events_us

__all__ = ["run"]


def run(ctx: Context) -> None:
    dev = ctx.dev
    res = {}
    step = inputs.StepCase(dev, inputs.step_counts("8x128", ctx.gpu))
    try:
        for expand in ("host", "device"):
            gp, arena = step.pass_graph(expand)
            try:
                equal = replay_equals_eager(step, gp)
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
        whole_step(ctx, step, res)
    finally:
        step.close()
    ctx.section("graph", res)


def replay_equals_eager(step: inputs.StepCase, gp, blocks: int = 0) -> bool:
    """Whether a replay of ``gp`` (``step``'s layers, ``blocks`` as :meth:`~bench.inputs.StepCase.run` takes it)
    writes what the eager batched pass writes (o, the GDN output, the K pool, the states), each from fresh inputs."""
    step.reset()
    step.run("batched", blocks)
    step.dev.synchronize()
    eager = {k: step.read(k) for k in ("o", "go", "k_pool", "states", "conv_y", "conv_states")}
    step.reset()
    step.replay(gp)
    step.dev.synchronize()
    return all(step.read(k) == v for k, v in eager.items())


def whole_step(ctx: Context, step: inputs.StepCase, res: dict) -> None:
    """The 48-layer pass as one graph (on the emulator one block of 4 layers): replay round trip against device
    time, and the new batch's host time."""
    dev = ctx.dev
    blocks = 12 if ctx.gpu else 1
    layers = f"{4 * blocks}_layers"
    gp, arena = step.pass_graph("device", blocks=blocks)
    try:
        equal = replay_equals_eager(step, gp, blocks)
        reps = ctx.reps(50, 2)
        t = host_and_round_trip({"set_batch": lambda: step.set_graph_batch(gp), "replay": gp.replay}, reps,
                                dev.synchronize)
        device_us = q12_events_us(dev, gp.replay, reps)  # replays back to back: the device never waits for the host
        res[layers] = {"replay_equals_eager": equal, **t, "replay_device_us": device_us,
                       "ssm_layers": gp.num_ssm_layers}
    finally:
        gp.close()
        arena.close()
    rt = res[layers]["replay"]["round_trip_us"]
    name = f"graph 8x128 {4 * blocks} layers"
    ctx.row(f"{name}: replay round trip", rt, "its device time (events)", device_us,
            note=f"info: goal device time plus a few us; host adds {rt - device_us:,.1f} us"
                 + ("" if equal else "; REPLAY != EAGER"))
    if not equal:
        ctx.error(f"graph/{layers}", "replay results differ from the eager pass")
    ctx.row(f"{name}: new batch host time (set_streams + set_state_tables)", res[layers]["set_batch"]["host_us"],
            "replay round trip", rt, note="info: overlaps the previous step")
