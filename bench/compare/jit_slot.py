"""Section ``jit_slot``: the per-SSM-layer ``h_state_ptrs`` upload (:meth:`~q12drv.core.staging.HStateSlot.upload`,
n = 8) against a pinned torch tensor's ``.to()``: host time and round trip, medians over 300 repetitions."""

from __future__ import annotations

from bench.compare.context import Context, torch_mod
from bench.timing import host_and_round_trip

__all__ = ["run"]


def run(ctx: Context) -> None:
    from q12drv import ScratchArena
    from q12drv.core.staging import reserve_h_state_slot

    dev = ctx.dev
    n = 8
    res = {}
    with ScratchArena(dev, 1 << 16) as arena:
        slot = reserve_h_state_slot(arena, n)
        ptrs = [0x7F00_0000_0000 + 4096 * b for b in range(n)]
        res["q12drv"] = host_and_round_trip({"upload": lambda: slot.upload(ptrs)}, ctx.reps(300, 3),
                                            dev.synchronize)["upload"]
        dev.synchronize()
    if ctx.gpu:
        try:
            torch = torch_mod()
            host = torch.tensor(ptrs, dtype=torch.int64).pin_memory()
            stream = torch.cuda.current_stream()
            keep = []
            res["torch"] = host_and_round_trip({"t": lambda: keep.append(host.to("cuda", non_blocking=True))},
                                               ctx.reps(300, 3), stream.synchronize)["t"]
        except Exception as exc:
            ctx.error("jit_slot/torch", f"{type(exc).__name__}: {exc}")
    ctx.section("jit_slot", res)
    if "torch" in res:
        ctx.row("h_state_ptrs upload (n=8): round trip", res["q12drv"]["round_trip_us"], "torch pinned tensor .to()",
                res["torch"]["round_trip_us"], note="info")
