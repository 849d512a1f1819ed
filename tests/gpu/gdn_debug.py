#!/usr/bin/env python3
"""One GPU run that says where a chunked-GDN bug is, then times chunked vs recurrent.

    PYTHONPATH=. python3 tests/gpu/gdn_debug.py [--no-time]

Part 1: tiny cases (1 stream, 1 head, d 64 and 128; lengths 1, 16, 64, 65, 130) in three
variants that isolate the kernel's paths:
  * ``state-only``: beta = 0, so V_new = 0: o = exp(gamma) Q S and S decays (the S^T fragments,
    the state load/store, Q S, gamma);
  * ``zero-state``: S0 = 0 (K K^T, the diagonal inverses, the block solve, P V_new, the update);
  * ``full``: both.
For each it prints the max abs error of o per 64-token chunk and of the final state against the
float64 reference (and the numpy model of the kernel, whose own error is the floor).
Part 2: CUDA-event timings (median of 30 after 5 warm-ups) of both kernels at Hk 16 / Hv 32 /
d 128 for 8 x 2048 and 1 x 8192 tokens.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from q12drv.bf16 import from_bf16_bits  # noqa: E402
from q12drv.kernels import gdn, gdn_chunk  # noqa: E402
from q12drv.kernels.meta import Q12MetaC, meta_defines  # noqa: E402
from tests.gpu import test_gdn_gpu as T  # noqa: E402


def setup():
    import torch
    from cuda.bindings import driver as cu

    from q12drv.nvrtc import compile_source

    torch.zeros(1, device="cuda")
    T._check(cu.cuInit(0))
    ctx = T._check(cu.cuDevicePrimaryCtxRetain(T._check(cu.cuDeviceGet(torch.cuda.current_device()))))
    T._check(cu.cuCtxSetCurrent(ctx))
    rec_mod = T._check(cu.cuModuleLoadData(compile_source(gdn.SOURCE, defines=meta_defines()).image))
    rec = {n: T._check(cu.cuModuleGetFunction(rec_mod, n.encode())) for n in gdn.ENTRIES}
    _, chunk = T.load_chunk_module()
    for name, f in chunk.items():
        regs = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, f))
        local = T._check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f))
        print(f"{name}: {regs} registers, {local} B local, {gdn_chunk.smem_bytes(128 if name.endswith('128') else 64)} B dynamic smem")
    return torch, rec, chunk


def debug_cases(torch, chunk):
    rng = np.random.default_rng(1234)
    worst = 0.0
    for d in (64, 128):
        for L in (1, 16, 64, 65, 130):
            for variant in ("state-only", "zero-state", "full"):
                inputs = list(T.make_inputs(rng, [L], 1, 1, d))
                if variant == "state-only":
                    inputs[4] = np.zeros_like(inputs[4])
                if variant == "zero-state":
                    inputs[6] = np.zeros_like(inputs[6])
                inputs = tuple(inputs)
                o, fin, guards = T.run_chunk_gpu(torch, chunk, inputs, 1, 1, d, rng)
                o_ref, fin_ref = gdn.reference(*inputs)
                o_mod, fin_mod = gdn_chunk.chunked_reference(*inputs)
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
    print(f"worst o error relative to max|o|: {worst:.2e}")


def time_kernel(torch, funcs, entry, grid, block, smem, vals, reps=30, warmup=5):
    for _ in range(warmup):
        T.launch(funcs, entry, grid, block, smem, vals)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        e0.record()
        T.launch(funcs, entry, grid, block, smem, vals)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def timings(torch, rec, chunk):
    hk, hv, d = 16, 32, 128
    for n, L in ((8, 2048), (1, 8192)):
        Tt = n * L
        cu_t = torch.from_numpy((np.arange(n + 1) * L).astype(np.int32)).cuda()
        q = torch.randn(Tt, hk, d, device="cuda").bfloat16()
        k = torch.randn(Tt, hk, d, device="cuda").bfloat16()
        v = torch.randn(Tt, hv, d, device="cuda").bfloat16()
        g = -torch.rand(Tt, hv, device="cuda") * 0.3
        beta = torch.rand(Tt, hv, device="cuda")
        o = torch.empty(Tt, hv, d, device="cuda", dtype=torch.bfloat16)
        st = torch.randn(n, hv, d, d, device="cuda") * 0.1
        ptrs = torch.tensor([st[i].data_ptr() for i in range(n)], dtype=torch.uint64, device="cuda")
        meta = Q12MetaC(cu_seqlens=cu_t.data_ptr(), batch_size=n, chunk_len=L, total_tokens=Tt)
        vals = [meta, ctypes.c_uint64(ptrs.data_ptr())]
        vals += [ctypes.c_uint64(x.data_ptr()) for x in (q, k, v, g, beta, o)] + [ctypes.c_int(hk), ctypes.c_int(hv)]
        res = {}
        for algo, mod, funcs in (("chunked", gdn_chunk, chunk), ("recurrent", gdn, rec)):
            grid, block, smem = mod.geometry(n, hv, d)
            res[algo] = time_kernel(torch, funcs, mod.entry_name(d), grid, block, smem, vals)
        tf = {a: 4 * Tt * hv * d * d / (ms * 1e-3) / 1e12 for a, ms in res.items()}
        print(f"{n}x{L} Hk{hk} Hv{hv} d{d}: chunked {res['chunked']:.3f} ms ({tf['chunked']:.1f} metric-TFLOPS), "
              f"recurrent {res['recurrent']:.3f} ms ({tf['recurrent']:.1f}); speed-up {res['recurrent'] / res['chunked']:.2f}x"
              f"  [fla-core published here: 0.959 ms at 8x2048]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-debug", action="store_true")
    args = ap.parse_args(argv)
    torch, rec, chunk = setup()
    if not args.no_debug:
        debug_cases(torch, chunk)
    if not args.no_time:
        timings(torch, rec, chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
