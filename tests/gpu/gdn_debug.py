#!/usr/bin/env python3
"""One GPU run that says where a chunked-GDN bug is, then times chunked vs recurrent.

    PYTHONPATH=. python3 tests/gpu/gdn_debug.py [--no-time]

Part 1: tiny cases (1 stream, 1 head, d 64 and 128; lengths 1, 16, 64, 65, 130) in three
variants that isolate the kernel's paths, for the fused kernel and for the wgmma pair (algo "wgmma"):
  * ``state-only``: beta = 0, so V_new = 0: o = exp(gamma) Q S and S decays (the S^T fragments,
    the state load/store, Q S, gamma);
  * ``zero-state``: S0 = 0 (K K^T, the diagonal inverses, the block solve, P V_new, the update);
  * ``full``: both.
For each it prints the max abs error of o per 64-token chunk and of the final state against the
float64 reference (and the numpy model of the kernel, whose own error is the floor).
Part 2 (variants): each entry of VARIANTS is one NVRTC compile of gdn/chunked_mma.cu with its -D set.
For each: registers / local bytes,
PASS/FAIL of o and final state against the float64 reference on a small ragged case (the GPU
tests' bounds) plus bit-equality with the default variant's result, then CUDA-event timings
(median of 15 after 3 warm-ups) at Hk 16 / Hv 32 / d 128 for 8 x 2048, 1 x 8192 and ragged
8 streams 256..2048; the recurrent kernel as a reference row; with v0 also the split pair and the wgmma pair
(each stage build, GDN_WG_XY 0, GDN_WG_EARLY 0, the flow form on every case (flags cleared, the precompute
beside the sequential kernel; ops takes it only where gdn_wgmma.uses_flow), the precompute alone). One table
at the end.

    PYTHONPATH=. python3 tests/gpu/gdn_debug.py --no-debug          # variants only
    PYTHONPATH=. python3 tests/gpu/gdn_debug.py --variants v0,v3    # a subset
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.timing import torch_events_us  # noqa: E402
from q12drv.core.bf16 import from_bf16_bits  # noqa: E402
from q12drv.kernels import gdn, gdn_chunk, gdn_wgmma  # noqa: E402
from q12drv.kernels.meta import Q12MetaC, meta_defines  # noqa: E402
from tests.gpu import test_gdn_gpu as T  # noqa: E402
from tests.helpers import rel_err  # noqa: E402


def setup():
    import torch
    from cuda.bindings import driver as cu

    from q12drv.core.nvrtc import compile_source

    torch.zeros(1, device="cuda")
    T._check(cu.cuInit(0))
    ctx = T._check(cu.cuDevicePrimaryCtxRetain(T._check(cu.cuDeviceGet(torch.cuda.current_device()))))
    T._check(cu.cuCtxSetCurrent(ctx))
    rec_mod = T._check(cu.cuModuleLoadData(compile_source(gdn.SOURCE, defines=meta_defines()).image))
    rec = {n: T._check(cu.cuModuleGetFunction(rec_mod, n.encode())) for n in gdn.ENTRIES}
    _, chunk = T.load_chunk_module()
    _, wg = T.load_chunk_module(source=gdn_wgmma.SOURCE)
    for name, f in {**chunk, **wg}.items():
        regs = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, f))
        local = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f))
        smem = (gdn_chunk if name in chunk else gdn_wgmma).entry_smem_bytes(name)
        print(f"{name}: {regs} registers, {local} B local, {smem} B dynamic smem")
    return torch, rec, {**chunk, **wg}


def debug_cases(torch, chunk):
    rng = np.random.default_rng(1234)
    worst = 0.0
    for pair, split in (("fused", 0), ("wgmma", 2)):
        print(f"-- {pair}")
        worst = max(worst, _debug_pair(torch, chunk, rng, pair, split))
    print(f"worst o error relative to max|o|: {worst:.2e}")


def _debug_pair(torch, chunk, rng, pair, split):
    worst = 0.0
    model_kw = dict(t_product=pair == "wgmma")
    for d in (64, 128):
        for L in (1, 16, 64, 65, 130):
            for variant in ("state-only", "zero-state", "full"):
                inputs = list(T.make_inputs(rng, [L], 1, 1, d))
                if variant == "state-only":
                    inputs[4] = np.zeros_like(inputs[4])
                if variant == "zero-state":
                    inputs[6] = np.zeros_like(inputs[6])
                inputs = tuple(inputs)
                o, fin, guards = T.run_chunk_gpu(torch, chunk, inputs, 1, 1, d, rng, split=split, pair=pair)
                o_ref, fin_ref = gdn.reference(*inputs)
                o_mod, fin_mod = gdn_chunk.chunked_reference(*inputs, **model_kw)
                of, rf, mf = (from_bf16_bits(x).astype(np.float64) for x in (o, o_ref, o_mod))
                per_chunk = [float(np.nanmax(np.abs(of[c:c + 64] - rf[c:c + 64]))) for c in range(0, L, 64)]
                model = [float(np.max(np.abs(mf[c:c + 64] - rf[c:c + 64]))) for c in range(0, L, 64)]
                es = float(np.max(np.abs(fin[0] - fin_ref[0])))
                em = float(np.max(np.abs(fin_mod[0] - fin_ref[0])))
                scale = float(np.max(np.abs(rf))) or 1.0
                nan = int(np.isnan(of).sum())
                print(f"d{d:<3} L{L:<4} {variant:<10} o max|err| per chunk "
                      + " ".join(f"{e:.2e}" for e in per_chunk)
                      + f"  (model {' '.join(f'{e:.1e}' for e in model)}; |o|max {scale:.2f})"
                      + f"  state {es:.2e} (model {em:.1e}, |S|max {np.max(np.abs(fin_ref[0])):.2f})"
                      + ("" if guards else "  GUARDS BROKEN") + (f"  {nan} NaN" if nan else ""))
                worst = max(worst, max(per_chunk) / scale if per_chunk else 0.0)
    return worst


# name, defines. Defaults: GDN_PREFETCH 0, GDN_WARP_INV 0, GDN_NORM_UNROLL 2. (v4-v7, GDN_KSPLIT 2: 8 warps
# splitting dk, lost (+40% at 8 x 2048, +3% at 1 x 8192) and were removed with the kernel path.)
# At 017c571 v4-bv32 (GDN_BV_SET=2, bv 32): 255r/144B, 2.48 / 2.48 / 1.60 ms; v5-bv16 11.2 / 5.6 / 6.1 ms; the
# narrower slice widths (BV 32/16) were then removed from the kernel (it is BV 64 only).
VARIANTS = [  # measured at d18a17d (tests/GPU.md): no prefetch and no per-warp inversion won; BV 32/16 lost 2-10x
    ("v0-default", ()),
    ("v1-prefetch", ("GDN_PREFETCH=1",)),
    ("v2-warpinv", ("GDN_WARP_INV=1",)),
    ("v3-prefetch-warpinv", ("GDN_PREFETCH=1", "GDN_WARP_INV=1")),
    ("v4-upd-bf16", ("GDN_UPD_SPLIT=0",)),  # the state update from one bf16 product (fla's precision): speed vs error
]
RAGGED_LENS = [256, 2048, 512, 1792, 768, 1536, 1024, 1280]   # 8 streams, 256..2048


def time_kernel(torch, funcs, entry, grid, block, smem, vals, reps=15, warmup=3):
    """Median ms of one launch (``entry`` a name), or of a sequence (a list of ``(entry, grid, block, smem)``,
    ``(entry, grid, block, smem, dependent)`` (PDL) or a callable (e.g. a memset), ``grid`` etc. then None):
    bench/timing.py's event loop."""
    seq = entry if isinstance(entry, list) else [(entry, grid, block, smem)]

    def go():
        for item in seq:
            if callable(item):
                item()
            else:
                T.launch(funcs, *item[:4], vals, dependent=len(item) > 4 and item[4])

    return torch_events_us(torch, go, reps, warmup) / 1e3


