"""The benchmarks' inputs: every set-up the scripts and suites of ``bench/`` share, public.

``bench/gpu_compare.py``'s sections (``bench/compare/``), the pytest-benchmark suites (``bench/test_*.py``),
``bench/breakdown.py``, ``bench/profile_host.py`` and ``bench/fla_gdn.py`` take their devices, streams, staged passes,
layer buffers, Gated DeltaNet inputs, attention problems and short-convolution inputs from here, so that one script
never reaches into another's helpers.

Everything here runs on the real driver and on the emulated one (``Q12DRV_DRIVER=emu``); on the emulator the
callers cut the shapes down so the numpy kernel emulators finish quickly (host-side costs such as packing and
launch bookkeeping are still real there).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path
from typing import Iterator

import numpy as np

import q12drv
from q12drv import ScratchArena, StreamStageInfo, make_scratch_plan, stage_batched_attn_metadata
from q12drv.core.bf16 import to_bf16_bits
from q12drv.core.driver import register_emulator
from q12drv.core.launch import load_module
from q12drv.core.layout import stacked_layout
from q12drv.kernels.expand import ExpandPlan, stage_on_device
from q12drv.kernels import ops
from q12drv.kernels.gdn import GdnConfig, GdnTensors, plan_gdn
from q12drv.kernels.meta import TAIL_STREAMS, Q12MetaC, meta_defines
from q12drv.prefill import AttentionShape, GdnShape, Q12Pass

__all__ = [
    "open_bench_device", "on_gpu", "stub_driver",
    "BENCH_SOURCE", "BENCH_SOURCE_DIR", "LAUNCH_CASES", "bench_launch", "raw_launcher", "ctypes_launcher",
    "make_streams", "staged_pass", "rand_bf16", "StagingCase", "kv_write_launcher",
    "QWEN3_NEXT", "step_counts", "StepCase",
    "GDN_CASES", "GDN_EMU_CASES", "gdn_case_lens", "gdn_inputs",
    "ATTN_CASES", "ATTN_EMU_CASES", "attn_flops", "attention_buffers",
    "DECODE_CASES", "DECODE_EMU_CASES", "MIXED_CASE", "MIXED_EMU_CASE",
    "CONV_CHANNELS", "CONV_WIDTH", "CONV_CASES", "CONV_EMU_CASES", "conv1d_floor_bytes", "conv1d_inputs",
]


def open_bench_device():
    """The device the benchmarks run on: ``Q12DRV_DRIVER`` (cuda / emu), else the GPU when there is one."""
    return q12drv.open_device(os.environ.get("Q12DRV_DRIVER") or "auto")


def on_gpu(dev) -> bool:
    """Whether ``dev`` runs on the real CUDA driver (not the emulator)."""
    return dev.driver.name == "cuda"


def stub_driver(dev) -> None:
    """Make the emulated driver's copies and launches no-ops, so that only q12drv's own Python is left to time.

    Raises
    ------
    ValueError
        ``dev`` runs on the real driver (its work cannot be stubbed).
    """
    if on_gpu(dev):
        raise ValueError("stub_driver replaces the emulated driver's work; it cannot stub a real GPU")
    drv = dev.driver
    drv.memcpy_htod_async = lambda *a: None
    drv.launch = lambda *a: None
    drv.launcher = lambda func, params_addr: (lambda grid, block, smem, stream: None)


# ----------------------------------------------------------------------------- launch latency
BENCH_SOURCE = "launch_overhead.cu"
#: Where the benchmark kernels live (outside cuda_src/: they are no product code).
BENCH_SOURCE_DIR = Path(__file__).resolve().parent / "cuda"


class _BigC(ctypes.Structure):
    _fields_ = [("v", ctypes.c_uint64 * 256)]


_STRUCTS = {"Q12Meta": Q12MetaC, "Q12BenchBig": _BigC}
#: Launch-latency matrix (cuda-python's, plus q12drv's own by-value metadata struct):
#: case -> (entry, argument values).
LAUNCH_CASES = {
    "empty": ("q12_bench_empty", {}),
    "1 ptr": ("q12_bench_ptr1", {"a0": 0x7F00_0000_0000}),
    "6 u64 + 2 i32": ("q12_bench_args8", {**{f"a{i}": 0x7F00_0000_0000 + 256 * i for i in range(6)}, "n0": 7, "n1": 9}),
    "16 ptrs": ("q12_bench_args16", {f"a{i}": 0x7F00_0000_0000 + 256 * i for i in range(16)}),
    "Q12Meta by value": ("q12_bench_meta", {}),
    "2048-byte struct": ("q12_bench_big", {}),
}


def bench_launch(dev, case: str):
    """A pre-packed :class:`~q12drv.core.launch.Launch` of the benchmark kernel for ``case``."""
    entry, values = LAUNCH_CASES[case]
    for name, _ in LAUNCH_CASES.values():  # on the emulator the empty kernels do nothing
        register_emulator(name, lambda args, mem, grid, block: None)
    module = load_module(dev, BENCH_SOURCE, defines=tuple(meta_defines()), struct_types=_STRUCTS,
                         source_dir=BENCH_SOURCE_DIR)
    return module.kernel(entry).prepare(**values)


def raw_launcher(dev, launch, grid=(1, 1, 1), block=(32, 1, 1)):
    """The floor: the driver's own launch call with ``launch``'s pre-packed argument array, nothing else.

    On the GPU this is ``cuda.bindings.driver.cuLaunchKernel`` called directly (its result is
    checked once per batch by the caller, not per launch); on the emulator, the driver method.
    """
    func, addr, stream = launch.kernel.func, launch._addr, dev.stream.raw
    gx, gy, gz = grid
    bx, by, bz = block
    if on_gpu(dev):
        from cuda.bindings import driver as cu

        f = cu.cuLaunchKernel

        def raw():
            return f(func, gx, gy, gz, bx, by, bz, 0, stream, addr, 0)
    else:
        f = dev.driver.launch

        def raw():
            return f(func, grid, block, 0, stream, addr)
    return raw


def ctypes_launcher(dev, launch, grid=(1, 1, 1), block=(32, 1, 1)):
    """``libcuda``'s ``cuLaunchKernel`` called through ctypes with ``launch``'s pre-packed argument array (no
    cuda-bindings wrapper in between): what a launch path that skipped the bindings would cost. None on the
    emulator (there is no libcuda). Its result is the caller's to check."""
    if not on_gpu(dev):
        return None
    f = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    u = ctypes.c_uint
    f.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    f.restype = ctypes.c_int
    func, addr, stream = int(launch.kernel.func), launch._addr, dev.stream.handle
    gx, gy, gz = grid
    bx, by, bz = block

    def raw():
        return f(func, gx, gy, gz, bx, by, bz, 0, stream, addr, None)
    return raw


