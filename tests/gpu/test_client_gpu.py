"""The example hybrid runtime on the GPU against transformers' Qwen3-Next forward (eager attention, its torch Gated
DeltaNet and convolution), per prompt: 8 ragged prompts of 1..2048 tokens batched, the same prompts in 2-3 interleaved
chunks mixed with decode steps, batched == per stream bit for bit. Tolerances: tests/client.py."""

from __future__ import annotations

import pytest

from tests.client import check_batched_prefill, check_chunked_equals_one_shot, setup_on, torch

pytestmark = pytest.mark.gpu

LENGTHS = (1, 2048, 77, 512, 3, 1500, 64, 900)
SIZES = dict(max_streams=8, max_tokens=4096, max_pass_tokens=8192)


@pytest.fixture(scope="module")
def setup():
    return setup_on("cuda", LENGTHS, seed=2)


def test_batched_prefill_equals_transformers(setup):
    check_batched_prefill(setup, **SIZES)


def test_chunks_and_decode_steps_equal_one_shot(setup):
    splits = [[1], [1000, 1, 1047], [40, 37], [256, 1, 255], [1, 1, 1], [700, 800], [63, 1], [450, 450]]
    check_chunked_equals_one_shot(setup, splits, **SIZES)


def test_batched_equals_per_stream_bit_for_bit(setup):
    ex, model, prompts, _ = setup
    out = {}
    for mode in ("batched", "per_stream"):
        rt = ex.HybridRuntime(model, **SIZES)
        streams = [rt.add_stream() for _ in prompts]
        out[mode] = rt.step(list(zip(streams, prompts)), mode=mode)
    for a, b in zip(out["batched"], out["per_stream"]):
        assert torch.equal(a, b)
