"""Staging the stacked metadata (MRoPE), n streams x tokens per stream.

Paths (see ``bench.inputs.StagingCase``): ``host`` (q12drv's stager: validate, pack, one copy),
``device`` (validate, one expansion launch carrying the per-stream tail), ``planned`` (the same
through an ``ExpandPlan`` made once: a pass checks only its starts and counts), ``bare`` (one copy of
the same bytes already packed: the floor), ``per_field`` (the same bytes as one copy per field).
``round trip`` groups wait for the stream after each call; ``host time`` groups time the call
alone (the stream is drained before each, outside the timing).
"""

import pytest

from bench.inputs import on_gpu
from bench.timing import round_trip

PATHS = ("host", "device", "planned", "bare", "per_field")
NS = (1, 2, 4, 8, 16, 32, 64)
TOKENS = (16, 128, 1024, 2048, 8192)


def _rounds(dev, total_tokens):
    if not on_gpu(dev):
        return 3
    return 200 if total_tokens <= 16384 else 40


@pytest.mark.parametrize("path", PATHS)
def test_staging_8x2048_round_trip(benchmark, dev, staging_cases, path):
    benchmark.group = "staging 8x2048 MRoPE round trip"
    case = staging_cases(8, 2048)
    benchmark.extra_info["staged_bytes"] = case.staged_bytes
    benchmark.pedantic(round_trip(dev, getattr(case, path)), setup=dev.synchronize, rounds=_rounds(dev, 16384),
                       iterations=1, warmup_rounds=2)
    assert case.check()


@pytest.mark.parametrize("path", ("host", "device", "planned"))
def test_staging_8x2048_host_time(benchmark, dev, staging_cases, path):
    benchmark.group = "staging 8x2048 MRoPE host time"
    case = staging_cases(8, 2048)
    benchmark.pedantic(getattr(case, path), setup=dev.synchronize, rounds=_rounds(dev, 16384), iterations=1,
                       warmup_rounds=2)
    assert case.check()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("path", ("host", "device", "per_field"))
def test_staging_curve(benchmark, dev, staging_cases, n, tokens, path):
    benchmark.group = f"staging curve n={n}"
    case = staging_cases(n, tokens)
    benchmark.extra_info.update(n=n, tokens=tokens, staged_bytes=case.staged_bytes)
    benchmark.pedantic(round_trip(dev, getattr(case, path)), setup=dev.synchronize, rounds=_rounds(dev, n * tokens),
                       iterations=1, warmup_rounds=1)
