"""Back-to-back passes with no host synchronization, every pass's staged bytes captured on the device.

:func:`run_soak` stages ``passes`` passes one after the other on one stream, each with
``layers`` per-layer ``h_state_ptrs`` uploads into its JIT slot; after each upload it enqueues a
device-to-device copy (``cuMemcpyDtoDAsync``) of the slot, and after the last one a copy of the
staged metadata block (as the pass's last layer would read it), into a history buffer. Nothing waits for the device in between (the pinned rings wait on
their own events, as they must). At the end one synchronize, one download, and every pass's
metadata block and every layer's pointer table are compared byte for byte with what the seed's
definitions say they must hold (:func:`q12drv.core.staging.expected_fields`, computed independently of
the stager's packer).

Every pass is distinguishable from every other one: its block-table and seq_len pointers and its
JIT-slot pointers encode the pass index, and its positions and slots cycle through several ragged
batches and prefix shifts. A pass that read another pass's bytes, a pinned slot rewritten under a
pending copy, a JIT-slot upload landing after the copy that should see it, or a cursor that moved
by anything but ``staged_bytes`` shows up as a mismatch naming the pass, the layer and the field.

``scripts/gpu_soak.py`` runs it on the GPU; the tests run it on the emulated driver in deferred mode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..core.arena import RING_KEYS, ScratchArena
from ..core.staging import expected_fields
from ..core.device import Device
from ..core.driver import TIMING_NOTE
from ..core.layout import a8, h_state_slot_bytes, make_scratch_plan, stacked_layout
from ..core.staging import StreamStageInfo, place_h_state_slot, stage_batched_attn_metadata, unpack_metadata

__all__ = ["SoakResult", "run_soak", "BATCHES"]

#: The ragged batches the passes cycle through: (per-stream counts, per-stream prefix starts, MRoPE).
BATCHES = (
    ((37, 5, 64), (16, 0, 100), True),
    ((1, 17, 16, 15), (0, 32, 7, 1000), False),
    ((120, 3), (48, 5), True),
    ((9, 9, 9, 9, 9), (0, 0, 0, 0, 0), False),
)
_SHIFTS = 5  # prefix shifts (in blocks) cycled on top of each batch's starts
_BLOCK = 16
_PTR_BASE = 0x7F00_0000_0000


@dataclass
class SoakResult:
    """What :func:`run_soak` did and found."""

    passes: int
    layers: int
    driver: str
    staged_bytes: int = 0
    history_bytes: int = 0
    stage_seconds: float = 0.0
    verify_seconds: float = 0.0
    ring_waits: int = 0
    mismatches: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        status = "PASS" if self.ok else f"FAIL ({len(self.mismatches)} mismatches; first: {self.mismatches[0]})"
        return (f"soak {status}: {self.passes} passes x {self.layers} JIT-slot uploads on {self.driver}, "
                f"{self.staged_bytes:,} metadata bytes staged, no host sync between passes "
                f"(ring waits {self.ring_waits}); enqueue {self.stage_seconds:.2f} s, verify {self.verify_seconds:.2f} s"
                + (f" ({TIMING_NOTE})" if self.driver.startswith("emu") else ""))


def _tables(dev: Device, batches) -> tuple:
    """Block tables for every batch and shift (host copies), all in one device buffer."""
    rng = np.random.default_rng(1234)
    host, tables = [], {}
    for k, (counts, starts, _) in enumerate(batches):
        for b, (c, s) in enumerate(zip(counts, starts)):
            need = -(-(s + (_SHIFTS - 1) * _BLOCK + c) // _BLOCK)
            t = rng.permutation(np.arange(1, 4 * need + 1))[:need].astype(np.int32)
            t[rng.random(need) < 0.05] = -1  # evicted entries go to the dummy block
            tables[(k, b)] = t
            host.append(t)
    flat = np.concatenate(host)
    buf = dev.alloc(flat.nbytes, "soak block tables")
    dev.upload(buf.ptr, flat)
    return tables, buf


def _expected_template(streams, layout, mrope: bool) -> bytes:
    """The staged block as the seed defines it (pads zero), built field by field from expected_fields."""
    want = expected_fields(streams, block_size=_BLOCK, use_mrope=mrope, dummy_kv_block=0)
    out = np.zeros(layout.staged_bytes, np.uint8)
    for f in layout.fields:
        out[f.offset:f.offset + f.nbytes] = np.ascontiguousarray(want[f.name], dtype=f.dtype).view(np.uint8)
    return out.tobytes()


def _pass_pointers(i: int, n: int) -> tuple:
    """Pass i's block-table and seq_len pointers: unique per pass and stream (never dereferenced)."""
    bt = [_PTR_BASE + (i << 16) + 64 * b for b in range(n)]
    sl = [_PTR_BASE + (1 << 40) + (i << 16) + 8 * b for b in range(n)]
    return bt, sl


def _slot_pointers(i: int, layer: int, n: int) -> list:
    return [_PTR_BASE + (2 << 40) + (((i << 8) | layer) << 12) + 16 * b for b in range(n)]


