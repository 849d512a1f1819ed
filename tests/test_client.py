"""The example hybrid runtime (examples/hybrid_prefill.py) on the CPU with q12drv's emulated driver, against
transformers' forward per prompt, for Qwen3-Next and Qwen3.5's text model: batched prefill, chunked prefill mixed with
decode steps, batched == per stream, a broken layer caught, bad input refused; for Qwen3.5, its interleaved MRoPE
(the runtime's rotation against the model's rotary embedding, and a prompt with an image's T/H/W positions through
the whole model). Skips without torch and transformers (and a model whose transformers module is missing); the GPU
version of these checks, at full lengths, is tests/gpu/test_client_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

from tests.client import (MODELS, MROPE_MODELS, check_batched_equals_per_stream, check_batched_prefill,
                          check_chunked_equals_one_shot, check_close, image_positions, reference_logits, rel_l2,
                          setup_on, torch)

PROMPTS_LENGTHS = (1, 7, 33, 64, 2, 19)
SIZES = dict(max_streams=8, max_tokens=128, max_pass_tokens=256)


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    return setup_on("cpu", PROMPTS_LENGTHS, seed=1, model=request.param)


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
    check_batched_equals_per_stream(setup, **SIZES)


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


def test_every_batch_within_the_runtimes_maxima_runs_batched(setup):
    """The runtime sizes its arena for any batch within its maxima (``Q12Pass.max_arena_bytes``): a ragged batch
    whose rounded per-stream blocks outgrow those of a skewed one of the same size is still admitted batched, not
    sent stream by stream for lack of space, and its layers' state tables fit beside it."""
    ex, model, _, _ = setup
    rt = ex.HybridRuntime(model, max_streams=3, max_tokens=8, max_pass_tokens=9)
    chunks = [(rt.add_stream(), list(range(n))) for n in (1, 5, 3)]
    step = rt.stage(chunks)
    assert step.batched, step.reason
    assert [len(x) for x in rt.step(chunks)] == [1, 5, 3]


def test_bad_input_is_refused_before_the_pass_writes(setup):
    ex, model, prompts, _ = setup
    rt = ex.HybridRuntime(model, max_streams=2, max_tokens=32, max_pass_tokens=64)
    s = rt.add_stream()
    before = [e[2].clone() for e in rt.layers]
    with pytest.raises(ValueError, match="would reach 40 tokens"):
        rt.step([(s, list(range(40)))])
    assert all(torch.equal(a, e[2]) for a, e in zip(before, rt.layers))
    assert s.cached == 0
    if rt.use_mrope:
        with pytest.raises(ValueError, match=r"positions of shape \(3, 4\) for a chunk of 5 tokens"):
            rt.step([(s, list(range(5)))], positions=[image_positions(4, 0, 0, 0)])
    else:
        with pytest.raises(ValueError, match="positions are for MRoPE models"):
            rt.step([(s, list(range(5)))], positions=[image_positions(5, 0, 0, 0)])
    assert s.cached == 0


def _wrong_rotations(shape) -> dict:
    """The rotations a runtime could get wrong for Qwen3.5, each a different frequency -> T/H/W map for unequal
    positions: plain RoPE (T only), Qwen2-VL's chunked sections, interleaved with the H and W sections swapped."""
    return {"plain": dataclasses.replace(shape, mrope_mode=0),
            "chunked": dataclasses.replace(shape, mrope_mode=1),
            "H and W sections swapped": dataclasses.replace(shape, mrope_section=(11, 10, 11))}