# ----------------------------------------------------------------------------- streams
def make_streams(dev, counts, starts=None, *, block_size=16, seed=0):
    """Streams whose block tables live in device memory (blocks interleaved across streams).

    Returns ``(streams, num_blocks, buffer)``; keep the buffer alive while the streams are used.
    """
    rng = np.random.default_rng(seed)
    n = len(counts)
    starts = list(starts) if starts is not None else [0] * n
    needed = [-(-(s + c) // block_size) for s, c in zip(starts, counts)]
    ids = rng.permutation(np.arange(1, sum(needed) + 1)).astype(np.int32)  # block 0: the dummy block
    cap = max(needed)
    host = np.zeros((n, cap), np.int32)
    off = 0
    for b, k in enumerate(needed):
        host[b, :k] = ids[off:off + k]
        off += k
    seq = np.array([s + c for s, c in zip(starts, counts)], np.uint32)
    buf = dev.alloc(host.nbytes + seq.nbytes + 64, "bench block tables")
    dev.upload(int(buf.ptr), host)
    seq_base = int(buf.ptr) + host.nbytes
    dev.upload(seq_base, seq)
    streams = [StreamStageInfo(int(s), int(c), host[b, :needed[b]], int(buf.ptr) + b * cap * 4, seq_base + 4 * b)
               for b, (s, c) in enumerate(zip(starts, counts))]
    return streams, sum(needed) + 1, buf


@contextlib.contextmanager
def staged_pass(dev, counts, starts=None, *, mrope: bool = False, block_size: int = 16,
                seed: int = 0) -> Iterator[tuple]:
    """A batch of ``counts`` tokens (after ``starts`` cached ones, default none) staged in its own arena.

    Yields ``(meta, streams, num_blocks, arena, bufs)``: the pass's metadata, its streams (block tables from
    :func:`make_streams` with ``seed``), the KV blocks they span (block 0 the dummy), the arena, and a list the
    caller appends its device buffers to. On the way out the device is synchronised and those buffers, the arena
    and the block tables are freed.
    """
    streams, num_blocks, tables = make_streams(dev, counts, starts, block_size=block_size, seed=seed)
    plan = make_scratch_plan(list(counts), 0, mrope, "exact")
    arena = ScratchArena(dev, plan.total_bytes + 4096)
    bufs = []
    try:
        meta = stage_batched_attn_metadata(arena, streams, block_size=block_size, use_mrope=mrope,
                                           scratch_offset_bytes=0, dummy_kv_block=0)
        dev.synchronize()
        yield meta, streams, num_blocks, arena, bufs
    finally:
        dev.synchronize()
        for b in bufs:
            b.free()
        arena.close()
        tables.free()


def rand_bf16(dev, shape, seed: int):
    """A device buffer of standard-normal bf16 values of ``shape`` (numpy's generator seeded with ``seed``).

    Returns ``(buffer, host bits)``; the caller frees the buffer.
    """
    arr = to_bf16_bits(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))
    buf = dev.alloc(arr.nbytes)
    dev.upload(int(buf.ptr), arr)
    return buf, arr


# ----------------------------------------------------------------------------- staging
class StagingCase:
    """One staging workload: n streams x ``tokens`` each, with the comparators' buffers pre-filled.

    ``host()``: q12drv's stager (validate, pack, one copy); ``device()``: the device-expansion
    path (validate, then one kernel launch carrying the per-stream tail as its parameters);
    ``planned()``: the same through :attr:`plan`, an :class:`~q12drv.kernels.expand.ExpandPlan` made once (a pass
    checks only its :attr:`starts` and :attr:`counts`; None over more than ``TAIL_STREAMS`` streams); ``bare()``: one copy of
    ``staged_bytes`` from a pinned buffer already holding the bytes (the floor: no packing);
    ``per_field()``: the same bytes as one copy per field from separate pinned buffers (no
    packing either). None of them waits; the caller synchronizes.
    """

    def __init__(self, dev, n: int, tokens: int, *, mrope: bool = True, block_size: int = 16, start: int = 0):
        self.dev, self.n, self.tokens, self.mrope, self.block_size = dev, n, tokens, mrope, block_size
        counts = [tokens] * n
        self.streams, self.num_blocks, self._tables = make_streams(dev, counts, [start] * n, block_size=block_size)
        plan = make_scratch_plan(counts, 0, mrope, "exact")
        self.layout = stacked_layout(n, n * tokens, mrope)
        self.arena = ScratchArena(dev, plan.total_bytes + 4096)
        self.offset = 0
        self.staged_bytes = self.layout.staged_bytes
        meta = self.host()
        dev.synchronize()
        raw = self.arena.read(self.offset, self.staged_bytes)
        self.packed = dev.pinned(self.staged_bytes, "bench packed")
        self.packed.array[:] = np.frombuffer(raw, np.uint8)
        self.dst = int(meta.positions_stacked)  # the block's first byte (positions come first)
        self.fields = []
        for f in self.layout.fields:
            pin = dev.pinned(max(f.nbytes, 1), f"bench field {f.name}")
            pin.array[:f.nbytes] = self.packed.array[f.offset:f.offset + f.nbytes]
            self.fields.append((self.dst + f.offset, pin, f.nbytes))
        self._htod = dev.driver.memcpy_htod_async
        self._raw_stream = dev.stream.raw
        self.plan = None
        self.starts = [s.proc_start for s in self.streams]
        self.counts = [s.proc_count for s in self.streams]
        if n <= TAIL_STREAMS:
            self.plan = ExpandPlan(self.arena, self.streams, block_size=block_size, use_mrope=mrope,
                                   scratch_offset_bytes=self.offset, dummy_kv_block=0)

    def host(self):
        self.arena.reset()
        return stage_batched_attn_metadata(self.arena, self.streams, block_size=self.block_size, use_mrope=self.mrope,
                                           scratch_offset_bytes=self.offset, dummy_kv_block=0)

    def device(self):
        self.arena.reset()
        return stage_on_device(self.arena, self.streams, block_size=self.block_size, use_mrope=self.mrope,
                               scratch_offset_bytes=self.offset, dummy_kv_block=0)

    def planned(self):
        self.arena.reset()
        return self.plan.stage(self.starts, self.counts)

    def bare(self):
        self._htod(self.dst, self.packed.addr, self.staged_bytes, self._raw_stream)

    def per_field(self):
        htod, s = self._htod, self._raw_stream
        for dst, pin, nbytes in self.fields:
            htod(dst, pin.addr, nbytes, s)

    def check(self) -> bool:
        """Whether the arena holds the expected bytes now (after a synchronize)."""
        self.dev.synchronize()
        return self.arena.read(self.offset, self.staged_bytes) == self.packed.array.tobytes()

    def close(self):
        self.arena.close()
        self.packed.free()
        for _, pin, _ in self.fields:
            pin.free()
        self._tables.free()


def kv_write_launcher(dev, case: StagingCase) -> tuple:
    """The whole ``ops.kv_write`` launcher (argument checks, geometry, packing, launch) over ``case``'s metadata
    (staged here by the host path), Hkv 2 and D 256, one row buffer as K and V and one pool as both.

    Returns ``(call, buffers)``: the zero-argument call and the device buffers the caller frees.
    """
    meta = case.host()
    row_elems = 2 * 256
    pool = dev.alloc(case.num_blocks * case.block_size * row_elems * 2, "kv pool")
    rows = dev.alloc(case.n * case.tokens * row_elems * 2, "kv rows")
    p, r = int(pool.ptr), int(rows.ptr)

    def call():
        ops.kv_write(dev, meta, r, r, p, p, num_kv_heads=2, head_dim=256, num_blocks=case.num_blocks)

    return call, (pool, rows)


# ----------------------------------------------------------------------------- one layer step
#: Qwen3-Next-like layer shapes: attention Hq 16, Hkv 2, D 256 (partial rotary 64, theta 1e7),
#: KV blocks of 16; Gated DeltaNet Hk 16, Hv 32, d 128.
QWEN3_NEXT = {
    "attention": AttentionShape(16, 2, 256, 64, 1e7),
    "gdn": GdnShape(16, 32, 128),
    "block_size": 16,
}


def step_counts(case: str, gpu: bool) -> list:
    """Per-stream token counts of a step case (``"8x128"`` or ``"ragged"``), cut down on the emulator."""
    if case == "8x128":
        return [128] * 8 if gpu else [8] * 8
    if case == "ragged":
        return [256, 512, 768, 1024, 1280, 1536, 1792, 2048] if gpu else [4, 8, 12, 16, 20, 24, 28, 32]
    raise ValueError(case)


class StepCase:
    """Buffers for one attention layer and one GDN layer over ``counts`` streams (random inputs).

    ``run(mode)`` builds a :class:`~q12drv.prefill.Q12Pass` (admission, plan, staging) and runs
    both layers, ``mode`` ``"batched"`` or ``"per_stream"``; it does not wait. The GDN layer runs one plan of
    ``gdn_config`` (default: the device's fastest path) for the whole batch in both modes and in the captured
    graph, through one workspace sized for the batched pass (which covers each stream's).
    """

    def __init__(self, dev, counts, *, shapes=QWEN3_NEXT, seed=0, gdn_config=GdnConfig()):
        self.dev, self.counts = dev, list(counts)
        att, gdn, bs = shapes["attention"], shapes["gdn"], shapes["block_size"]
        #: the short convolution's channels: Qwen3-Next's [q | k | v], 2 Hk dk + Hv dv
        self.conv_channels = (2 * gdn.num_k_heads + gdn.num_v_heads) * gdn.head_dim
        self.att, self.gdn, self.bs = att, gdn, bs
        self.gdn_plan = plan_gdn(gdn_config, gdn, len(counts), max(counts), dev)
        n, total = len(counts), sum(counts)
        self.streams, self.num_blocks, self._tables = make_streams(dev, counts, block_size=bs, seed=seed)
        rng = np.random.default_rng(seed)
        hq, hkv, d = att.num_q_heads, att.num_kv_heads, att.head_dim
        hk, hv, dg = gdn.num_k_heads, gdn.num_v_heads, gdn.head_dim

        def bf16(*shape):
            return to_bf16_bits(rng.standard_normal(shape, dtype=np.float32))

        host = {
            "q": bf16(total, hq, d), "k": bf16(total, hkv, d), "v": bf16(total, hkv, d), "o": None,
            "k_pool": None, "v_pool": None,
            "gq": bf16(total, hk, dg), "gk": bf16(total, hk, dg), "gv": bf16(total, hv, dg), "go": None,
            "g": (-np.exp(rng.standard_normal((total, hv))) * 0.1).astype(np.float32),
            "beta": (1 / (1 + np.exp(-rng.standard_normal((total, hv))))).astype(np.float32),
            "states": (rng.standard_normal((n, hv, dg, dg)) * 0.1).astype(np.float32),
            # the short convolution over [q | k | v] (width 4), its taps and per-stream states
            "conv_x": bf16(total, self.conv_channels), "conv_y": None, "conv_w": bf16(self.conv_channels, 4),
            "conv_states": bf16(n, 3, self.conv_channels),
        }
        sizes = {"o": total * hq * d * 2, "k_pool": self.num_blocks * bs * hkv * d * 2,
                 "v_pool": self.num_blocks * bs * hkv * d * 2, "go": total * hv * dg * 2,
                 "workspace": max(16, self.gdn_plan.workspace_bytes), "conv_y": total * self.conv_channels * 2}
        host["workspace"] = None
        self.host, self.sizes = host, sizes
        self.ptrs, self._owned = {}, []
        for name, arr in host.items():
            buf = dev.alloc(arr.nbytes if arr is not None else sizes[name], f"bench {name}")
            self._owned.append(buf)
            self.ptrs[name] = int(buf.ptr)
        self.reset()
        self.state_ptrs = [self.ptrs["states"] + b * hv * dg * dg * 4 for b in range(n)]
        self.conv_state_ptrs = [self.ptrs["conv_states"] + b * 3 * self.conv_channels * 2 for b in range(n)]
        self.gdn_tensors = GdnTensors(*(self.ptrs[k] for k in ("gq", "gk", "gv", "g", "beta", "go")))
        #: 48 layers' state tables (a convolution's and a GDN layer's for each of 36), staged once a pass
        self.arena = ScratchArena(dev, Q12Pass.arena_bytes(self.counts, state_rows=72))
        dev.synchronize()

    def reset(self) -> None:
        """Upload the inputs again (the layers update Q, K, the pools and the states in place)."""
        for name, arr in self.host.items():
            if arr is not None:
                self.dev.upload(self.ptrs[name], arr)
            else:
                self.dev.memset(self.ptrs[name], 0, self.sizes[name])
        self.dev.synchronize()

    def read(self, name: str) -> bytes:
        nbytes = self.host[name].nbytes if self.host[name] is not None else self.sizes[name]
        return self.dev.download(self.ptrs[name], nbytes)

    def body(self, gp, blocks: int = 0) -> None:
        """The layers of :meth:`run` inside a :class:`~q12drv.prefill.graphs.PassGraph` (what gets captured): one
        attention and one GDN layer, or ``blocks`` of Qwen3-Next's (three linear-attention layers, each the short
        convolution and Gated DeltaNet with their own state tables, then one attention layer)."""
        p, kw = self.ptrs, self.gdn_kwargs()
        att = (p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], self.att)
        conv = (p["conv_x"], p["conv_y"], p["conv_w"])
        if not blocks:
            gp.attention_layer(*att, num_blocks=self.num_blocks)
            gp.gdn_layer(0, self.gdn_tensors, self.gdn, **kw)
        for i in range(blocks):
            for j in range(3):
                gp.conv1d(6 * i + 2 * j, *conv, channels=self.conv_channels, width=4)
                gp.gdn_layer(6 * i + 2 * j + 1, self.gdn_tensors, self.gdn, **kw)
            gp.attention_layer(*att, num_blocks=self.num_blocks)

    def pass_graph(self, expand: str = "host", blocks: int = 0):
        """A :class:`~q12drv.prefill.graphs.PassGraph` sized exactly for these streams, captured (its eager run
        included) with :meth:`body`'s layers."""
        from q12drv.prefill.graphs import PassGraph

        n, total = len(self.counts), sum(self.counts)
        arena = ScratchArena(self.dev, 1 << 20)
        gp = PassGraph(arena, max_streams=n, max_tokens=total, max_chunk=max(self.counts), block_size=self.bs,
                       use_mrope=False, dummy_kv_block=0, num_ssm_layers=6 * blocks or 1,
                       state_bytes=self.gdn.num_v_heads * self.gdn.head_dim ** 2 * 4, expand=expand)
        self.set_graph_batch(gp)
        gp.capture(lambda g: self.body(g, blocks))
        self.dev.synchronize()
        return gp, arena

    def set_graph_batch(self, gp) -> None:
        """The streams and every state table (:meth:`state_tables`) for ``gp``'s next replay."""
        gp.set_streams(self.streams)
        gp.set_state_tables(self.state_tables(gp.num_ssm_layers))

    def state_tables(self, count: int) -> list:
        """``count`` state tables as :meth:`run` and :meth:`body` read them: one, the GDN states; or per
        linear-attention layer the convolution's, then the GDN layer's (here every layer's the same states)."""
        return [self.state_ptrs] if count == 1 else [self.conv_state_ptrs, self.state_ptrs] * (count // 2)

    def replay(self, gp) -> None:
        self.set_graph_batch(gp)
        gp.replay()

    def gdn_kwargs(self) -> dict:
        """``config`` (the case's plan), ``workspace`` and ``workspace_bytes`` of every GDN layer of the case."""
        return {"config": self.gdn_plan, "workspace": self.ptrs["workspace"], "workspace_bytes": self.sizes["workspace"]}

    def run(self, mode: str, blocks: int = 0) -> Q12Pass:
        """One pass: one attention layer and one GDN layer (its state pointers as a list: the layer copies them);
        ``blocks`` > 0: instead that many of Qwen3-Next's layer blocks (three linear-attention layers, each the short
        convolution and Gated DeltaNet, then one attention layer; its 48 layers are 12), every convolution's and GDN
        layer's state table staged once for the pass (``Q12Pass.stage_states``)."""
        p = self.ptrs
        q12 = Q12Pass(self.arena, self.streams, block_size=self.bs, use_mrope=False, dummy_kv_block=0,
                      head_dim=self.att.head_dim, policy="exact", mode=mode)
        gdn = (self.state_ptrs, self.gdn_tensors, self.gdn)
        att = (p["q"], p["k"], p["v"], p["k_pool"], p["v_pool"], p["o"], self.att)
        kw = self.gdn_kwargs()
        if not blocks:
            q12.attention_layer(*att, num_blocks=self.num_blocks)
            q12.gdn_layer(*gdn, **kw)
        rows = iter(q12.stage_states(self.state_tables(6 * blocks)) if blocks else ())
        conv = (p["conv_x"], p["conv_y"], p["conv_w"])
        for _ in range(blocks):
            for _ in range(3):
                q12.conv1d(next(rows), *conv, channels=self.conv_channels, width=4)
                q12.gdn_layer(next(rows), *gdn[1:], **kw)
            q12.attention_layer(*att, num_blocks=self.num_blocks)
        return q12

    def close(self):
        self.arena.close()
        for buf in self._owned:
            buf.free()
        self._tables.free()


# ----------------------------------------------------------------------------- Gated DeltaNet
#: The Gated DeltaNet cases (stream lengths) of ``gpu_compare``'s GDN section and of ``bench/fla_gdn.py`` (its
#: comparator, timed on the same lengths in its own process), at :data:`QWEN3_NEXT`'s GDN heads.
GDN_CASES = {"8x2048": [2048] * 8, "1x8192": [8192], "ragged8": [256, 2048, 512, 1792, 768, 1536, 1024, 1280]}
#: The same on the emulator: cut down.
GDN_EMU_CASES = {"2x16": [16, 16], "ragged8": [3, 16, 1, 7, 2, 9, 5, 4]}
#: Decode steps (every stream one token; four: speculative decode), memory-bound on the streams' fp32 states.
GDN_DECODE_CASES = {"64x1": [1] * 64, "256x1": [1] * 256, "64x4": [4] * 64, "64x8": [8] * 64, "64x16": [16] * 64}
#: The same on the emulator: cut down.
GDN_DECODE_EMU_CASES = {"4x1": [1] * 4, "4x4": [4] * 4}


def gdn_decode_floor_bytes(counts, hk: int, hv: int, d: int) -> int:
    """Bytes a Gated DeltaNet step must move at least: every stream's fp32 ``[Hv, d, d]`` state read and written,
    q and k (``T x Hk x d``), v and o (``T x Hv x d``) bf16, g and beta (``T x Hv``) fp32."""
    t = sum(counts)
    return 2 * len(counts) * hv * d * d * 4 + 2 * t * (hk + hv) * d * 2 + 2 * t * hv * 4


def gdn_case_lens(spec: str) -> list:
    """A case's stream lengths: a name of :data:`GDN_CASES`, or ``NxL`` (N streams of L tokens).

    Raises
    ------
    ValueError
        ``spec`` is neither.
    """
    if spec in GDN_CASES:
        return list(GDN_CASES[spec])
    try:
        n, length = (int(x) for x in spec.split("x"))
    except ValueError:
        raise ValueError(f"a case is one of {', '.join(GDN_CASES)} or NxL (N streams of L tokens), "
                         f"got {spec!r}") from None
    if n < 1 or length < 1:
        raise ValueError(f"a case NxL needs N >= 1 and L >= 1, got {spec!r}")
    return [length] * n


def gdn_inputs(dev, counts, hk, hv, d, ws_bytes, bufs) -> dict:
    """A GDN layer's inputs for streams of ``counts`` tokens (bf16 q, k, v from fixed seeds, fp32 log-space g
    and beta, fp32 states and their pointers, o, a ``ws_bytes`` workspace) as device buffers by ``gdn.gdn``'s
    argument names (``"state"``: the states themselves), appended to ``bufs``."""
    n, total = len(counts), sum(counts)
    q, _ = rand_bf16(dev, (total, hk, d), 11)
    k, _ = rand_bf16(dev, (total, hk, d), 12)
    v, _ = rand_bf16(dev, (total, hv, d), 13)
    rng = np.random.default_rng(14)
    g = (-rng.random((total, hv)) * 0.3).astype(np.float32)
    beta = rng.random((total, hv)).astype(np.float32)
    st = (rng.standard_normal((n, hv, d, d)) * 0.1).astype(np.float32)
    x = {"q": q, "k": k, "v": v, "g": dev.alloc(g.nbytes), "beta": dev.alloc(beta.nbytes),
         "state": dev.alloc(st.nbytes), "o": dev.alloc(total * hv * d * 2), "h_state_ptrs": dev.alloc(8 * n),
         "workspace": dev.alloc(ws_bytes)}
    bufs += list(x.values())
    dev.upload(int(x["g"].ptr), g)
    dev.upload(int(x["beta"].ptr), beta)
    dev.upload(int(x["state"].ptr), st)
    dev.upload(int(x["h_state_ptrs"].ptr),
               np.array([int(x["state"].ptr) + i * hv * d * d * 4 for i in range(n)], np.uint64))
    dev.synchronize()
    return x


# ----------------------------------------------------------------------------- attention
#: Attention cases (Hq 16, Hkv 2, block 16, D 128 and 256): name -> (q_lens, cached keys before the chunk).
ATTN_CASES = {
    "fresh 8x2048": ([2048] * 8, [0] * 8),
    "fresh 4x4096": ([4096] * 4, [0] * 4),
    "ragged 8x256..4096": ([256, 768, 1280, 1792, 2304, 2816, 3328, 4096], [0] * 8),
    "chunked 1x(2048 on 8192)": ([2048], [6144]),
    "chunked 2x(2048 on 8192)": ([2048] * 2, [6144] * 2),
}
#: The same on the emulator: cut down.
ATTN_EMU_CASES = {"fresh 2x16": ([16, 16], [0, 0]), "chunked 2x(5 on 21)": ([5, 3], [16, 7])}


def attn_flops(d, hq, q_lens, kv_lens) -> float:
    """FLOPs of causal attention by the pairs formula: 4 * D * Hq * sum_b (Lq (Lk - Lq) + Lq (Lq + 1) / 2)."""
    pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, kv_lens))
    return 4.0 * d * hq * pairs


