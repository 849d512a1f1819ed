"""Section ``attention``: batched varlen paged causal attention, both of ``ops.attention``'s kernels (``algo="mma"``
and ``"wgmma"``; the default ``"auto"`` takes wgmma on the H200 for D 128 and 256) on the cases of
:data:`bench.inputs.ATTN_CASES` (Hq 16, Hkv 2, blocks of 16, D 128 and 256: fresh 8 x 2048 and 4 x 4096, ragged 8 x
256..4096, chunked 2048 on 8192 keys for 1 and 2 streams) against torch FA2 (SDPA FLASH batched, or ``varlen_attn``
with the bottom-right causal window for ragged and chunked) and cuDNN (SDPA, per stream for ragged and chunked), on
gathered K/V both head-expanded and on the Hkv heads (``enable_gqa``, FA2's own GQA), as q12drv reads them. Device
time from events around 8 back-to-back calls, median of 20 after 3 warm-ups; TFLOP/s by the pairs formula
(:func:`bench.inputs.attn_flops`).

Section ``attention_window`` (:func:`run_window`): the sliding window's speed goal, time grows with the window, not
the context: 2048 new tokens on 32768 cached keys with a window of 4096 keys (transformers' ``sliding_window``
4096, ``window_left`` 4095) against the same kernel on 2048 new tokens on 4096 cached keys without a window (goal
<= 1.2x its time), and against torch FA2 varlen (``varlen_attn``, ``window_size=(4095, 0)``, on the Hkv heads)
on the windowed case (goal <= 1x); Hq 16, Hkv 2, blocks of 16, D 128 and 256, both kernels."""

from __future__ import annotations

import numpy as np

from bench import inputs
from bench.compare.context import Context, torch_mod
from bench.timing import q12_events_us, torch_events_us

__all__ = ["run", "run_window"]


def run(ctx: Context) -> None:
    from q12drv.kernels import ops

    dev = ctx.dev
    hq, hkv, bs = 16, 2, 16
    cases = inputs.ATTN_CASES if ctx.gpu else inputs.ATTN_EMU_CASES
    res = ctx.section("attention", {"shape": [hq, hkv, bs], "cases": {}})
    for d in (128, 256):
        with inputs.attention_buffers(dev, cases, hq, hkv, d, bs) as (q, kp, vp, o):
            for cname, (q_lens, prefixes) in cases.items():
                _case(ctx, ops, cname, d, q_lens, prefixes, hq, hkv, bs, q, kp, vp, o, res)


def _case(ctx: Context, ops, cname, d, q_lens, prefixes, hq, hkv, bs, q, kp, vp, o, res) -> None:
    dev = ctx.dev
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    r = {"d": d, "q_lens": q_lens, "kv_lens": kv_lens, "flop": inputs.attn_flops(d, hq, q_lens, kv_lens)}
    res["cases"][f"{cname} D{d}"] = r
    with inputs.staged_pass(dev, q_lens, prefixes, block_size=bs, seed=d) as (meta, streams, num_blocks, arena, bufs):
        algos = ("mma", "wgmma")  # both kernels ("auto" picks wgmma on the H200 for these head dims)
        for algo in algos:

            def q12(algo=algo):
                ops.attention(dev, meta, q.ptr, kp.ptr, vp.ptr, o.ptr, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              algo=algo)

            r[f"q12drv_{algo}_us"] = q12_events_us(dev, q12, ctx.reps(20, 1))
        if ctx.gpu:
            ctx.comparator(f"attention/torch {cname} D{d}",
                           lambda: r.update(_torch(ctx, q_lens, kv_lens, hq, hkv, d, ctx.reps(20, 1))))
        for algo in algos:
            us = r[f"q12drv_{algo}_us"]
            tf = r["flop"] / us * 1e-6
            print(f"   attention {cname:26s} D{d} {algo:5s}: q12drv {us:9.1f} us {tf:6.1f} TFLOP/s", flush=True)
            for comp in ("flash", "cudnn", "flash_gqa", "cudnn_gqa"):
                if r.get(f"{comp}_us"):
                    print(f"      {comp:9s} {r[f'{comp}_us']:9.1f} us {r['flop'] / r[f'{comp}_us'] * 1e-6:6.1f} TFLOP/s"
                          f"  q12/{comp} {us / r[f'{comp}_us']:.3f}", flush=True)
            for comp, goal in (("flash", ("<=", 1.0)), ("cudnn", ("<=", 1.25)), ("flash_gqa", ("<=", 1.0)),
                               ("cudnn_gqa", ("<=", 1.25))):
                if r.get(f"{comp}_us"):
                    ctx.row(f"attention {cname} D{d} {algo}", us, r[f"{comp}_api"], r[f"{comp}_us"], goal,
                            note=f"TFLOP/s {tf:.0f} vs {r['flop'] / r[f'{comp}_us'] * 1e-6:.0f}")


