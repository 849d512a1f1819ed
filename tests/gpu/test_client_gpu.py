"""The example hybrid runtime on the GPU against transformers' Qwen3-Next forward (eager attention, its torch Gated
DeltaNet and convolution), per prompt: 8 ragged prompts of 1..2048 tokens batched, the same prompts in 2-3 interleaved
chunks mixed with decode steps, batched == per stream bit for bit. Tolerances: tests/client.py."""

from __future__ import annotations

import pytest

from tests.client import check_close, model_on, reference_is_torch, reference_logits, rel_l2, run_chunked, torch

pytestmark = pytest.mark.gpu

LENGTHS = (1, 2048, 77, 512, 3, 1500, 64, 900)


@pytest.fixture(scope="module")
def setup():
    reference_is_torch()
    ex, model = model_on("cuda")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [reference_logits(model, p) for p in prompts]
    return ex, model, prompts, refs


def test_batched_prefill_equals_transformers(setup):
    ex, model, prompts, refs = setup
    rt = ex.HybridRuntime(model, max_streams=8, max_tokens=4096, max_pass_tokens=8192)
    streams = [rt.add_stream() for _ in prompts]
    for i, (ours, ref) in enumerate(zip(rt.step(list(zip(streams, prompts))), refs)):
        check_close(ours.float(), ref, f"prompt {i} ({len(prompts[i])} tokens)")


def test_chunks_and_decode_steps_equal_one_shot(setup):
    ex, model, prompts, refs = setup
    once, _ = run_chunked(ex.HybridRuntime(model, max_streams=8, max_tokens=4096, max_pass_tokens=8192), prompts,
                          [[len(p)] for p in prompts])
    splits = [[1], [1000, 1, 1047], [40, 37], [256, 1, 255], [1, 1, 1], [700, 800], [63, 1], [450, 450]]
    chunked, _ = run_chunked(ex.HybridRuntime(model, max_streams=8, max_tokens=4096, max_pass_tokens=8192),
                             prompts, splits)
    for i in range(len(prompts)):
        assert rel_l2(chunked[i], once[i]) < 1e-2, i
        check_close(chunked[i], refs[i], f"prompt {i} in chunks {splits[i]}")


def test_batched_equals_per_stream_bit_for_bit(setup):
    ex, model, prompts, _ = setup
    out = {}
    for mode in ("batched", "per_stream"):
        rt = ex.HybridRuntime(model, max_streams=8, max_tokens=4096, max_pass_tokens=8192)
        streams = [rt.add_stream() for _ in prompts]
        out[mode] = rt.step(list(zip(streams, prompts)), mode=mode)
    for a, b in zip(out["batched"], out["per_stream"]):
        assert torch.equal(a, b)