@pytest.mark.parametrize("setup", MROPE_MODELS, indirect=True)
def test_the_rotation_is_the_models_rotary_embedding(setup):
    """q12drv's RoPE with the runtime's shape equals transformers' rotary embedding (its cos and sin, applied by
    transformers' apply_rotary_pos_emb in fp32) at T/H/W positions thousands apart, where a wrong axis for any frequency
    shows: swapping the H and W sections ([11, 10, 11]) moves only the lowest frequency (j = 31, from H to T), whose
    angle changes by a radian only at such distances. Text alone (T = H = W) rotates alike under every mode and
    section, and an image's offsets of a few positions move only the high frequencies (the whole-model test below)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    ex, model, _, _ = setup
    rt = ex.HybridRuntime(model, **SIZES)
    shape, n, rd = rt.attn_shape, 40, rt.attn_shape.rotary_dim
    assert (shape.mrope_mode, shape.mrope_section) == (2, (11, 11, 10))
    i = torch.arange(n)
    pos = torch.stack([i, 5000 + 3 * i, 11000 + 7 * i])
    g = torch.Generator().manual_seed(3)
    q0 = torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g).bfloat16()
    k0 = torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=g).bfloat16()
    cos, sin = model.model.rotary_emb(q0.float(), pos[:, None, :])  # fp32, the model's own sections
    want = [x[0].transpose(0, 1) for x in apply_rotary_pos_emb(q0.float()[None].transpose(1, 2),
                                                               k0.float()[None].transpose(1, 2), cos, sin)]

    def rotated(rotation) -> tuple:
        stream = rt.add_stream()
        step = rt.stage([(stream, list(range(n)))], positions=[pos])
        q, k = q0.clone(), k0.clone()
        step.rope(q, k, rotation)
        assert torch.equal(q[..., rd:], q0[..., rd:]) and torch.equal(k[..., rd:], k0[..., rd:])
        return q[..., :rd], k[..., :rd]

    # one bf16 rounding of the exact rotation: 1.6e-3 measured, under 2^-8 (one bf16 ulp)
    errors = [rel_l2(got, ref[..., :rd]) for got, ref in zip(rotated(shape), want)]
    assert max(errors) < 4e-3, errors
    for name, wrong in _wrong_rotations(shape).items():
        errors = [rel_l2(got, ref[..., :rd]) for got, ref in zip(rotated(wrong), want)]
        assert min(errors) > 5e-2, (name, errors)  # 0.11 with the sections swapped, 1.0-1.1 plain or chunked


@pytest.mark.parametrize("setup", MROPE_MODELS, indirect=True)
def test_an_images_positions_reach_the_rotation(setup):
    """A prompt with an image (4 x 6 tokens between text) at the T/H/W positions Qwen3-VL lays out, one shot and in
    chunks split inside the image beside a text-only stream, equals transformers fed the same 3-row position ids; the
    rotation the runtime would get wrong (plain, Qwen2-VL's chunked sections) fails the same comparison. Batched ==
    per stream bit for bit with the positions."""
    ex, model, prompts, refs = setup
    pos = image_positions(9, 4, 6, 8)
    n = pos.shape[1]
    p = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = reference_logits(model, p, pos)
    assert rel_l2(reference_logits(model, p), ref) > 4 * 3e-2  # the positions matter (0.14)

    def run(wrong: str | None = None, split=(n,), mode="auto") -> "torch.Tensor":
        rt = ex.HybridRuntime(model, **SIZES)
        if wrong is not None:
            rt.attn_shape = _wrong_rotations(rt.attn_shape)[wrong]
        s, text = rt.add_stream(), rt.add_stream()  # text: prompts[2] beside it, at its own (text) positions
        out, at = [], 0
        text_chunks = iter([prompts[2][:16], prompts[2][16:17], prompts[2][17:]])
        for c in split:
            chunk = next(text_chunks, None)
            chunks = [(s, p[at:at + c])] + ([(text, chunk)] if chunk else [])
            logits = rt.step(chunks, positions=[pos[:, at:at + c]] + [None] * (len(chunks) - 1), mode=mode)
            out.append(logits[0].float())
            if chunk:
                check_close(logits[1].float(), refs[2][text.cached - len(chunk):text.cached], "the text stream")
            at += c
        return torch.cat(out)

    check_close(run(), ref, "an image's positions, one shot")
    chunked = run(split=(14, 1, 26), mode="batched")
    check_close(chunked, ref, "an image's positions in chunks split inside the image")
    assert torch.equal(chunked, run(split=(14, 1, 26), mode="per_stream"))
    for wrong in ("plain", "chunked"):
        with pytest.raises(AssertionError):  # 0.064 relative L2 measured for both
            check_close(run(wrong), ref, wrong)


def test_decode_steps_on_long_contexts_run_the_decode_kernel(monkeypatch):
    """Decode steps of two streams on 700 and 600 cached tokens: the pass's attention splits the keys, so the runtime
    sizes a workspace (``Q12Pass.attention_workspace_bytes``) and ``attention_layer`` runs the split decode kernel;
    the logits still equal transformers' (Qwen3-Next)."""
    from q12drv.kernels import attention_decode as dec

    ran = []
    real = dec.enqueue_decode
    monkeypatch.setattr(dec, "enqueue_decode", lambda *a, **k: ran.append(a[2].num_splits) or real(*a, **k))
    setup = setup_on("cpu", (703, 602), seed=3, model="qwen3_next")
    splits = [[700, 1, 1, 1], [600, 1, 1]]
    check_chunked_equals_one_shot(setup, splits, max_streams=2, max_tokens=704, max_pass_tokens=1308)
    assert ran and min(ran) > 1  # every decode step's layers: the split kernel