def _torch(ctx: Context, q_lens, kv_lens, hq, hkv, d, n_reps, warmup=3) -> dict:
    """Device time (us) of torch's FA2 and cuDNN attention on the case, K/V gathered (contiguous): head-expanded
    (``flash``, ``cudnn``: G = Hq / Hkv copies of every K/V head) and on the Hkv heads (``flash_gqa``,
    ``cudnn_gqa``: SDPA ``enable_gqa``, FA2 varlen's own GQA), which reads the K/V bytes q12drv reads.

    FA2: equal fresh streams -> SDPA FLASH on [n, Hq, L, D] with is_causal; otherwise (ragged or
    chunked) ``torch.nn.attention.varlen.varlen_attn`` (FA2 varlen, packed rows, cu_seqlens) with
    ``window_size=(-1, 0)``, the bottom-right causal window. cuDNN: SDPA CUDNN per stream, summed in one
    timing (fresh: is_causal; chunked: an explicit bottom-right boolean mask). Returns
    ``{flash_us, flash_api, cudnn_us, cudnn_api}`` and the same for ``flash_gqa``, ``cudnn_gqa`` (a missing
    entry: that comparator failed, see errors).
    """
    torch = torch_mod()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = hq // hkv
    n = len(q_lens)
    fresh = all(q == k for q, k in zip(q_lens, kv_lens))
    uniform = fresh and len(set(q_lens)) == 1
    qs = [torch.randn(1, hq, lq, d, device="cuda", dtype=torch.bfloat16) for lq in q_lens]
    ks_g = [torch.randn(1, hkv, lk, d, device="cuda", dtype=torch.bfloat16) for lk in kv_lens]  # Hkv heads (GQA)
    vs_g = [torch.randn(1, hkv, lk, d, device="cuda", dtype=torch.bfloat16) for lk in kv_lens]
    ks = [k.repeat_interleave(g, dim=1) for k in ks_g]  # head-expanded: every query head its own K/V copy
    vs = [v.repeat_interleave(g, dim=1) for v in vs_g]
    masks = [None if lq == lk else
             torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(diagonal=lk - lq)  # row r sees keys <= lk - lq + r
             for lq, lk in zip(q_lens, kv_lens)]
    out = {}

    def timed(key, api, fn):
        try:
            out[f"{key}_us"] = torch_events_us(torch, fn, n_reps, warmup)
            out[f"{key}_api"] = api
        except Exception as exc:
            ctx.error(f"attention/{key} {n}x{q_lens[0]}..{kv_lens[-1]} D{d}", f"{type(exc).__name__}: {exc}")

    def sdpa(backend, q, k, v, mask, gqa=False):
        with sdpa_kernel(backend):
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    if uniform:
        tq, tk, tv = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        gk, gv = torch.cat(ks_g), torch.cat(vs_g)
        timed("flash", "torch SDPA FA2 (batched)", lambda: sdpa(SDPBackend.FLASH_ATTENTION, tq, tk, tv, None))
        timed("cudnn", "torch SDPA cuDNN (batched)", lambda: sdpa(SDPBackend.CUDNN_ATTENTION, tq, tk, tv, None))
        # the same on the Hkv heads (enable_gqa): 1/G of the K/V bytes, as q12drv reads them
        timed("flash_gqa", "torch SDPA FA2 GQA (batched)",
              lambda: sdpa(SDPBackend.FLASH_ATTENTION, tq, gk, gv, None, gqa=True))
        timed("cudnn_gqa", "torch SDPA cuDNN GQA (batched)",
              lambda: sdpa(SDPBackend.CUDNN_ATTENTION, tq, gk, gv, None, gqa=True))
        return out
    from torch.nn.attention.varlen import varlen_attn

    pq = torch.cat([x[0].transpose(0, 1) for x in qs]).contiguous()  # [T, Hq, D]
    pk = torch.cat([x[0].transpose(0, 1) for x in ks]).contiguous()
    pv = torch.cat([x[0].transpose(0, 1) for x in vs]).contiguous()
    cq = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + list(np.cumsum(kv_lens)), dtype=torch.int32, device="cuda")
    timed("flash", "torch varlen_attn FA2 (window -1,0)",
          lambda: varlen_attn(pq, pk, pv, cq, ck, max(q_lens), max(kv_lens), window_size=(-1, 0)))
    gk = torch.cat([x[0].transpose(0, 1) for x in ks_g]).contiguous()  # [T, Hkv, D]: FA2's own GQA
    gv = torch.cat([x[0].transpose(0, 1) for x in vs_g]).contiguous()
    timed("flash_gqa", "torch varlen_attn FA2 GQA (window -1,0)",
          lambda: varlen_attn(pq, gk, gv, cq, ck, max(q_lens), max(kv_lens), window_size=(-1, 0)))

    def per_stream():
        for q, k, v, m in zip(qs, ks, vs, masks):
            sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, m)

    timed("cudnn", "torch SDPA cuDNN per stream" + ("" if fresh else " (bool mask)"), per_stream)

    def per_stream_gqa():
        for q, k, v, m in zip(qs, ks_g, vs_g, masks):
            sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, m, gqa=True)

    timed("cudnn_gqa", "torch SDPA cuDNN GQA per stream" + ("" if fresh else " (bool mask)"), per_stream_gqa)
    return out


