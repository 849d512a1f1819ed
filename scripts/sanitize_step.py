#!/usr/bin/env python3
"""One small prefill step through q12drv.prefill.Q12Pass, for compute-sanitizer (scripts/sanitize.sh).

Three passes over 3 ragged streams of a few dozen tokens (cached prefixes, a shared dummy block),
so that every kernel runs: plain RoPE with a D=64 attention layer and a d=64 Gated DeltaNet layer;
MRoPE (interleaved, vision positions on one stream) with a D=128 attention layer; plain RoPE with a
D=256 attention layer and a d=128 GDN layer, its metadata expanded on the device
(``q12_expand_meta_tail``) and compared with the host stager's bytes; each pass batched and per stream.
Everything goes through q12drv's own driver API (no torch). Every buffer the step writes has a
256-byte guard band before and after it, filled with 0xA5 and checked afterwards; the arena's own
guard band too. Batched and per stream must agree bit for bit, every output element must be
written, and the staged metadata must read back as the seed defines it.

    python3 scripts/sanitize_step.py [--driver cuda|emu] [--compile-only]

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from q12drv import ScratchArena, StreamStageInfo, make_scratch_plan, open_device  # noqa: E402
from q12drv.core.staging import verify_readback  # noqa: E402
from q12drv.tools.demo import layer_inputs  # noqa: E402
from q12drv.kernels import ops  # noqa: E402
from q12drv.kernels.gdn import GdnConfig, GdnTensors, plan_gdn  # noqa: E402
from q12drv.prefill import AttentionShape, GdnShape, Q12Pass  # noqa: E402

GUARD = 256
GUARD_BYTE = 0xA5
BLOCK = 16
COUNTS = (23, 41, 9)
STARTS = (16, 0, 37)       # stream 0 and 2 have part of their prompt in the KV cache already
GDN64 = GdnShape(num_k_heads=2, num_v_heads=4, head_dim=64)
GDN128 = GdnShape(num_k_heads=1, num_v_heads=2, head_dim=128)
#: name -> (MRoPE, attention shape, GDN shape or None)
LAYERS = {
    "rope d64": (False, AttentionShape(4, 2, 64, 64, 1e4), GDN64),
    "mrope d128": (True, AttentionShape(4, 2, 128, 64, 1e6, mrope_mode=2, mrope_section=(11, 11, 10)), None),
    "rope d256": (False, AttentionShape(4, 2, 256, 64, 1e7), GDN128),
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


def make_streams(dev, rng, mrope: bool):
    needed = [-(-(s + c) // BLOCK) for s, c in zip(STARTS, COUNTS)]
    ids = rng.permutation(np.arange(1, sum(needed) + 1)).astype(np.int32)  # block 0: the dummy block
    tables, off = [], 0
    for k in needed:
        tables.append(ids[off:off + k])
        off += k
    flat = np.concatenate(tables + [np.array([s + c for s, c in zip(STARTS, COUNTS)], np.int32)])
    tbuf = Guarded(dev, "block tables + seq_lens", flat)
    streams, at = [], 0
    for b, (s, c) in enumerate(zip(STARTS, COUNTS)):
        mp = None
        if mrope and b == 1:  # vision tokens: T fixed, H and W walk a 4-wide grid
            mp = np.stack([np.full(c, s), s + np.arange(c) // 4, s + np.arange(c) % 4]).astype(np.int64)
        streams.append(StreamStageInfo(s, c, tables[b], tbuf.ptr + 4 * at, tbuf.ptr + 4 * (off + b), mp))
        at += tables[b].size
    return streams, tbuf, int(ids.max()) + 1


def step(dev, name: str, problems: list) -> None:
    mrope, attn, gdn = LAYERS[name]
    rng = np.random.default_rng(12)
    streams, tbuf, num_blocks = make_streams(dev, rng, mrope)
    n, total = len(streams), sum(COUNTS)
    host = layer_inputs(rng, total, n, num_blocks, BLOCK, attn, gdn or GDN64)
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
        written = ["o"] + (["go"] if gdn is not None else [])
        for k in written:
            if np.any(np.frombuffer(results["batched"][k], np.uint16) == 0xFFFF):
                problems.append(f"{name}: {k} has elements the kernels never wrote")
        differ = [k for k in results["batched"] if results["batched"][k] != results["per_stream"][k]]
        if differ:
            problems.append(f"{name}: batched and per stream differ in {', '.join(differ)}")
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
    """Stage the same batch on the host and through the device expansion kernel; the bytes must match."""
    from q12drv import stage_batched_attn_metadata
    from q12drv.kernels.expand import stage_on_device

    staged = []
    for stage in (stage_batched_attn_metadata, stage_on_device):
        arena.reset()
        meta = stage(arena, streams, block_size=BLOCK, use_mrope=False, scratch_offset_bytes=0, dummy_kv_block=0)
        dev.synchronize()
        staged.append(arena.read(meta.scratch_offset_bytes, meta.staged_bytes))
    if staged[0] != staged[1]:
        problems.append("q12_expand_meta_tail: device-expanded metadata differs from the host stager's")
    if not arena.guard_intact():
        problems.append("q12_expand_meta_tail: the arena's guard band was overwritten")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sanitize_step.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default="cuda", choices=["cuda", "emu", "auto"])
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
    for line in problems:
        print("FAIL " + line)
    print(f"sanitize_step: {'ok' if not problems else f'{len(problems)} problems'} "
          f"({', '.join(LAYERS)}; batched and per stream; 3 streams, {sum(COUNTS)} tokens)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