def run_soak(dev: Device, passes: int, *, layers: int = 4, batches=BATCHES, max_mismatches: int = 20) -> SoakResult:
    """Stage ``passes`` passes back to back with ``layers`` JIT-slot uploads each; verify them all.

    Parameters
    ----------
    dev : Device
        Any driver; on the emulator use ``deferred=True`` so that stream work really lags the host.
    passes : int
    layers : int
        SSM layers per pass (JIT-slot uploads, each captured).
    batches : sequence of (counts, starts, mrope)
        What the passes cycle through.

    Returns
    -------
    SoakResult
        ``ok`` when every captured byte matched.
    """
    if passes < 1 or layers < 1:
        raise ValueError(f"passes and layers must be >= 1, got {passes}, {layers}")
    result = SoakResult(passes, layers, f"{dev.driver.name}{' (deferred)' if getattr(dev.driver, 'deferred', False) else ''}")
    tables, tables_buf = _tables(dev, batches)
    # per (batch, shift): the streams (with placeholder pointers), the layout, the expected bytes
    variants = {}
    capacity = 0
    for k, (counts, starts, mrope) in enumerate(batches):
        plan = make_scratch_plan(list(counts), 2, mrope, "exact")
        capacity = max(capacity, plan.total_bytes)
        for sh in range(_SHIFTS):
            streams = [StreamStageInfo(s + sh * _BLOCK, c, tables[(k, b)], 1, 1)
                       for b, (c, s) in enumerate(zip(counts, starts))]
            layout = stacked_layout(len(counts), sum(counts), mrope)
            variants[(k, sh)] = (plan, streams, layout, _expected_template(streams, layout, mrope))
    order = [(i % len(batches), (i // len(batches)) % _SHIFTS) for i in range(passes)]
    per_pass = [a8(variants[v][2].staged_bytes) + layers * h_state_slot_bytes(len(batches[v[0]][0])) for v in order]
    offsets = np.concatenate([[0], np.cumsum(per_pass)]).astype(np.int64)
    history = dev.alloc(int(offsets[-1]), "soak history")
    stream = dev.new_stream()
    raw_stream = stream.raw
    dtod = dev.driver.memcpy_dtod_async
    hist = int(history.ptr)
    arena = ScratchArena(dev, capacity)
    try:
        t0 = time.perf_counter()
        for i, (k, sh) in enumerate(order):
            plan, template_streams, layout, _ = variants[(k, sh)]
            n = len(template_streams)
            bt, sl = _pass_pointers(i, n)
            streams = [StreamStageInfo(s.proc_start, s.proc_count, s.block_table, bt[b], sl[b])
                       for b, s in enumerate(template_streams)]
            arena.reset()
            for r in (plan.moe, *plan.stream_blocks):
                arena.reserve(r.name, r.nbytes, offset=r.offset)
            meta = stage_batched_attn_metadata(arena, streams, block_size=_BLOCK, use_mrope=batches[k][2],
                                               scratch_offset_bytes=plan.stacked.offset, dummy_kv_block=0,
                                               stream=stream)
            slot = place_h_state_slot(arena, meta)
            slot_bytes = h_state_slot_bytes(n)
            at = hist + int(offsets[i]) + a8(meta.staged_bytes)
            for layer in range(layers):
                slot.upload(_slot_pointers(i, layer, n), stream)
                dtod(at, int(slot.ptr), slot_bytes, raw_stream)  # what this layer's kernel would read
                at += slot_bytes
            # the metadata as the pass's last layer sees it, after every slot upload
            dtod(hist + int(offsets[i]), int(meta.positions_stacked), meta.staged_bytes, raw_stream)
            result.staged_bytes += meta.staged_bytes
        result.stage_seconds = time.perf_counter() - t0
        for key in RING_KEYS.values():
            ring = arena.find_attachment(key)
            result.ring_waits += ring.waits if ring is not None else 0
        stream.synchronize()
        t0 = time.perf_counter()
        data = np.frombuffer(dev.download(history.ptr, history.nbytes, stream), np.uint8)
        result.history_bytes = history.nbytes
        _verify(result, data, offsets, order, variants, batches, layers, max_mismatches)
        result.verify_seconds = time.perf_counter() - t0
    finally:
        arena.close()
        history.free()
        tables_buf.free()
        stream.destroy()
    return result


def _verify(result: SoakResult, data, offsets, order, variants, batches, layers, max_mismatches) -> None:
    for i, v in enumerate(order):
        _, streams, layout, template = variants[v]
        n = len(streams)
        off = int(offsets[i])
        got = data[off:off + layout.staged_bytes]
        want = bytearray(template)
        bt, sl = _pass_pointers(i, n)
        for name, values in (("block_table_ptrs", bt), ("seq_len_ptrs", sl)):
            f = layout.field(name)
            want[f.offset:f.offset + f.nbytes] = np.array(values, np.uint64).tobytes()
        if got.tobytes() != bytes(want):
            fields_got = unpack_metadata(got, layout)
            fields_want = unpack_metadata(bytes(want), layout)
            bad = [name for name in fields_want if not np.array_equal(fields_got[name], fields_want[name])]
            result.mismatches.append(f"pass {i} (batch {v[0]}, shift {v[1]}): metadata fields {', '.join(bad)} differ")
        off += a8(layout.staged_bytes)
        slot_bytes = h_state_slot_bytes(n)
        for layer in range(layers):
            got_ptrs = data[off:off + slot_bytes].view(np.uint64)
            want_ptrs = np.array(_slot_pointers(i, layer, n), np.uint64)
            if not np.array_equal(got_ptrs, want_ptrs):
                result.mismatches.append(f"pass {i} layer {layer}: h_state_ptrs slot holds {got_ptrs.tolist()}, "
                                         f"expected {want_ptrs.tolist()}")
            off += slot_bytes
        if len(result.mismatches) >= max_mismatches:
            result.mismatches.append("(stopped after this many)")
            return
