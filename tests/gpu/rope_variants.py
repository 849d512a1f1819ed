"""Compare compile-time variants of ``cuda_src/rope.cu`` on one GPU run (not a pytest file).

    python3 tests/gpu/rope_variants.py            # all variants
    python3 tests/gpu/rope_variants.py v0 v3      # a subset by name (legacy always runs)

Each variant is one NVRTC compile of the source with its ``-D`` macros (registers and spills from
ptxas are printed) and a launch geometry: ``threads`` per CTA and a grid of ``grid_waves`` x the
resident CTAs (from ``cuOccupancyMaxActiveBlocksPerMultiprocessor``; 0 = one CTA per warp-group of
tokens, no persistence), never more CTAs than the work needs. Correctness on a small ragged case
(plain RoPE Qwen3-Next shape, interleaved MRoPE, chunked MRoPE full rotary): bit for bit equal to
the legacy kernel (``-DROPE_LEGACY=1``) and within the tests' tolerance of the float64 reference.
Two references for the access pattern: torch copying only the rotary prefixes (the floor's bytes,
strided like the kernel's), and the shipped kernel under each ``CU_LIMIT_MAX_L2_FETCH_GRANULARITY``.
Timing: 64k tokens for the Qwen3-Next shape (Hq 16, Hkv 2, D 256, rd 64, theta 1e7) and a
full-rotary Qwen3-like shape (Hq 32, Hkv 8, D 128, rd 128, theta 1e6), plain RoPE, cold L2 (the
buffer sets rotate as in bench/gpu_compare.py), CUDA events, 3 warm-up launches, median of 20.
TB/s count the floor bytes (rope.floor_bytes); "floor" is the fraction of 4.23 TB/s (the D2D rate
the bench uses); a torch D2D copy of the same byte count is timed as a second reference.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time

# name, defines, threads per CTA, grid_waves (x resident CTAs; 0 = no persistence)
VARIANTS = [  # measured at d18a17d and 017c571 (tests/GPU.md): within run-to-run noise (+-10%) of each other
    ("v0-shipped", (), 256, 1),
    ("v1-angles-first", ("ROPE_ANGLES_FIRST=1",), 256, 1),
    ("v2-512", (), 512, 1),
    ("v3-upl2-3cta", ("ROPE_UPL=2", "ROPE_MAX_THREADS=256", "ROPE_MIN_BLOCKS=3"), 256, 1),  # 80 regs, 24 warps/SM
]
LEGACY = ("legacy", ("ROPE_LEGACY=1",), 256, 1)

SHAPES = [  # name, hq, hkv, d, rd, theta
    ("qwen3next", 16, 2, 256, 64, 1e7),
    ("fullrot", 32, 8, 128, 128, 1e6),
]
T_TIMING = 65536
D2D_TBPS = 4.23
WARMUP, REPS = 3, 20


def _upl(defs):
    for d in defs:
        if d.startswith("ROPE_UPL="):
            return int(d.split("=")[1])
    return 3


def main(argv):
    import numpy as np
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from cuda.bindings import driver as cu

    from bench.timing import cold_sets, torch_events_us
    from q12drv.kernels import rope
    from q12drv.kernels.meta import meta_defines
    from q12drv.core.nvrtc import compile_source
    from tests.gpu.raw_harness import Buf, Kernel, _check
    from tests.gpu.test_rope_gpu import assert_close, make_meta, make_positions, rand_bf16

    t_start = time.time()
    want = set(argv)
    variants = [v for v in VARIANTS if not want or v[0] in want or v[0].split("-")[0] in want]
    variants = [LEGACY] + variants
    Kernel(rope.SOURCE, "q12_rope")  # makes the context current (and checks the shipped build: 0 spills)
    dev = _check(cu.cuCtxGetDevice())
    n_sms = _check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)

    def build(defs):
        img = compile_source(rope.SOURCE, arch="sm_90", defines=tuple(meta_defines()) + tuple(defs), use_cache=False,
                             verbose_resources=True)
        m = re.search(r"(\d+) bytes spill stores.*?Used (\d+) registers", img.log, re.S)
        info = f"{m.group(2)} regs, {m.group(1)} B spill" if m else "?"
        module = _check(cu.cuModuleLoadData(img.image))
        func = _check(cu.cuModuleGetFunction(module, b"q12_rope"))
        return module, func, info

    def geometry(func, defs, threads, waves, T, hq, hkv, d, rd):
        occ = _check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, 0))
        legacy = "ROPE_LEGACY=1" in defs
        if waves == 0:
            g, b, _ = rope.geometry(T, hq, hkv, d, rd, threads=threads, legacy=legacy, upl=_upl(defs),
                                    ctas_per_sm=1 << 20, num_sms=n_sms)
        else:
            g, b, _ = rope.geometry(T, hq, hkv, d, rd, threads=threads, legacy=legacy, upl=_upl(defs),
                                    ctas_per_sm=occ * waves, num_sms=n_sms)
        return g, b, occ

    def launch(func, grid, block, meta, q_ptr, k_ptr, hq, hkv, d, rd, theta, mode, sec):
        params = [meta, ctypes.c_uint64(q_ptr), ctypes.c_uint64(k_ptr), ctypes.c_int32(hq), ctypes.c_int32(hkv),
                  ctypes.c_int32(d), ctypes.c_int32(rd), ctypes.c_float(theta), ctypes.c_int32(mode),
                  ctypes.c_int32(sec[0]), ctypes.c_int32(sec[1]), ctypes.c_int32(sec[2])]
        argv_ = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        _check(cu.cuLaunchKernel(func, *grid, *block, 0, stream, ctypes.addressof(argv_), 0))
        return params, argv_

    # ---------------------------------------------------------------- correctness cases (small, ragged)
    lens = [1, 15, 16, 17, 63, 64, 65, 1100]
    checks = [  # d, rd, hq, hkv, theta, mode, sec
        (256, 64, 16, 2, 1e7, 0, (0, 0, 0)),
        (256, 64, 16, 4, 1e7, 2, (11, 11, 10)),
        (128, 128, 32, 8, 1e6, 1, (16, 24, 24)),
    ]
    rng = np.random.default_rng(7)
    keep = []
    cases = []
    for d, rd, hq, hkv, theta, mode, sec in checks:
        pos_t, pos_h, pos_w = make_positions(rng, lens, mode)
        q = rand_bf16(rng, (sum(lens), hq, d))
        k = rand_bf16(rng, (sum(lens), hkv, d))
        meta = make_meta(keep, pos_t, pos_h, pos_w, lens)
        ref = rope.reference(q, k, pos_t, rd, theta, mode, sec, pos_h, pos_w)
        cases.append(dict(d=d, rd=rd, hq=hq, hkv=hkv, theta=theta, mode=mode, sec=sec, q=q, k=k, meta=meta, ref=ref))

    # ---------------------------------------------------------------- timing buffers (cold L2)
    timing = {}
    for name, hq, hkv, d, rd, theta in SHAPES:
        floor = rope.floor_bytes(T_TIMING, hq, hkv, rd)
        n_sets = cold_sets(floor)
        pos = np.arange(T_TIMING, dtype=np.uint32) % 8192  # 8 streams of 8192, as the bench
        meta = make_meta(keep, pos, pos, pos, [8192] * (T_TIMING // 8192))
        sets = [(torch.randn(T_TIMING, hq, d, device="cuda", dtype=torch.bfloat16),
                 torch.randn(T_TIMING, hkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
        timing[name] = dict(hq=hq, hkv=hkv, d=d, rd=rd, theta=theta, floor=floor, meta=meta, sets=sets)

    def events_us(fn):
        return torch_events_us(torch, fn, REPS, WARMUP)

    # D2D reference: copy floor/2 bytes (read + write = floor), rotating buffers
    d2d = {}
    for name, tc in timing.items():
        n = tc["floor"] // 2 // 2
        bufs = [(torch.empty(n, dtype=torch.int16, device="cuda"), torch.empty(n, dtype=torch.int16, device="cuda"))
                for _ in range(2)]
        turn = [0]

        def cp(bufs=bufs, turn=turn):
            a, b = bufs[turn[0] % 2]
            turn[0] += 1
            b.copy_(a)

        d2d[name] = events_us(cp)
        del bufs

    # the same access pattern without the math: a strided copy of the rotary prefix of every head row
    # (reads and writes exactly the floor bytes, through torch's copy kernel)
    strided = {}
    for name, tc in timing.items():
        turn = [0]

        def sc(tc=tc, turn=turn):
            sets, rd = tc["sets"], tc["rd"]
            (qa, ka), (qb, kb) = sets[turn[0] % len(sets)], sets[(turn[0] + 1) % len(sets)]
            turn[0] += 1
            qb[..., :rd].copy_(qa[..., :rd])
            kb[..., :rd].copy_(ka[..., :rd])

        strided[name] = events_us(sc)

    legacy_out = []
    table = []
    l2_rows = []  # (granularity, shape, us) for the shipped kernel under cuCtxSetLimit(MAX_L2_FETCH_GRANULARITY)
    for vi, (vname, defs, threads, waves) in enumerate(variants):
        try:
            module, func, info = build(defs)
        except Exception as exc:  # noqa: BLE001
            print(f"{vname}: BUILD FAILED {type(exc).__name__}: {str(exc)[:400]}")
            continue
        ok_all = True
        occ = 0
        for ci, c in enumerate(cases):
            try:
                T = sum(lens)
                grid, block, occ = geometry(func, defs, threads, waves, T, c["hq"], c["hkv"], c["d"], c["rd"])
                qb, kb = Buf(c["q"]), Buf(c["k"])
                launch(func, grid, block, c["meta"], qb.ptr, kb.ptr, c["hq"], c["hkv"], c["d"], c["rd"], c["theta"],
                       c["mode"], c["sec"])
                torch.cuda.synchronize()
                qo, ko = qb.read(np.uint16, c["q"].shape), kb.read(np.uint16, c["k"].shape)
                qb.check_guards()
                kb.check_guards()
                assert_close(qo, c["ref"][0], "q")
                assert_close(ko, c["ref"][1], "k")
                if vi == 0:
                    legacy_out.append((qo, ko))
                    same = True
                else:
                    same = np.array_equal(qo, legacy_out[ci][0]) and np.array_equal(ko, legacy_out[ci][1])
                ok_all &= same
                print(f"{vname:22s} case {ci} (D{c['d']} rd{c['rd']} mode {c['mode']}): ref ok, == legacy {same}")
            except Exception as exc:  # noqa: BLE001
                ok_all = False
                print(f"{vname:22s} case {ci}: FAIL {type(exc).__name__}: {str(exc)[:300]}")
        print(f"{vname:22s} [{info}, {occ} CTAs/SM of {threads}] {'PASS' if ok_all else 'FAIL'}")
        for sname, tc in timing.items():
            try:
                grid, block, _ = geometry(func, defs, threads, waves, T_TIMING, tc["hq"], tc["hkv"], tc["d"], tc["rd"])
                turn = [0]

                def run(tc=tc, grid=grid, block=block, turn=turn):
                    q, k = tc["sets"][turn[0] % len(tc["sets"])]
                    turn[0] += 1
                    launch(func, grid, block, tc["meta"], q.data_ptr(), k.data_ptr(), tc["hq"], tc["hkv"], tc["d"],
                           tc["rd"], tc["theta"], 0, (0, 0, 0))

                us = events_us(run)
                table.append((vname, sname, us, info, occ, grid[0], ok_all))
            except Exception as exc:  # noqa: BLE001
                print(f"{vname} {sname}: timing failed {type(exc).__name__}: {exc}")
        if vname == "v0-shipped":  # does the L2 fetch granularity hint change the partial-row pattern?
            lim = cu.CUlimit.CU_LIMIT_MAX_L2_FETCH_GRANULARITY
            orig = _check(cu.cuCtxGetLimit(lim))
            try:
                for gran in (32, 64, 128):
                    _check(cu.cuCtxSetLimit(lim, gran))
                    for sname, tc in timing.items():
                        grid, block, _ = geometry(func, defs, threads, waves, T_TIMING, tc["hq"], tc["hkv"], tc["d"],
                                                  tc["rd"])
                        turn = [0]

                        def run(tc=tc, grid=grid, block=block, turn=turn):
                            q, k = tc["sets"][turn[0] % len(tc["sets"])]
                            turn[0] += 1
                            launch(func, grid, block, tc["meta"], q.data_ptr(), k.data_ptr(), tc["hq"], tc["hkv"],
                                   tc["d"], tc["rd"], tc["theta"], 0, (0, 0, 0))

                        l2_rows.append((gran, sname, events_us(run)))
            finally:
                _check(cu.cuCtxSetLimit(lim, orig))
            print(f"L2 fetch granularity: the context's default is {orig} B")
        _check(cu.cuModuleUnload(module))

    print()
    print(f"rope {T_TIMING // 1024}k tokens, plain, cold L2, device time (median of {REPS}); "
          f"floor = fraction of {D2D_TBPS} TB/s (goal >= 0.70)")
    for sname, hq, hkv, d, rd, _ in SHAPES:
        tc = timing[sname]
        fl = tc["floor"]
        print(f"\n{sname}: Hq{hq} Hkv{hkv} D{d} rd{rd}, floor {fl / 1e6:.0f} MB = {fl / (D2D_TBPS * 1e6):.1f} us; "
              f"torch D2D copy of the same bytes {d2d[sname]:.1f} us ({fl / d2d[sname] / 1e6:.2f} TB/s)")
        print(f"{'variant':24s} {'us':>8s} {'TB/s':>6s} {'floor':>6s} {'vs D2D':>6s} {'grid':>5s}  build")
        print(f"torch strided copy of the rotary prefixes (the same bytes, the same pattern): {strided[sname]:.1f} us "
              f"({fl / strided[sname] / 1e6:.2f} TB/s, {fl / strided[sname] / 1e6 / D2D_TBPS:.1%} of the floor rate)")
        for gran, sn, us in l2_rows:
            if sn == sname:
                print(f"v0-shipped with MAX_L2_FETCH_GRANULARITY {gran:3d} B: {us:8.1f} us "
                      f"({fl / us / 1e6 / D2D_TBPS:.1%} of the floor rate)")
        for vname, sn, us, info, occ, g, ok in table:
            if sn != sname:
                continue
            tb = fl / us / 1e6
            print(f"{vname:24s} {us:8.1f} {tb:6.2f} {tb / D2D_TBPS:6.1%} {d2d[sname] / us:6.1%} {g:5d}  "
                  f"{info}, {occ}/SM{'' if ok else '  CHECK FAILED'}")
    print(f"\ntotal {time.time() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
