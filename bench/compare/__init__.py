"""``bench/gpu_compare.py``'s sections, one module each: every section times q12drv and its comparators in the
same run and adds its rows to the table (:class:`~bench.compare.context.Context`).

:data:`SECTIONS` (name -> ``run(ctx)``), in the order a full run takes them (the newest last, so that a run near
its time budget skips it before the others).
"""

from __future__ import annotations

from bench.compare import (attention, client, conv1d, decode, gdn, graph, jit_slot, kv_write, launch, layer_ops, rope,
                           staging, step)

__all__ = ["SECTIONS"]

SECTIONS = {
    "launch": launch.run,
    "staging": staging.run,
    "curve": staging.run_curve,
    "jit_slot": jit_slot.run,
    "step": step.run,
    "kv_write": kv_write.run,
    "rope": rope.run,
    "attention": attention.run,
    "graph": graph.run,
    "gdn": gdn.run,
    "gdn_decode": gdn.run_decode,
    "conv1d": conv1d.run,
    "attention_window": attention.run_window,
    "layer_ops": layer_ops.run,
    "client": client.run,
    "decode": decode.run,
}
