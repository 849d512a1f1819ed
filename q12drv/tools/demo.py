"""``q12drv demo``: one Q12 pass end to end, printed step by step.

Plans a batch of 8 ragged streams (Qwen3-Next-like: top-k 10, block 16, MRoPE interleaved),
decides admission, prints the region map, stages the metadata with one pinned copy, places
the ``h_state_ptrs`` slot for several SSM layers, reads the arena back and verifies every
field. With kernels, it then runs one attention layer and one Gated DeltaNet layer batched and
per stream and compares them bit for bit.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.admission import check_kernel_batched_eligible
from ..core.arena import ScratchArena
from ..core.staging import verify_readback
from ..core.device import Device
from ..core.driver import TIMING_NOTE
from ..core.layout import Q12_SIZING_STREAMS, h_state_slot_bytes, make_scratch_plan
from ..core.staging import StreamStageInfo, place_h_state_slot, stage_batched_attn_metadata

__all__ = ["DemoConfig", "run_demo", "demo_streams", "demo_layers", "layer_inputs"]


@dataclass(frozen=True)
class DemoConfig:
    """The demo batch: chunk lengths, prefix-cache hits, and the model shape (Qwen3-Next-like)."""

    chunk_start: int = 512
    chunk_lens: tuple = (37, 129, 1, 200, 64, 17, 90, 48)
    cached_in_chunk: tuple = (0, 0, 0, 40, 0, 0, 26, 0)  # prefix-cache hits inside the chunk
    block_size: int = 16
    top_k: int = 10
    use_mrope: bool = True
    ssm_layers: int = 6
    num_q_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    rotary_dim: int = 64
    rope_theta: float = 1e7
    mrope_section: tuple = (11, 11, 10)
    gdn_k_heads: int = 16
    gdn_v_heads: int = 32
    gdn_head_dim: int = 128
    seed: int = 0


def demo_streams(dev: Device, cfg: DemoConfig):
    """Streams with interleaved block tables in device memory. Returns (streams, admission tuples, buffer)."""
    rng = np.random.default_rng(cfg.seed)
    n = len(cfg.chunk_lens)
    kv_lens = [cfg.chunk_start + L for L in cfg.chunk_lens]
    needed = [-(-k // cfg.block_size) for k in kv_lens]
    ids = rng.permutation(np.arange(1, sum(needed) + 1)).astype(np.int32)  # block 0 = dummy
    cap = max(needed)
    buf = dev.alloc(n * cap * 4 + n * 8, "demo block tables + seq_lens")
    host = np.zeros(n * cap, np.int32)
    streams, tuples, off = [], [], 0
    for b, (L, hit) in enumerate(zip(cfg.chunk_lens, cfg.cached_in_chunk)):
        table = ids[off:off + needed[b]]
        off += needed[b]
        host[b * cap:b * cap + table.size] = table
        proc_start = cfg.chunk_start + hit
        streams.append(StreamStageInfo(proc_start, L - hit, table, int(buf.ptr) + 4 * b * cap,
                                       int(buf.ptr) + 4 * n * cap + 8 * b))
        tuples.append((L, L - hit, cfg.chunk_start, False))
    dev.upload(buf.ptr, host)
    dev.upload(int(buf.ptr) + 4 * n * cap, np.array(kv_lens, dtype=np.uint64))  # u32 seq_len, 8-byte spaced
    return streams, tuples, buf


def _timing_note(dev: Device) -> str:
    """What a timing printed for ``dev`` needs said: that it is not a GPU's, on the emulated driver."""
    return "" if dev.driver.runs_cubins else f" ({TIMING_NOTE})"


