"""Launch latency (host enqueue time per launch), cuda-python's matrix plus q12drv's paths.

For each parameter shape (``LAUNCH_CASES``): ``raw`` is the driver's launch call with the
pre-packed argument array and nothing else (the floor); ``Launch.launch`` is q12drv's per-launch
path; ``bound`` is :meth:`~q12drv.core.launch.Launch.bind`'s zero-argument callable; ``set+launch``
rewrites every scalar argument first. One benchmark call is ``BATCH`` launches (the stream is
drained before each call, outside the timing); ``extra_info["us_per_launch"]`` is per launch.
"""

import pytest

from bench.inputs import (BENCH_SOURCE, BENCH_SOURCE_DIR, LAUNCH_CASES, bench_launch, kv_write_launcher, on_gpu,
                          raw_launcher)

BATCH = 100
GRID, BLOCK = (1, 1, 1), (32, 1, 1)
PATHS = ("raw", "Launch.launch", "bound", "set+launch")


def _batched(fn):
    def run():
        for _ in range(BATCH):
            fn()
    return run


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_launch_latency(benchmark, dev, case, path):
    benchmark.group = f"launch-latency {case}"
    launch = bench_launch(dev, case)
    stream = dev.stream
    if path == "raw":
        fn = raw_launcher(dev, launch, GRID, BLOCK)
    elif path == "Launch.launch":
        def fn():
            launch.launch(GRID, BLOCK, 0, stream)
    elif path == "bound":
        fn = launch.bind(GRID, BLOCK, 0, stream)
    else:
        values = LAUNCH_CASES[case][1]

        def fn():
            launch.set(**values)
            launch.launch(GRID, BLOCK, 0, stream)
    benchmark.extra_info["driver"] = dev.driver.name
    benchmark.pedantic(_batched(fn), setup=dev.synchronize, rounds=50 if on_gpu(dev) else 5, iterations=1,
                       warmup_rounds=1)
    if benchmark.stats is not None:
        benchmark.extra_info["us_per_launch"] = benchmark.stats.stats.median / BATCH * 1e6
    dev.synchronize()


def test_kv_write_launcher(benchmark, dev, staging_cases):
    """``ops.kv_write``: argument checks, geometry, packing and the launch (8 streams x 16 tokens)."""
    benchmark.group = "launcher"
    fn, buffers = kv_write_launcher(dev, staging_cases(8, 16))
    benchmark.pedantic(fn, setup=dev.synchronize, rounds=200 if on_gpu(dev) else 5, iterations=1, warmup_rounds=1)
    dev.synchronize()
    for buf in buffers:
        buf.free()


def test_launch_kernels_build_outside_cuda_src():
    """The benchmark kernels live in bench/cuda/ (no product code), their includes in cuda_src/."""
    from q12drv.core.launch import parse_signatures
    from q12drv.core.nvrtc import compile_source, local_headers
    from q12drv.kernels.meta import meta_defines

    source = (BENCH_SOURCE_DIR / BENCH_SOURCE).read_text()
    entries = parse_signatures(source, {"Q12Meta": object, "Q12BenchBig": object}, local_headers(source))
    assert set(entries) == {entry for entry, _ in LAUNCH_CASES.values()}
    assert compile_source(BENCH_SOURCE, defines=meta_defines(), source_dir=BENCH_SOURCE_DIR).image
