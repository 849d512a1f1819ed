"""Section ``decode``: decode attention (``ops.attention(..., algo="decode")``: the split-KV kernel with its planned
split count, and the merge where it splits) on the decode batches of :data:`bench.inputs.DECODE_CASES` (64 x 1 token
on 8k cached keys, 16 x 1 on 32k, 4 x 1 on 128k), each at Hq 16 / Hkv 2 / D 256 and Hq 32 / Hkv 8 / D 128, blocks of
16; and a mixed batch (a few prefill chunks beside many decode streams, :data:`bench.inputs.MIXED_CASE`).

Rows: each decode batch against its KV-read floor (every stream's K and V read once, ``sum(kv_len) * Hkv * D * 2``
bytes each, at the H200's 4.8 TB/s: the goal is 85% of it), against torch's ``sum`` reading the same bytes (the
practical ceiling of a read) and against the wgmma prefill kernel fed the same batch
(``algo="wgmma"``, what ``"auto"`` runs today); the mixed batch as one pass through the wgmma kernel (what ``"auto"``
runs today) against its parts run separately, the prefill chunks through the wgmma kernel and the decode streams
through the decode kernel (two staged passes; the goal: the mixed batch no slower). The first decode batch (64 x 8k)
also runs on FP8 (e4m3) pools with per-head scales (``kv_dtype="fp8_e4m3"``, the FP8 split entries): against the
same batch's bf16 decode (issue 27's goal: at most 0.6 of its time, the pools being half the bytes) and against its
own KV-read floor (``sum(kv_len) * Hkv * D`` bytes each for K and V at 4.8 TB/s). K and V hold one value (the kernels'
time does not depend on the values; the pools, over 1 GB, are far past L2); Q is random. Device time from events
around 8 back-to-back calls of the op (a decode call is its split launch and, with splits, the merge), median of 20
after 3 warm-ups."""

from __future__ import annotations

from bench import inputs
from bench.compare import ceiling
from bench.compare.context import HBM_TBPS, Context
from bench.timing import q12_events_us

__all__ = ["run", "LAYOUTS"]

#: (Hq, Hkv, D) of the decode rows: Qwen3-Next's attention layers and a Llama-like GQA 4:1 layout.
LAYOUTS = ((16, 2, 256), (32, 8, 128))
_BS = 16
_KV_BYTE = 0x3C  # every K and V element 0x3C3C (about 0.0115)
_FP8_BYTE = 0x38  # every FP8 K and V element e4m3 1.0, times the scale
_FP8_SCALE = 0.0115
#: The FP8 rows' goal: the FP8 decode at most this fraction of the bf16 decode's time on the same batch.
FP8_GOAL = 0.6


def run(ctx: Context) -> None:
    from q12drv.kernels import attention_decode as dec

    cases = inputs.DECODE_CASES if ctx.gpu else inputs.DECODE_EMU_CASES
    res = ctx.section("decode", {"block_size": _BS, "cases": {}})
    for hq, hkv, d in LAYOUTS:
        for i, (cname, (q_lens, prefixes)) in enumerate(cases.items()):
            _case(ctx, dec, f"{cname} Hq{hq}/Hkv{hkv} D{d}", q_lens, prefixes, hq, hkv, d, res, fp8=i == 0)
    _mixed(ctx, inputs.MIXED_CASE if ctx.gpu else inputs.MIXED_EMU_CASE, res)


def _pools(ctx: Context, num_blocks: int, hkv: int, d: int, bufs: list, elem_bytes: int = 2,
           fill: int = _KV_BYTE) -> tuple:
    """K and V pools of ``num_blocks`` blocks of ``elem_bytes`` elements (2: bf16, 1: e4m3), every byte ``fill``,
    appended to ``bufs``."""
    nbytes = num_blocks * _BS * hkv * d * elem_bytes
    kp, vp = ctx.dev.alloc(nbytes, "decode k_pool"), ctx.dev.alloc(nbytes, "decode v_pool")
    bufs += [kp, vp]
    for p in (kp, vp):
        ctx.dev.memset(p.ptr, fill, nbytes)
    return kp, vp


