"""Compare compile-time variants of ``cuda_src/attn_prefill.cu`` on one GPU run (not a pytest file).

    python3 tests/gpu/attn_variants.py            # all variants, D128 and D256
    python3 tests/gpu/attn_variants.py v0 v3      # a subset by name

Each variant is one NVRTC compile of the source with its ``-D ATTN_D<d>_<KNOB>`` macros (the host
geometry comes from ``q12drv.kernels.attention.config``). For each variant: correctness on a small
ragged, chunked, interleaved-block-table case against the float32 reference (D 128 and 256,
PASS/FAIL on the same 1e-2 relative-error bound as tests/gpu/test_attention_gpu.py, plus
batched == per-stream bit for bit), then the timing of 8 x 2048, Hq 16, Hkv 2, block 16 for
D 128 and 256 with CUDA events (3 warm-up launches, median of 20), next to torch SDPA flash and
cuDNN on gathered (repeat_interleave'd) K/V. TFLOP/s use the pairs formula of kernels.md B2:
4 * D * Hq * sum_b (Lq (Lk - Lq) + Lq (Lq + 1) / 2).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time

# name, defines (both head dims set in one compile; unset knobs keep the shipped value)
VARIANTS = [
    ("v0-shipped", ()),
    # one __syncthreads per tile (ring issued right after the barrier), page lookups via smem
    ("v1-st2-psmem", ("ATTN_D128_ST=2", "ATTN_D128_PSMEM=1", "ATTN_D256_ST=2", "ATTN_D256_PSMEM=1")),
    # + GQA packing (8 q heads of a kv head in one CTA) + per-warp causal tile skipping
    ("v2-st2-gqa", ("ATTN_D128_ST=2", "ATTN_D128_PSMEM=1", "ATTN_D128_GQA=1", "ATTN_D128_WSKIP=1",
                    "ATTN_D256_ST=2", "ATTN_D256_PSMEM=1", "ATTN_D256_GQA=1", "ATTN_D256_WSKIP=1")),
    # three-stage ring (D256 with BN 32 to fit shared memory)
    ("v3-st3-gqa", ("ATTN_D128_ST=3", "ATTN_D128_PSMEM=1", "ATTN_D128_GQA=1", "ATTN_D128_WSKIP=1",
                    "ATTN_D256_ST=3", "ATTN_D256_BN=32", "ATTN_D256_PSMEM=1", "ATTN_D256_GQA=1",
                    "ATTN_D256_WSKIP=1")),
    # D128: 8 warps x 16 rows, BN 64 (169 regs: one 256-thread CTA per SM)
    ("v4-d128-8w-bn64", ("ATTN_D128_NW=8", "ATTN_D128_MW=1", "ATTN_D128_BN=64", "ATTN_D128_ST=2",
                         "ATTN_D128_PSMEM=1", "ATTN_D128_GQA=1", "ATTN_D128_WSKIP=1")),
    # as v1 without GQA packing but with warp skipping, three stages
    ("v5-st3-noGQA", ("ATTN_D128_ST=3", "ATTN_D128_PSMEM=1", "ATTN_D128_WSKIP=1")),
]

N, L, HQ, HKV, BS = 8, 2048, 16, 2, 16
WARMUP, REPS = 3, 20


def _flops(d, q_lens, kv_lens, hq):
    pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, kv_lens))
    return 4.0 * d * hq * pairs


def main(argv):
    import numpy as np
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from cuda.bindings import driver as cu

    from q12drv.bf16 import to_bf16_bits
    from q12drv.kernels import attention as attn
    from q12drv.kernels.meta import meta_defines
    from q12drv.nvrtc import compile_source
    from tests.gpu.test_attention_gpu import Case, _ok, _rel

    t_start = time.time()
    want = set(argv)
    variants = [v for v in VARIANTS if not want or v[0] in want or v[0].split("-")[0] in want]
    torch.zeros(1, device="cuda")

    class Funcs(dict):
        pass

    def build(defs):
        img = compile_source(attn.SOURCE, defines=tuple(meta_defines()) + tuple(defs), use_cache=False,
                             verbose_resources=True)
        res = {}
        for d in (128, 256):
            entry = attn.HEAD_DIMS[d]
            m = re.search(rf"Compiling entry function '{entry}'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                          img.log, re.S)
            res[d] = f"{m.group(2)} regs, {m.group(1)} B spill, {attn.config(d, defs)['smem']} B smem" if m else "?"
        module = _ok(cu.cuModuleLoadData(img.image))
        funcs = Funcs()
        for d in (64, 128, 256):
            f = _ok(cu.cuModuleGetFunction(module, attn.HEAD_DIMS[d].encode()))
            smem = attn.config(d, defs)["smem"]
            if smem <= 227 * 1024:
                _ok(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
                _ok(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
            funcs[d] = f
        funcs.defines = tuple(defs)
        return module, funcs, res

    # Patch the shared Case.run geometry to the variant's (Case.run calls attn.geometry positionally).
    real_geometry = attn.geometry
    current = {"defs": (), "hkv": 1}

    def geometry(n, chunk, hq, d, **kw):
        return real_geometry(n, chunk, hq, d, num_kv_heads=current["hkv"], defines=current["defs"])

    attn.geometry = geometry

    # Correctness cases: ragged, chunked (prefix keys), shuffled block tables.
    rng = np.random.default_rng(1234)
    checks = [Case(rng, [1, 15, 17, 64, 65, 300, 1031], [0, 77, 5, 16, 200, 64, 900], hq=16, hkv=2, d=d, bs=16)
              for d in (128, 256)]
    refs = [attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, c.hq, c.hkv, c.bs, c.d ** -0.5)
            for c in checks]

    # Timing problem: 8 x 2048 fresh prefill, one contiguous pool region per stream (shuffled pages).
    def timing_case(d):
        q_lens = [L] * N
        c = Case(np.random.default_rng(d), q_lens, [0] * N, hq=HQ, hkv=HKV, d=d, bs=BS)
        return c

    timing = {d: timing_case(d) for d in (128, 256)}

    def time_q12(c, funcs):
        from tests.gpu import test_attention_gpu as tag

        keep = []
        meta = c.meta(list(range(N)), keep)
        rows = int(meta.total_tokens)
        o = torch.empty(rows * c.hq * c.d, dtype=torch.int16, device="cuda")
        grid, block, smem = real_geometry(N, L, c.hq, c.d, num_kv_heads=c.hkv, defines=funcs.defines)
        params = [meta, ctypes.c_uint64(c.dq.data_ptr()), ctypes.c_uint64(c.dk.data_ptr()),
                  ctypes.c_uint64(c.dv.data_ptr()), ctypes.c_uint64(o.data_ptr()), ctypes.c_int(c.hq),
                  ctypes.c_int(c.hkv), ctypes.c_int(c.bs), ctypes.c_float(c.d ** -0.5)]
        argv_ = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)

        def launch():
            _ok(cu.cuLaunchKernel(funcs[c.d], *grid, *block, smem, stream, ctypes.addressof(argv_), 0))

        del tag
        return events_us(launch)

    def events_us(fn):
        for _ in range(WARMUP):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(REPS):
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3)
        return float(np.median(ts))

    # torch comparators on gathered K/V (same shapes; values random)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch_us = {}
    for d in (128, 256):
        tq = torch.randn(N, HQ, L, d, device="cuda", dtype=torch.bfloat16)
        tk = torch.randn(N, HKV, L, d, device="cuda", dtype=torch.bfloat16).repeat_interleave(HQ // HKV, dim=1)
        tv = torch.randn(N, HKV, L, d, device="cuda", dtype=torch.bfloat16).repeat_interleave(HQ // HKV, dim=1)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

                torch_us[(d, name)] = events_us(sdpa)
            except Exception as exc:  # noqa: BLE001
                torch_us[(d, name)] = None
                print(f"torch SDPA {name} D{d}: {type(exc).__name__}: {exc}")
        del tq, tk, tv

    table = []
    for name, defs in variants:
        try:
            module, funcs, res = build(defs)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: BUILD FAILED {type(exc).__name__}: {str(exc)[:400]}")
            continue
        current["defs"], current["hkv"] = tuple(defs), HKV
        for c, ref in zip(checks, refs):
            scale = c.d ** -0.5
            try:
                out = c.run(funcs, list(range(len(c.q_lens))), scale)
                err = _rel(out, ref)
                worst = max(_rel(out[c.cu[b]:c.cu[b + 1]], ref[c.cu[b]:c.cu[b + 1]]) for b in range(len(c.q_lens)))
                same = all(np.array_equal(c.run(funcs, [b], scale), out[c.cu[b]:c.cu[b + 1]]) for b in (0, 5, 6))
                ok = (not (out == 0xFFFF).any()) and err < 1e-2 and worst < 1e-2 and same
                print(f"{name:18s} D{c.d}: rel err {err:.2e} (worst stream {worst:.2e}), batched==alone {same}: "
                      f"{'PASS' if ok else 'FAIL'}   [{res[c.d]}]")
            except Exception as exc:  # noqa: BLE001
                print(f"{name:18s} D{c.d}: FAIL {type(exc).__name__}: {exc}")
        for d in (128, 256):
            c = timing[d]
            try:
                us = time_q12(c, funcs)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} D{d}: timing failed {type(exc).__name__}: {exc}")
                continue
            table.append((name, d, us))
        _ok(cu.cuModuleUnload(module))
    attn.geometry = real_geometry

    print()
    print(f"attention {N}x{L} Hq{HQ} Hkv{HKV} block {BS}, fresh prefill, device time (median of {REPS})")
    print(f"{'variant':20s} {'D':>4s} {'us':>9s} {'TFLOP/s':>8s} {'vs FA2':>7s} {'vs cuDNN':>8s}")
    for d in (128, 256):
        fl = _flops(d, [L] * N, [L] * N, HQ)
        for name in ("flash", "cudnn"):
            us = torch_us.get((d, name))
            if us:
                print(f"{'torch SDPA ' + name:20s} {d:4d} {us:9.1f} {fl / us * 1e-6:8.1f}")
        for vname, vd, us in table:
            if vd != d:
                continue
            fa, cd = torch_us.get((d, "flash")), torch_us.get((d, "cudnn"))
            print(f"{vname:20s} {d:4d} {us:9.1f} {fl / us * 1e-6:8.1f} "
                  f"{(fa / us if fa else float('nan')):7.3f} {(cd / us if cd else float('nan')):8.3f}")
    print("ratio = comparator time / variant time (> 1: the variant is faster)")
    print(f"total {time.time() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
