"""Section ``gdn``: Gated DeltaNet, q12drv's plans (:data:`GDN_CONFIGS`: ``default``, the device's fastest path;
the mma.sync two-pass schedule; the fused kernel; the fp32 recurrent kernel) at Qwen3-Next's heads (Hk 16, Hv 32,
d 128) on :data:`bench.inputs.GDN_CASES` (8 x 2048, 1 x 8192, ragged 8 streams of 256..2048), against each other and
against fla-core's ``chunk_gated_delta_rule`` timed in its own process (``bench/fla_gdn.py``: replayed from a CUDA
graph, its device time alone). q12drv's device time from events around 8 back-to-back calls, median of 30 after 3
warm-ups. Section ``gdn_decode``: decode steps (64 x 1, 256 x 1, 64 x 4 tokens; 64 x 8 and 64 x 16 for the
recurrence's bound) against their byte floor (every stream's fp32 state read and written) at 4.8 TB/s and, for one
token a stream, against torch's in-place ``mul_`` over the same state bytes (the practical ceiling); the default (the
recurrence there) and the recurrence against the chunked form, buffer sets rotated past 3x L2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import inputs
from bench.compare import ceiling
from bench.compare.context import HBM_TBPS, Context, faster
from bench.report import ROOT
from bench.timing import q12_events_us
from q12drv.kernels.gdn import GdnConfig

__all__ = ["run", "run_decode", "GDN_CONFIGS"]

#: The section's configs (``gdn.gdn``'s plans for each case): the device's default, the mma.sync schedules, the
#: fp32 recurrent kernel.
GDN_CONFIGS = {"default": GdnConfig(), "mma_two_pass": GdnConfig(schedule="two_pass", isa="mma"),
               "mma_fused": GdnConfig(schedule="fused"), "recurrent": GdnConfig(math="recurrent")}


def run(ctx: Context) -> None:
    from q12drv.kernels.gdn import GdnTensors, gdn, plan_gdn

    dev = ctx.dev
    shape = inputs.QWEN3_NEXT["gdn"]
    hk, hv, d = shape.num_k_heads, shape.num_v_heads, shape.head_dim
    cases = inputs.GDN_CASES if ctx.gpu else inputs.GDN_EMU_CASES
    res = ctx.section("gdn", {"shape": [hk, hv, d], "cases": {}})
    for key, counts in cases.items():
        n = len(counts)
        with inputs.staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
            plans = {name: plan_gdn(cfg, shape, n, max(counts), dev) for name, cfg in GDN_CONFIGS.items()}
            ws_bytes = max(16, *(p.workspace_bytes for p in plans.values()))
            x = inputs.gdn_inputs(dev, counts, hk, hv, d, ws_bytes, bufs)
            tensors = GdnTensors(*(int(x[k].ptr) for k in ("q", "k", "v", "g", "beta", "o")))
            out = res["cases"][key] = {"paths": {name: f"{p.math} {p.schedule} {p.isa} {p.build}".strip()
                                                 for name, p in plans.items()}}
            for name, plan in plans.items():
                def call(plan=plan):
                    gdn(dev, meta, x["h_state_ptrs"].ptr, tensors, shape, plan, workspace=x["workspace"].ptr,
                        workspace_bytes=ws_bytes)

                out[f"{name}_us"] = q12_events_us(dev, call, ctx.reps(30, 1))
            ctx.row(f"gdn {key} Hk{hk} Hv{hv} d{d}: mma_fused", out["mma_fused_us"], "q12drv recurrent kernel",
                    out["recurrent_us"], note="info: device time")
            ctx.row(f"gdn {key} Hk{hk} Hv{hv} d{d}: mma_two_pass", out["mma_two_pass_us"], "q12drv fused kernel",
                    out["mma_fused_us"], note="info: device time; bit-identical results")
            ctx.row(f"gdn {key} Hk{hk} Hv{hv} d{d}: default ({out['paths']['default']})", out["default_us"],
                    "q12drv mma two-pass schedule", out["mma_two_pass_us"], note="info: device time")
    if ctx.gpu:
        ctx.comparator("gdn/fla", lambda: _fla(ctx, res, list(cases)))


#: The decode rows' configs: the default (the recurrence on a decode step), the chunked form's best and the
#: recurrence (where the default's bound on tokens a stream should sit).
DECODE_CONFIGS = {"default": GdnConfig(), "chunked": GdnConfig(math="chunked"),
                  "recurrent": GdnConfig(math="recurrent")}


def run_decode(ctx: Context) -> None:
    """Section ``gdn_decode``: decode steps against their byte floor (every state read and written) at 4.8 TB/s:
    the goal >= 85% for one token a stream, and four tokens (speculative decode) within 1.2x of one token's time."""
    from q12drv.kernels.gdn import GdnTensors, gdn, plan_gdn

    dev = ctx.dev
    shape = inputs.QWEN3_NEXT["gdn"]
    hk, hv, d = shape.num_k_heads, shape.num_v_heads, shape.head_dim
    cases = inputs.GDN_DECODE_CASES if ctx.gpu else inputs.GDN_DECODE_EMU_CASES
    out = ctx.section("gdn_decode", {"shape": [hk, hv, d], "cases": {}})["cases"]
    for key, counts in cases.items():
        n = len(counts)
        floor = inputs.gdn_decode_floor_bytes(counts, hk, hv, d)
        r = out[key] = {"counts_per_stream": counts[0], "streams": n, "floor_bytes": floor}
        with inputs.staged_pass(dev, counts) as (meta, streams, num_blocks, arena, bufs):
            plans = {name: plan_gdn(cfg, shape, n, max(counts), dev) for name, cfg in DECODE_CONFIGS.items()}
            ws_bytes = max(16, *(p.workspace_bytes for p in plans.values()))
            n_sets = ctx.cold_sets(floor)
            sets = [inputs.gdn_inputs(dev, counts, hk, hv, d, ws_bytes, bufs) for _ in range(n_sets)]
            r["paths"] = {name: f"{p.math} {p.schedule} {p.isa} {p.build}".strip() for name, p in plans.items()}
            for name, plan in plans.items():
                turn = [0]

                def call(plan=plan, turn=turn):
                    x = sets[turn[0] % n_sets]
                    turn[0] += 1
                    gdn(dev, meta, x["h_state_ptrs"].ptr, GdnTensors(*(int(x[k].ptr) for k in
                                                                       ("q", "k", "v", "g", "beta", "o"))),
                        shape, plan, workspace=x["workspace"].ptr, workspace_bytes=ws_bytes)

                r[f"{name}_us"] = q12_events_us(dev, call, ctx.reps(30, 1))
            goal = 0.85 if counts[0] == 1 else None
            if ctx.gpu and counts[0] == 1:
                r["torch_in_place_us"] = ceiling.in_place_us(ctx, n * hv * d * d * 4)
                ctx.row(f"gdn decode {key} Hv{hv} d{d}: default", r["default_us"],
                        "torch x.mul_(1.0) over the same state bytes", r["torch_in_place_us"],
                        note="info: the practical ceiling of an in-place update of the states (cold L2)")
            ctx.memory_rows(f"gdn decode {key} Hv{hv} d{d}: default vs floor", r, "default_us", floor, goal,
                            tbps=HBM_TBPS, of=f"the {HBM_TBPS} TB/s floor; default = {r['paths']['default']}")
            ctx.row(f"gdn decode {key} Hv{hv} d{d}: default", r["default_us"], "q12drv chunked form",
                    r["chunked_us"], note=f"device time, cold L2; default = {r['paths']['default']}")
            ctx.row(f"gdn decode {key} Hv{hv} d{d}: recurrence", r["recurrent_us"], "q12drv chunked form",
                    r["chunked_us"],
                    note=f"info: where math='auto' stops taking the recurrence ({r['paths']['recurrent']})")
    one, four = (("64x1", "64x4") if ctx.gpu else ("4x1", "4x4"))
    ctx.row(f"gdn decode {four}: default", out[four]["default_us"], f"{one}: default", out[one]["default_us"],
            ("<=", 1.2), note="speculative decode: four tokens a stream against one")


def _fla(ctx: Context, res: dict, keys: list) -> None:
    """fla-core in its own process (``bench/fla_gdn.py``); its JSON line becomes the comparator."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fla_gdn.py"), "--cases", ",".join(keys)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    fla = json.loads(lines[-1]) if lines else {"ok": False, "error": f"no JSON (rc {proc.returncode}): {proc.stderr[-2000:]}"}
    res["fla"] = fla
    if not fla.get("ok"):
        ctx.error("gdn/fla", f"fla-core not run: {fla.get('error')}")
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
            ctx.row(f"gdn {key} Hk16 Hv32 d128: {name}", ours, f"fla-core {fla.get('fla_version')} chunk GDN ({how})",
                    theirs, goal, note=note)
