"""Section ``client``: the example runtime's batched prefill (``examples/hybrid_prefill.py``: q12drv for the pass's
metadata, RoPE, the KV cache, attention, the short convolution and Gated DeltaNet; torch for the token-wise work)
against transformers' own forward of the same model, eager, run per prompt and run batched with right padding.

The model is the client tests' Qwen3-Next at the real models' per-head shapes (``tiny_config``: hidden 512, GDN
Hk 2 / Hv 4 at d 128, attention Hq 8 / Hkv 1 at D 256, rotary 64), 8 layers in the 3:1 linear / full pattern, bf16,
random weights. Timed (wall clock around the call and a synchronize, median): the runtime's one pass over all
prompts (staging, every layer, the LM head; the streams are made and their states zeroed before, outside the timed
region); transformers' ``model(ids)`` per prompt, one after another; transformers' ``model(ids, attention_mask)``
on the prompts padded to the longest. transformers uses fla-core's and causal-conv1d's kernels for Gated DeltaNet
and the convolution where they import (the row's note says which). The share row: the device time inside q12drv's
layer ops (events around each ``attention_layer``, ``conv1d`` and ``gdn_layer`` call, summed over a pass) against the
pass's wall clock, each the median of as many profiled passes as the other rows take; the events of a host-bound
pass also hold the host's gaps between an op's launches.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time

from bench.compare.context import Context
from bench.timing import host_and_round_trip

__all__ = ["run", "CASES", "EMU_CASES"]

#: Prompt lengths per case.
CASES = {"8x2048": [2048] * 8, "ragged8": [1, 37, 256, 511, 700, 1024, 1500, 2048]}
#: On the emulator (torch on the CPU): cut down, as are the layers (one 3:1 block).
EMU_CASES = {"ragged3": [1, 5, 3]}
LAYERS, EMU_LAYERS = 8, 4


def run(ctx: Context) -> None:
    try:
        import torch
        import transformers  # noqa: F401  (the example's model)
    except ImportError as exc:
        ctx.error("client/torch+transformers", f"the client needs torch and transformers: {exc}")
        return
    from examples import hybrid_prefill as ex
    from q12drv import Q12Pass

    device = "cuda" if ctx.gpu else "cpu"
    torch.manual_seed(0)
    layers = LAYERS if ctx.gpu else EMU_LAYERS
    model = ex.tiny_model("qwen3_next", device, num_hidden_layers=layers, mlp_only_layers=list(range(layers)))
    cfg = model.config
    fast = [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]
    note = f"transformers with {', '.join(fast)}" if fast else "transformers' torch code (no fla-core, no causal-conv1d)"
    res = ctx.section("client", {"layers": layers, "transformers_fast_paths": fast, "cases": {}})
    cases = CASES if ctx.gpu else EMU_CASES
    reps = ctx.reps(10, 1)
    sync = torch.cuda.synchronize if ctx.gpu else (lambda: None)
    g = torch.Generator().manual_seed(1)
    for key, lens in cases.items():
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        rt = ex.HybridRuntime(model, max_streams=len(lens), max_tokens=max(lens), max_pass_tokens=sum(lens))
        r = res["cases"][key] = {"lens": lens}

        def ours(profile=None):
            streams = [rt.add_stream() for _ in prompts]
            sync()
            t0 = time.perf_counter()
            with profile or contextlib.nullcontext():
                rt.step(list(zip(streams, prompts)))
            sync()
            t = (time.perf_counter() - t0) * 1e6
            for s in streams:
                rt.release_stream(s)
            return t

        ours()  # warm-up: kernels loaded, the arena's rings made
        r["q12drv_us"] = statistics.median(ours() for _ in range(reps))
        with torch.no_grad():
            ids = [torch.tensor([p], device=device) for p in prompts]
            padded = torch.zeros(len(lens), max(lens), dtype=torch.long, device=device)
            mask = torch.zeros_like(padded)
            for b, p in enumerate(prompts):
                padded[b, :len(p)] = torch.tensor(p)
                mask[b, :len(p)] = 1
            for name, fn in (("per_prompt_us", lambda: [model(x) for x in ids]),
                             ("padded_us", lambda: model(padded, attention_mask=mask))):
                ctx.comparator(f"client/{name} {key}", lambda name=name, fn=fn: r.__setitem__(
                    name, host_and_round_trip({name: fn}, reps, sync, warmup=1)[name]["round_trip_us"]))
        profiled = []
        for _ in range(reps):  # the share from the median of profiled passes (events around every op slow a pass)
            ops = _OpTimes(torch, Q12Pass, ctx.gpu)
            profiled.append((ours(ops), ops.total_us()))
        r["pass_us_profiled"] = statistics.median(p for p, _ in profiled)
        r["q12drv_ops_us"] = statistics.median(o for _, o in profiled)
        label = f"client {key}: prefill ({layers} layers)"
        ctx.row(label, r["q12drv_us"], "transformers per prompt (eager)", r.get("per_prompt_us"), note=note)
        ctx.row(label, r["q12drv_us"], "transformers batched, right-padded (eager)", r.get("padded_us"), note=note)
        ctx.row(f"client {key}: time in q12drv's ops", r["q12drv_ops_us"], "the whole pass (profiled runs)",
                r["pass_us_profiled"], note="the ratio is q12drv's share of the pass")


class _OpTimes:
    """While entered, the pass's layer ops (``Q12Pass.attention_layer``, ``conv1d``, ``gdn_layer``) are timed: CUDA
    events around each call on the GPU (their device time, summed after the pass), the wall clock on the CPU."""

    OPS = ("attention_layer", "conv1d", "gdn_layer")

    def __init__(self, torch, cls, gpu: bool):
        self.torch, self.cls, self.gpu = torch, cls, gpu
        self.pairs: list = []
        self.cpu_us = 0.0
        self._saved: dict = {}

    def __enter__(self):
        for name in self.OPS:
            orig = self._saved[name] = getattr(self.cls, name)
            setattr(self.cls, name, self._timed(orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(self.cls, name, orig)
        return False

    def _timed(self, orig):
        def call(pass_, *args, **kwargs):
            if self.gpu:
                start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                orig(pass_, *args, **kwargs)
                end.record()
                self.pairs.append((start, end))
            else:
                t0 = time.perf_counter()
                orig(pass_, *args, **kwargs)
                self.cpu_us += (time.perf_counter() - t0) * 1e6

        return call

    def total_us(self) -> float:
        if self.gpu:
            self.torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.pairs) * 1e3
        return self.cpu_us
