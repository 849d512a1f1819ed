#!/usr/bin/env python3
"""Time q12drv and its comparators in one run on the GPU; print a ratio table last.

    PYTHONPATH=. python3 bench/gpu_compare.py --out results.json

Every comparison is measured in the same process, interleaved where it matters, so only the
ratios are claimed (absolute numbers drift from run to run). Sections (each one fails alone: an
error is recorded and the rest still run):

* ``launch``: host enqueue time per launch of the same empty kernel (6 x u64 + 2 x i32): the raw
  pre-packed ``cuLaunchKernel`` (the floor, its result checked once per batch) vs
  ``Launch.launch``, ``Launch.bind()`` and ``set + launch``; the whole parameter matrix; the
  ``ops.kv_write`` launcher (checks + packing + launch); cuda.core's ``launch()`` when installed.
  Median over batches of 200 launches, the stream drained between batches, paths interleaved.
* ``staging``: 8 streams x 2048 tokens with MRoPE. q12drv ``host`` (validate, pack, one copy) and
  ``device`` (validate, then one expansion launch carrying the per-stream tail), ``planned`` (the
  same through an ``ExpandPlan`` made once: a pass checks only its starts and counts) against one bare
  ``cuMemcpyHtoDAsync`` of the same ``staged_bytes`` (already packed: the floor), one copy per field
  (already packed), and torch-style (one pinned torch tensor per field, ``.to(device,
  non_blocking=True)`` each). Host time = the call alone; round trip = the call and a stream sync.
  The bytes each path leaves in the arena are checked.
* ``curve``: the same round trips for n in {1..64} x tokens per stream in {16..8192}, and where
  the device path overtakes the packed copy.
* ``jit_slot``: the per-SSM-layer ``h_state_ptrs`` upload.
* ``step``: admission + staging + one attention + one Gated DeltaNet layer (Qwen3-Next-like),
  batched vs per stream, 8 x 128 and 8 ragged 256..2048 tokens; wall-clock round trip. Also the
  8 x 128 pass through Qwen3-Next's 48 layers (12 x (3 GDN + 1 attention)), for information.
* ``kv_write`` (64k tokens) vs torch ``index_copy_``; ``rope`` vs eager torch (the HF formula);
  ``attention`` (the default kernel, Hq 16, Hkv 2, block 16, D 128 and 256: fresh 8 x 2048 and
  4 x 4096, ragged 8 x 256..4096, chunked 2048 on 8192 keys for 1 and 2 streams) vs torch FA2
  (SDPA FLASH batched, or ``varlen_attn`` with the bottom-right causal window for ragged/chunked)
  and cuDNN (SDPA, per stream for ragged/chunked) on gathered, head-expanded K/V; device time from
  events, median after warm-up; TFLOP/s by the pairs formula (kernels.md B2).
* ``graph``: a captured pass (stage copy + layer kernels) replayed with new metadata vs eager.

Expected runtime on the H200: about 30-60 s (plus NVRTC compiles on a cold cubin cache).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import q12drv  # noqa: E402
from bench import common  # noqa: E402
from bench.timing import cold_sets, host_and_round_trip, q12_events_us, torch_events_us  # noqa: E402
from q12drv.kernels.gdn import GdnConfig  # noqa: E402

RESULTS: dict = {"meta": {}, "sections": {}, "errors": {}, "table": []}
ARGS = None
DEV = None
T0 = time.perf_counter()


# ----------------------------------------------------------------------------- timing
def med(xs) -> float:
    return float(statistics.median(xs))


def per_call_batches(paths: dict, batch: int, batches: int, sync) -> dict:
    """Median host time per call (us) of each zero-argument callable, in batches, paths interleaved."""
    out = {name: [] for name in paths}
    for fn in paths.values():  # warm-up
        for _ in range(min(batch, 20)):
            fn()
    sync()
    pc = time.perf_counter
    for _ in range(batches):
        for name, fn in paths.items():
            sync()
            t0 = pc()
            for _ in range(batch):
                fn()
            out[name].append((pc() - t0) / batch * 1e6)
    sync()
    return {name: med(v) for name, v in out.items()}


def row(name, ours, comparator, theirs, goal=None, note=""):
    """A table row: times in us; ``goal`` is (op, value) on the ratio q12drv/comparator, e.g. ("<=", 1.05)."""
    ratio = ours / theirs if (ours is not None and theirs) else None
    met = None
    if goal is not None and ratio is not None:
        op, value = goal
        met = ratio <= value if op == "<=" else ratio >= value
    RESULTS["table"].append({"name": name, "q12drv_us": ours, "comparator": comparator, "comparator_us": theirs,
                             "ratio": ratio, "goal": None if goal is None else f"{goal[0]} {goal[1]:g}",
                             "met": met, "note": note})


def faster(k: float):
    """Goal: q12drv at least ``k`` times faster (ratio <= 1/k)."""
    return ("<=", 1.0 / k)


def torch_mod():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    return torch


def gpu() -> bool:
    return common.on_gpu(DEV)


def reps(n_gpu: int, n_emu: int = 2) -> int:
    return (max(3, n_gpu // 4) if ARGS.quick else n_gpu) if gpu() else n_emu


# ----------------------------------------------------------------------------- sections
def section_launch():
    dev = DEV
    grid, block = (1, 1, 1), (32, 1, 1)
    stream = dev.stream
    res = {}
    batch, batches = (200, 60) if gpu() else (20, 3)
    if ARGS.quick and gpu():
        batches = 15
    for case in common.LAUNCH_CASES:
        launch = common.bench_launch(dev, case)
        raw = common.raw_launcher(dev, launch, grid, block)
        values = common.LAUNCH_CASES[case][1]

        def q12(launch=launch):
            launch.launch(grid, block, 0, stream)

        def set_launch(launch=launch, values=values):
            launch.set(**values)
            launch.launch(grid, block, 0, stream)

        paths = {"raw": raw, "Launch.launch": q12, "bound": launch.bind(grid, block, 0, stream), "set+launch": set_launch}
        res[case] = per_call_batches(paths, batch, batches, dev.synchronize)
        if gpu():
            err = raw()[0]
            if int(err):
                raise RuntimeError(f"raw cuLaunchKernel failed: {err!r}")
    RESULTS["sections"]["launch"] = res
    a = res["6 u64 + 2 i32"]
    row("launch: Launch.launch (6 u64 + 2 i32)", a["Launch.launch"], "raw cuLaunchKernel, pre-packed", a["raw"], ("<=", 1.05))
    row("launch: Launch.bind() call", a["bound"], "raw cuLaunchKernel, pre-packed", a["raw"], ("<=", 1.05))
    row("launch: set(8 args) + launch", a["set+launch"], "raw cuLaunchKernel, pre-packed", a["raw"])
    m = res["Q12Meta by value"]
    row("launch: Launch.launch (Q12Meta by value)", m["Launch.launch"], "raw cuLaunchKernel, pre-packed", m["raw"], ("<=", 1.05))

    # the whole launcher: argument checks, geometry, packing, launch
    from q12drv.kernels import ops

    case = common.StagingCase(dev, 8, 16, mrope=False)
    try:
        meta = case.host()
        row_elems = 2 * 256
        pool = dev.alloc(case.num_blocks * 16 * row_elems * 2, "kv pool")
        rows = dev.alloc(8 * 16 * row_elems * 2, "kv rows")
        p, r = int(pool.ptr), int(rows.ptr)

        def kv():
            ops.kv_write(dev, meta, r, r, p, p, num_kv_heads=2, head_dim=256, num_blocks=case.num_blocks)

        kv_launch = ops.prepared(dev, "q12_kv_write")
        kv_raw = common.raw_launcher(dev, kv_launch, (1, 1, 1), (256, 1, 1))
        t = per_call_batches({"ops.kv_write": kv, "raw": kv_raw}, batch, max(3, batches // 2), dev.synchronize)
        res["ops.kv_write"] = t
        row("launcher: ops.kv_write (checks+pack+launch)", t["ops.kv_write"], "raw cuLaunchKernel, pre-packed", t["raw"],
            note="info: the full launcher")
        pool.free()
        rows.free()
    finally:
        case.close()

    if gpu():
        try:
            res["cuda.core launch()"] = _cuda_core_launch(batch, batches)
            row("launch: cuda.core launch() (comparator)", res["cuda.core launch()"], "raw cuLaunchKernel, pre-packed",
                a["raw"], note="info: what cuda.core costs here")
        except Exception as exc:  # optional comparator
            RESULTS["errors"]["launch/cuda.core"] = f"{type(exc).__name__}: {exc}"


def _cuda_core_launch(batch, batches) -> float:
    from cuda.core import Device as CoreDevice
    from cuda.core import LaunchConfig, ObjectCode, launch

    from q12drv.kernels.meta import meta_defines
    from q12drv.core.nvrtc import compile_source

    image = compile_source(common.BENCH_SOURCE, arch=DEV.arch, defines=tuple(meta_defines()),
                           source_dir=common.BENCH_SOURCE_DIR).image
    cdev = CoreDevice(DEV.ordinal)
    cdev.set_current()
    kernel = ObjectCode.from_cubin(image).get_kernel("q12_bench_args8")
    s = cdev.create_stream()
    cfg = LaunchConfig(grid=1, block=32)
    args = [np.uint64(0x7F00_0000_0000 + 256 * i) for i in range(6)] + [np.int32(7), np.int32(9)]

    def fire():
        launch(s, cfg, kernel, *args)

    t = per_call_batches({"core": fire}, batch, batches, s.sync)["core"]
    s.close()
    return t


def section_staging():
    dev = DEV
    n, tokens = (8, 2048) if gpu() else (8, 256)
    case = common.StagingCase(dev, n, tokens)
    res = {"n": n, "tokens_per_stream": tokens, "staged_bytes": case.staged_bytes,
           "device_path_bytes": case.staged_bytes - case.layout.tail_offset}
    try:
        paths = {"host": case.host, "device": case.device, "planned": case.planned, "bare": case.bare,
                 "per_field": case.per_field}
        t = host_and_round_trip(paths, reps(200, 3), dev.synchronize)
        verified = {}
        for name, fn in paths.items():
            fn()
            verified[name] = case.check()
        res.update(t)
        res["verified"] = verified
        try:
            res["torch_style"] = _torch_style(case, reps(200, 3))
        except Exception as exc:
            RESULTS["errors"]["staging/torch_style"] = f"{type(exc).__name__}: {exc}"
    finally:
        case.close()
    RESULTS["sections"]["staging"] = res
    label = f"{n}x{tokens} MRoPE"
    for path, what in (("planned", "planned expand"), ("device", "device expand"), ("host", "host pack")):
        row(f"staging {label}: host time ({what})", res[path]["host_us"], "(budget)", 25.0, ("<=", 1.0),
            note="goal: <= 25 us")
        row(f"staging {label}: round trip ({what})", res[path]["round_trip_us"], "bare cuMemcpyHtoDAsync of staged_bytes",
            res["bare"]["round_trip_us"], ("<=", 1.2))
        if "torch_style" in res:
            row(f"staging {label}: round trip ({what})", res[path]["round_trip_us"], "torch-style (.to per field)",
                res["torch_style"]["round_trip_us"], faster(4))
        row(f"staging {label}: round trip ({what})", res[path]["round_trip_us"], "per-field copies (8 HtoD)",
            res["per_field"]["round_trip_us"], faster(2))
    if not all(res["verified"].values()):
        RESULTS["errors"]["staging/verify"] = f"arena bytes differ after: {[k for k, v in res['verified'].items() if not v]}"


def _torch_fields(case):
    """The packed fields as pinned torch tensors (u32/u64 viewed as i32/i64: same bytes)."""
    torch = torch_mod()
    out = []
    for f in case.layout.fields:
        arr = case.packed.array[f.offset:f.offset + f.nbytes].view(f.dtype)
        arr = arr.view({"<u4": np.int32, "<u8": np.int64}.get(f.dtype, arr.dtype))
        out.append(torch.from_numpy(arr.copy()).pin_memory())
    return out


def _torch_style(case, n_reps) -> dict:
    torch = torch_mod()
    fields = _torch_fields(case)
    dev = torch.device("cuda", DEV.ordinal)
    stream = torch.cuda.current_stream()
    keep = []

    def stage():
        keep[:] = [t.to(dev, non_blocking=True) for t in fields]

    t = host_and_round_trip({"torch": stage}, n_reps, stream.synchronize)["torch"]
    got = b"".join(x.cpu().numpy().tobytes() + b"\0" * (f.padded - f.nbytes) for x, f in zip(keep, case.layout.fields))
    t["verified"] = got == case.packed.array.tobytes()
    return t


def section_curve():
    dev = DEV
    ns = (1, 2, 4, 8, 16, 32, 64) if gpu() else (1, 8)
    tokens = (16, 128, 1024, 2048, 8192) if gpu() else (16, 128)
    if ARGS.quick and gpu():
        ns, tokens = (1, 8, 64), (16, 2048, 8192)
    points = []
    have_torch = True
    for n in ns:
        for L in tokens:
            if time.perf_counter() - T0 > ARGS.budget_s * 0.6:
                RESULTS["errors"]["curve"] = f"stopped at n={n}, tokens={L}: over 60% of the time budget"
                break
            total = n * L
            r = reps(30 if total <= 16384 else (12 if total <= 131072 else 6), 2)
            case = common.StagingCase(dev, n, L)
            try:
                t = host_and_round_trip({"host": case.host, "device": case.device, "planned": case.planned,
                                         "bare": case.bare, "per_field": case.per_field}, r, dev.synchronize, warmup=1)
                p = {"n": n, "tokens": L, "total_tokens": total, "staged_bytes": case.staged_bytes, **t}
                if have_torch and gpu():
                    try:
                        p["torch_style"] = _torch_style(case, r)
                    except Exception as exc:
                        have_torch = False
                        RESULTS["errors"]["curve/torch_style"] = f"{type(exc).__name__}: {exc}"
                points.append(p)
            finally:
                case.close()
    crossover = {"device": {}, "planned": {}}
    for n in ns:
        pts = [p for p in points if p["n"] == n]
        for path, out in crossover.items():
            wins = [p["tokens"] for p in pts if p[path]["round_trip_us"] < p["host"]["round_trip_us"]]
            out[str(n)] = min(wins) if wins else None
    RESULTS["sections"]["curve"] = {"points": points, "device_beats_host_from_tokens": crossover["device"],
                                    "planned_beats_host_from_tokens": crossover["planned"]}


def section_jit_slot():
    from q12drv import ScratchArena
    from q12drv.core.staging import reserve_h_state_slot

    dev = DEV
    n = 8
    res = {}
    with ScratchArena(dev, 1 << 16) as arena:
        slot = reserve_h_state_slot(arena, n)
        ptrs = [0x7F00_0000_0000 + 4096 * b for b in range(n)]
        res["q12drv"] = host_and_round_trip({"upload": lambda: slot.upload(ptrs)}, reps(300, 3), dev.synchronize)["upload"]
        dev.synchronize()
    if gpu():
        try:
            torch = torch_mod()
            host = torch.tensor(ptrs, dtype=torch.int64).pin_memory()
            stream = torch.cuda.current_stream()
            keep = []
            res["torch"] = host_and_round_trip({"t": lambda: keep.append(host.to("cuda", non_blocking=True))},
                                               reps(300, 3), stream.synchronize)["t"]
        except Exception as exc:
            RESULTS["errors"]["jit_slot/torch"] = f"{type(exc).__name__}: {exc}"
    RESULTS["sections"]["jit_slot"] = res
    if "torch" in res:
        row("h_state_ptrs upload (n=8): round trip", res["q12drv"]["round_trip_us"], "torch pinned tensor .to()",
            res["torch"]["round_trip_us"], note="info")


def section_step():
    dev = DEV
    res = {}
    for name in ("8x128", "ragged"):
        step = common.StepCase(dev, common.step_counts(name, gpu()))
        try:
            # 50 repetitions after 5 warm-ups: with 20 after 2, the same eager step measured 445 us here
            # and 259 us in the graph section (run M); with these both sections agree (run N)
            t = host_and_round_trip({"batched": lambda: step.run("batched"), "per_stream": lambda: step.run("per_stream")},
                                    reps(50, 1), dev.synchronize, warmup=5)
            res[name] = {"counts": step.counts, **t}
        finally:
            step.close()
        goal = 4 if name == "8x128" else 1.5
        row(f"step {name}: batched (stage+attn+GDN)", res[name]["batched"]["round_trip_us"], "per-stream fallback",
            res[name]["per_stream"]["round_trip_us"], faster(goal))
    # the same 8 x 128 pass through all 48 layers of Qwen3-Next (12 x (3 GDN + 1 attention)): what a
    # runtime's pass costs once the per-layer work, not the per-pass work, dominates
    step = common.StepCase(dev, common.step_counts("8x128", gpu()))
    try:
        t = host_and_round_trip({"batched": lambda: step.run("batched", 12), "per_stream": lambda: step.run("per_stream", 12)},
                                reps(10, 1), dev.synchronize, warmup=1)
        res["8x128_48_layers"] = {"counts": step.counts, **t}
    finally:
        step.close()
    for mode in ("batched", "per_stream"):
        row(f"step 8x128 48 layers: {mode} host time", res["8x128_48_layers"][mode]["host_us"], "its round trip",
            res["8x128_48_layers"][mode]["round_trip_us"], note="info")
    row("step 8x128 48 layers: batched", res["8x128_48_layers"]["batched"]["round_trip_us"], "per-stream fallback",
        res["8x128_48_layers"]["per_stream"]["round_trip_us"], note="info: Qwen3-Next's 12 x (3 GDN + attn)")
    RESULTS["sections"]["step"] = res


@contextlib.contextmanager
def _staged_pass(dev, counts, mrope=False, block_size=16):
    """A batch of ``counts`` staged in its own arena; yields ``(meta, streams, num_blocks, arena, bufs)``.

    Buffers appended to ``bufs`` are freed, with the arena and the block tables, on the way out.
    """
    from q12drv import ScratchArena, make_scratch_plan, stage_batched_attn_metadata

    streams, num_blocks, tables = common.make_streams(dev, counts, block_size=block_size)
    plan = make_scratch_plan(counts, 0, mrope, "exact")
    arena = ScratchArena(dev, plan.total_bytes + 4096)
    bufs = []
    try:
        meta = stage_batched_attn_metadata(arena, streams, block_size=block_size, use_mrope=mrope,
                                           scratch_offset_bytes=0, dummy_kv_block=0)
        dev.synchronize()
        yield meta, streams, num_blocks, arena, bufs
    finally:
        dev.synchronize()
        for b in bufs:
            b.free()
        arena.close()
        tables.free()


def _rand_bf16(dev, shape, seed):
    from q12drv.core.bf16 import to_bf16_bits

    arr = to_bf16_bits(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))
    buf = dev.alloc(arr.nbytes)
    dev.upload(int(buf.ptr), arr)
    return buf, arr


D2D_TBPS = 4.23  # H200 D2D copy, read + write (bench/RESULTS.md); the memory-bound kernels' limit
def _cold_sets(bytes_per_set: int) -> int:
    """Buffer sets to rotate among so the bytes touched between two uses of a set exceed 3x L2 (two on the emulator)."""
    return cold_sets(bytes_per_set) if gpu() else 2


def _memory_rows(name, res, key, floor_bytes, goal_fraction):
    us = res.get(key)
    if us is None:
        return
    tbps = floor_bytes / (us * 1e-6) / 1e12
    res[key.replace("_us", "_tbps")] = tbps
    res[key.replace("_us", "_fraction")] = tbps / D2D_TBPS
    row(name, us, f"floor: {floor_bytes / 1e6:,.0f} MB at {D2D_TBPS} TB/s", floor_bytes / (D2D_TBPS * 1e12) * 1e6,
        ("<=", 1.0 / goal_fraction) if goal_fraction else None,
        note=f"{tbps:.2f} TB/s = {tbps / D2D_TBPS:.1%} of D2D")


def section_kv_write():
    from q12drv.kernels import ops

    dev = DEV
    counts = [8192] * 8 if gpu() else [64] * 2
    hkv, d, bs = 2, 256, 16
    total = sum(counts)
    row_elems = hkv * d
    floor = 2 * 2 * total * row_elems * 2  # K and V, read + written (the slots' 8 B/token not counted)
    res = {"tokens": total, "row_bytes": row_elems * 2, "floor_bytes": floor}
    with _staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
        pool_bytes = num_blocks * bs * row_elems * 2
        n_sets = _cold_sets(2 * total * row_elems * 2 + 2 * pool_bytes)
        sets = []
        for i in range(n_sets):
            k, _ = _rand_bf16(dev, (total, hkv, d), 1 + 10 * i)
            v, _ = _rand_bf16(dev, (total, hkv, d), 2 + 10 * i)
            kp, vp = dev.alloc(pool_bytes), dev.alloc(pool_bytes)
            bufs += [k, v, kp, vp]
            sets.append((k, v, kp, vp))
        res["buffer_sets"] = n_sets
        turn = [0]

        def q12():
            k, v, kp, vp = sets[turn[0] % n_sets]
            turn[0] += 1
            ops.kv_write(dev, meta, k.ptr, v.ptr, kp.ptr, vp.ptr, num_kv_heads=hkv, head_dim=d, num_blocks=num_blocks)

        res["q12drv_us"] = q12_events_us(dev, q12, reps(50, 1))
        RESULTS["sections"]["kv_write"] = res
        _memory_rows(f"kv_write {total // 1024}k tokens: vs D2D floor", res, "q12drv_us", floor, 0.75)
        if gpu():
            _comparator("kv_write/torch",
                        lambda: _kv_write_torch(arena, meta, total, hkv, d, num_blocks, bs, res, n_sets))


def _comparator(name, fn):
    """Run one comparator; record its error instead of losing the section."""
    try:
        fn()
    except Exception as exc:
        RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)


def _kv_write_torch(arena, meta, total, hkv, d, num_blocks, bs, res, n_sets=1):
    torch = torch_mod()
    slots = np.frombuffer(arena.read(int(meta.slot_stacked) - int(arena.base), 8 * total), np.int64).copy()
    ts = torch.from_numpy(slots).cuda()
    sets = []
    for _ in range(n_sets):  # as many buffer sets as q12drv rotates among: same cold L2
        tk = torch.randn(total, hkv * d, device="cuda", dtype=torch.bfloat16)
        tv = torch.randn(total, hkv * d, device="cuda", dtype=torch.bfloat16)
        tkp = torch.zeros(num_blocks * bs, hkv * d, device="cuda", dtype=torch.bfloat16)
        sets.append((tk, tv, tkp, torch.zeros_like(tkp)))
    turn = [0]

    def ref():
        tk, tv, tkp, tvp = sets[turn[0] % n_sets]
        turn[0] += 1
        tkp.index_copy_(0, ts, tk)
        tvp.index_copy_(0, ts, tv)

    res["torch_index_copy_us"] = torch_events_us(torch, ref, reps(50, 1))
    row(f"kv_write {total // 1024}k tokens (K+V)", res["q12drv_us"], "torch index_copy_ (K, V)",
        res["torch_index_copy_us"], faster(1.5), note="device time, cold L2")


def section_rope():
    from q12drv.kernels import ops
    from q12drv.kernels import rope as rk

    dev = DEV
    counts = [8192] * 8 if gpu() else [32] * 2
    hq, hkv, d, rd, theta = 16, 2, 256, 64, 1e7
    total = sum(counts)
    # The floor: only the rotary dims of each head must move (read + written), plus the positions.
    floor = rk.floor_bytes(total, hq, hkv, rd)
    res = {"tokens": total, "shape": [hq, hkv, d, rd], "floor_bytes": floor}
    with _staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
        # L2 holds whole 32-byte sectors: the rotary prefix of a head row (128 B) is what a pass touches.
        n_sets = _cold_sets(floor)
        sets = []
        for i in range(n_sets):
            q, _ = _rand_bf16(dev, (total, hq, d), 3 + 10 * i)
            k, _ = _rand_bf16(dev, (total, hkv, d), 4 + 10 * i)
            bufs += [q, k]
            sets.append((q, k))
        res["buffer_sets"] = n_sets
        turn = [0]

        def q12():
            q, k = sets[turn[0] % n_sets]
            turn[0] += 1
            ops.rope(dev, meta, q.ptr, k.ptr, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rotary_dim=rd, theta=theta)

        res["q12drv_us"] = q12_events_us(dev, q12, reps(50, 1))
        # Full rotary (Qwen3-like Hq 32 Hkv 8 D 128 rd 128): timing only, so the buffers are left
        # uninitialised (no host RNG for 1.3 GB; the kernel's speed does not depend on the values).
        fhq, fhkv, fd, frd, ftheta = 32, 8, 128, 128, 1e6
        ffloor = rk.floor_bytes(total, fhq, fhkv, frd)
        fsets = []
        for _ in range(_cold_sets(ffloor)):
            fq, fk = dev.alloc(total * fhq * fd * 2), dev.alloc(total * fhkv * fd * 2)
            bufs += [fq, fk]
            fsets.append((fq, fk))

        def q12_full():
            q, k = fsets[turn[0] % len(fsets)]
            turn[0] += 1
            ops.rope(dev, meta, q.ptr, k.ptr, num_q_heads=fhq, num_kv_heads=fhkv, head_dim=fd, rotary_dim=frd,
                     theta=ftheta)

        res["full_rotary"] = {"shape": [fhq, fhkv, fd, frd], "floor_bytes": ffloor}
        res["full_rotary"]["q12drv_us"] = q12_events_us(dev, q12_full, reps(50, 1))
        RESULTS["sections"]["rope"] = res
        _memory_rows(f"rope {total // 1024}k tokens: vs floor (rotary dims)", res, "q12drv_us", floor, 0.70)
        _memory_rows(f"rope {total // 1024}k tokens: full rotary Hq32 Hkv8 D128 rd128", res["full_rotary"],
                     "q12drv_us", ffloor, None)
        if gpu():
            _comparator("rope/torch", lambda: _rope_torch(streams, total, hq, hkv, d, rd, theta, res, n_sets))


def _rope_torch(streams, total, hq, hkv, d, rd, theta, res, n_sets=1):
    torch = torch_mod()
    pos = torch.from_numpy(np.concatenate([np.arange(s.proc_start, s.proc_start + s.proc_count)
                                           for s in streams])).cuda()
    sets = [(torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
    inv_freq = 1.0 / (theta ** (torch.arange(0, rd, 2, device="cuda", dtype=torch.float32) / rd))
    turn = [0]

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def hf():
        tq, tk = sets[turn[0] % n_sets]
        turn[0] += 1
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(tq.dtype)[:, None, :], emb.sin().to(tq.dtype)[:, None, :]
        out = []
        for x in (tq, tk):
            xr, xp = x[..., :rd], x[..., rd:]
            out.append(torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1))
        return out

    res["torch_eager_us"] = torch_events_us(torch, hf, reps(50, 1))
    row(f"rope {total // 1024}k tokens (Hq16 Hkv2 D256 rd64)", res["q12drv_us"], "eager torch (HF formula)",
        res["torch_eager_us"], faster(3), note="device time, cold L2")


#: Attention cases of the issue (Hq 16, Hkv 2, block 16, D 128 and 256): name -> (q_lens, cached keys before the chunk).
ATTN_CASES = {
    "fresh 8x2048": ([2048] * 8, [0] * 8),
    "fresh 4x4096": ([4096] * 4, [0] * 4),
    "ragged 8x256..4096": ([256, 768, 1280, 1792, 2304, 2816, 3328, 4096], [0] * 8),
    "chunked 1x(2048 on 8192)": ([2048], [6144]),
    "chunked 2x(2048 on 8192)": ([2048] * 2, [6144] * 2),
}
ATTN_EMU_CASES = {"fresh 2x16": ([16, 16], [0, 0]), "chunked 2x(5 on 21)": ([5, 3], [16, 7])}


def attn_flops(d, hq, q_lens, kv_lens) -> float:
    """FLOPs of causal attention, kernels.md B2: 4 * D * Hq * sum_b (Lq (Lk - Lq) + Lq (Lq + 1) / 2)."""
    pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, kv_lens))
    return 4.0 * d * hq * pairs


def section_attention():
    """ops.attention (both kernels: algo "mma" and "wgmma") on the issue's cases vs torch FA2 and cuDNN; TFLOP/s by
    the pairs formula."""
    from q12drv.kernels import ops

    dev = DEV
    hq, hkv, bs = 16, 2, 16
    cases = ATTN_CASES if gpu() else ATTN_EMU_CASES
    res = {"shape": [hq, hkv, bs], "cases": {}}
    RESULTS["sections"]["attention"] = res
    for d in (128, 256):
        # One Q / K pool / V pool / O of the largest case per head dim, reused by every case.
        t_max = max(sum(q) for q, _ in cases.values())
        blocks_max = max(sum(-(-(q + p) // bs) for q, p in zip(qs, ps)) + 1 for qs, ps in cases.values())
        bufs = []
        try:
            q, _ = _rand_bf16(dev, (t_max, hq, d), 5)
            bufs.append(q)
            kp, _ = _rand_bf16(dev, (blocks_max * bs, hkv, d), 6)
            bufs.append(kp)
            vp, _ = _rand_bf16(dev, (blocks_max * bs, hkv, d), 7)
            bufs.append(vp)
            o = dev.alloc(t_max * hq * d * 2)
            bufs.append(o)
            for cname, (q_lens, prefixes) in cases.items():
                _attention_case(dev, ops, cname, d, q_lens, prefixes, hq, hkv, bs, q, kp, vp, o, res)
        finally:
            dev.synchronize()
            for buf in bufs:
                buf.free()


def _attention_case(dev, ops, cname, d, q_lens, prefixes, hq, hkv, bs, q, kp, vp, o, res):
    from q12drv import ScratchArena, make_scratch_plan, stage_batched_attn_metadata

    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    r = {"d": d, "q_lens": q_lens, "kv_lens": kv_lens, "flop": attn_flops(d, hq, q_lens, kv_lens)}
    res["cases"][f"{cname} D{d}"] = r
    streams, num_blocks, tables = common.make_streams(dev, q_lens, prefixes, block_size=bs, seed=d)
    arena = ScratchArena(dev, make_scratch_plan(q_lens, 0, False, "exact").total_bytes + 4096)
    try:
        meta = stage_batched_attn_metadata(arena, streams, block_size=bs, use_mrope=False,
                                           scratch_offset_bytes=0, dummy_kv_block=0)
        dev.synchronize()

        algos = ("mma", "wgmma")  # both kernels ("auto" picks wgmma on the H200 for these head dims)
        for algo in algos:

            def q12(algo=algo):
                ops.attention(dev, meta, q.ptr, kp.ptr, vp.ptr, o.ptr, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              algo=algo)

            r[f"q12drv_{algo}_us"] = q12_events_us(dev, q12, reps(20, 1))
        if gpu():
            _comparator(f"attention/torch {cname} D{d}",
                        lambda: r.update(_attention_torch(q_lens, kv_lens, hq, hkv, d, reps(20, 1))))
        for algo in algos:
            us = r[f"q12drv_{algo}_us"]
            tf = r["flop"] / us * 1e-6
            line = f"   attention {cname:26s} D{d} {algo:5s}: q12drv {us:9.1f} us {tf:6.1f} TFLOP/s"
            for comp in ("flash", "cudnn", "flash_gqa", "cudnn_gqa"):
                if r.get(f"{comp}_us"):
                    line += (f" | {comp} {r[f'{comp}_us']:9.1f} us {r['flop'] / r[f'{comp}_us'] * 1e-6:6.1f} TFLOP/s"
                             f" q12/{comp} {us / r[f'{comp}_us']:.3f}")
            print(line, flush=True)
            for comp, goal in (("flash", ("<=", 1.0)), ("cudnn", ("<=", 1.25)), ("flash_gqa", ("<=", 1.0)),
                               ("cudnn_gqa", ("<=", 1.25))):
                if r.get(f"{comp}_us"):
                    row(f"attention {cname} D{d} {algo}", us, r[f"{comp}_api"], r[f"{comp}_us"], goal,
                        note=f"TFLOP/s {tf:.0f} vs {r['flop'] / r[f'{comp}_us'] * 1e-6:.0f}")
    finally:
        dev.synchronize()
        arena.close()
        tables.free()


def _attention_torch(q_lens, kv_lens, hq, hkv, d, n_reps, warmup=3):
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
            RESULTS["errors"][f"attention/{key} {n}x{q_lens[0]}..{kv_lens[-1]} D{d}"] = f"{type(exc).__name__}: {exc}"

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


def gdn_inputs(dev, counts, hk, hv, d, ws_bytes, bufs) -> dict:
    """The GDN section's inputs for streams of ``counts`` tokens (bf16 q, k, v from fixed seeds, fp32 log-space g
    and beta, fp32 states and their pointers, o, a ``ws_bytes`` workspace) as device buffers by ``gdn.gdn``'s
    argument names (``"state"``: the states themselves), appended to ``bufs``."""
    n, total = len(counts), sum(counts)
    q, _ = _rand_bf16(dev, (total, hk, d), 11)
    k, _ = _rand_bf16(dev, (total, hk, d), 12)
    v, _ = _rand_bf16(dev, (total, hv, d), 13)
    rng = np.random.default_rng(14)
    g = (-rng.random((total, hv)) * 0.3).astype(np.float32)
    beta = rng.random((total, hv)).astype(np.float32)
    st = (rng.standard_normal((n, hv, d, d)) * 0.1).astype(np.float32)
    x = {"q": q, "k": k, "v": v, "g": dev.alloc(g.nbytes), "beta": dev.alloc(beta.nbytes),
         "state": dev.alloc(st.nbytes), "o": dev.alloc(total * hv * d * 2), "h_state_ptrs": dev.alloc(8 * n),
         "workspace": dev.alloc(ws_bytes)}
    bufs += list(x.values())
    dev.upload(int(x["g"].ptr), g)
    dev.upload(int(x["beta"].ptr), beta)
    dev.upload(int(x["state"].ptr), st)
    dev.upload(int(x["h_state_ptrs"].ptr),
               np.array([int(x["state"].ptr) + i * hv * d * d * 4 for i in range(n)], np.uint64))
    dev.synchronize()
    return x


#: The GDN section's configs (``gdn.gdn``'s plans for each case): the device's default, the mma.sync schedules, the
#: fp32 recurrent kernel.
GDN_CONFIGS = {"default": GdnConfig(), "mma_two_pass": GdnConfig(schedule="two_pass", isa="mma"),
               "mma_fused": GdnConfig(schedule="fused"), "recurrent": GdnConfig(math="recurrent")}


def section_gdn():
    """q12drv's GDN plans (:data:`GDN_CONFIGS`: the default, the device's fastest path; the mma.sync two-pass
    schedule; the fused kernel; the recurrent kernel; Hk 16, Hv 32, d 128) vs fla-core's chunk_gated_delta_rule
    (own process): 8 x 2048, 1 x 8192 and ragged 8 streams of 256..2048."""
    from q12drv.kernels.gdn import GdnShape, GdnTensors, gdn, plan_gdn

    dev = DEV
    hk, hv, d = 16, 32, 128
    shape = GdnShape(hk, hv, d)
    ragged = [256, 2048, 512, 1792, 768, 1536, 1024, 1280]   # bench/fla_gdn.py RAGGED["ragged8"]
    cases = [("8x2048", [2048] * 8), ("1x8192", [8192]), ("ragged8", ragged)] if gpu() else \
        [("2x16", [16, 16]), ("ragged8", [3, 16, 1, 7, 2, 9, 5, 4])]
    res = {"shape": [hk, hv, d], "cases": {}}
    RESULTS["sections"]["gdn"] = res
    for key, counts in cases:
        n = len(counts)
        with _staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
            plans = {name: plan_gdn(cfg, shape, n, max(counts), dev) for name, cfg in GDN_CONFIGS.items()}
            ws_bytes = max(16, *(p.workspace_bytes for p in plans.values()))
            x = gdn_inputs(dev, counts, hk, hv, d, ws_bytes, bufs)
            tensors = GdnTensors(*(int(x[k].ptr) for k in ("q", "k", "v", "g", "beta", "o")))
            out = res["cases"][key] = {"paths": {name: f"{p.math} {p.schedule} {p.isa} {p.sequential}".strip()
                                                 for name, p in plans.items()}}
            for name, plan in plans.items():
                def run(plan=plan):
                    gdn(dev, meta, x["h_state_ptrs"].ptr, tensors, shape, plan, workspace=x["workspace"].ptr,
                        workspace_bytes=ws_bytes)

                out[f"{name}_us"] = q12_events_us(dev, run, reps(30, 1))
            row(f"gdn {key} Hk{hk} Hv{hv} d{d}: mma_fused", out["mma_fused_us"], "q12drv recurrent kernel",
                out["recurrent_us"], note="info: device time")
            row(f"gdn {key} Hk{hk} Hv{hv} d{d}: mma_two_pass", out["mma_two_pass_us"], "q12drv fused kernel",
                out["mma_fused_us"], note="info: device time; bit-identical results")
            row(f"gdn {key} Hk{hk} Hv{hv} d{d}: default ({out['paths']['default']})", out["default_us"],
                "q12drv mma two-pass schedule", out["mma_two_pass_us"], note="info: device time")
    if gpu():
        _comparator("gdn/fla", lambda: _gdn_fla(res, [key for key, _ in cases]))


def _gdn_fla(res, keys):
    """fla-core in its own process (bench/fla_gdn.py); its JSON line becomes the comparator."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fla_gdn.py"), "--cases", ",".join(keys)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    fla = json.loads(lines[-1]) if lines else {"ok": False, "error": f"no JSON (rc {proc.returncode}): {proc.stderr[-2000:]}"}
    res["fla"] = fla
    if not fla.get("ok"):
        RESULTS["errors"]["gdn/fla"] = f"fla-core not run: {fla.get('error')}"
        return
    for key in keys:
        theirs = fla["cases"][key]["ms"] * 1e3
        for name in GDN_CONFIGS:
            ours = res["cases"][key][f"{name}_us"]
            note = "device time; fla in its own process"
            if name != "recurrent":   # goal: >= 1.0x fla (ratio ours/theirs <= 1.0), then >= 2x (<= 0.5)
                ratio = ours / theirs
                res["cases"][key][f"{name}_over_fla"] = ratio
                note += (f"; goal >= 1.0x fla: {'met' if ratio <= 1.0 else 'NOT met'} (ratio {ratio:.2f})"
                         f"; 2x: {'met' if ratio <= 0.5 else 'not yet'}")
            goal = None if name == "recurrent" else faster(2) if name == "default" else faster(1)
            how = fla["cases"][key].get("how", "eager")   # graph: replayed, device time alone (bench/fla_gdn.py)
            row(f"gdn {key} Hk16 Hv32 d128: {name}", ours, f"fla-core {fla.get('fla_version')} chunk GDN ({how})",
                theirs, goal, note=note)


