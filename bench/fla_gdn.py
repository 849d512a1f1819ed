#!/usr/bin/env python3
"""Time fla-core's ``chunk_gated_delta_rule`` (the GDN comparator) in a process of its own.

    PYTHONPATH=/tmp/site python3 bench/fla_gdn.py [--cases 8x2048,1x8192,ragged8] [--reps 30]

A case is ``NxL`` (N streams of L tokens) or a name of ``bench.inputs.GDN_CASES`` (``ragged8``: 8 streams of
256..2048 tokens; the lengths gpu_compare's GDN section times q12drv on).

Same problem as q12drv's chunked kernel: varlen streams through ``cu_seqlens`` (batch dim 1),
Hk 16 / Hv 32 / d 128, bf16 q/k/v, fp32 log-space g, bf16 beta, an fp32 initial state
``[N, Hv, dk, dv]``, ``output_final_state=True``, ``use_qk_l2norm_in_kernel=True``. Times from torch CUDA events,
median after warm-up, three ways:

* ``eager_ms``: the plain call (fla derives its chunk indices from ``cu_seqlens`` on the host each call);
* ``static_ms``: with ``cu_seqlens_cpu`` and ``chunk_indices`` computed once (no host sync in the call);
* ``graph_ms``: that call captured in a CUDA graph and replayed: device time alone, none of Triton's
  per-launch host cost (about ten launches a call, tens of us each on the H200's VM).

``ms``, the comparator, is ``graph_ms`` when the capture works (else the faster of the other two): fla's
best device time, not the host's speed. Prints ONE JSON line (the last line of stdout):
``{"ok": true, "fla_version": ..., "cases": {"8x2048": {"ms": ..., "how": "graph", ...}, ...}}`` or
``{"ok": false, "error": ...}``. It runs alone because fla once hit an illegal memory access after
other GPU work in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.inputs import GDN_CASES, gdn_case_lens  # noqa: E402
from bench.timing import torch_events_us  # noqa: E402


def time_case(torch, fn, lens, hk, hv, d, reps, warmup):
    dev = "cuda"
    n, L = len(lens), max(lens)
    T = int(sum(lens))
    q = torch.randn(1, T, hk, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, T, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, T, hv, d, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(1, T, hv, device=dev, dtype=torch.float32) * 0.3
    beta = torch.rand(1, T, hv, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(n, hv, d, d, device=dev, dtype=torch.float32) * 0.1
    cu = torch.tensor([0] + [int(x) for x in _cumsum(lens)], device=dev, dtype=torch.long)

    def run(**static):
        return fn(q, k, v, g, beta, scale=d ** -0.5, initial_state=h0, output_final_state=True,
                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True, **static)

    out, final = run()
    assert tuple(out.shape) == (1, T, hv, d) and tuple(final.shape) == (n, hv, d, d), (out.shape, final.shape)
    res = {"n": n, "L": L, "tokens": T, "eager_ms": torch_events_us(torch, run, reps, warmup) / 1e3}
    from fla.ops.utils.index import prepare_chunk_indices

    cu_cpu = cu.cpu()
    static = {"cu_seqlens_cpu": cu_cpu, "chunk_indices": prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu_cpu)}
    o_s, f_s = run(**static)
    if not (_close(torch, o_s, out) and _close(torch, f_s, final)):
        raise AssertionError("fla with precomputed chunk indices gives other results than without")
    res["static_ms"] = torch_events_us(torch, lambda: run(**static), reps, warmup) / 1e3
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                run(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g, f_g = run(**static)
        graph.replay()
        torch.cuda.synchronize()
        if not (_close(torch, o_g, out) and _close(torch, f_g, final)):
            raise AssertionError("the replayed graph gives other results than the eager call")
        res["graph_ms"] = torch_events_us(torch, graph.replay, reps, warmup) / 1e3
        res["ms"], res["how"] = res["graph_ms"], "graph"
    except Exception as exc:  # no capture: the best eager time, and why
        res["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["ms"], res["how"] = min(res["eager_ms"], res["static_ms"]), "eager"
    res["metric_tflops"] = 4 * T * hv * d * d / (res["ms"] * 1e-3) / 1e12
    return res


def _close(torch, a, b) -> bool:
    """Same results up to 1e-3 of the largest magnitude (the same kernels on the same inputs)."""
    a, b = a.float(), b.float()
    return bool((a - b).abs().max() <= 1e-3 * b.abs().max().clamp_min(1e-30))


def _cumsum(xs):
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(GDN_CASES), help="comma-separated: NxL or a named case")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--heads", default="16,32,128", help="Hk,Hv,d")
    args = ap.parse_args(argv)
    hk, hv, d = (int(x) for x in args.heads.split(","))
    result = {"ok": False, "heads": [hk, hv, d]}
    try:
        import torch

        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        result["fla_version"] = getattr(fla, "__version__", "unknown")
        result["torch"] = torch.__version__
        cases = {}
        for spec in args.cases.split(","):
            cases[spec] = time_case(torch, chunk_gated_delta_rule, gdn_case_lens(spec), hk, hv, d, args.reps, args.warmup)
        result["cases"] = cases
        result["ok"] = True
    except Exception as exc:  # recorded, not raised: the caller records an error row
        result["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
