"""Sections ``staging`` and ``curve``: staging the stacked metadata with MRoPE, q12drv's paths against copies of
the same bytes already packed.

``staging``: 8 streams x 2048 tokens. q12drv ``host`` (validate, pack, one copy), ``device`` (validate, then one
expansion launch carrying the per-stream tail) and ``planned`` (the same through an ``ExpandPlan`` made once: a pass
checks only its starts and counts) against one bare ``cuMemcpyHtoDAsync`` of the same ``staged_bytes`` (the floor),
one copy per field, and torch-style (one pinned torch tensor per field, ``.to(device, non_blocking=True)`` each).
Host time: the call alone; round trip: the call and a stream synchronize; medians over 200 repetitions, the paths
interleaved, an idle stream before each call (:func:`bench.timing.host_and_round_trip`). The comparators move bytes
that are already packed: q12drv's numbers include validating and packing, theirs do not. The bytes each path leaves
in the arena are checked.

``curve``: the same round trips for n in {1..64} x tokens per stream in {16..8192} (fewer repetitions for the large
points), and from how many tokens a stream the device paths beat the host pack.
"""

from __future__ import annotations

import numpy as np

from bench import inputs
from bench.compare.context import Context, faster, torch_mod
from bench.timing import host_and_round_trip

__all__ = ["run", "run_curve"]


def run(ctx: Context) -> None:
    dev = ctx.dev
    n, tokens = (8, 2048) if ctx.gpu else (8, 256)
    case = inputs.StagingCase(dev, n, tokens)
    res = {"n": n, "tokens_per_stream": tokens, "staged_bytes": case.staged_bytes,
           "device_path_bytes": case.staged_bytes - case.layout.tail_offset}
    try:
        paths = {"host": case.host, "device": case.device, "planned": case.planned, "bare": case.bare,
                 "per_field": case.per_field}
        t = host_and_round_trip(paths, ctx.reps(200, 3), dev.synchronize)
        verified = {}
        for name, fn in paths.items():
            fn()
            verified[name] = case.check()
        res.update(t)
        res["verified"] = verified
        try:
            res["torch_style"] = _torch_style(ctx, case, ctx.reps(200, 3))
        except Exception as exc:
            ctx.error("staging/torch_style", f"{type(exc).__name__}: {exc}")
    finally:
        case.close()
    ctx.section("staging", res)
    label = f"{n}x{tokens} MRoPE"
    for path, what in (("planned", "planned expand"), ("device", "device expand"), ("host", "host pack")):
        ctx.row(f"staging {label}: host time ({what})", res[path]["host_us"], "(budget)", 25.0, ("<=", 1.0),
                note="goal: <= 25 us")
        ctx.row(f"staging {label}: round trip ({what})", res[path]["round_trip_us"],
                "bare cuMemcpyHtoDAsync of staged_bytes", res["bare"]["round_trip_us"], ("<=", 1.2))
        if "torch_style" in res:
            ctx.row(f"staging {label}: round trip ({what})", res[path]["round_trip_us"], "torch-style (.to per field)",
                    res["torch_style"]["round_trip_us"], faster(4))
        ctx.row(f"staging {label}: round trip ({what})", res[path]["round_trip_us"], "per-field copies (8 HtoD)",
                res["per_field"]["round_trip_us"], faster(2))
    if not all(res["verified"].values()):
        ctx.error("staging/verify", f"arena bytes differ after: {[k for k, v in res['verified'].items() if not v]}")


def _torch_fields(case):
    """The packed fields as pinned torch tensors (u32/u64 viewed as i32/i64: same bytes)."""
    torch = torch_mod()
    out = []
    for f in case.layout.fields:
        arr = case.packed.array[f.offset:f.offset + f.nbytes].view(f.dtype)
        arr = arr.view({"<u4": np.int32, "<u8": np.int64}.get(f.dtype, arr.dtype))
        out.append(torch.from_numpy(arr.copy()).pin_memory())
    return out


def _torch_style(ctx: Context, case, n_reps: int) -> dict:
    """Host time and round trip of one pinned torch tensor per field ``.to(device, non_blocking=True)``; whether
    the bytes arrived (``verified``)."""
    torch = torch_mod()
    fields = _torch_fields(case)
    dev = torch.device("cuda", ctx.dev.ordinal)
    stream = torch.cuda.current_stream()
    keep = []

    def stage():
        keep[:] = [t.to(dev, non_blocking=True) for t in fields]

    t = host_and_round_trip({"torch": stage}, n_reps, stream.synchronize)["torch"]
    got = b"".join(x.cpu().numpy().tobytes() + b"\0" * (f.padded - f.nbytes) for x, f in zip(keep, case.layout.fields))
    t["verified"] = got == case.packed.array.tobytes()
    return t


def run_curve(ctx: Context) -> None:
    dev = ctx.dev
    ns = (1, 2, 4, 8, 16, 32, 64) if ctx.gpu else (1, 8)
    tokens = (16, 128, 1024, 2048, 8192) if ctx.gpu else (16, 128)
    if ctx.quick and ctx.gpu:
        ns, tokens = (1, 8, 64), (16, 2048, 8192)
    points = []
    have_torch = True
    for n in ns:
        for length in tokens:
            if ctx.elapsed_s() > ctx.budget_s * 0.6:
                ctx.error("curve", f"stopped at n={n}, tokens={length}: over 60% of the time budget")
                break
            total = n * length
            r = ctx.reps(30 if total <= 16384 else (12 if total <= 131072 else 6), 2)
            case = inputs.StagingCase(dev, n, length)
            try:
                t = host_and_round_trip({"host": case.host, "device": case.device, "planned": case.planned,
                                         "bare": case.bare, "per_field": case.per_field}, r, dev.synchronize, warmup=1)
                p = {"n": n, "tokens": length, "total_tokens": total, "staged_bytes": case.staged_bytes, **t}
                if have_torch and ctx.gpu:
                    try:
                        p["torch_style"] = _torch_style(ctx, case, r)
                    except Exception as exc:
                        have_torch = False
                        ctx.error("curve/torch_style", f"{type(exc).__name__}: {exc}")
                points.append(p)
            finally:
                case.close()
    crossover = {"device": {}, "planned": {}}
    for n in ns:
        pts = [p for p in points if p["n"] == n]
        for path, out in crossover.items():
            wins = [p["tokens"] for p in pts if p[path]["round_trip_us"] < p["host"]["round_trip_us"]]
            out[str(n)] = min(wins) if wins else None
    ctx.section("curve", {"points": points, "device_beats_host_from_tokens": crossover["device"],
                          "planned_beats_host_from_tokens": crossover["planned"]})