def section_graph():
    dev = DEV
    res = {}
    step = common.StepCase(dev, common.step_counts("8x128", gpu()))
    try:
        for expand in ("host", "device"):
            gp, arena = step.pass_graph(expand)
            try:
                step.reset()
                step.run("batched")
                dev.synchronize()
                eager = {k: step.read(k) for k in ("o", "go", "k_pool", "states")}
                step.reset()
                step.replay(gp)
                dev.synchronize()
                equal = all(step.read(k) == v for k, v in eager.items())
                t = host_and_round_trip({"eager": lambda: step.run("batched"), "replay": lambda: step.replay(gp),
                                         "per_stream": lambda: step.run("per_stream")}, reps(50, 2), dev.synchronize)
                res[expand] = {"replay_equals_eager": equal, **t}
            finally:
                gp.close()
                arena.close()
            row(f"graph ({expand} metadata): set_streams + replay", res[expand]["replay"]["round_trip_us"],
                "eager batched step (Q12Pass)", res[expand]["eager"]["round_trip_us"],
                note="info: 8x128 attn+GDN" + ("" if equal else "; REPLAY != EAGER"))
            row(f"graph ({expand} metadata): set_streams + replay", res[expand]["replay"]["round_trip_us"],
                "per-stream fallback step", res[expand]["per_stream"]["round_trip_us"], note="info: 8x128 attn+GDN")
            if not equal:
                RESULTS["errors"][f"graph/{expand}"] = "replay results differ from the eager pass"
    finally:
        step.close()
    RESULTS["sections"]["graph"] = res


