"""Compare compile-time variants of ``cuda_src/attn_prefill.cu`` and ``attention/wgmma.cu`` on one GPU run (not a pytest file).

    python3 tests/gpu/attn_variants.py            # all variants, D128 and D256
    python3 tests/gpu/attn_variants.py v0 v3      # a subset by name

Each variant is one NVRTC compile of its source with its ``-D ATTN_D<d>_<KNOB>`` / ``ATTN_WG_*`` macros
(the host geometry comes from ``q12drv.kernels.attention.config`` / ``attention_wgmma.config``). For each variant: correctness on a small
ragged, chunked, interleaved-block-table case against the float32 reference (D 128 and 256,
PASS/FAIL on the same 1e-2 relative-error bound as tests/gpu/test_attention_gpu.py, plus
batched == per-stream bit for bit), then the timing of the issue's cases (bench/gpu_compare.py ATTN_CASES: fresh 8 x 2048 and
4 x 4096, ragged 8 x 256..4096, chunked 2048 on 8192 keys x 1 and 2; Hq 16, Hkv 2, block 16) for
D 128 and 256 with CUDA events (3 warm-up launches, median of 20), next to torch FA2 and cuDNN
on gathered (repeat_interleave'd) K/V (bench/gpu_compare.py _attention_torch says which API per
case; the FA2 varlen comparator is checked once against SDPA math with a bottom-right mask). TFLOP/s use the pairs formula of kernels.md B2:
4 * D * Hq * sum_b (Lq (Lk - Lq) + Lq (Lq + 1) / 2).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time

# name, kernel ("mma": attention/mma.cu, "wgmma": attention/wgmma.cu), defines (both head dims set in one
# compile; unset knobs keep the default). A variant is not timed at a head dim none of its macros touch.
# mma.sync variants measured and not promoted (4 warps x 16 rows with QREG or MINB, BN 32 with 3-4
# stages at D256, DS at D128, the two-barrier loop, a 3-stage ring at D128, D256 without DS):
# tests/GPU.md, runs C-Q.
VARIANTS = [
    ("v0-default", "mma", ()),
    # wgmma (sm_90a): 2 consumer warpgroups x 64 rows and a producer warpgroup (WS), BN 128 (D128) / 64
    # (D256), 1 CTA/SM, 128-byte swizzled tiles, per-stage mbarriers. Measured and dropped (tests/GPU.md
    # runs P-U): one warpgroup per CTA, D128 BN 64, S of the next tile during the softmax without WS
    # (+0..11% interleaved, -5..8% swizzled, at 254 registers). Measured on top of WS and dropped (runs
    # Y / Z / AA): PP (ping-pong turns, FA3): 0-20% slower than WS alone; OV (S of the next tile before
    # P V of this one inside a warpgroup, first and last tiles peeled so ptxas does not serialize): ~15%
    # slower than WS alone, as fast as the session-4 kernel; ST 3: as fast as 2; PS (a persistent CTA
    # per SM looping over row tiles heaviest first, the producer streaming the next tile's K/V and Q
    # while the consumers finish, O stored from registers): run AA, D128 fresh 8 x 2048 3% faster,
    # everything else 2-26% slower (ragged worst: the static round-robin over items balances badly);
    # removed.
    ("wg0-default", "wgmma", ()),
    # the session-4 kernel: no producer warpgroup, every thread copies and computes (WS is 1.08-1.28x
    # faster on every case in runs Y and Z, 1.11-1.32x in runs AF and AG)
    ("wg1-no-ws", "wgmma", ("ATTN_WG_D128_WS=0", "ATTN_WG_D256_WS=0")),
    # ... and a CTA barrier per tile instead of the mbarriers (run U: 4-6% slower than wg1)
    ("wg2-syncthreads", "wgmma", ("ATTN_WG_D128_WS=0", "ATTN_WG_D256_WS=0", "ATTN_WG_D128_MB=0", "ATTN_WG_D256_MB=0")),
    # ... and the interleaved (no-swizzle) operand layout, the first version (runs P-T: 1.4-1.7x slower)
    ("wg3-interleaved", "wgmma", ("ATTN_WG_D128_WS=0", "ATTN_WG_D256_WS=0", "ATTN_WG_D128_SW=0", "ATTN_WG_D256_SW=0",
                                  "ATTN_WG_D128_MB=0", "ATTN_WG_D256_MB=0")),
    # three K/V stages: D128 only (D256, BN 64: 64 KiB of Q + 3 x 64 KiB of K/V > 227 KiB); runs Y / Z:
    # as fast as two
    ("wg4-st3", "wgmma", ("ATTN_WG_D128_ST=3",)),
]

HQ, HKV, BS = 16, 2, 16
WARMUP, REPS = 3, 20


def main(argv):
    import numpy as np
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from cuda.bindings import driver as cu

    from q12drv.kernels import attention as attn
    from q12drv.kernels import attention_wgmma as attnw
    from q12drv.kernels.meta import meta_defines
    from q12drv.core.nvrtc import compile_source
    from tests.gpu.test_attention_gpu import Case, _ok
    from tests.helpers import rel_err_bf16, shuffled_tables

    t_start = time.time()
    want = set(argv)
    variants = [v for v in VARIANTS if not want or v[0] in want or v[0].split("-")[0] in want]
    torch.zeros(1, device="cuda")

    modules = {"mma": attn, "wgmma": attnw}

    def geometry_of(kind, defs):
        if kind == "wgmma":
            return lambda n, chunk, hq, hkv, d: attnw.geometry(n, chunk, hq, hkv, d, defines=defs)
        return lambda n, chunk, hq, hkv, d: attn.geometry(n, chunk, hq, d, num_kv_heads=hkv, defines=defs)

    def build(kind, defs):
        """``(module, {D: (CUfunction, geometry)}, {D: resource line})`` of one variant build."""
        mod = modules[kind]
        img = compile_source(mod.SOURCE, defines=tuple(meta_defines()) + tuple(defs), use_cache=False,
                             verbose_resources=True)
        res = {}
        for d in (128, 256):
            entry = mod.HEAD_DIMS[d]
            m = re.search(rf"Compiling entry function '{entry}'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                          img.log, re.S)
            res[d] = f"{m.group(2)} regs, {m.group(1)} B spill, {mod.config(d, defs)['smem']} B smem" if m else "?"
        module = _ok(cu.cuModuleLoadData(img.image))
        funcs, geo = {}, geometry_of(kind, tuple(defs))
        for d, entry in mod.HEAD_DIMS.items():
            f = _ok(cu.cuModuleGetFunction(module, entry.encode()))
            smem = mod.config(d, defs)["smem"]
            if smem <= 227 * 1024:
                _ok(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
                _ok(cu.cuFuncSetAttribute(f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
            funcs[d] = (f, geo)
        return module, funcs, res

    # Correctness cases: ragged, chunked (prefix keys), shuffled block tables.
    rng = np.random.default_rng(1234)
    checks = [Case(rng, [1, 15, 17, 64, 65, 300, 1031], [0, 77, 5, 16, 200, 64, 900], hq=16, hkv=2, d=d, bs=16)
              for d in (128, 256)]
    refs = [attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, c.hq, c.hkv, c.bs, c.d ** -0.5)
            for c in checks]

    from bench import gpu_compare as gc

    class DevCase(Case):
        """Timing case with device-side random Q and pools (no host copies); interleaved block tables."""

        def __init__(self, q_lens, prefixes, d, seed):
            rng = np.random.default_rng(seed)
            self.q_lens = np.asarray(q_lens, np.int64)
            self.kv_lens = (self.q_lens + np.asarray(prefixes, np.int64)).astype(np.int32)
            self.cu = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
            self.hq, self.hkv, self.d, self.bs = HQ, HKV, d, BS
            nblk = [-(-int(k) // BS) for k in self.kv_lens]
            num_blocks = sum(nblk) + 4
            self.tables = shuffled_tables(rng, nblk, num_blocks)
            g = torch.Generator(device="cuda").manual_seed(seed)
            t = int(self.cu[-1])
            self.dq = torch.randn(t * HQ * d, device="cuda", dtype=torch.bfloat16, generator=g)
            self.dk = torch.randn(num_blocks * BS * HKV * d, device="cuda", dtype=torch.bfloat16, generator=g)
            self.dv = torch.randn(num_blocks * BS * HKV * d, device="cuda", dtype=torch.bfloat16, generator=g)
            self.dtables = [torch.from_numpy(tb.copy()).cuda() for tb in self.tables]

    cases = gc.ATTN_CASES

    def time_q12(c, kernel):
        func, geo = kernel
        keep = []
        meta = c.meta(list(range(len(c.q_lens))), keep)
        rows = int(meta.total_tokens)
        o = torch.empty(rows * c.hq * c.d, dtype=torch.int16, device="cuda")
        grid, block, smem = geo(len(c.q_lens), int(meta.chunk_len), c.hq, c.hkv, c.d)
        params = [meta, ctypes.c_uint64(c.dq.data_ptr()), ctypes.c_uint64(c.dk.data_ptr()),
                  ctypes.c_uint64(c.dv.data_ptr()), ctypes.c_uint64(o.data_ptr()), ctypes.c_int(c.hq),
                  ctypes.c_int(c.hkv), ctypes.c_int(c.bs), ctypes.c_float(c.d ** -0.5)]
        argv_ = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)

        def launch():
            _ok(cu.cuLaunchKernel(func, *grid, *block, smem, stream, ctypes.addressof(argv_), 0))

        return gc.torch_events_us(torch, launch, REPS, WARMUP)

    # Comparator semantics: FA2 varlen with window (-1, 0) == SDPA math with a bottom-right mask.
    try:
        from torch.nn.attention.varlen import varlen_attn
        import torch.nn.functional as F

        ql, kl = [64, 40], [200, 40]
        qq = [torch.randn(l, HQ, 128, device="cuda", dtype=torch.bfloat16) for l in ql]
        kk = [torch.randn(l, HQ, 128, device="cuda", dtype=torch.bfloat16) for l in kl]
        vv = [torch.randn(l, HQ, 128, device="cuda", dtype=torch.bfloat16) for l in kl]
        cq = torch.tensor([0, 64, 104], dtype=torch.int32, device="cuda")
        ck = torch.tensor([0, 200, 240], dtype=torch.int32, device="cuda")
        got = varlen_attn(torch.cat(qq), torch.cat(kk), torch.cat(vv), cq, ck, 64, 200, window_size=(-1, 0))
        want = []
        for a_, b_, c_, lq, lk in zip(qq, kk, vv, ql, kl):
            m = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(diagonal=lk - lq)
            want.append(F.scaled_dot_product_attention(a_.transpose(0, 1).float(), b_.transpose(0, 1).float(),
                                                        c_.transpose(0, 1).float(), attn_mask=m).transpose(0, 1))
        err = (got.float() - torch.cat(want)).abs().max().item()
        print(f"comparator check: varlen_attn window (-1, 0) vs SDPA math bottom-right mask: max abs diff {err:.2e} "
              f"{'PASS' if err < 2e-2 else 'FAIL'}")
    except Exception as exc:  # noqa: BLE001
        print(f"comparator check failed: {type(exc).__name__}: {exc}")

    timing = {}
    torch_res = {}
    for d in (128, 256):
        for cname, (q_lens, prefixes) in cases.items():
            timing[(cname, d)] = DevCase(q_lens, prefixes, d, seed=d + len(q_lens))
            kv_lens = [a_ + b_ for a_, b_ in zip(q_lens, prefixes)]
            torch_res[(cname, d)] = gc._attention_torch(q_lens, kv_lens, HQ, HKV, d, REPS, WARMUP)
        torch.cuda.empty_cache()
    for k_, e_ in gc.RESULTS["errors"].items():
        print(f"torch comparator error {k_}: {e_[:300]}")

    table = []
    for name, kind, defs in variants:
        try:
            module, funcs, res = build(kind, defs)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: BUILD FAILED {type(exc).__name__}: {str(exc)[:400]}")
            continue
        for c, ref in zip(checks, refs):
            scale = c.d ** -0.5
            try:
                out = c.run(funcs[c.d], list(range(len(c.q_lens))), scale)
                err = rel_err_bf16(out, ref)
                worst = max(rel_err_bf16(out[c.cu[b]:c.cu[b + 1]], ref[c.cu[b]:c.cu[b + 1]])
                            for b in range(len(c.q_lens)))
                same = all(np.array_equal(c.run(funcs[c.d], [b], scale), out[c.cu[b]:c.cu[b + 1]]) for b in (0, 5, 6))
                ok = (not (out == 0xFFFF).any()) and err < 1e-2 and worst < 1e-2 and same
                print(f"{name:18s} D{c.d}: rel err {err:.2e} (worst stream {worst:.2e}), batched==alone {same}: "
                      f"{'PASS' if ok else 'FAIL'}   [{res[c.d]}]")
            except Exception as exc:  # noqa: BLE001
                print(f"{name:18s} D{c.d}: FAIL {type(exc).__name__}: {exc}")
        for d in (128, 256):
            other = 384 - d  # the other head dim (128 <-> 256)
            if defs and all(f"_D{other}_" in x for x in defs):
                continue  # only the other head dim's knobs: the same kernel as the default here
            for cname in cases:
                try:
                    us = time_q12(timing[(cname, d)], funcs[d])
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} {cname} D{d}: timing failed {type(exc).__name__}: {exc}")
                    continue
                table.append((name, cname, d, us))
        _ok(cu.cuModuleUnload(module))

    print()
    print(f"attention Hq{HQ} Hkv{HKV} block {BS}, device time (median of {REPS}); ratio = q12 time / comparator time "
          f"(goals: <= 1.0 vs FA2, <= 1.25 vs cuDNN)")
    print(f"{'case':26s} {'variant':30s} {'D':>4s} {'us':>9s} {'TFLOP/s':>8s} {'q12/FA2':>8s} {'q12/cuDNN':>9s}")
    for d in (128, 256):
        for cname, (q_lens, prefixes) in cases.items():
            kv_lens = [a_ + b_ for a_, b_ in zip(q_lens, prefixes)]
            fl = gc.attn_flops(d, HQ, q_lens, kv_lens)
            tr = torch_res[(cname, d)]
            for comp in ("flash", "cudnn"):
                us = tr.get(f"{comp}_us")
                if us:
                    print(f"{cname:26s} {tr[comp + '_api'][:30]:30s} {d:4d} {us:9.1f} {fl / us * 1e-6:8.1f}")
            fa, cd = tr.get("flash_us"), tr.get("cudnn_us")
            for vname, vc, vd, us in table:
                if vd != d or vc != cname:
                    continue
                print(f"{cname:26s} {vname:30s} {d:4d} {us:9.1f} {fl / us * 1e-6:8.1f} "
                      f"{(us / fa if fa else float('nan')):8.3f} {(us / cd if cd else float('nan')):9.3f}")
    print(f"total {time.time() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
