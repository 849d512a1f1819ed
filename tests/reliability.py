"""Shared pieces of the reliability tests: a small live pass ("world") and a snapshot of every byte
it owns (arena + guard band, the pinned rings, every device buffer, the cursor and reservations)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from q12drv import ScratchArena, make_scratch_plan
from q12drv.tools.demo import layer_inputs
from q12drv.prefill import AttentionShape, GdnConfig, GdnShape, Q12Pass
from tests.helpers import LayerBuffers, make_streams

COUNTS = (37, 5, 64)
STARTS = (16, 0, 100)
BLOCK = 16
ATTN = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, rope_theta=1e6, mrope_mode=2,
                      mrope_section=(6, 5, 5))
GDN = GdnShape(num_k_heads=2, num_v_heads=4, head_dim=64)
#: The world's GDN layer: the fused kernel (no workspace to own).
FUSED = GdnConfig(schedule="fused")


def host_inputs(rng, total: int, n: int, num_blocks: int, attn: AttentionShape = ATTN, gdn: GdnShape = GDN) -> dict:
    return layer_inputs(rng, total, n, num_blocks, BLOCK, attn, gdn)


@dataclass
class World:
    """A device with a staged pass (MRoPE, 3 ragged streams) and the buffers of one attention and one
    GDN layer, everything run once so that modules, launches and both pinned rings are warm."""

    dev: object
    streams: list
    tables: object
    plan: object
    arena: ScratchArena
    q12: Q12Pass
    layer: LayerBuffers
    num_blocks: int

    @classmethod
    def build(cls, dev, *, mode: str = "batched", seed: int = 0, run_layers: bool = True) -> "World":
        rng = np.random.default_rng(seed)
        streams, tables = make_streams(dev, list(COUNTS), list(STARTS), block_size=BLOCK, rng=rng, mrope_vision=(0,))
        plan = make_scratch_plan(list(COUNTS), 4, True, "exact")
        arena = ScratchArena(dev, plan.total_bytes + 4096)
        num_blocks = int(max(int(s.block_table.max()) for s in streams)) + 1
        layer = LayerBuffers(dev, host_inputs(rng, sum(COUNTS), len(COUNTS), num_blocks), label="world ")
        w = cls(dev, streams, tables, plan, arena, None, layer, num_blocks)
        w.upload_inputs()
        w.q12 = w.new_pass(mode)
        if run_layers:
            w.run_layers()
            dev.synchronize()
        return w

    def new_pass(self, mode: str = "batched", **kw) -> Q12Pass:
        # the scheduler's view: first chunks (chunk_start 0) whose heads are in the prefix cache
        chunks = [(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in self.streams]
        args = dict(block_size=BLOCK, use_mrope=True, dummy_kv_block=0, top_k=4, head_dim=ATTN.head_dim,
                    policy="exact", mode=mode, chunks=chunks)
        args.update(kw)
        return Q12Pass(self.arena, self.streams, **args)

    def upload_inputs(self) -> None:
        self.layer.upload()

    def p(self, name: str) -> int:
        return self.layer.p(name)

    def state_ptrs(self) -> list:
        return self.layer.states(len(self.streams))

    def attention_args(self) -> tuple:
        return self.layer.attention_args()

    def gdn_args(self) -> tuple:
        return self.layer.gdn_args(len(self.streams))

    def run_layers(self, q12: Q12Pass | None = None) -> None:
        q12 = q12 or self.q12
        q12.attention_layer(*self.attention_args(), ATTN, num_blocks=self.num_blocks)
        q12.gdn_layer(*self.gdn_args(), GDN, config=FUSED)

    def outputs(self) -> dict:
        self.dev.synchronize()
        return {k: self.dev.download(self.layer.bufs[k].ptr, self.layer.host[k].nbytes)
                for k in ("q", "k", "o", "k_pool", "v_pool", "go", "states")}

    def close(self) -> None:
        self.arena.close()


def ring_state(arena: ScratchArena) -> dict:
    """Every pinned ring of ``arena``: per slot its bytes, address and pending flag, and the ring's position."""
    out = {}
    for key in ("ring:staging", "ring:h_state"):
        ring = arena.find_attachment(key)
        if ring is None:
            out[key] = None
            continue
        slots = tuple((s.index, None if s.buffer is None else (s.buffer.addr, s.array.tobytes()), s.pending)
                      for s in ring.slots)
        out[key] = (ring._next, ring.uses, ring.waits, slots)
    return out


def snapshot(dev, arena: ScratchArena | None = None) -> dict:
    """Every byte and every piece of bookkeeping a bad call must leave alone (synchronizes first)."""
    dev.synchronize()
    snap = {"buffers": {(int(b.ptr), b.nbytes, b.name): dev.download(b.ptr, b.nbytes) for b in dev.buffers}}
    if arena is not None and not arena.closed:
        snap["arena"] = (arena.cursor, arena.regions)
        snap["rings"] = ring_state(arena)
    if dev.driver.name == "emu":
        snap["live"] = (dev.driver.live_allocations(), dev.driver.live_handles())
    return snap


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    assert before["buffers"].keys() == after["buffers"].keys(), "a device buffer was allocated or freed"
    for key, data in before["buffers"].items():
        if data != after["buffers"][key]:
            i = next(j for j, (x, y) in enumerate(zip(data, after["buffers"][key])) if x != y)
            raise AssertionError(f"device buffer {key[2]!r} changed (first at byte {i})")
    for k in ("arena", "rings", "live"):
        if k in before:
            assert before[k] == after[k], f"{k} changed"