SECTIONS = {
    "launch": section_launch,
    "staging": section_staging,
    "curve": section_curve,
    "jit_slot": section_jit_slot,
    "step": section_step,
    "kv_write": section_kv_write,
    "rope": section_rope,
    "attention": section_attention,
    "graph": section_graph,
    "gdn": section_gdn,
}


# ----------------------------------------------------------------------------- report
def environment(dev) -> dict:
    env = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "driver": dev.driver.name,
           "device": dev.name, "arch": dev.arch, "python": platform.python_version(), "numpy": np.__version__,
           "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    try:
        env["commit"] = os.environ.get("Q12_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        env["dirty"] = bool(dirty)
    except Exception:
        env["commit"] = "unknown"
    try:
        env["driver_version"] = dev.driver.driver_version()
        import cuda.bindings

        env["cuda_bindings"] = cuda.bindings.__version__
    except Exception:
        pass
    try:
        import torch

        env["torch"] = torch.__version__
    except Exception:
        env["torch"] = None
    return env


def print_table():
    rows = RESULTS["table"]
    print()
    meta = RESULTS["meta"]
    print(f"== q12drv vs comparators: {meta.get('device')} ({meta.get('driver')}), commit {meta.get('commit')}"
          f"{' (dirty)' if meta.get('dirty') else ''}, {meta.get('date_utc')}")
    for name, err in RESULTS["errors"].items():
        print(f"   error in {name}: {err.splitlines()[0][:160]}")
    header = f"{'name':<48} {'q12drv':>10} {'comparator':<40} {'comp':>10} {'ratio':>7}  {'goal':<8} {'met':<4}"
    print(header)
    print("-" * len(header))

    def us(x):
        return "-" if x is None else (f"{x:,.1f}" if x < 1e4 else f"{x:,.0f}")

    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        goal = r["goal"] or "-"
        print(f"{r['name'][:48]:<48} {us(r['q12drv_us']):>10} {r['comparator'][:40]:<40} {us(r['comparator_us']):>10} "
              f"{ratio:>7}  {goal:<8} {met:<4}")
    print("times in us; ratio = q12drv / comparator (lower is faster); goal applies to the ratio")


def _section_error(exc: BaseException) -> str:
    """A failed section's entry in RESULTS["errors"] (its traceback also goes to stderr)."""
    tb = traceback.format_exc()
    print(tb, file=sys.stderr, flush=True)
    return f"{type(exc).__name__}: {exc}\n{tb}"


def main(argv=None) -> int:
    global ARGS, DEV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write every measurement as JSON here")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    ap.add_argument("--driver", default=os.environ.get("Q12DRV_DRIVER") or "cuda",
                    help="cuda (default) or emu (a plumbing check with tiny shapes; no comparators)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and curve points")
    ap.add_argument("--budget-s", type=float, default=80.0, help="stop starting new work after this many seconds")
    ARGS = ap.parse_args(argv)
    DEV = q12drv.open_device(ARGS.driver)
    RESULTS["meta"] = environment(DEV)
    try:
        for name in [s.strip() for s in ARGS.sections.split(",") if s.strip()]:
            if name not in SECTIONS:
                RESULTS["errors"][name] = "unknown section"
                continue
            if time.perf_counter() - T0 > ARGS.budget_s:
                RESULTS["errors"][name] = "skipped: time budget spent"
                continue
            print(f"-- {name} ...", flush=True)
            common.run_section(RESULTS, name, SECTIONS[name], DEV, _section_error)
    finally:
        common.finish_run(RESULTS, T0, ARGS.out, print_table, DEV)
    return 0


if __name__ == "__main__":
    sys.exit(main())