def _case(ctx: Context, dec, name: str, q_lens, prefixes, hq: int, hkv: int, d: int, res: dict,
          fp8: bool = False) -> None:
    from q12drv.kernels import ops

    dev = ctx.dev
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    floor = 2 * sum(kv_lens) * hkv * d * 2  # K and V of every stream's kv head rows, read once
    r = res["cases"][name] = {"q_lens": list(q_lens), "kv_lens": kv_lens, "floor_bytes": floor}
    with inputs.staged_pass(dev, q_lens, prefixes, block_size=_BS) as (meta, streams, num_blocks, arena, bufs):
        t = sum(q_lens)
        q, _ = inputs.rand_bf16(dev, (t, hq, d), 5)
        o = dev.alloc(t * hq * d * 2)
        bufs += [q, o]
        kp, vp = _pools(ctx, num_blocks, hkv, d, bufs)
        plan = dec.plan_decode(meta.batch_size, meta.chunk_len, max(kv_lens), hq, hkv, d, num_sms=dev.sm_count)
        wsb = plan.workspace_bytes_for(t)
        ws = dev.alloc(max(16, wsb))
        bufs.append(ws)
        r["num_splits"], r["workspace_bytes"] = plan.num_splits, wsb
        args = (dev, meta, q.ptr, kp.ptr, vp.ptr, o.ptr)
        heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}

        def decode():
            ops.attention(*args, **heads, algo="decode", workspace=ws.ptr, workspace_bytes=wsb)

        def wgmma():
            ops.attention(*args, **heads, algo="wgmma")

        r["q12drv_us"] = q12_events_us(dev, decode, ctx.reps(20, 1))
        r["wgmma_us"] = q12_events_us(dev, wgmma, ctx.reps(20, 1))
        if fp8:
            _fp8(ctx, dec, name, meta, q, o, num_blocks, hq, hkv, d, r, bufs)
    tbps = {k: floor / (r[f"{k}_us"] * 1e-6) / 1e12 for k in ("q12drv", "wgmma")}
    print(f"   decode {name:32s}: {r['q12drv_us']:9.1f} us {tbps['q12drv']:5.2f} TB/s ({plan.num_splits} splits); "
          f"wgmma {r['wgmma_us']:9.1f} us {tbps['wgmma']:5.2f} TB/s", flush=True)
    ctx.memory_rows(f"decode {name}: vs KV-read floor", r, "q12drv_us", floor, 0.85, tbps=HBM_TBPS,
                    of=f"{HBM_TBPS} TB/s")
    if ctx.gpu:
        r["torch_read_us"] = ceiling.read_us(ctx, floor)
        ctx.row(f"decode {name}", r["q12drv_us"], "torch x.sum() over the same K/V bytes", r["torch_read_us"],
                note="info: the practical ceiling of reading the K/V once (cold L2)")
    ctx.row(f"decode {name}", r["q12drv_us"], "q12drv wgmma kernel, same batch", r["wgmma_us"], ("<=", 1.0),
            note=f"{plan.num_splits} splits; wgmma {tbps['wgmma']:.2f} TB/s of KV read")
    if fp8:
        f = r["fp8"]
        print(f"   decode {name + ' FP8':32s}: {f['q12drv_us']:9.1f} us "
              f"{f['floor_bytes'] / (f['q12drv_us'] * 1e-6) / 1e12:5.2f} TB/s ({f['num_splits']} splits); "
              f"{f['q12drv_us'] / r['q12drv_us']:.2f} of bf16", flush=True)
        ctx.memory_rows(f"decode {name} FP8: vs FP8 KV-read floor", f, "q12drv_us", f["floor_bytes"], None,
                        tbps=HBM_TBPS, of=f"{HBM_TBPS} TB/s")
        ctx.row(f"decode {name} FP8", f["q12drv_us"], "q12drv decode kernel, bf16 pools, same batch", r["q12drv_us"],
                ("<=", FP8_GOAL), note=f"{f['num_splits']} splits; FP8 pools are half the bf16 bytes")


