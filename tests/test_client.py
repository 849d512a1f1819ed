"""The example hybrid runtime (examples/hybrid_prefill.py) on the CPU with q12drv's emulated driver, against
transformers' Qwen3-Next forward per prompt: batched prefill, chunked prefill mixed with decode steps, batched ==
per stream, a broken layer caught, bad input refused. Skips without torch and transformers; the GPU version of these
checks, at full lengths, is tests/gpu/test_client_gpu.py."""

from __future__ import annotations

import pytest

from tests.client import check_batched_prefill, check_chunked_equals_one_shot, check_close, rel_l2, setup_on, torch

PROMPTS_LENGTHS = (1, 7, 33, 64, 2, 19)
SIZES = dict(max_streams=8, max_tokens=128, max_pass_tokens=256)


@pytest.fixture(scope="module")
def setup():
    return setup_on("cpu", PROMPTS_LENGTHS, seed=1)


def test_batched_prefill_equals_transformers(setup):
    check_batched_prefill(setup, **SIZES)


def test_chunks_and_decode_steps_equal_one_shot(setup):
    # 2-3 chunks a prompt; a 1-token chunk is a decode step beside other streams' prefill chunks
    splits = [[1], [3, 1, 3], [16, 1, 16], [30, 30, 4], [1, 1], [10, 9]]
    one, s1, rt, s2 = check_chunked_equals_one_shot(setup, splits, **SIZES)
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
        rt = ex.HybridRuntime(model, **SIZES)
        streams = [rt.add_stream() for _ in prompts]
        first = rt.step([(s, p[:len(p) // 2 or 1]) for s, p in zip(streams, prompts)], mode=mode)
        rest = [(s, p[len(p) // 2 or 1:]) for s, p in zip(streams, prompts) if len(p) > 1]
        out[mode] = first + rt.step(rest, mode=mode)
    for a, b in zip(out["batched"], out["per_stream"]):
        assert torch.equal(a, b)


def test_a_broken_layer_fails_the_comparison(setup):
    """The comparison would catch a runtime that forgot the conv and SSM states between chunks."""
    ex, model, prompts, refs = setup
    rt = ex.HybridRuntime(model, **SIZES)
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
