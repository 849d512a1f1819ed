"""One prefill step (admission, staging, one attention layer, one Gated DeltaNet layer), batched vs per stream.

Qwen3-Next-like shapes (``bench.inputs.QWEN3_NEXT``); ``8x128``: eight streams of 128 tokens,
``ragged``: eight streams of 256..2048 (cut down on the emulator). Round trip: the step plus a
wait for the stream.
"""

import pytest

from bench.inputs import StepCase, on_gpu, step_counts
from bench.timing import round_trip


@pytest.fixture(scope="module")
def steps(dev):
    cases = {}

    def get(name):
        if name not in cases:
            cases[name] = StepCase(dev, step_counts(name, on_gpu(dev)))
        return cases[name]

    yield get
    for c in cases.values():
        c.close()


@pytest.mark.parametrize("mode", ["batched", "per_stream"])
@pytest.mark.parametrize("case", ["8x128", "ragged"])
def test_step(benchmark, dev, steps, case, mode):
    benchmark.group = f"step {case}"
    step = steps(case)
    benchmark.extra_info["counts"] = step.counts
    benchmark.pedantic(round_trip(dev, lambda: step.run(mode)), setup=dev.synchronize,
                       rounds=50 if on_gpu(dev) else 1, iterations=1, warmup_rounds=5)
