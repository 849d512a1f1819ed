"""The example hybrid runtime (examples/hybrid_prefill.py) on the CPU with q12drv's emulated driver, against
transformers' Qwen3-Next forward per prompt: batched prefill, chunked prefill mixed with decode steps, batched ==
per stream, a broken layer caught, bad input refused. Skips without torch and transformers; the GPU version of these
checks, at full lengths, is tests/gpu/test_client_gpu.py."""

from __future__ import annotations

import pytest

from tests.client import check_close, model_on, reference_is_torch, reference_logits, rel_l2, run_chunked, torch

PROMPTS_LENGTHS = (1, 7, 33, 64, 2, 19)


@pytest.fixture(scope="module")
def setup():
    reference_is_torch()
    ex, model = model_on("cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPTS_LENGTHS]
    refs = [reference_logits(model, p) for p in prompts]
    return ex, model, prompts, refs


def test_batched_prefill_equals_transformers(setup):
    ex, model, prompts, refs = setup
    rt = ex.HybridRuntime(model, max_streams=8, max_tokens=128, max_pass_tokens=256)
    streams = [rt.add_stream() for _ in prompts]
    logits = rt.step(list(zip(streams, prompts)))
    for i, (ours, ref) in enumerate(zip(logits, refs)):
        check_close(ours.float(), ref, f"prompt {i} ({len(prompts[i])} tokens)")


def test_chunks_and_decode_steps_equal_one_shot(setup):
    ex, model, prompts, refs = setup
    one = ex.HybridRuntime(model, max_streams=8, max_tokens=128, max_pass_tokens=256)
    once, s1 = run_chunked(one, prompts, [[len(p)] for p in prompts])
    # 2-3 chunks a prompt; a 1-token chunk is a decode step beside other streams' prefill chunks
    splits = [[1], [3, 1, 3], [16, 1, 16], [30, 30, 4], [1, 1], [10, 9]]
    rt = ex.HybridRuntime(model, max_streams=8, max_tokens=128, max_pass_tokens=256)
    chunked, s2 = run_chunked(rt, prompts, splits)
    for i in range(len(prompts)):
        assert rel_l2(chunked[i], once[i]) < 1e-2, i
        check_close(chunked[i], refs[i], f"prompt {i} in chunks {splits[i]}")
    # the caches and states the chunks left equal the one-shot pass's (bf16 noise of the token-wise torch work)
    for (kind, *a), (_, *b) in zip(one.layers, rt.layers):
        if kind == "attention":
            for x, y in zip(a[1:3], b[1:3]):
                for s_once, s_chunk in zip(s1, s2):
                    n = s_once.cached
                    rows_x = x[s_once.blocks].reshape(-1, *x.shape[2:])[:n]
                    rows_y = y[s_chunk.blocks].reshape(-1, *y.shape[2:])[:n]
                    assert rel_l2(rows_y, rows_x) < 1e-2
        else:
            for x, y in zip(a[1:3], b[1:3]):
                for s_once, s_chunk in zip(s1, s2):
                    assert rel_l2(y[s_chunk.slot], x[s_once.slot]) < 1e-2


def test_batched_equals_per_stream_bit_for_bit(setup):
    ex, model, prompts, _ = setup
    out = {}
    for mode in ("batched", "per_stream"):
        rt = ex.HybridRuntime(model, max_streams=8, max_tokens=128, max_pass_tokens=256)
        streams = [rt.add_stream() for _ in prompts]
        first = rt.step([(s, p[:len(p) // 2 or 1]) for s, p in zip(streams, prompts)], mode=mode)
        rest = [(s, p[len(p) // 2 or 1:]) for s, p in zip(streams, prompts) if len(p) > 1]
        out[mode] = first + rt.step(rest, mode=mode)
    for a, b in zip(out["batched"], out["per_stream"]):
        assert torch.equal(a, b)


def test_a_broken_layer_fails_the_comparison(setup):
    """The comparison would catch a runtime that forgot the conv and SSM states between chunks."""
    ex, model, prompts, refs = setup
    rt = ex.HybridRuntime(model, max_streams=8, max_tokens=128, max_pass_tokens=256)
    s = rt.add_stream()
    p = prompts[3]
    first = rt.step([(s, p[:32])])[0]
    for entry in rt.layers:  # the broken runtime: states dropped between chunks
        if entry[0] == "gdn":
            entry[2].zero_()
            entry[3].zero_()
    second = rt.step([(s, p[32:])])[0]
    with pytest.raises(AssertionError):
        check_close(torch.cat([first, second]).float(), refs[3], "states dropped")


def test_bad_input_is_refused_before_the_pass_writes(setup):
    ex, model, prompts, _ = setup
    rt = ex.HybridRuntime(model, max_streams=2, max_tokens=32, max_pass_tokens=64)
    s = rt.add_stream()
    before = [e[2].clone() for e in rt.layers]
    with pytest.raises(ValueError, match="would reach 40 tokens"):
        rt.step([(s, list(range(40)))])
    assert all(torch.equal(a, e[2]) for a, e in zip(before, rt.layers))
    assert s.cached == 0
