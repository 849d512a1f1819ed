"""What the client tests share (CPU and GPU): the example runtime loaded from examples/, the transformers models it
serves (:data:`MODELS`: Qwen3-Next, Qwen3.5's text model), the reference forward per prompt, and the comparisons with
their tolerances.

Tolerance: the runtime and transformers both compute in bf16 with the model's own modules for everything token-wise,
and q12drv's kernels round their outputs once to bf16; transformers' own bf16 forward differs from its fp32 forward
by 0.8-1.3e-2 relative L2 in the logits at hidden 512. 3e-2 relative L2 per prompt is bf16 noise, not slack; the
argmax must agree wherever the reference's top-2 margin exceeds 3e-2 of the logits' scale.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TOL = 3e-2
#: The example's model names, each a test parameter; one whose transformers module is missing skips.
MODELS = [pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(f"transformers.models.{module}") is None,
                                                       reason=f"this transformers has no {module}"))
          for name, module in (("qwen3_next", "qwen3_next"), ("qwen3_5", "qwen3_5"))]
#: Those with MRoPE (T/H/W positions): Qwen3.5.
MROPE_MODELS = [m for m in MODELS if m.values != ("qwen3_next",)]


def load_example():
    import sys

    mod = sys.modules.get("hybrid_prefill")
    if mod is None:
        spec = importlib.util.spec_from_file_location("hybrid_prefill", ROOT / "examples" / "hybrid_prefill.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["hybrid_prefill"] = mod  # its dataclasses resolve their module
        spec.loader.exec_module(mod)
    return mod


def reference_is_torch() -> None:
    """transformers swaps its torch Gated DeltaNet and convolution for fla-core's / causal-conv1d's kernels where
    those import: the reference must be transformers' own torch code."""
    for package in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(package) is None, f"{package} imports here: the reference would not be torch"


def setup_on(device: str, lengths: tuple, seed: int, model: str = "qwen3_next") -> tuple:
    """``(example module, model, prompts, reference logits per prompt)``: the example's tiny ``model`` on ``device``
    (bf16, weights from seed 0) and one random prompt per length (token ids from ``seed``)."""
    reference_is_torch()
    ex = load_example()
    torch.manual_seed(0)
    model = ex.tiny_model(model, device)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    return ex, model, prompts, [reference_logits(model, p) for p in prompts]


@torch.no_grad()
def reference_logits(model, prompt: list, positions=None) -> "torch.Tensor":
    """transformers' logits of one prompt; ``positions``: its ``[3, n]`` T/H/W rotary positions (MRoPE models),
    default what the model computes itself."""
    device = next(model.parameters()).device
    pos = None if positions is None else torch.as_tensor(positions, device=device)[:, None, :]
    return model(torch.tensor([prompt], device=device), position_ids=pos).logits[0].float()


def check_batched_prefill(setup: tuple, **sizes) -> None:
    """Every prompt in one batched pass of a fresh ``HybridRuntime(model, **sizes)``, each against its reference."""
    ex, model, prompts, refs = setup
    rt = ex.HybridRuntime(model, **sizes)
    streams = [rt.add_stream() for _ in prompts]
    for i, (ours, ref) in enumerate(zip(rt.step(list(zip(streams, prompts))), refs)):
        check_close(ours.float(), ref, f"prompt {i} ({len(prompts[i])} tokens)")


def check_chunked_equals_one_shot(setup: tuple, splits: list, **sizes) -> tuple:
    """The prompts in one pass and in interleaved chunks (``splits``, see :func:`run_chunked`), each in a fresh
    ``HybridRuntime(model, **sizes)``: the chunked logits equal the one-shot's within bf16 noise and the reference
    within :data:`TOL`. Returns ``(one-shot runtime, its streams, chunked runtime, its streams)``."""
    ex, model, prompts, refs = setup
    one = ex.HybridRuntime(model, **sizes)
    once, s1 = run_chunked(one, prompts, [[len(p)] for p in prompts])
    rt = ex.HybridRuntime(model, **sizes)
    chunked, s2 = run_chunked(rt, prompts, splits)
    for i in range(len(prompts)):
        assert rel_l2(chunked[i], once[i]) < 1e-2, i
        check_close(chunked[i], refs[i], f"prompt {i} in chunks {splits[i]}")
    return one, s1, rt, s2


def check_batched_equals_per_stream(setup: tuple, **sizes) -> None:
    """The runtime batched and forced per stream give the same logits bit for bit, over two passes (each prompt's
    first half, then the rest: the second pass continues every stream from its cache and states)."""
    ex, model, prompts, _ = setup
    out = {}
    for mode in ("batched", "per_stream"):
        rt = ex.HybridRuntime(model, **sizes)
        streams = [rt.add_stream() for _ in prompts]
        first = rt.step([(s, p[:len(p) // 2 or 1]) for s, p in zip(streams, prompts)], mode=mode)
        rest = [(s, p[len(p) // 2 or 1:]) for s, p in zip(streams, prompts) if len(p) > 1]
        out[mode] = first + rt.step(rest, mode=mode)
    assert all(torch.equal(a, b) for a, b in zip(out["batched"], out["per_stream"]))


def rel_l2(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_close(ours, ref, what: str) -> None:
    """Relative L2 within :data:`TOL`, and the argmax equal wherever the reference's top-2 margin exceeds it."""
    err = rel_l2(ours, ref)
    assert err < TOL, f"{what}: relative L2 {err:.3e} >= {TOL}"
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > TOL * ref.abs().max()
    agree = ours.argmax(-1) == ref.argmax(-1)
    assert bool(agree[decided].all()), f"{what}: argmax differs where the reference's margin is clear"


def run_chunked(rt, prompts: list, splits: list) -> list:
    """Each prompt in chunks (``splits[i]``: chunk lengths), the streams' chunks interleaved: pass k carries chunk k of
    every stream that has one. Returns each prompt's logits and the streams."""
    streams = [rt.add_stream() for _ in prompts]
    outs = [[] for _ in prompts]
    at = [0] * len(prompts)
    for k in range(max(len(s) for s in splits)):
        chunks = []
        for i, p in enumerate(prompts):
            if k < len(splits[i]):
                chunks.append((streams[i], p[at[i]:at[i] + splits[i][k]]))
                at[i] += splits[i][k]
        for (s, _), logits in zip(chunks, rt.step(chunks)):
            outs[streams.index(s)].append(logits.float())
    return [torch.cat(o) for o in outs], streams


def image_positions(n_text: int, rows: int, cols: int, n_after: int) -> "torch.Tensor":
    """``[3, n]`` T/H/W rotary positions of a prompt of ``n_text`` text tokens, one image of ``rows x cols`` tokens and
    ``n_after`` text tokens, laid out as Qwen3-VL's ``get_rope_index`` lays them: a text token at T = H = W = its
    index, the image's tokens at T = its first index with H and W that plus the token's row and column, the text after
    it from that plus ``max(rows, cols)``."""
    base = torch.arange(n_text)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    image = torch.stack([torch.zeros(rows * cols, dtype=torch.long), r.reshape(-1), c.reshape(-1)]) + n_text
    after = torch.arange(n_after) + n_text + max(rows, cols)
    return torch.cat([base.expand(3, -1), image, after.expand(3, -1)], dim=1)
