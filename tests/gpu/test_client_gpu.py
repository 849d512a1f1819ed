"""The example hybrid runtime on the GPU against transformers' forward (eager attention, its torch Gated DeltaNet and
convolution), per prompt, for Qwen3-Next and Qwen3.5's text model: 8 ragged prompts of 1..2048 tokens batched, the
same prompts in 2-3 interleaved chunks mixed with decode steps, batched == per stream bit for bit; for Qwen3.5 a
prompt with a 32 x 24 image's T/H/W positions, in chunks split inside the image. Tolerances: tests/client.py."""

from __future__ import annotations

import pytest

from tests.client import (MODELS, MROPE_MODELS, check_batched_equals_per_stream, check_batched_prefill,
                          check_chunked_equals_one_shot, check_close, image_positions, reference_logits,
                          setup_on, torch)

pytestmark = pytest.mark.gpu

LENGTHS = (1, 2048, 77, 512, 3, 1500, 64, 900)
SIZES = dict(max_streams=8, max_tokens=4096, max_pass_tokens=8192)


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    return setup_on("cuda", LENGTHS, seed=2, model=request.param)


def test_batched_prefill_equals_transformers(setup):
    check_batched_prefill(setup, **SIZES)


def test_chunks_and_decode_steps_equal_one_shot(setup):
    splits = [[1], [1000, 1, 1047], [40, 37], [256, 1, 255], [1, 1, 1], [700, 800], [63, 1], [450, 450]]
    check_chunked_equals_one_shot(setup, splits, **SIZES)


def test_batched_equals_per_stream_bit_for_bit(setup):
    check_batched_equals_per_stream(setup, **SIZES)


@pytest.mark.parametrize("setup", MROPE_MODELS, indirect=True)
def test_an_images_positions_reach_the_rotation(setup):
    """300 text tokens, a 32 x 24 image (768 tokens), 400 text tokens at the positions Qwen3-VL lays out, in 3 chunks
    split inside the image (the second a decode step), against transformers fed the same 3-row position ids."""
    ex, model, _, _ = setup
    pos = image_positions(300, 32, 24, 400).cuda()
    n = pos.shape[1]
    p = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    rt = ex.HybridRuntime(model, **SIZES)
    s, out, at = rt.add_stream(), [], 0
    for c in (700, 1, n - 701):
        out.append(rt.step([(s, p[at:at + c])], positions=[pos[:, at:at + c]])[0].float())
        at += c
    check_close(torch.cat(out), reference_logits(model, p, pos), "an image's positions in chunks")