def _fp8(ctx: Context, dec, name: str, meta, q, o, num_blocks: int, hq: int, hkv: int, d: int, r: dict,
         bufs: list) -> None:
    """The same decode batch on FP8 pools (every element e4m3 1.0, each head's scale :data:`_FP8_SCALE`) through
    ``ops.attention(algo="decode", kv_dtype="fp8_e4m3")``: ``r["fp8"]`` its time, split count and KV-read floor."""
    import numpy as np

    from q12drv.kernels import ops

    dev = ctx.dev
    kp, vp = _pools(ctx, num_blocks, hkv, d, bufs, elem_bytes=1, fill=_FP8_BYTE)
    scales = dev.alloc(2 * hkv * 4, "decode fp8 scales")
    bufs.append(scales)
    dev.upload(scales.ptr, np.full(2 * hkv, _FP8_SCALE, np.float32))
    plan = dec.plan_decode(meta.batch_size, meta.chunk_len, max(r["kv_lens"]), hq, hkv, d, num_sms=dev.sm_count,
                           kv_dtype="fp8_e4m3")
    wsb = plan.workspace_bytes_for(meta.total_tokens)
    ws = dev.alloc(max(16, wsb))
    bufs.append(ws)
    f = r["fp8"] = {"num_splits": plan.num_splits, "floor_bytes": r["floor_bytes"] // 2}

    def decode():
        ops.attention(dev, meta, q.ptr, kp.ptr, vp.ptr, o.ptr, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      algo="decode", workspace=ws.ptr, workspace_bytes=wsb, kv_dtype="fp8_e4m3",
                      k_scale=scales.ptr, v_scale=scales.ptr + hkv * 4)

    f["q12drv_us"] = q12_events_us(dev, decode, ctx.reps(20, 1))


def _mixed(ctx: Context, case: dict, res: dict) -> None:
    """The mixed batch as one wgmma pass, and its prefill and decode parts as two passes (wgmma, decode)."""
    from q12drv.kernels import attention_decode as dec
    from q12drv.kernels import ops

    dev = ctx.dev
    hq, hkv, d = LAYOUTS[0]
    pre, dcd = case["prefill"], case["decode"]
    name = f"mixed {len(pre[0])}x({pre[0][0]} on {pre[0][0] + pre[1][0]}) + {len(dcd[0])}x1 on {dcd[1][0] + 1}"
    r = res["cases"][name] = {"prefill": pre, "decode": dcd}
    heads = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    counts, starts = pre[0] + dcd[0], pre[1] + dcd[1]
    t = sum(counts)
    with inputs.staged_pass(dev, counts, starts, block_size=_BS) as (whole, _, num_blocks, _, bufs), \
            inputs.staged_pass(dev, *pre, block_size=_BS) as (mp, _, _, _, _), \
            inputs.staged_pass(dev, *dcd, block_size=_BS) as (md, _, _, _, _):
        q, _ = inputs.rand_bf16(dev, (t, hq, d), 5)
        o = dev.alloc(t * hq * d * 2)
        bufs += [q, o]
        kp, vp = _pools(ctx, num_blocks, hkv, d, bufs)  # every pass's tables index blocks 1 .. num_blocks - 1 of it
        plan = dec.plan_decode(md.batch_size, md.chunk_len, max(dcd[1]) + 1, hq, hkv, d, num_sms=dev.sm_count)
        wsb = plan.workspace_bytes_for(md.total_tokens)
        ws = dev.alloc(max(16, wsb))
        bufs.append(ws)
        rows = sum(pre[0]) * hq * d * 2  # byte offset of the decode streams' Q and O rows

        def together():
            ops.attention(dev, whole, q.ptr, kp.ptr, vp.ptr, o.ptr, **heads, algo="wgmma")

        def parts():
            ops.attention(dev, mp, q.ptr, kp.ptr, vp.ptr, o.ptr, **heads, algo="wgmma")
            ops.attention(dev, md, q.ptr + rows, kp.ptr, vp.ptr, o.ptr + rows, **heads, algo="decode", workspace=ws.ptr,
                          workspace_bytes=wsb)

        r["q12drv_us"] = q12_events_us(dev, together, ctx.reps(20, 1))
        r["parts_us"] = q12_events_us(dev, parts, ctx.reps(20, 1))
    print(f"   decode {name}: one wgmma pass {r['q12drv_us']:9.1f} us, parts {r['parts_us']:9.1f} us", flush=True)
    ctx.row(f"decode {name} Hq{hq}/Hkv{hkv} D{d}: one pass (wgmma)", r["q12drv_us"],
            "prefill part (wgmma) + decode part (decode), two passes", r["parts_us"], ("<=", 1.0),
            note=f"{plan.num_splits} splits on the decode part")
