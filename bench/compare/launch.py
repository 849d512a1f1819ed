"""Section ``launch``: host enqueue time per launch of the same empty kernel, q12drv's paths against the raw
pre-packed ``cuLaunchKernel``.

The whole parameter matrix (:data:`bench.inputs.LAUNCH_CASES`) x the paths ``raw`` (the driver call with the
pre-packed argument array, its result checked once per batch: the floor), ``Launch.launch``, ``Launch.bind()``'s
callable and ``set`` + launch; the ``ops.kv_write`` launcher (checks + geometry + packing + launch, 8 x 16 tokens)
against its own raw launch; cuda.core's ``launch()`` when installed. Median over batches of 200 launches (60
batches; 15 with ``--quick``), the stream drained before each batch, the paths interleaved batch by batch.
"""

from __future__ import annotations

import numpy as np

from bench import inputs
from bench.compare.context import Context
from bench.timing import per_call_batches

__all__ = ["run"]

RAW = "raw cuLaunchKernel, pre-packed"


def run(ctx: Context) -> None:
    dev = ctx.dev
    grid, block = (1, 1, 1), (32, 1, 1)
    stream = dev.stream
    res = {}
    batch, batches = (200, 60) if ctx.gpu else (20, 3)
    if ctx.quick and ctx.gpu:
        batches = 15
    for case in inputs.LAUNCH_CASES:
        launch = inputs.bench_launch(dev, case)
        raw = inputs.raw_launcher(dev, launch, grid, block)
        values = inputs.LAUNCH_CASES[case][1]

        def q12(launch=launch):
            launch.launch(grid, block, 0, stream)

        def set_launch(launch=launch, values=values):
            launch.set(**values)
            launch.launch(grid, block, 0, stream)

        paths = {"raw": raw, "Launch.launch": q12, "bound": launch.bind(grid, block, 0, stream), "set+launch": set_launch}
        res[case] = per_call_batches(paths, batch, batches, dev.synchronize)
        if ctx.gpu:
            err = raw()[0]
            if int(err):
                raise RuntimeError(f"raw cuLaunchKernel failed: {err!r}")
    ctx.section("launch", res)
    a = res["6 u64 + 2 i32"]
    ctx.row("launch: Launch.launch (6 u64 + 2 i32)", a["Launch.launch"], RAW, a["raw"], ("<=", 1.05))
    ctx.row("launch: Launch.bind() call", a["bound"], RAW, a["raw"], ("<=", 1.05))
    ctx.row("launch: set(8 args) + launch", a["set+launch"], RAW, a["raw"])
    m = res["Q12Meta by value"]
    ctx.row("launch: Launch.launch (Q12Meta by value)", m["Launch.launch"], RAW, m["raw"], ("<=", 1.05))

    # the whole launcher: argument checks, geometry, packing, launch
    from q12drv.kernels import ops

    case = inputs.StagingCase(dev, 8, 16, mrope=False)
    try:
        kv, buffers = inputs.kv_write_launcher(dev, case)
        kv_launch = ops.prepared(dev, "q12_kv_write")
        kv_raw = inputs.raw_launcher(dev, kv_launch, (1, 1, 1), (256, 1, 1))
        t = per_call_batches({"ops.kv_write": kv, "raw": kv_raw}, batch, max(3, batches // 2), dev.synchronize)
        res["ops.kv_write"] = t
        ctx.row("launcher: ops.kv_write (checks+pack+launch)", t["ops.kv_write"], RAW, t["raw"],
                note="info: the full launcher")
        for buf in buffers:
            buf.free()
    finally:
        case.close()

    if ctx.gpu:
        try:
            res["cuda.core launch()"] = _cuda_core_launch(ctx, batch, batches)
            ctx.row("launch: cuda.core launch() (comparator)", res["cuda.core launch()"], RAW, a["raw"],
                    note="info: what cuda.core costs here")
        except Exception as exc:  # optional comparator
            ctx.error("launch/cuda.core", f"{type(exc).__name__}: {exc}")


def _cuda_core_launch(ctx: Context, batch: int, batches: int) -> float:
    """cuda.core's ``launch()`` of the same empty kernel (6 u64 + 2 i32), timed as the other paths."""
    from cuda.core import Device as CoreDevice
    from cuda.core import LaunchConfig, ObjectCode, launch

    from q12drv.core.nvrtc import compile_source
    from q12drv.kernels.meta import meta_defines

    image = compile_source(inputs.BENCH_SOURCE, arch=ctx.dev.arch, defines=tuple(meta_defines()),
                           source_dir=inputs.BENCH_SOURCE_DIR).image
    cdev = CoreDevice(ctx.dev.ordinal)
    cdev.set_current()
    kernel = ObjectCode.from_cubin(image).get_kernel("q12_bench_args8")
    s = cdev.create_stream()
    cfg = LaunchConfig(grid=1, block=32)
    args = [np.uint64(0x7F00_0000_0000 + 256 * i) for i in range(6)] + [np.int32(7), np.int32(9)]

    def fire():
        launch(s, cfg, kernel, *args)

    t = per_call_batches({"core": fire}, batch, batches, s.sync)["core"]
    s.close()
    return t
