"""Section ``layer_ops``: each layer op's host time against the raw driver calls it issues, in the same run.

The op's driver calls are recorded once (on a device of its own whose driver entry points are wrapped: launches,
host-to-device copies, event records and queries: the pinned ring's) and replayed as the bare driver calls with the
same arguments (on the GPU: ``cuLaunchKernel``, ``cuMemcpyHtoDAsync``, ``cuEventRecord``, ``cuEventQuery`` from
cuda.bindings, a dependent launch replayed as a plain one; their results are not checked). Both are timed per call in batches, interleaved (``per_call_batches``),
on the 8 x 128 step case (``bench.inputs.StepCase``, Qwen3-Next-like), batched. The op is timed on a second pass of
the same case on the bench's own device, whose driver is not wrapped (the wrappers' Python call per driver call is
in neither number). The goal is on the ratio op / raw: <= 1.5.
"""

from __future__ import annotations

from typing import Any, Callable

from bench import inputs
from bench.compare.context import Context
from bench.timing import per_call_batches
from q12drv import open_device
from q12drv.core.driver import open_driver

__all__ = ["run", "CallRecorder"]

#: What a recorded call is replayed as: the driver entry points that issue work.
_CALLS = ("launch", "memcpy_htod_async", "event_record", "event_query")
_FACTORIES = ("launcher", "dependent_launcher", "bound_launcher")
GOAL = ("<=", 1.5)


class CallRecorder:
    """Wraps a driver instance's work-issuing entry points (before a Device is made on it); between :meth:`start`
    and :meth:`stop` each outermost call is listed as ``(kind, args)``, kind in ``launch``, ``memcpy_htod_async``,
    ``event_record``, ``event_query`` (a launch made through a launcher is listed as a ``launch`` with its arguments)."""

    def __init__(self, driver: Any):
        self.driver = driver
        self.calls: list | None = None
        self._depth = 0  # a base-class launcher calls launch(): only the outermost call is listed
        for name in _CALLS:
            self._wrap_call(name)
        for name in _FACTORIES:
            self._wrap_factory(name)

    def start(self) -> None:
        self.calls = []

    def stop(self) -> list:
        calls, self.calls = self.calls, None
        return calls

    def _enter(self, kind: str, args: tuple) -> None:
        if self.calls is not None and self._depth == 0:
            self.calls.append((kind, args))
        self._depth += 1

    def _wrap_call(self, name: str) -> None:
        orig = getattr(self.driver, name)

        def call(*args):
            self._enter(name, args)
            try:
                return orig(*args)
            finally:
                self._depth -= 1

        setattr(self.driver, name, call)

    def _wrap_factory(self, name: str) -> None:
        orig = getattr(self.driver, name)
        rec = self

        if name == "bound_launcher":
            def factory(func, grid, block, smem, stream, params_addr, owner=None):
                fire = orig(func, grid, block, smem, stream, params_addr, owner)
                args = (func, grid, block, smem, stream, params_addr)

                def wrapped():
                    rec._enter("launch", args)
                    try:
                        fire()
                    finally:
                        rec._depth -= 1

                wrapped.owner = getattr(fire, "owner", owner)
                return wrapped
        else:
            def factory(func, params_addr):
                fire = orig(func, params_addr)

                def wrapped(grid, block, smem, stream):
                    rec._enter("launch", (func, grid, block, smem, stream, params_addr))
                    try:
                        fire(grid, block, smem, stream)
                    finally:
                        rec._depth -= 1

                return wrapped

        setattr(self.driver, name, factory)