@contextlib.contextmanager
def attention_buffers(dev, cases: dict, hq: int, hkv: int, d: int, bs: int) -> Iterator[tuple]:
    """One Q, K pool, V pool (random bf16, fixed seeds) and O of the largest of ``cases`` (name -> (q_lens,
    prefixes)) at head dim ``d``, reused by every case: yields ``(q, k_pool, v_pool, o)``; the device is
    synchronised and the buffers freed on the way out."""
    t_max = max(sum(q) for q, _ in cases.values())
    blocks_max = max(sum(-(-(q + p) // bs) for q, p in zip(qs, ps)) + 1 for qs, ps in cases.values())
    bufs = []
    try:
        q, _ = rand_bf16(dev, (t_max, hq, d), 5)
        bufs.append(q)
        kp, _ = rand_bf16(dev, (blocks_max * bs, hkv, d), 6)
        bufs.append(kp)
        vp, _ = rand_bf16(dev, (blocks_max * bs, hkv, d), 7)
        bufs.append(vp)
        o = dev.alloc(t_max * hq * d * 2)
        bufs.append(o)
        yield q, kp, vp, o
    finally:
        dev.synchronize()
        for buf in bufs:
            buf.free()


# ----------------------------------------------------------------------------- decode attention
#: Decode batches (one new token a stream): name -> (q_lens, cached keys before the token).
DECODE_CASES = {"64x8k": ([1] * 64, [8191] * 64), "16x32k": ([1] * 16, [32767] * 16),
                "4x128k": ([1] * 4, [131071] * 4)}
#: The same on the emulator: cut down.
DECODE_EMU_CASES = {"2x40": ([1, 1], [39, 39]), "1x(3 on 70)": ([3], [67])}
#: A mixed batch: a few prefill chunks (``prefill``: q_lens, cached keys) beside many decode streams (``decode``).
MIXED_CASE = {"prefill": ([512] * 4, [3584] * 4), "decode": ([1] * 60, [8191] * 60)}
#: The same on the emulator: cut down.
MIXED_EMU_CASE = {"prefill": ([5], [11]), "decode": ([1] * 3, [20] * 3)}


# ----------------------------------------------------------------------------- the short convolution
#: Qwen3-Next's short convolution runs over ``[q | k | v]``: C = 2 Hk dk + Hv dv channels (8192), width 4.
CONV_CHANNELS = 2 * QWEN3_NEXT["gdn"].num_k_heads * QWEN3_NEXT["gdn"].head_dim \
    + QWEN3_NEXT["gdn"].num_v_heads * QWEN3_NEXT["gdn"].head_dim
CONV_WIDTH = 4
#: The convolution's cases: 8 x 2048 tokens and the GDN section's ragged batch.
CONV_CASES = {"8x2048": [2048] * 8, "ragged8": list(GDN_CASES["ragged8"])}
#: The same on the emulator: cut down (the channel count stays).
CONV_EMU_CASES = {"2x16": [16, 16], "ragged8": [3, 16, 1, 7, 2, 9, 5, 4]}


def conv1d_floor_bytes(total_tokens: int, n: int, channels: int = CONV_CHANNELS, width: int = CONV_WIDTH) -> int:
    """Bytes the short convolution must move at least: x read and y written (``T x C`` bf16 each), every
    stream's state read and written (``(W - 1) x C`` bf16 each way); the taps (``C x W``) are not counted."""
    return 2 * total_tokens * channels * 2 + 2 * n * (width - 1) * channels * 2


def conv1d_inputs(dev, counts, bufs, *, channels: int = CONV_CHANNELS, width: int = CONV_WIDTH, seed: int = 0,
                  like: dict | None = None) -> dict:
    """The short convolution's inputs for streams of ``counts`` tokens as device buffers, appended to ``bufs``.

    Keys: ``x`` and ``y`` ``[T, C]`` bf16 (x random), ``w`` ``[C, W]`` (random bf16 taps, scaled by 0.5), ``states``
    (one random ``[W - 1, C]`` bf16 state per stream, back to back) and ``state_ptrs`` (their n u64 addresses);
    ``host``: the host bits of x, w and the states. ``like``: an earlier result whose host bits are uploaded again
    (another buffer set of the same problem, without drawing ``T x C`` random numbers again).
    """
    n, total = len(counts), sum(counts)
    if like is not None:
        host = like["host"]
    else:
        rng = np.random.default_rng(seed)
        host = {"x": to_bf16_bits(rng.standard_normal((total, channels), dtype=np.float32)),
                "w": to_bf16_bits(0.5 * rng.standard_normal((channels, width), dtype=np.float32)),
                "states": to_bf16_bits(rng.standard_normal((n, width - 1, channels), dtype=np.float32))}
    x = {"x": dev.alloc(host["x"].nbytes), "y": dev.alloc(host["x"].nbytes), "w": dev.alloc(host["w"].nbytes),
         "states": dev.alloc(host["states"].nbytes), "state_ptrs": dev.alloc(8 * n)}
    bufs += list(x.values())
    for key in ("x", "w", "states"):
        dev.upload(int(x[key].ptr), host[key])
    dev.upload(int(x["state_ptrs"].ptr),
               np.array([int(x["states"].ptr) + b * (width - 1) * channels * 2 for b in range(n)], np.uint64))
    dev.synchronize()
    x["host"] = host
    return x
