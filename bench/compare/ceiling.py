"""What a plain torch elementwise kernel reaches on the same bytes as a memory-bound q12drv kernel: the practical
ceiling a byte floor at the data sheet's 4.8 TB/s does not show.

* :func:`in_place_us`: ``x.mul_(1.0)`` on fp32 tensors of the given bytes (each byte read and written in place, as
  the Gated DeltaNet decode build updates its states);
* :func:`read_us`: ``x.sum(dtype=float32)`` over bf16 tensors of the given bytes (each byte read once, as decode
  attention reads its K/V).

Both rotate buffer sets past 3x L2 (:func:`bench.timing.cold_sets`), and time with events around back-to-back calls
(:func:`bench.timing.torch_events_us`)."""

from __future__ import annotations

from bench.compare.context import Context, torch_mod
from bench.timing import torch_events_us

__all__ = ["in_place_us", "read_us"]


def _timed(ctx: Context, nbytes: int, dtype_name: str, op) -> float:
    torch = torch_mod()
    dtype = getattr(torch, dtype_name)
    elems = int(nbytes) // torch.tensor([], dtype=dtype).element_size()
    sets = [torch.ones(elems, dtype=dtype, device="cuda") for _ in range(ctx.cold_sets(nbytes))]
    turn = [0]

    def call():
        op(torch, sets[turn[0] % len(sets)])
        turn[0] += 1

    try:
        return torch_events_us(torch, call, ctx.reps(20, 1))
    finally:
        del sets
        torch.cuda.empty_cache()


def in_place_us(ctx: Context, nbytes: int) -> float:
    """Device time (us) of ``x.mul_(1.0)`` over ``nbytes`` of fp32 (``nbytes`` read and ``nbytes`` written)."""
    return _timed(ctx, nbytes, "float32", lambda torch, x: x.mul_(1.0))


def read_us(ctx: Context, nbytes: int) -> float:
    """Device time (us) of ``x.sum(dtype=torch.float32)`` over ``nbytes`` of bf16 (``nbytes`` read)."""
    return _timed(ctx, nbytes, "bfloat16", lambda torch, x: x.sum(dtype=torch.float32))