def raw_replay(dev, calls: list) -> Callable[[], None]:
    """The recorded ``calls`` as the bare driver calls (on the emulator, the driver's own methods, unwrapped)."""
    plan = []
    if inputs.on_gpu(dev):
        from cuda.bindings import driver as cu

        for kind, a in calls:
            if kind == "launch":
                func, (gx, gy, gz), (bx, by, bz), smem, stream, addr = a
                plan.append((cu.cuLaunchKernel, (func, gx, gy, gz, bx, by, bz, smem, stream, addr, 0)))
            elif kind == "memcpy_htod_async":
                plan.append((cu.cuMemcpyHtoDAsync, a))
            elif kind == "event_record":
                plan.append((cu.cuEventRecord, a))
            else:
                plan.append((cu.cuEventQuery, a))
    else:  # the emulated devices are separate machines: the recording device's context made current first
        cls = type(dev.driver)
        plan.append((dev.set_current, ()))
        for kind, a in calls:
            plan.append((getattr(cls, kind).__get__(dev.driver), a))

    def replay():
        for f, a in plan:
            f(*a)

    return replay


def _ops(q12, step) -> dict:
    """The layer ops of ``q12`` (a pass of ``step``) as no-argument calls."""
    p, att, nb = step.ptrs, step.att, step.num_blocks
    kw = step.gdn_kwargs()
    row, conv_row = q12.stage_states([step.state_ptrs, step.conv_state_ptrs])  # once a pass, outside the ops
    c, conv = step.conv_channels, (p["conv_x"], p["conv_y"], p["conv_w"])
    return {
        "attention_layer": lambda: q12.attention_layer(p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], att,
                                                       num_blocks=nb),
        "rope": lambda: q12.rope(p["q"], p["k"], att),
        "kv_write": lambda: q12.kv_write(p["k"], p["v"], p["k_pool"], p["v_pool"], att, num_blocks=nb),
        "attention": lambda: q12.attention(p["q"], p["k_pool"], p["v_pool"], p["o"], att, num_blocks=nb),
        "gdn_layer": lambda: q12.gdn_layer(step.state_ptrs, step.gdn_tensors, step.gdn, **kw),
        "gdn_layer (staged states)": lambda: q12.gdn_layer(row, step.gdn_tensors, step.gdn, **kw),
        "conv1d": lambda: q12.conv1d(step.conv_state_ptrs, *conv, channels=c, width=4),
        "conv1d (staged states)": lambda: q12.conv1d(conv_row, *conv, channels=c, width=4),
    }


def run(ctx: Context) -> None:
    recorder = CallRecorder(open_driver("cuda" if ctx.gpu else "emu"))
    dev = open_device(recorder.driver, ctx.dev.ordinal)
    res: dict = {}
    counts = inputs.step_counts("8x128", ctx.gpu)
    step, plain = inputs.StepCase(dev, counts), inputs.StepCase(ctx.dev, counts)
    try:
        # the calls are recorded on the wrapped device; the op is timed on the bench's own device (no wrappers)
        recorded, timed = _ops(step.run("batched"), step), _ops(plain.run("batched"), plain)
        dev.synchronize()
        ctx.dev.synchronize()
        batch, batches = (20, ctx.reps(40, 2)) if ctx.gpu else (2, 2)

        def sync():
            dev.synchronize()
            ctx.dev.synchronize()

        for name, op in recorded.items():
            op()  # warm: every launch of this op prepared before the recording
            timed[name]()
            dev.synchronize()
            ctx.dev.synchronize()
            recorder.start()
            op()
            calls = recorder.stop()
            dev.synchronize()
            kinds = [k for k, _ in calls]
            t = per_call_batches({"op": timed[name], "raw": raw_replay(dev, calls)}, batch, batches, sync)
            res[name] = {**t, "launches": kinds.count("launch"), "copies": kinds.count("memcpy_htod_async"),
                         "event_records": kinds.count("event_record")}
            r = res[name]
            what = ", ".join(f"{k} {w}" for k, w in ((r["launches"], "launches"), (r["copies"], "copies"),
                                                      (r["event_records"] + kinds.count("event_query"), "event calls"))
                             if k)
            ctx.row(f"layer op {name}: host time (8x128)", t["op"], f"raw driver calls ({what})", t["raw"], GOAL,
                    note="host time per call")
    finally:
        dev.synchronize()
        ctx.dev.synchronize()
        step.close()
        plain.close()
        dev.close()
    ctx.section("layer_ops", res)
