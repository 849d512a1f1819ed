#!/usr/bin/env python3
"""One small prefill step through q12drv.prefill.Q12Pass, for compute-sanitizer (scripts/sanitize.sh).

Three passes over 3 ragged streams of a few dozen tokens (cached prefixes, a shared dummy block),
so that every kernel in ``q12drv.kernels.ops.ENTRIES`` runs: plain RoPE with a D=64 attention layer,
a width-4 short convolution and a d=64 Gated DeltaNet layer; MRoPE (interleaved, vision positions on
one stream) with a D=128 sliding-window attention layer (4 keys: the mma.sync kernel skips the first key
tile of the stream whose chunk starts at 37) and a width-3 convolution; plain RoPE with a D=256
attention layer, a width-2 convolution and a d=128 GDN layer. Each attention layer runs the
device's default kernel (``algo="auto"``: wgmma on Hopper at D=128 and 256) and, where that is not
the mma.sync kernel, ``Q12Pass.attention`` with ``algo="mma"`` too; each GDN layer runs every GDN
kernel in turn. At each head dim a decode pass (3 streams of 1, 4 and 2 new tokens on cached prompts, the layer's
window) runs ``Q12Pass.attention`` with ``algo="decode"``, its keys split three ways (the split kernel and the merge),
on bf16 pools and on the same pools quantized to FP8 (the FP8 split kernel, per-head scales). The metadata is also expanded on the device, for the 3 streams
(``q12_expand_meta_tail``) and for 65 (``q12_expand_meta``), and compared with the host stager's
bytes. Each pass runs batched and per stream. Everything goes through q12drv's own driver API (no
torch). Every buffer the step writes has a 256-byte guard band before and after it, filled with 0xA5
and checked afterwards; the arena's own guard band too. Batched and per stream must agree bit for
bit, every output element must be written, and the staged metadata must read back as the seed
defines it.

    python3 scripts/sanitize_step.py [--driver cuda|emu] [--compile-only]

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from q12drv import (ScratchArena, StreamStageInfo, make_scratch_plan, open_device,  # noqa: E402
                    stage_batched_attn_metadata)
from q12drv.core.staging import verify_readback  # noqa: E402
from q12drv.tools.demo import layer_inputs  # noqa: E402
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402
from q12drv.core.fp8 import E4M3_MAX  # noqa: E402
from q12drv.kernels import ops  # noqa: E402
from q12drv.kernels.kv_write import quantize_rows  # noqa: E402
from q12drv.kernels.expand import stage_on_device  # noqa: E402
from q12drv.kernels.meta import TAIL_STREAMS  # noqa: E402
from q12drv.kernels.gdn import GdnConfig, GdnTensors, plan_gdn  # noqa: E402
from q12drv.prefill import AttentionShape, GdnShape, Q12Pass  # noqa: E402

GUARD = 256
GUARD_BYTE = 0xA5
BLOCK = 16
COUNTS = (23, 41, 9)
STARTS = (16, 0, 37)       # stream 0 and 2 have part of their prompt in the KV cache already
GDN64 = GdnShape(num_k_heads=2, num_v_heads=4, head_dim=64)
GDN128 = GdnShape(num_k_heads=1, num_v_heads=2, head_dim=128)
DECODE_COUNTS = (1, 4, 2)  # a decode step, a speculative step of 4 tokens, one of 2
DECODE_STARTS = (150, 7, 300)
DECODE_SPLITS = 3
CONV_CHANNELS = 64
#: name -> (MRoPE, attention shape, short convolution width, GDN shape or None)
LAYERS = {
    "rope d64": (False, AttentionShape(4, 2, 64, 64, 1e4), 4, GDN64),
    "mrope d128": (True, AttentionShape(4, 2, 128, 64, 1e6, mrope_mode=2, mrope_section=(11, 11, 10),
                                        sliding_window=4), 3, None),
    "rope d256": (False, AttentionShape(4, 2, 256, 64, 1e7), 2, GDN128),
}


class Guarded:
    """A device buffer with a guard band on each side; ``ptr`` is the first byte after the front band."""

    def __init__(self, dev, name: str, host: np.ndarray):
        self.dev, self.name, self.host = dev, name, np.ascontiguousarray(host)
        self.buf = dev.alloc(self.host.nbytes + 2 * GUARD, name)
        dev.memset(self.buf.ptr, GUARD_BYTE, self.buf.nbytes)
        dev.upload(int(self.buf.ptr) + GUARD, self.host)
        self.ptr = int(self.buf.ptr) + GUARD

    def reset(self) -> None:
        self.dev.upload(self.ptr, self.host)

    def get(self, problems: list) -> bytes:
        raw = self.dev.download(self.buf.ptr, self.buf.nbytes)
        if raw[:GUARD] != bytes([GUARD_BYTE]) * GUARD or raw[-GUARD:] != bytes([GUARD_BYTE]) * GUARD:
            problems.append(f"guard band around {self.name} overwritten")
        return raw[GUARD:-GUARD]


def make_streams(dev, rng, mrope: bool, counts=COUNTS, starts=STARTS):
    """Streams of ``counts`` new tokens after ``starts`` cached ones, their block tables (a permutation of blocks
    1.., block 0 being the dummy) and kv lengths in one guarded device buffer; returns ``(streams, buffer,
    num_blocks)``."""
    needed = [-(-(s + c) // BLOCK) for s, c in zip(starts, counts)]
    ids = rng.permutation(np.arange(1, sum(needed) + 1)).astype(np.int32)  # block 0: the dummy block
    tables, off = [], 0
    for k in needed:
        tables.append(ids[off:off + k])
        off += k
    flat = np.concatenate(tables + [np.array([s + c for s, c in zip(starts, counts)], np.int32)])
    tbuf = Guarded(dev, "block tables + seq_lens", flat)
    streams, at = [], 0
    for b, (s, c) in enumerate(zip(starts, counts)):
        mp = None
        if mrope and b == 1:  # vision tokens: T fixed, H and W walk a 4-wide grid
            mp = np.stack([np.full(c, s), s + np.arange(c) // 4, s + np.arange(c) % 4]).astype(np.int64)
        streams.append(StreamStageInfo(s, c, tables[b], tbuf.ptr + 4 * at, tbuf.ptr + 4 * (off + b), mp))
        at += tables[b].size
    return streams, tbuf, int(ids.max()) + 1


def conv_inputs(rng, total: int, n: int, width: int) -> dict:
    """Host inputs of one short convolution over ``total`` tokens of CONV_CHANNELS channels: ``cx`` and ``cy``
    ``[T, C]`` (``cy`` poisoned with bf16 NaN), ``cw`` ``[C, W]``, ``cstates`` ``[n, W - 1, C]``, all bf16."""
    c = CONV_CHANNELS
    return {"cx": to_bf16_bits(rng.standard_normal((total, c))), "cy": np.full((total, c), 0xFFFF, np.uint16),
            "cw": to_bf16_bits(rng.standard_normal((c, width)) * 0.5),
            "cstates": to_bf16_bits(rng.standard_normal((n, width - 1, c)))}


def step(dev, name: str, problems: list) -> None:
    mrope, attn, width, gdn = LAYERS[name]
    rng = np.random.default_rng(12)
    streams, tbuf, num_blocks = make_streams(dev, rng, mrope)
    n, total = len(streams), sum(COUNTS)
    host = layer_inputs(rng, total, n, num_blocks, BLOCK, attn, gdn or GDN64)
    host.update(conv_inputs(rng, total, n, width))
    hkv, d = attn.num_kv_heads, attn.head_dim  # FP8 pools beside the bf16 ones: the FP8 KV write
    host.update({"k_pool8": np.zeros((num_blocks, BLOCK, hkv, d), np.uint8),
                 "v_pool8": np.zeros((num_blocks, BLOCK, hkv, d), np.uint8),
                 "k_scale": np.full(hkv, 0.02, np.float32), "v_scale": np.full(hkv, 0.01, np.float32)})
    fp8 = dataclasses.replace(attn, kv_dtype="fp8_e4m3")
    also_mma = ops.attention_entry("auto", attn.head_dim, dev.arch) != ops.attention_entry("mma", attn.head_dim,
                                                                                            dev.arch)
    if also_mma:  # the mma.sync kernel on the same inputs, into its own output
        host["o_mma"] = host["o"].copy()
    bufs = {k: Guarded(dev, f"{name} {k}", a) for k, a in host.items()}
    chunks = [(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in streams]
    plan = make_scratch_plan(list(COUNTS), 4, mrope, "exact")
    results = {}
    with ScratchArena(dev, plan.total_bytes + 512) as arena:
        for mode in ("batched", "per_stream"):
            for b in bufs.values():
                b.reset()
            q12 = Q12Pass(arena, streams, block_size=BLOCK, use_mrope=mrope, dummy_kv_block=0, top_k=4,
                          head_dim=attn.head_dim, chunks=chunks, policy="exact", mode=mode)
            if q12.mode != mode:
                problems.append(f"{name}: asked for {mode}, ran {q12.mode} ({q12.reason})")
            p = {k: b.ptr for k, b in bufs.items()}
            q12.attention_layer(p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], attn, num_blocks=num_blocks)
            q12.kv_write(p["k"], p["v"], p["k_pool8"], p["v_pool8"], fp8, num_blocks=num_blocks,
                         k_scale=p["k_scale"], v_scale=p["v_scale"])
            if also_mma:  # q as RoPE left it, the pools as the KV write left them
                q12.attention(p["q"], p["k_pool"], p["v_pool"], p["o_mma"], attn, num_blocks=num_blocks, algo="mma")
            conv_states = [p["cstates"] + b * host["cstates"][0].nbytes for b in range(n)]
            q12.conv1d(conv_states, p["cx"], p["cy"], p["cw"], channels=CONV_CHANNELS, width=width)
            if gdn is not None:
                states = [p["states"] + b * host["states"][0].nbytes for b in range(n)]
                plans = gdn_plans(dev, gdn, n, max(COUNTS))
                ws_bytes = max(16, *(q12.gdn_workspace_bytes(gdn, plan) for _, plan in plans))
                ws = dev.alloc(ws_bytes, "gdn workspace")
                tensors = GdnTensors(p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"])
                for _, plan in plans:  # every kernel, each on the previous one's states
                    q12.gdn_layer(states, tensors, gdn, config=plan, workspace=int(ws.ptr), workspace_bytes=ws_bytes)
            dev.synchronize()
            if gdn is not None:
                ws.free()
            metas = [(q12.meta, streams)] if q12.batched else [(m, [s]) for m, s in zip(q12.stream_meta, streams)]
            for meta, ss in metas:
                for line in verify_readback(arena.read(meta.scratch_offset_bytes, meta.staged_bytes), meta, ss):
                    problems.append(f"{name} {mode}: staged metadata: {line}")
            results[mode] = {k: b.get(problems) for k, b in bufs.items()}
            if not arena.guard_intact():
                problems.append(f"{name} {mode}: the arena's guard band was overwritten")
        if name == "rope d256":
            expand_matches_host(dev, arena, streams, problems)
        written = ["o", "cy"] + (["o_mma"] if also_mma else []) + (["go"] if gdn is not None else [])
        for k in written:
            if np.any(np.frombuffer(results["batched"][k], np.uint16) == 0xFFFF):
                problems.append(f"{name}: {k} has elements the kernels never wrote")
        differ = [k for k in results["batched"] if results["batched"][k] != results["per_stream"][k]]
        if differ:
            problems.append(f"{name}: batched and per stream differ in {', '.join(differ)}")
        tbuf.get(problems)
    for b in list(bufs.values()) + [tbuf]:
        b.buf.free()


def decode_step(dev, name: str, problems: list) -> None:
    """``Q12Pass.attention(algo="decode")`` at the layer's heads and sliding window over DECODE_COUNTS new tokens after
    DECODE_STARTS cached ones, split DECODE_SPLITS ways, batched and per stream, on bf16 pools (into ``o``) and on
    the same pools quantized to e4m3 with per-head scales (into ``o8``): batched and per stream equal bit for bit,
    every O element written, the guard bands around O and the workspace intact. Then the layer's Gated DeltaNet
    (GDN64 where it has none) over the same streams with the default plan (the recurrence's decode build): batched
    and per stream equal bit for bit (output and states), every output element written."""
    attn, gshape = LAYERS[name][1], LAYERS[name][3] or GDN64
    hq, hkv, d = attn.num_q_heads, attn.num_kv_heads, attn.head_dim
    shape = AttentionShape(hq, hkv, d, d, sliding_window=attn.sliding_window)
    fp8 = dataclasses.replace(shape, kv_dtype="fp8_e4m3")
    rng = np.random.default_rng(14)
    streams, tbuf, num_blocks = make_streams(dev, rng, False, DECODE_COUNTS, DECODE_STARTS)
    total = sum(DECODE_COUNTS)
    host = {"q": to_bf16_bits(rng.standard_normal((total, hq, d))),
            "k_pool": to_bf16_bits(rng.standard_normal((num_blocks, BLOCK, hkv, d))),
            "v_pool": to_bf16_bits(rng.standard_normal((num_blocks, BLOCK, hkv, d))),
            "o": np.full((total, hq, d), 0xFFFF, np.uint16), "o8": np.full((total, hq, d), 0xFFFF, np.uint16)}
    gdn_host = layer_inputs(rng, total, len(streams), 1, BLOCK, attn, gshape)
    host.update({k: gdn_host[k] for k in ("gq", "gk", "gv", "g", "beta", "go", "states")})
    for pool in ("k_pool", "v_pool"):  # as q12_kv_write_fp8 writes them, each head's scale its amax / 448
        x = host[pool]
        scale = (np.abs(from_bf16_bits(x).reshape(-1, hkv, d)).max(axis=(0, 2)) / E4M3_MAX).astype(np.float32)
        host[pool[0] + "_scale"] = scale
        host[pool + "8"] = quantize_rows(x.reshape(-1, hkv * d), scale, d).reshape(x.shape)
    bufs = {k: Guarded(dev, f"{name} decode {k}", a) for k, a in host.items()}
    results = {}
    with ScratchArena(dev, make_scratch_plan(list(DECODE_COUNTS), 0, False, "exact").total_bytes + 512) as arena:
        for mode in ("batched", "per_stream"):
            for b in bufs.values():
                b.reset()
            q12 = Q12Pass(arena, streams, block_size=BLOCK, use_mrope=False, dummy_kv_block=0, head_dim=d,
                          policy="exact", mode=mode)
            ws_bytes = max(q12.decode_workspace_bytes(s, DECODE_SPLITS) for s in (shape, fp8))
            ws = Guarded(dev, f"{name} decode workspace", np.zeros(ws_bytes, np.uint8))
            p = {k: b.ptr for k, b in bufs.items()}
            q12.attention(p["q"], p["k_pool"], p["v_pool"], p["o"], shape, num_blocks=num_blocks, algo="decode",
                          num_splits=DECODE_SPLITS, workspace=ws.ptr, workspace_bytes=ws_bytes)
            q12.attention(p["q"], p["k_pool8"], p["v_pool8"], p["o8"], fp8, num_blocks=num_blocks, algo="decode",
                          num_splits=DECODE_SPLITS, workspace=ws.ptr, workspace_bytes=ws_bytes, k_scale=p["k_scale"],
                          v_scale=p["v_scale"])
            plan = plan_gdn(GdnConfig(), gshape, len(streams), max(DECODE_COUNTS), dev)
            if plan.build != "decode":
                problems.append(f"{name}: a decode step planned {plan.kernels[0].entry}, not the decode build")
            states = [p["states"] + b * host["states"][0].nbytes for b in range(len(streams))]
            q12.gdn_layer(states, GdnTensors(p["gq"], p["gk"], p["gv"], p["g"], p["beta"], p["go"]), gshape,
                          config=plan)
            dev.synchronize()
            results[mode] = {k: bufs[k].get(problems) for k in ("o", "o8", "go", "states")}
            ws.get(problems)
            ws.buf.free()
    for k, what in (("o", "decode"), ("o8", "FP8 decode"), ("go", "GDN decode")):
        if np.any(np.frombuffer(results["batched"][k], np.uint16) == 0xFFFF):
            problems.append(f"{name} {what}: O has elements the kernels never wrote")
        if results["batched"][k] != results["per_stream"][k]:
            problems.append(f"{name} {what}: batched and per stream differ")
    if results["batched"]["states"] != results["per_stream"]["states"]:
        problems.append(f"{name} GDN decode: the states differ batched and per stream")
    tbuf.get(problems)
    for b in list(bufs.values()) + [tbuf]:
        b.buf.free()


def gdn_plans(dev, shape: GdnShape, n: int, longest: int) -> list:
    """``[(label, plan), ...]``: a plan for every GDN kernel the step can run, the same in both modes: the recurrent
    and fused kernels, the mma two-pass schedule planned for this device and for a device of one SM (the stage rule
    then takes the other sequential build), and on Hopper the wgmma two-pass schedule the same two ways (the one-SM
    plan takes the wide CTA at d128, one stage at d64) and the overlapped schedule, which the rules take for streams
    of 8192 tokens and more."""
    one_sm = SimpleNamespace(arch=dev.arch, sm_count=1)
    wanted = [("recurrent", GdnConfig(math="recurrent"), dev), ("fused", GdnConfig(schedule="fused"), dev),
              ("mma two-pass", GdnConfig(schedule="two_pass", isa="mma"), dev),
              ("mma two-pass, one SM", GdnConfig(schedule="two_pass", isa="mma"), one_sm)]
    if dev.arch in ("sm_90", "sm_90a"):
        wanted += [("wgmma two-pass", GdnConfig(schedule="two_pass", isa="wgmma"), dev),
                   ("wgmma two-pass, one SM", GdnConfig(schedule="two_pass", isa="wgmma"), one_sm),
                   ("overlapped", GdnConfig(schedule="overlapped"), dev)]
    return [(label, plan_gdn(config, shape, n, longest, where)) for label, config, where in wanted]


def expand_matches_host(dev, arena, streams, problems: list) -> None:
    """Stage the same batch on the host and through the device expansion kernels, the step's 3 streams
    (``q12_expand_meta_tail``: the per-stream fields as launch parameters) and TAIL_STREAMS + 1 short ones
    (``q12_expand_meta``: the fields copied in first); the bytes must match."""
    counts = [1 + b % 3 for b in range(TAIL_STREAMS + 1)]
    many, mbuf, _ = make_streams(dev, np.random.default_rng(13), False, counts, [b % 20 for b in range(len(counts))])
    plan = make_scratch_plan(counts, 0, False, "exact")
    with ScratchArena(dev, plan.total_bytes + 512) as wide:
        for entry, where, batch in (("q12_expand_meta_tail", arena, streams), ("q12_expand_meta", wide, many)):
            staged = []
            for stage in (stage_batched_attn_metadata, stage_on_device):
                where.reset()
                meta = stage(where, batch, block_size=BLOCK, use_mrope=False, scratch_offset_bytes=0,
                             dummy_kv_block=0)
                dev.synchronize()
                staged.append(where.read(meta.scratch_offset_bytes, meta.staged_bytes))
            if staged[0] != staged[1]:
                problems.append(f"{entry}: device-expanded metadata differs from the host stager's")
            if not where.guard_intact():
                problems.append(f"{entry}: the arena's guard band was overwritten")
    mbuf.get(problems)
    mbuf.buf.free()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sanitize_step.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default="cuda", choices=["cuda", "emu", "auto"],
                    help="default cuda; emu runs the same step and checks on the emulated driver")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile (and cache) the kernels the step uses, then exit (run once before the sanitizer)")
    args = ap.parse_args(argv)
    problems: list = []
    with open_device(args.driver) as dev:
        if args.compile_only:
            for entry in ops.ENTRIES:  # every kernel the step can launch (every GDN kernel included)
                ops.prepared(dev, entry)
            print(f"sanitize_step: kernels compiled and cached on {dev.name}")
            return 0
        for name in LAYERS:
            step(dev, name, problems)
            decode_step(dev, name, problems)
    for line in problems:
        print("FAIL " + line)
    print(f"sanitize_step: {'ok' if not problems else f'{len(problems)} problems'} "
          f"({', '.join(LAYERS)}; batched and per stream; 3 streams, {sum(COUNTS)} tokens)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