def _median_us(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run_demo(dev: Device, cfg: DemoConfig = DemoConfig(), *, kernels: bool = True, out: Callable[[str], None] = print,
             dump=None) -> bool:
    """Run the demo on ``dev``; return True when every check passed.

    ``dump``: a path to write an arena dump of the staged batched pass to (see :mod:`q12drv.tools.dump`).
    """
    ok = True
    out(f"device: {dev.name} (driver {dev.driver.name}, {dev.arch})")
    if getattr(dev.driver, "fallback_reason", None):
        out(f"  driver 'auto' fell back to the emulator: {dev.driver.fallback_reason}")
    streams, tuples, tables = demo_streams(dev, cfg)
    n = len(streams)
    counts = [s.proc_count for s in streams]
    plan = make_scratch_plan(counts, cfg.top_k, cfg.use_mrope, "seed")
    scratch = plan.total_bytes
    out(f"batch: {n} streams, chunk_start {cfg.chunk_start}, tokens per stream {counts} "
        f"(total {sum(counts)}), MRoPE {'on' if cfg.use_mrope else 'off'}, block {cfg.block_size}, top-k {cfg.top_k}")
    decision = check_kernel_batched_eligible(tuples, n, sum(counts), False, cfg.head_dim, scratch, cfg.top_k,
                                             cfg.use_mrope, False, True)
    out(f"admission: {decision}")
    out(f"scratch sized for this batch: {scratch:,} bytes (policy 'seed'; "
        f"Q12_SIZING_STREAMS = {Q12_SIZING_STREAMS})")
    out("region map:")
    for line in plan.describe().splitlines():
        out("  " + line)
    with ScratchArena(dev, scratch) as arena:
        def stage():
            arena.reset()
            for r in (plan.moe, *plan.stream_blocks):
                arena.reserve(r.name, r.nbytes, offset=r.offset)
            return stage_batched_attn_metadata(arena, streams, block_size=cfg.block_size, use_mrope=cfg.use_mrope,
                                               scratch_offset_bytes=plan.stacked.offset, dummy_kv_block=0)

        meta = stage()
        slot = place_h_state_slot(arena, meta)
        states = dev.alloc(8 * 4096, "demo h_state stand-ins")
        for layer in range(cfg.ssm_layers):
            slot.upload([int(states.ptr) + 4096 * ((layer * n + b) % 8) for b in range(n)])
        out(f"staged {meta.staged_bytes:,} bytes at offset {meta.scratch_offset_bytes:,} with one pinned copy; "
            f"h_state_ptrs slot at {slot.offset:,} (= offset + staged_bytes), uploaded for {slot.uploads} SSM layers")
        raw = arena.read(meta.scratch_offset_bytes, meta.staged_bytes)
        problems = verify_readback(raw, meta, streams)
        last = np.frombuffer(arena.read(slot.offset, h_state_slot_bytes(n)), np.uint64)
        want_last = [int(states.ptr) + 4096 * (((cfg.ssm_layers - 1) * n + b) % 8) for b in range(n)]
        if list(last) != want_last:
            problems.append("h_state_ptrs slot does not hold the last layer's pointers")
        if not arena.guard_intact():
            problems.append("the arena's guard band was overwritten")
        for p in problems:
            out(f"  FAIL {p}")
        out(f"read-back: {'every field, pad and the JIT slot verified' if not problems else f'{len(problems)} problems'}")
        ok &= not problems
        if dump is not None:
            from .dump import dump_arena

            num_blocks = max(int(np.max(s.block_table)) for s in streams) + 1
            path = dump_arena(arena, dump, plan=plan, meta=meta, streams=streams, h_slot=slot, num_blocks=num_blocks)
            out(f"dump: wrote {path} (look inside with 'q12drv inspect {path}')")

        host_us = _median_us(stage, 50)
        rt_us = _median_us(lambda: (stage(), dev.synchronize()), 50)
        out(f"staging time (median of 50): host {host_us:.1f} us (pack + enqueue), round trip {rt_us:.1f} us"
            + _timing_note(dev))
        if kernels:
            ok &= demo_layers(dev, cfg, streams, tuples, out=out)
    out("demo: " + ("all checks passed" if ok else "CHECKS FAILED"))
    return ok


def layer_inputs(rng: np.random.Generator, total: int, n: int, num_blocks: int, block_size: int,
                 attn, gdn) -> dict:
    """Fresh random host inputs for one attention layer and one GDN layer over ``total`` packed tokens.

    bf16 tensors are uint16 bit patterns; the outputs (``o``, ``go``) are poisoned with 0xFFFF (bf16
    NaN) so that an element no kernel wrote is visible. Keys: ``q, k, v`` ``[T, H, D]``, ``k_pool,
    v_pool`` ``[num_blocks, block_size, Hkv, D]`` (earlier chunks' keys), ``o``; GDN ``gq, gk``
    ``[T, Hk, d]``, ``gv, go`` ``[T, Hv, d]``, ``g`` (log decay <= 0) and ``beta`` ``[T, Hv]`` fp32,
    ``states`` ``[n, Hv, d, d]`` fp32. Used by the demo, the tests and the GPU scripts.
    """
    from ..core.bf16 import to_bf16_bits

    hq, hkv, d = attn.num_q_heads, attn.num_kv_heads, attn.head_dim
    hk, hv, dg = gdn.num_k_heads, gdn.num_v_heads, gdn.head_dim
    pool_shape = (num_blocks, block_size, hkv, d)
    return {
        "q": to_bf16_bits(rng.standard_normal((total, hq, d))),
        "k": to_bf16_bits(rng.standard_normal((total, hkv, d))),
        "v": to_bf16_bits(rng.standard_normal((total, hkv, d))),
        "k_pool": to_bf16_bits(rng.standard_normal(pool_shape)),
        "v_pool": to_bf16_bits(rng.standard_normal(pool_shape)),
        "o": np.full((total, hq, d), 0xFFFF, np.uint16),
        "gq": to_bf16_bits(rng.standard_normal((total, hk, dg))),
        "gk": to_bf16_bits(rng.standard_normal((total, hk, dg))),
        "gv": to_bf16_bits(rng.standard_normal((total, hv, dg))),
        "g": (-np.exp(rng.standard_normal((total, hv)) * 0.5) * 0.1).astype(np.float32),
        "beta": (1 / (1 + np.exp(-rng.standard_normal((total, hv))))).astype(np.float32),
        "go": np.full((total, hv, dg), 0xFFFF, np.uint16),
        "states": (rng.standard_normal((n, hv, dg, dg)) * 0.1).astype(np.float32),
    }


def demo_layers(dev: Device, cfg: DemoConfig, streams, tuples, *, out: Callable[[str], None] = print) -> bool:
    """Run one attention and one GDN layer batched and per stream; compare bit for bit; time both."""
    from ..kernels.gdn import GdnConfig, GdnTensors, plan_gdn
    from ..prefill.q12pass import AttentionShape, GdnShape, Q12Pass

    n = len(streams)
    total = sum(s.proc_count for s in streams)
    num_blocks = int(max(int(np.max(s.block_table)) for s in streams)) + 1
    attn = AttentionShape(cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope_theta,
                          2 if cfg.use_mrope else 0, cfg.mrope_section if cfg.use_mrope else (0, 0, 0))
    gshape = GdnShape(cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_dim)
    host = layer_inputs(np.random.default_rng(cfg.seed + 1), total, n, num_blocks, cfg.block_size, attn, gshape)
    plan = make_scratch_plan([s.proc_count for s in streams], cfg.top_k, cfg.use_mrope, "exact")
    # the GDN layer's plan, the same in both modes: the device's fastest path for the whole batch
    gplan = plan_gdn(GdnConfig(), gshape, n, max(s.proc_count for s in streams), dev)
    results, times = {}, {}

    def run(mode: str, timed: bool) -> None:
        bufs = {name: dev.alloc(a.nbytes, f"demo {name} ({mode})") for name, a in host.items()}
        for name, a in host.items():
            dev.upload(bufs[name].ptr, a)
        bufs["workspace"] = dev.alloc(max(16, gplan.workspace_bytes), f"demo GDN workspace ({mode})")
        p = {name: int(b.ptr) for name, b in bufs.items()}
        states = [p["states"] + b * host["states"][0].nbytes for b in range(n)]
        start, end = dev.event(timing=True), dev.event(timing=True)
        start.record()
        q12 = Q12Pass(arena, streams, block_size=cfg.block_size, use_mrope=cfg.use_mrope, dummy_kv_block=0,
                      top_k=cfg.top_k, head_dim=cfg.head_dim, chunks=tuples, policy="exact", mode=mode)
        q12.attention_layer(p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], attn, num_blocks=num_blocks)
        q12.gdn_layer(states, GdnTensors(p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"]), gshape, config=gplan,
                      workspace=p["workspace"], workspace_bytes=bufs["workspace"].nbytes)
        end.record()
        end.synchronize()
        if timed:
            times[mode] = start.elapsed_ms(end)
            results[mode] = {name: dev.download(bufs[name].ptr, bufs[name].nbytes)
                             for name in ("o", "k_pool", "v_pool", "go", "states", "q", "k")}
            out(f"{mode:>10}: {q12.mode}{' (' + q12.reason + ')' if q12.reason else ''}, staging + one attention "
                f"+ one GDN layer in {times[mode]:.2f} ms" + _timing_note(dev))
        for b in bufs.values():
            b.free()
        for e in (start, end):
            e.destroy()

    with ScratchArena(dev, plan.total_bytes + 4096) as arena:
        for mode in ("batched", "per_stream"):
            if dev.driver.runs_cubins:
                run(mode, timed=False)  # loads the modules (compiling them on first use) outside the timing
            run(mode, timed=True)
    same = [name for name in results["batched"] if results["batched"][name] == results["per_stream"][name]]
    differ = [name for name in results["batched"] if name not in same]
    o_bits = np.frombuffer(results["batched"]["o"], np.uint16)
    go_bits = np.frombuffer(results["batched"]["go"], np.uint16)
    unwritten = int(np.sum(o_bits == 0xFFFF)) + int(np.sum(go_bits == 0xFFFF))
    out(f"batched vs per stream: {'bit-identical' if not differ else 'DIFFER in ' + ', '.join(differ)} "
        f"({', '.join(same)}); batched {times['per_stream'] / max(times['batched'], 1e-9):.2f}x the speed of per stream"
        + _timing_note(dev))
    if unwritten:
        out(f"  FAIL {unwritten} output elements were never written")
    return not differ and not unwritten