TIMING_CASES = (("8x2048", [2048] * 8), ("1x8192", [8192]), ("ragged8", RAGGED_LENS), ("8x128", [128] * 8),
                ("1x2048", [2048]))


def flow_workspace_bytes(n, chunk_len, hk, hv, d):
    """The flow form's workspace for every build: a ``GDN_WG_USEQ=0`` build's records (U in fp32) are larger than
    the default's, and each build's layout is taken with :data:`gdn_wgmma.FLOW_USEQ` set to it."""
    saved = gdn_wgmma.FLOW_USEQ
    try:
        sizes = []
        for useq in (True, False):
            gdn_wgmma.FLOW_USEQ = useq
            sizes.append(gdn_wgmma.workspace_bytes(n, chunk_len, hk, hv, d))
    finally:
        gdn_wgmma.FLOW_USEQ = saved
    return max(sizes)


def timing_cases(torch, keys=None):
    """The timing cases (Hk 16, Hv 32, d 128) as ``(key, n, tokens, hv, d, launch values, tensors)``; ``keys``:
    only those of TIMING_CASES."""
    hk, hv, d = 16, 32, 128
    out = []
    for key, lens in TIMING_CASES:
        if keys is not None and key not in keys:
            continue
        n, Tt = len(lens), int(sum(lens))
        cu_t = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)).cuda()
        q = torch.randn(Tt, hk, d, device="cuda").bfloat16()
        k = torch.randn(Tt, hk, d, device="cuda").bfloat16()
        v = torch.randn(Tt, hv, d, device="cuda").bfloat16()
        g = -torch.rand(Tt, hv, device="cuda") * 0.3
        beta = torch.rand(Tt, hv, device="cuda")
        o = torch.empty(Tt, hv, d, device="cuda", dtype=torch.bfloat16)
        st = torch.randn(n, hv, d, d, device="cuda") * 0.1
        ptrs = torch.tensor([st[i].data_ptr() for i in range(n)], dtype=torch.uint64, device="cuda")
        meta = Q12MetaC(cu_seqlens=cu_t.data_ptr(), batch_size=n, chunk_len=max(lens), total_tokens=Tt)
        ws_bytes = max(gdn_chunk.workspace_bytes(n, max(lens), hk, hv, d), flow_workspace_bytes(n, max(lens), hk, hv, d))
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
        vals = [meta, ctypes.c_uint64(ptrs.data_ptr())]
        vals += [ctypes.c_uint64(x.data_ptr()) for x in (q, k, v, g, beta, o)] + [ctypes.c_int(hk), ctypes.c_int(hv)]
        vals.append(ctypes.c_uint64(ws.data_ptr()))  # the pairs' extra argument (ignored by the others)
        out.append((key, n, Tt, hv, d, vals, (q, k, v, g, beta, o, st, ptrs, cu_t, ws)))
    return out