#: The window section's cases: name -> (q_lens, cached keys before the chunk, window_left or None).
WINDOW_CASES = {"1x(2048 on 32768) W4096": ([2048], [32768], 4095), "1x(2048 on 4096)": ([2048], [4096], None)}
#: The same on the emulator: cut down.
WINDOW_EMU_CASES = {"1x(5 on 40) W8": ([5], [40], 7), "1x(5 on 8)": ([5], [8], None)}


def run_window(ctx: Context) -> None:
    """The sliding window's speed goal (the module docstring): q12drv's windowed case against its own no-window case
    and against torch FA2 varlen with the same window."""
    from q12drv.kernels import ops

    dev = ctx.dev
    hq, hkv, bs = 16, 2, 16
    cases = WINDOW_CASES if ctx.gpu else WINDOW_EMU_CASES
    wname, bname = cases  # the windowed case, then the no-window one
    wq, wp, window = cases[wname]
    res = ctx.section("attention_window", {"shape": [hq, hkv, bs], "window_left": window, "cases": {}})
    for d in (128, 256):
        plain = {name: (q, p) for name, (q, p, _) in cases.items()}
        with inputs.attention_buffers(dev, plain, hq, hkv, d, bs) as (q, kp, vp, o):
            r = {}
            for name, (q_lens, prefixes, wl) in cases.items():
                with inputs.staged_pass(dev, q_lens, prefixes, block_size=bs, seed=d) as (meta, *_):
                    for algo in ("mma", "wgmma"):

                        def q12(algo=algo, meta=meta, wl=wl):
                            ops.attention(dev, meta, q.ptr, kp.ptr, vp.ptr, o.ptr, num_q_heads=hq, num_kv_heads=hkv,
                                          head_dim=d, algo=algo, window_left=wl)

                        r[name, algo] = q12_events_us(dev, q12, ctx.reps(20, 1))
        kv_w = [a + b for a, b in zip(wq, wp)]
        flash = {}
        if ctx.gpu:
            ctx.comparator(f"attention_window/torch D{d}",
                           lambda: flash.update(_torch_window(ctx, wq, kv_w, hq, hkv, d, window, ctx.reps(20, 1))))
        res["cases"][f"D{d}"] = {f"{name} {algo}": us for (name, algo), us in r.items()} | flash
        for algo in ("mma", "wgmma"):
            us = r[wname, algo]
            print(f"   attention {wname} D{d} {algo:5s}: q12drv {us:9.1f} us, no window {bname} {r[bname, algo]:9.1f} us"
                  + (f", FA2 {flash['flash_us']:9.1f} us" if flash.get("flash_us") else ""), flush=True)
            ctx.row(f"attention window {wname} D{d} {algo}", us, f"q12drv {algo} {bname}, no window", r[bname, algo],
                    ("<=", 1.2))
            if flash.get("flash_us"):
                ctx.row(f"attention window {wname} D{d} {algo}", us, flash["flash_api"], flash["flash_us"],
                        ("<=", 1.0))


def _torch_window(ctx: Context, q_lens, kv_lens, hq, hkv, d, window_left, n_reps, warmup=3) -> dict:
    """Device time (us) of torch FA2 varlen (``varlen_attn``, packed rows, bottom-right causal) with
    ``window_size=(window_left, 0)`` on contiguous K/V of the Hkv heads (FA2's own GQA): ``{flash_us, flash_api}``
    (empty where it failed, see errors)."""
    torch = torch_mod()
    from torch.nn.attention.varlen import varlen_attn

    pq = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    pk = torch.randn(sum(kv_lens), hkv, d, device="cuda", dtype=torch.bfloat16)
    pv = torch.randn(sum(kv_lens), hkv, d, device="cuda", dtype=torch.bfloat16)
    cq = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + list(np.cumsum(kv_lens)), dtype=torch.int32, device="cuda")
    api = f"torch varlen_attn FA2 GQA (window {window_left},0)"
    try:
        us = torch_events_us(torch, lambda: varlen_attn(pq, pk, pv, cq, ck, max(q_lens), max(kv_lens),
                                                        window_size=(window_left, 0)), n_reps, warmup)
    except Exception as exc:
        ctx.error(f"attention_window/flash D{d}", f"{type(exc).__name__}: {exc}")
        return {}
    return {"flash_us": us, "flash_api": api}