def small_ragged_check(torch, funcs, ref_bits):
    """PASS/FAIL of one variant on a small ragged case; returns (verdict, o, fin)."""
    rng = np.random.default_rng(77)
    hk, hv, d = 2, 4, 128
    inputs = T.make_inputs(rng, [1, 63, 64, 65, 0, 300, 130], hk, hv, d)
    o, fin, guards = T.run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng)
    o_ref, fin_ref = gdn.reference(*inputs)
    eo = rel_err(from_bf16_bits(o), from_bf16_bits(o_ref))
    es = rel_err(fin, fin_ref)
    ok = guards and eo < T.CHUNK_O_REL and es < T.CHUNK_STATE_REL and np.isfinite(from_bf16_bits(o)).all()
    same = "" if ref_bits is None else (" =v0" if np.array_equal(o, ref_bits[0]) and np.array_equal(fin, ref_bits[1]) else " !=v0")
    return f"{'PASS' if ok else 'FAIL'} o {eo:.1e} S {es:.1e}{same}", o, fin


def _compile_one(job):
    from q12drv.core.nvrtc import compile_source

    source, defines = job
    compile_source(source, defines=[*meta_defines(), *defines])  # into the on-disk cubin cache
    return defines


def precompile(selected):
    """NVRTC compiles of every variant in parallel processes (each takes ~20-40 s; the loads then hit
    the on-disk cache), so the whole script stays well under 90 s: gdn/chunked_mma.cu's ``selected`` and every
    wgmma build (WGMMA_VARIANTS, gdn/chunked_wgmma.cu)."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(gdn_chunk.SOURCE, d) for _, d in selected] + [(gdn_wgmma.SOURCE, d) for _, d in WGMMA_VARIANTS]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=len(jobs)) as ex:
        for _ in ex.map(_compile_one, jobs):
            pass
    print(f"compiled {len(jobs)} builds in {time.time() - t0:.1f} s", flush=True)


# the wgmma pair's builds: name, gdn/chunked_wgmma.cu defines. Defaults: GDN_WG_XY 1, GDN_WG_EARLY 1 (EARLY changes only
# the one-stage build: its seq2 row is the default's), GDN_WG_AHEAD 1 (changes only the two-stage build), GDN_WG_OLO 0
# (since run AT), GDN_WG_UWS 1 (changes only the flow form: its wg-uws0-flow row is the pair's records and arithmetic),
# GDN_WG_FLOW_AHEAD 0 (the UWS flow form's GDN_WG_AHEAD), GDN_WG_PREP_WG 1 (its precompute's products on wgmma),
# GDN_WG_KQREC 1 (its k and q tiles from the precompute; session 12).
# GDN_WG_TLO is gone (no T lo product or record since run AM); GDN_WG_AHEAD 2 too (session 11's run BB: the copies
# under the update's wgmma made the flow form 0.384 -> 0.431 ms at 1 x 8192, the two-stage pair 0.479 -> 0.559 at
# 8 x 2048).
WGMMA_VARIANTS = [
    ("wg", ()),
    ("wg-xy0", ("GDN_WG_XY=0",)),         # X and Y waited together (R not computed under Y's wgmma)
    ("wg-early0", ("GDN_WG_EARLY=0",)),   # seq1: the next chunk's records copied at its top, not after the last wgmma
    ("wg-ahead0", ("GDN_WG_AHEAD=0",)),   # seq2: the next chunk's copies issued before X, not while X and Y run
    ("wg-olo1", ("GDN_WG_OLO=1",)),       # O's product with V_new hi + lo (4 wgmma more, a little more accurate)
    ("wg-uws0", ("GDN_WG_UWS=0", "GDN_WG_FLOW_VH=0")),   # flow: the pair's records and chain (V_new^T = R^T T^T),
                                                        # not U - W S (key-head items: its precompute's)
    ("wg-fahead1", ("GDN_WG_FLOW_AHEAD=1",)),   # flow (UWS): the next chunk's copies under X' and Y, not before
    ("wg-prepmma", ("GDN_WG_PREP_WG=0", "GDN_WG_KQREC=0", "GDN_WG_USEQ=0", "GDN_WG_FLOW_VH=0")),
    # ^ flow (UWS): the precompute's products on mma.sync
    ("wg-kqrec0", ("GDN_WG_KQREC=0",)),         # flow (UWS): the k and q tiles by cp.async from k and q, not copied
                                                # with the record
    ("wg-vh0", ("GDN_WG_FLOW_VH=0",)),          # flow (UWS): one precompute item a key head in every chunk, not a
                                                # value head in the first 8
    ("wg-vhall", ("GDN_WG_FLOW_VH_FIRST=1073741824",)),   # flow (UWS): one item a value head in every chunk
    ("wg-diag0", ("GDN_WG_DIAGNORM=0",)),       # flow (UWS): the rows' scales by normalise, not from the diagonals
    ("wg-useq0", ("GDN_WG_USEQ=0",)),           # flow (UWS): U's product in the precompute, U in fp32 in the record
    ("wg-tkeep0", ("GDN_WG_TKEEP=0",)),         # flow (USEQ): T diag(beta EK) by rescaling T diag(beta)'s tiles
    ("wg-wfrag0", ("GDN_WG_WFRAG=0",)),         # flow: W's A fragments two k-steps at a time, reloaded each half
    ("wg-pbal0", ("GDN_WG_PBAL=0",)),           # flow: P from Q K^T's rows (warp 3 16 n-tiles), invert_diagonal apart
    ("wg-kkearly0", ("GDN_WG_KKEARLY=0",)),     # flow: each value head's K K^T issued after chunk_gamma's barrier
    ("wg-pubfence1", ("GDN_WG_PUBFENCE=1",)),   # flow: __threadfence() before each ready flag's st.release
    ("wg-cvtfirst0", ("GDN_WG_CVT_FIRST=0",)),  # flow (USEQ): S's fragments converted under U's wgmma (a second
                                                # fence, where ptxas waits for U's products)
    ("wg-tok00", ("GDN_WG_FLOW_TOK0=0",)),      # flow (USEQ): the stream's first token re-read every chunk
    ("wg-flags4", ("GDN_WG_FLOW_FLAGS=4",)),    # flow: 4 ready flags read at a poll, not 32
]


def wgmma_rows(torch, chunk_funcs, cases, builds=None):
    """Rows of the wgmma pair: per build (WGMMA_VARIANTS; ``builds``: only those names, and the default) and stage
    count its small ragged check and its times (the precompute included), then the tile precompute alone; every
    build's flow form checked against float64 too; ``chunk_funcs``: gdn/chunked_mma.cu's entries."""
    from cuda.bindings import driver as cu

    rows, wide_rows = [], []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    prep_row = ["wg-prep-only", "-", "-"]
    # the default build's one-stage and wide pairs with the sequential launch after the precompute (ops launches it
    # with PDL, as every other wgmma row here)
    plain_rows = {1: ["wg-seq1-no-pdl", "-", "bit-identical: tests/gpu/test_gdn_gpu.py"],
                  "wide": ["wg-wide-no-pdl", "-", "bit-identical: tests/gpu/test_gdn_gpu.py"]}
    flow_rows = {"flow": ["wg-flow", "-", "U - W S: vs float64 below, tests/gpu/test_gdn_gpu.py"],
                 "nopdl": ["wg-flow-no-pdl", "-", "serial: the sequential launch without PDL"],
                 "prep": ["wg-flow-prep-only", "-", "flags cleared + the persistent precompute"],
                 "seq": ["wg-flow-seq-only", "-", "the sequential kernel, every flag already set"]}
    default_flow = None   # the default build's flow form on the small ragged case: (o, final states)
    for name, defines in WGMMA_VARIANTS:
        if builds and name != "wg" and name not in builds:
            continue
        # a GDN_WG_USEQ build's flow stage and records: its module's attributes, workspaces and launches
        gdn_wgmma.FLOW_USEQ = "GDN_WG_USEQ=0" not in defines
        mod, wfuncs = T.load_chunk_module(defines, source=gdn_wgmma.SOURCE)
        funcs = {**chunk_funcs, **wfuncs}
        # the wide form (one CTA of two warpgroups), timed with every build: its arithmetic is the two-stage kernel's;
        # and every other build's flow form where the rule takes it (uses_flow) and at 1 x 2048
        wide_row = [f"{name}-wide", "-", "bit-identical: tests/gpu/test_gdn_gpu.py"]
        build_flow_row = [f"{name}-flow", "-", "times only (the GPU tests check the default build's flow form)"]
        for st in gdn_wgmma.STAGES:
            f = wfuncs[gdn_wgmma.entries(128, st)[1]]
            regs = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, f))
            local = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f))
            rng = np.random.default_rng(77)
            inputs = T.make_inputs(rng, [1, 63, 64, 65, 0, 300, 130], 2, 4, 128)
            o, fin, guards = T.run_chunk_gpu(torch, funcs, inputs, 2, 4, 128, rng, split=st, pair="wgmma")
            o_ref, fin_ref = gdn.reference(*inputs)
            eo, es = rel_err(from_bf16_bits(o), from_bf16_bits(o_ref)), rel_err(fin, fin_ref)
            ok = guards and eo < T.CHUNK_O_REL and es < T.CHUNK_STATE_REL and np.isfinite(from_bf16_bits(o)).all()
            row = [f"{name}-seq{st}", f"{regs}r/{local}B", f"{'PASS' if ok else 'FAIL'} o {eo:.1e} S {es:.1e}"]
            for key, n, Tt, hv, d, vals, tensors in cases:
                geos = gdn_wgmma.geometry(n, int(vals[0].chunk_len), vals[8].value, hv, d, st)
                pair = [(e, *geo, i == 1) for i, (e, geo) in enumerate(zip(gdn_wgmma.entries(d, st), geos))]
                row.append(time_kernel(torch, funcs, pair, None, None, None, vals))
                if name == "wg" and st == 1:
                    plain_rows[1].append(time_kernel(torch, funcs, [x[:4] for x in pair], None, None, None, vals))
                if st == 2:
                    wide = [(e, *geo, i == 1) for i, (e, geo) in enumerate(zip(gdn_wgmma.wide_entries(d),
                            gdn_wgmma.wide_geometry(n, int(vals[0].chunk_len), vals[8].value, hv, d)))]
                    wide_row.append(time_kernel(torch, funcs, wide, None, None, None, vals))
                    if name == "wg":
                        plain_rows["wide"].append(time_kernel(torch, funcs, [x[:4] for x in wide], None, None, None,
                                                              vals))
                if name == "wg" and st == 2:
                    prep_row.append(time_kernel(torch, funcs, pair[:1], None, None, None, vals))
                    flow = flow_launches(torch, n, hv, d, vals, tensors)
                    serial = flow[:2] + [flow[2][:4]]
                    for key_, seq_ in (("flow", flow), ("nopdl", serial), ("prep", flow[:2]), ("seq", [flow[2][:4]])):
                        flow_rows[key_].append(time_kernel(torch, funcs, seq_, None, None, None, vals))
                elif st == 2:
                    build_flow_row.append(
                        time_kernel(torch, funcs, flow_launches(torch, n, hv, d, vals, tensors), None, None, None, vals)
                        if key == "1x2048" or gdn_wgmma.uses_flow(n, int(vals[0].chunk_len), hv, d, sms) else None)
            rows.append(row)
            print(f"{row[0]}: {row[2]}", flush=True)
            if st == 2:   # the flow form (fla's order: not the pair's bits) on the same inputs, every build
                o, fin, guards = T.run_chunk_gpu(torch, funcs, inputs, 2, 4, 128, rng, split=2, pair="flow")
                eo, es = rel_err(from_bf16_bits(o), from_bf16_bits(o_ref)), rel_err(fin, fin_ref)
                ok = guards and eo < T.CHUNK_O_REL and es < T.CHUNK_STATE_REL and np.isfinite(from_bf16_bits(o)).all()
                verdict = f"{'PASS' if ok else 'FAIL'} o {eo:.1e} S {es:.1e}"
                if name == "wg":
                    flow_rows["flow"][2] = f"{verdict} (fla's order U - W S)"
                    default_flow = (o, fin)
                else:   # the same inputs (rng 77) as the default build's flow form
                    same = np.array_equal(o, default_flow[0]) and np.array_equal(fin, default_flow[1])
                    verdict += f", {'the' if same else 'not the'} default build's bits"
                    build_flow_row[2] = f"{verdict} (flow; the GPU tests check the default build's)"
                print(f"{name}-flow: {verdict}", flush=True)
        wide_rows.append(wide_row)
        if name != "wg":
            wide_rows.append(build_flow_row)
        T._check(cu.cuModuleUnload(mod))
    gdn_wgmma.FLOW_USEQ = True
    return rows + wide_rows + list(plain_rows.values()) + list(flow_rows.values()) + [prep_row]


def flow_launches(torch, n, hv, d, vals, tensors):
    """The flow form of a timing case as time_kernel's sequence: the flags cleared (a torch fill on the
    launches' stream), then gdn_wgmma.flow_launches: the precompute, the sequential kernel with PDL."""
    hk, chunk_len, ws = vals[8].value, int(vals[0].chunk_len), tensors[-1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    off = gdn_wgmma.flags_offset(n, chunk_len, hk, hv, d)
    flags = ws[off: off + gdn_wgmma.flags_bytes(n, chunk_len, hk)]
    return [flags.zero_] + list(gdn_wgmma.flow_launches(n, chunk_len, hk, hv, d, sms))


def variants(torch, rec, names=None, builds=None):
    from cuda.bindings import driver as cu

    selected = [v for v in VARIANTS if not names or v[0] in names or v[0].split("-")[0] in names]
    cases = timing_cases(torch)
    rows = []
    # the recurrent kernel, once
    rec_row = ["recurrent", "-", "-"]
    for key, n, Tt, hv, d, vals, _ in cases:
        grid, block, smem = gdn.geometry(n, hv, d)
        rec_row.append(time_kernel(torch, rec, gdn.entry_name(d), grid, block, smem, vals))
    rows.append(rec_row)
    ref_bits = None
    for name, defines in selected:
        t0 = time.time()
        try:
            mod, funcs = T.load_chunk_module(defines)
        except Exception as exc:  # a variant that does not compile is a row, not the end of the run
            rows.append([name, "compile error", str(exc).splitlines()[0][:60], None, None, None])
            continue
        f = funcs["q12_gdn_chunk_d128"]
        regs = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, f))
        local = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f))
        verdict, o, fin = small_ragged_check(torch, funcs, ref_bits)
        if ref_bits is None:
            ref_bits = (o, fin)
        row = [name, f"{regs}r/{local}B", verdict]
        split_rows = {st: [f"{name.split('-')[0]}-split-seq{st}", "-", "bit-identical: tests/gpu/test_gdn_gpu.py"]
                      for st in gdn_chunk.SEQ_STAGES}
        prep_row = [f"{name.split('-')[0]}-split-prep-only", "-", "-"]
        for key, n, Tt, hv, d, vals, _ in cases:
            grid, block, smem = gdn_chunk.geometry(n, hv, d)
            row.append(time_kernel(torch, funcs, gdn_chunk.entry_name(d), grid, block, smem, vals))
            chunk_len = int(vals[0].chunk_len)
            for st, srow in split_rows.items():
                geos = gdn_chunk.split_geometry(n, chunk_len, vals[8].value, hv, d, st)
                pair = [(e, *geo) for e, geo in zip(gdn_chunk.split_entries(d, st), geos)]
                srow.append(time_kernel(torch, funcs, pair, None, None, None, vals))
            prep_row.append(time_kernel(torch, funcs, pair[:1], None, None, None, vals))
        rows.append(row)
        if name == "v0-default":
            rows += [*split_rows.values(), prep_row, *wgmma_rows(torch, funcs, cases, builds)]
        T._check(cu.cuModuleUnload(mod))
        print(f"{name}: {verdict}  ({time.time() - t0:.1f} s)", flush=True)
    keys = [c[0] for c in cases]
    toks = {c[0]: c[2] for c in cases}
    print("\nchunked GDN variants, Hk 16 Hv 32 d 128, CUDA events median (ms); fla-core: bench/gpu_compare.py, same run")
    print(f"{'variant':<26} {'regs/local':<11} " + " ".join(f"{k:>9}" for k in keys) + "  small ragged vs float64")
    for name, rl, verdict, *ms in rows:
        cells = " ".join(f"{m:9.3f}" if isinstance(m, float) else f"{'-':>9}" for m in ms)
        print(f"{name:<26} {rl:<11} {cells}  {verdict}")
    print("metric TFLOPS = 4 T Hv d^2 / t: " + ", ".join(f"{k}: T={toks[k]}" for k in keys))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-time", action="store_true", help="skip the variants table")
    ap.add_argument("--no-debug", action="store_true", help="skip the per-chunk error cases")
    ap.add_argument("--variants", default="", help="comma-separated names or prefixes (v0,v3); default all")
    ap.add_argument("--wg-builds", default="", help="comma-separated wgmma builds (WGMMA_VARIANTS: wg-uws0,wg-kqrec0); "
                    "default all (the default build always)")
    args = ap.parse_args(argv)
    names = [x for x in args.variants.split(",") if x]
    if not args.no_time:   # before any CUDA context in this process (the workers fork)
        precompile([v for v in VARIANTS if not names or v[0] in names or v[0].split("-")[0] in names])
    torch, rec, chunk = setup()
    if not args.no_debug:
        debug_cases(torch, chunk)
    if not args.no_time:
        variants(torch, rec, names, [x for x in args.wg_builds.split(",") if x])
    return 0


if __name__ == "__main__":
    sys.exit(main())
