"""Bad-input matrix: every public entry point fed wrong types, out-of-range numbers, empty and huge
batches, NULL or misaligned pointers, short block tables, undersized arenas and wrongly shaped MRoPE
arrays raises a clear error naming the argument (and the bound), and leaves every byte as it was:
the arena and its guard band, both pinned rings, every device buffer, the cursor and the
reservations, the live allocation counts.

The table of cases in ``tests/README.md`` is generated from :data:`CASES` and checked against it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import q12drv
from q12drv import (
    CapacityError,
    CudaError,
    Device,
    DeviceArray,
    DevicePtr,
    Q12Error,
    ScratchArena,
    StreamStageInfo,
    check_kernel_batched_eligible,
    make_scratch_plan,
    open_device,
    place_h_state_slot,
    q12_batched_scratch_bytes,
    q12_batched_scratch_bytes_varlen,
    stage_batched_attn_metadata,
    stage_stream_metadata,
)
from q12drv.core.admission import decide
from q12drv.tools.cli import main as cli_main
from q12drv.kernels import ops
from q12drv.kernels.gdn import GdnConfig, chunked_mma, plan_gdn
from q12drv.kernels.gdn import gdn as gdn_launch
from q12drv.prefill import GdnShape, Q12Pass
from tests.reliability import ATTN, BLOCK, FUSED, GDN, World, assert_same, snapshot

ATTN_FP8 = dataclasses.replace(ATTN, kv_dtype="fp8_e4m3")


@dataclass(frozen=True)
class Case:
    id: str
    input: str
    call: Callable
    exc: type
    match: str


def _stream(w, b=0, **kw):
    s = w.streams[b]
    fields = dict(proc_start=s.proc_start, proc_count=s.proc_count, block_table=s.block_table,
                  block_table_dev=s.block_table_dev, seq_len_dev=s.seq_len_dev, mrope_positions=s.mrope_positions)
    fields.update(kw)
    return StreamStageInfo(**fields)


def _with(w, b=0, **kw):
    out = list(w.streams)
    out[b] = _stream(w, b, **kw)
    return out


def _stage(w, streams=None, **kw):
    args = dict(block_size=BLOCK, use_mrope=True, scratch_offset_bytes=w.arena.cursor, dummy_kv_block=0)
    args.update(kw)
    return stage_batched_attn_metadata(w.arena, w.streams if streams is None else streams, **args)


def _pass(w, streams=None, **kw):
    args = dict(block_size=BLOCK, use_mrope=True, dummy_kv_block=0, top_k=4, head_dim=64, policy="exact")
    args.update(kw)
    return Q12Pass(w.arena, w.streams if streams is None else streams, **args)


def _attn(w, shape=ATTN, num_blocks=None, **ptrs):
    args = dict(zip(("q", "k", "v", "k_pool", "v_pool", "o"), w.attention_args()))
    args.update(ptrs)
    w.q12.attention_layer(*args.values(), shape, num_blocks=w.num_blocks if num_blocks is None else num_blocks)


def _gdn(w, shape=GDN, state_ptrs=None, config=FUSED, tensors=None, **ptrs):
    states, default = w.gdn_args()
    tensors = dataclasses.replace(default, **ptrs) if tensors is None else tensors
    w.q12.gdn_layer(states if state_ptrs is None else state_ptrs, tensors, shape, config=config)


def _op_kv_write(w, **kw):
    args = dict(device=w.dev, meta=w.q12.meta, k=w.p("k"), v=w.p("v"), k_pool=w.p("k_pool"), v_pool=w.p("v_pool"),
                num_kv_heads=2, head_dim=64, num_blocks=w.num_blocks)
    args.update(kw)
    ops.kv_write(**args)


def _op_rope(w, **kw):
    args = dict(device=w.dev, meta=w.q12.meta, q=w.p("q"), k=w.p("k"), num_q_heads=4, num_kv_heads=2, head_dim=64,
                rotary_dim=32, theta=1e6, mrope_mode=2, sections=(6, 5, 5))
    args.update(kw)
    ops.rope(**args)


def _op_attention(w, **kw):
    args = dict(device=w.dev, meta=w.q12.meta, q=w.p("q"), k_pool=w.p("k_pool"), v_pool=w.p("v_pool"), o=w.p("o"),
                num_q_heads=4, num_kv_heads=2, head_dim=64)
    args.update(kw)
    ops.attention(**args)


def _op_gdn(w, **kw):
    args = dict(device=w.dev, meta=w.q12.meta, h_state_ptrs=int(w.q12.h_slot.ptr), tensors=w.layer.gdn_tensors(),
                shape=GDN, plan_or_config=FUSED)
    args.update(kw)
    gdn_launch(**args)


def _admit(**kw):
    args = dict(streams=[(8, 8, 16, False), (9, 9, 16, False)], n=2, arena_cap=64, is_mla=False, head_dim=64,
                scratch_cap=1 << 20, top_k=4, mrope=True, allow_chunk_zero=True, varlen=True)
    args.update(kw)
    return check_kernel_batched_eligible(**args)


def _huge_tokens(w):
    # two streams of 2**30 tokens each: the i32 prefix sum would overflow (block tables stay small)
    big = dict(proc_start=0, proc_count=1 << 30, block_table=np.arange(1024, dtype=np.int32),
               block_table_dev=w.streams[0].block_table_dev, seq_len_dev=w.streams[0].seq_len_dev)
    _stage(w, [StreamStageInfo(**big), StreamStageInfo(**big)], block_size=1 << 20, use_mrope=False)


def _many_streams(w, n=20000):
    s = _stream(w, 1, mrope_positions=None)
    _stage(w, [s] * n)


def _bad_meta(w):
    return dataclasses.replace(w.q12.meta, staged_bytes=w.q12.meta.staged_bytes - 64)


def _stale_meta(w):
    # what the pass's metadata looks like to a launcher after arena.reset(): its generation is behind
    # (a real reset is in test_launchers_refuse_stale_and_closed_metadata)
    return dataclasses.replace(w.q12.meta, generation=w.q12.meta.generation - 1)


class _ClosedArena:
    closed = True
    generation = 0


def _closed_meta(w):
    return dataclasses.replace(w.q12.meta, arena=_ClosedArena())


def _closed_arena(w):
    arena = ScratchArena(w.dev, 4096)
    arena.close()
    return arena


def _fresh_arena(w):
    w.arena.reset()  # (restored by the snapshot comparison? no: only used by cases that raise first)


CASES = [
    # --- devices and pointers --------------------------------------------------------------------
    Case("open_device driver int", "open_device(42)", lambda w: open_device(42), TypeError, "driver must be"),
    Case("open_device driver unknown", "open_device('gpu')", lambda w: open_device("gpu"), ValueError,
         "driver must be one of auto, cuda, emu"),
    Case("open_device ordinal negative", "open_device('emu', -1)", lambda w: open_device("emu", -1), ValueError,
         r"ordinal must be >= 0, got -1"),
    Case("open_device ordinal float", "open_device('emu', 1.5)", lambda w: open_device("emu", 1.5), TypeError,
         "ordinal must be an int"),
    Case("open_device deferred str", "open_device('emu', deferred='yes')",
         lambda w: open_device("emu", deferred="yes"), TypeError, "deferred must be a bool"),
    Case("Device driver str", "Device('emu')", lambda w: Device("emu"), TypeError, "driver must be a q12drv Driver"),
    Case("alloc zero", "dev.alloc(0)", lambda w: w.dev.alloc(0), ValueError, r"nbytes \(allocation size\) must be >= 1"),
    Case("alloc float", "dev.alloc(1.5)", lambda w: w.dev.alloc(1.5), TypeError, "nbytes .* must be an int"),
    Case("pinned negative", "dev.pinned(-8)", lambda w: w.dev.pinned(-8), ValueError, r"pinned allocation size\) must be >= 1"),
    Case("DevicePtr negative", "DevicePtr(-1)", lambda w: DevicePtr(-1), ValueError, r"\[0, 2\*\*64\)"),
    Case("DevicePtr past 64 bits", "DevicePtr(2**64)", lambda w: DevicePtr(1 << 64), ValueError, r"\[0, 2\*\*64\)"),
    Case("DevicePtr float", "DevicePtr(4096.5)", lambda w: DevicePtr(4096.5), TypeError, "device pointer must be an int"),
    Case("DevicePtr bool", "DevicePtr(True)", lambda w: DevicePtr(True), TypeError, "device pointer must be an int, got bool"),
    Case("DevicePtr numpy bool", "DevicePtr(np.True_)", lambda w: DevicePtr(np.True_), TypeError,
         "device pointer must be an int"),
    Case("memset value past a byte", "dev.memset(p, 300, 4)", lambda w: w.dev.memset(w.p("o"), 300, 4), ValueError,
         r"memset value \(a byte\) must be in \[0, 255\], got 300"),
    Case("memset value negative", "dev.memset(p, -1, 4)", lambda w: w.dev.memset(w.p("o"), -1, 4), ValueError,
         r"memset value \(a byte\) must be in \[0, 255\], got -1"),
    Case("memset nbytes negative", "dev.memset(p, 0, -4)", lambda w: w.dev.memset(w.p("o"), 0, -4), ValueError,
         "memset nbytes must be >= 0"),
    Case("alloc past the device", "dev.alloc(2**50)", lambda w: w.dev.alloc(1 << 50), CudaError,
         "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"),
    Case("pinned past the host", "dev.pinned(2**50)", lambda w: w.dev.pinned(1 << 50), CudaError,
         "cuMemHostAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"),
    Case("DeviceArray NULL-1", "DeviceArray(-16, u8, 4)", lambda w: DeviceArray(-16, np.uint8, 4), ValueError,
         r"\[0, 2\*\*64\)"),
    # --- the arena -------------------------------------------------------------------------------
    Case("arena capacity zero", "ScratchArena(dev, 0)", lambda w: ScratchArena(w.dev, 0), ValueError,
         r"capacity nbytes must be in \[1, "),
    Case("arena capacity negative", "ScratchArena(dev, -4096)", lambda w: ScratchArena(w.dev, -4096), ValueError,
         "capacity nbytes must be in"),
    Case("arena capacity huge", "ScratchArena(dev, 2**50)", lambda w: ScratchArena(w.dev, 1 << 50), ValueError,
         r"must be in \[1, 1099511627776\], got 1125899906842624"),
    Case("arena capacity float", "ScratchArena(dev, 4096.0)", lambda w: ScratchArena(w.dev, 4096.0), TypeError,
         "capacity nbytes must be an int"),
    Case("arena device str", "ScratchArena('emu', 4096)", lambda w: ScratchArena("emu", 4096), TypeError,
         "device must be a q12drv Device"),
    Case("reserve negative", "arena.reserve('x', -1)", lambda w: w.arena.reserve("x", -1), ValueError,
         "region 'x': size must be a non-negative int"),
    Case("reserve past capacity", "arena.reserve('x', capacity)", lambda w: w.arena.reserve("x", w.arena.capacity),
         CapacityError, r"x needs [\d,]+ bytes but only [\d,]+ are available"),
    Case("reserve align 3", "arena.reserve('x', 8, align=3)", lambda w: w.arena.reserve("x", 8, align=3), ValueError,
         "alignment must be a power of two, got 3"),
    Case("reserve name int", "arena.reserve(5, 8)", lambda w: w.arena.reserve(5, 8), TypeError, "region name must be a str"),
    Case("reserve behind cursor", "arena.reserve('x', 8, offset=0)", lambda w: w.arena.reserve("x", 8, offset=0),
         ValueError, "would overlap what is reserved up to the cursor"),
    Case("reserve offset float", "arena.reserve('x', 8, offset=8.0)",
         lambda w: w.arena.reserve("x", 8, offset=float(w.arena.cursor)), TypeError, "offset must be an int"),
    Case("read negative", "arena.read(-1, 8)", lambda w: w.arena.read(-1, 8), ValueError, "negative offset or size"),
    Case("read past capacity", "arena.read(0, capacity + 1)", lambda w: w.arena.read(0, w.arena.capacity + 1),
         CapacityError, "read needs"),
    Case("read size float", "arena.read(0, 1.5)", lambda w: w.arena.read(0, 1.5), TypeError, "nbytes must be an int"),
    Case("view past capacity", "arena.view(capacity, u8, 1)", lambda w: w.arena.view(w.arena.capacity, np.uint8, 1),
         CapacityError, "view needs"),
    Case("view of a closed arena", "arena.view(0, u8, 1) after close()",
         lambda w: _closed_arena(w).view(0, np.uint8, 1), Q12Error, "this ScratchArena is closed"),
    Case("ptr of a closed arena", "arena.ptr(0) after close()", lambda w: _closed_arena(w).ptr(0), Q12Error,
         "this ScratchArena is closed"),
    Case("read of a closed arena", "arena.read(0, 8) after close()", lambda w: _closed_arena(w).read(0, 8), Q12Error,
         "this ScratchArena is closed"),
    Case("reserve in a closed arena", "arena.reserve('x', 8) after close()",
         lambda w: _closed_arena(w).reserve("x", 8), Q12Error, "this ScratchArena is closed"),
    # --- sizing and planning ---------------------------------------------------------------------
    Case("plan empty", "make_scratch_plan([], 4, True)", lambda w: make_scratch_plan([], 4, True), ValueError,
         "counts is empty"),
    Case("plan zero count", "make_scratch_plan([5, 0], ...)", lambda w: make_scratch_plan([5, 0], 4, True), ValueError,
         r"counts\[1\] must be >= 1, got 0"),
    Case("plan float count", "make_scratch_plan([5.0], ...)", lambda w: make_scratch_plan([5.0], 4, True), TypeError,
         r"counts\[0\] must be an int"),
    Case("plan top_k negative", "make_scratch_plan([5], -1, True)", lambda w: make_scratch_plan([5], -1, True),
         ValueError, "top_k must be >= 0"),
    Case("plan mrope int", "make_scratch_plan([5], 4, 1)", lambda w: make_scratch_plan([5], 4, 1), TypeError,
         "mrope must be a bool"),
    Case("plan policy", "make_scratch_plan([5], 4, True, 'fast')", lambda w: make_scratch_plan([5], 4, True, "fast"),
         ValueError, "policy must be one of"),
    Case("plan i32 overflow", "make_scratch_plan([2**30, 2**30], ...)",
         lambda w: make_scratch_plan([1 << 30, 1 << 30], 0, False), ValueError, "overflows the i32 cu_seqlens"),
    Case("seed bytes negative n", "q12_batched_scratch_bytes(-1, 8, 4, True)",
         lambda w: q12_batched_scratch_bytes(-1, 8, 4, True), ValueError, "n must be >= 1"),
    Case("seed bytes zero streams", "q12_batched_scratch_bytes(0, 8, 4, True)",
         lambda w: q12_batched_scratch_bytes(0, 8, 4, True), ValueError, "n must be >= 1, got 0"),
    Case("seed varlen zero streams", "q12_batched_scratch_bytes_varlen(0, 0, 8, 4, True)",
         lambda w: q12_batched_scratch_bytes_varlen(0, 0, 8, 4, True), ValueError, "n must be >= 1, got 0"),
    Case("seed bytes float chunk", "q12_batched_scratch_bytes(4, 8.0, 4, True)",
         lambda w: q12_batched_scratch_bytes(4, 8.0, 4, True), TypeError, "chunk_len must be an int"),
    Case("seed varlen mrope str", "q12_batched_scratch_bytes_varlen(4, 32, 8, 4, 'no')",
         lambda w: q12_batched_scratch_bytes_varlen(4, 32, 8, 4, "no"), TypeError, "mrope must be a bool"),
    # --- admission -------------------------------------------------------------------------------
    Case("admission n mismatch", "n=3 for 2 tuples", lambda w: _admit(n=3), ValueError, "n = 3 but 2 stream tuples"),
    Case("admission tuple shape", "streams=[(8, 8)]", lambda w: _admit(streams=[(8, 8)], n=1), TypeError,
         r"streams\[0\] must be a \(chunk_len, eff_len, chunk_start, is_last\) tuple"),
    Case("admission is_mla 'False'", "is_mla='False'", lambda w: _admit(is_mla="False"), TypeError,
         "is_mla must be a bool .* got str 'False'"),
    Case("admission is_mla 1", "is_mla=1", lambda w: _admit(is_mla=1), TypeError, "is_mla must be a bool"),
    Case("admission mrope 'no'", "mrope='no'", lambda w: _admit(mrope="no"), TypeError, "mrope must be a bool"),
    Case("admission allow_chunk_zero NaN", "allow_chunk_zero=nan", lambda w: _admit(allow_chunk_zero=float("nan")),
         TypeError, "allow_chunk_zero must be a bool"),
    Case("admission varlen 0", "varlen=0", lambda w: _admit(varlen=0), TypeError, "varlen must be a bool"),
    Case("admission is_last 'False'", "(8, 8, 16, 'False')",
         lambda w: _admit(streams=[(8, 8, 16, "False"), (9, 9, 16, False)]), TypeError,
         r"streams\[0\].is_last must be a bool"),
    Case("decide is_mla 'no'", "decide(..., is_mla='no')",
         lambda w: decide([(8, 8, 16, False)] * 2, 64, "no", 64, 1 << 20, 4, True, True, True), TypeError,
         "is_mla must be a bool"),
    Case("decide varlen NaN", "decide(..., varlen=nan)",
         lambda w: decide([(8, 8, 16, False)] * 2, 64, False, 64, 1 << 20, 4, True, True, float("nan")), TypeError,
         "varlen must be a bool"),
    Case("admission eff over chunk", "(8, 9, 16, False)", lambda w: _admit(streams=[(8, 9, 16, False)] * 2), ValueError,
         r"streams\[0\]: eff_len 9 exceeds chunk_len 8"),
    Case("admission negative start", "(8, 8, -16, False)", lambda w: _admit(streams=[(8, 8, -16, False)] * 2),
         ValueError, r"streams\[0\].chunk_start must be >= 0"),
    Case("admission head_dim float", "head_dim=64.0", lambda w: _admit(head_dim=64.0), TypeError,
         "head_dim must be an int"),
    Case("admission scratch negative", "scratch_cap=-1", lambda w: _admit(scratch_cap=-1), ValueError,
         "scratch_cap must be >= 0"),
    # --- the stager ------------------------------------------------------------------------------
    Case("stage arena wrong type", "stage(arena=dev)",
         lambda w: stage_batched_attn_metadata(w.dev, w.streams, block_size=16, use_mrope=True, scratch_offset_bytes=0,
                                               dummy_kv_block=0), TypeError, "arena must be a ScratchArena"),
    Case("stage empty batch", "streams=[]", lambda w: _stage(w, []), ValueError, "streams is empty"),
    Case("stage huge batch", "20,000 streams into a small arena", _many_streams, CapacityError,
         r"stacked_metadata needs [\d,]+ bytes"),
    Case("stage i32 total overflow", "2 x 2**30 tokens", _huge_tokens, ValueError,
         "overflow the i32 cu_seqlens prefix sum"),
    Case("stage i32 kv_len overflow", "proc_start=2**31-2", lambda w: _stage(w, _with(w, 1, proc_start=(1 << 31) - 2)),
         ValueError, r"streams\[1\]: proc_start \+ proc_count = \d+ overflows the i32 kv_lens"),
    Case("stage u32 position negative", "proc_start=-1", lambda w: _stage(w, _with(w, 1, proc_start=-1)), ValueError,
         r"streams\[1\].proc_start must be in \[0, 2147483647\]"),
    Case("stage count float", "proc_count=5.0", lambda w: _stage(w, _with(w, 1, proc_count=5.0)), TypeError,
         r"streams\[1\].proc_count must be an int"),
    Case("stage NULL block table", "block_table_dev=0", lambda w: _stage(w, _with(w, 1, block_table_dev=0)), ValueError,
         r"streams\[1\].block_table_dev must be a non-NULL device pointer in \(0, 2\*\*64\)"),
    Case("stage pointer past 64 bits", "seq_len_dev=2**64", lambda w: _stage(w, _with(w, 2, seq_len_dev=1 << 64)),
         ValueError, r"streams\[2\].seq_len_dev must be a non-NULL device pointer in \(0, 2\*\*64\), got 0x1"
                     r"0000000000000000"),
    Case("stage short block table", "block_table[:1] for kv_len 105",
         lambda w: _stage(w, _with(w, 2, block_table=w.streams[2].block_table[:1])), ValueError,
         r"streams\[2\].block_table has 1 entries but kv_len 164 at block_size 16 needs 11"),
    Case("stage table over i32", "block_table entry 2**33",
         lambda w: _stage(w, _with(w, 1, block_table=np.full(4, 1 << 33))), ValueError, "entries outside int32"),
    Case("stage table uint64 wraps to -1", "block_table uint64 2**64 - 1",
         lambda w: _stage(w, _with(w, 1, block_table=np.full(4, (1 << 64) - 1, np.uint64))), ValueError,
         r"entries outside int32 \(min 18446744073709551615"),
    Case("stage table uint64 past i32", "block_table uint64 2**64 - 2**31",
         lambda w: _stage(w, _with(w, 1, block_table=np.full(4, (1 << 64) - (1 << 31), np.uint64))), ValueError,
         "entries outside int32"),
    Case("stage table uint32 past i32", "block_table uint32 2**31",
         lambda w: _stage(w, _with(w, 1, block_table=np.full(4, 1 << 31, np.uint32))), ValueError,
         r"entries outside int32 \(min 2147483648"),
    Case("stage mrope uint64 near 2**64", "mrope_positions uint64 2**64 - 1",
         lambda w: _stage(w, _with(w, 0, mrope_positions=np.full((3, 37), (1 << 64) - 1, np.uint64))), ValueError,
         r"mrope_positions must be in \[0, 4294967295\] \(u32\), got \[18446744073709551615"),
    Case("stage misaligned block table", "block_table_dev=ptr+2",
         lambda w: _stage(w, _with(w, 1, block_table_dev=w.streams[1].block_table_dev + 2)), ValueError,
         r"streams\[1\].block_table_dev must be 4-byte aligned"),
    Case("stage misaligned seq_len", "seq_len_dev=ptr+1",
         lambda w: _stage(w, _with(w, 2, seq_len_dev=w.streams[2].seq_len_dev + 1)), ValueError,
         r"streams\[2\].seq_len_dev must be 4-byte aligned"),
    Case("stage table float", "block_table float64",
         lambda w: _stage(w, _with(w, 1, block_table=np.zeros(4))), TypeError, "must be a 1-D integer array"),
    Case("stage mrope wrong shape", "mrope_positions (2, 37)",
         lambda w: _stage(w, _with(w, 0, mrope_positions=np.zeros((2, 37), np.int64))), ValueError,
         r"mrope_positions must be an integer array of shape \(3, 37\)"),
    Case("stage mrope transposed", "mrope_positions (37, 3)",
         lambda w: _stage(w, _with(w, 0, mrope_positions=np.zeros((37, 3), np.int64))), ValueError,
         r"shape \(3, 37\), got int64 \(37, 3\)"),
    Case("stage mrope u32 overflow", "mrope_positions 2**32",
         lambda w: _stage(w, _with(w, 0, mrope_positions=np.full((3, 37), 1 << 32))), ValueError,
         r"mrope_positions must be in \[0, 4294967295\]"),
    Case("stage mrope without flag", "mrope_positions with use_mrope=False",
         lambda w: _stage(w, use_mrope=False), ValueError, "mrope_positions given but use_mrope is False"),
    Case("stage block_size 24", "block_size=24", lambda w: _stage(w, block_size=24), ValueError,
         "block_size must be a power of two"),
    Case("stage dummy block negative", "dummy_kv_block=-1", lambda w: _stage(w, dummy_kv_block=-1), ValueError,
         r"dummy_kv_block must be in \[0, 2147483647\]"),
    Case("stage offset behind cursor", "scratch_offset_bytes=0", lambda w: _stage(w, scratch_offset_bytes=0),
         ValueError, "would overlap what is reserved up to the cursor"),
    Case("stage offset past capacity", "scratch_offset_bytes=capacity+8",
         lambda w: _stage(w, scratch_offset_bytes=w.arena.capacity + 8), ValueError,
         r"scratch_offset_bytes must be in \[0, \d+\]"),
    Case("stage scratch too small", "3 streams at capacity - 64",
         lambda w: _stage(w, scratch_offset_bytes=w.arena.capacity - 64), CapacityError,
         r"stacked_metadata needs [\d,]+ bytes but only [\d,]+ are available"),
    Case("stage stream index", "stage_stream_metadata(b=3)",
         lambda w: stage_stream_metadata(w.arena, w.plan, 3, w.streams[0], block_size=16, use_mrope=True,
                                         dummy_kv_block=0), IndexError, "stream index 3 out of range for a plan of 3"),
    Case("stage stream index str", "stage_stream_metadata(b='0')",
         lambda w: stage_stream_metadata(w.arena, w.plan, "0", w.streams[0], block_size=16, use_mrope=True,
                                         dummy_kv_block=0), TypeError, "b must be an int"),
    Case("stage stream plan type", "stage_stream_metadata(plan=None)",
         lambda w: stage_stream_metadata(w.arena, None, 0, w.streams[0], block_size=16, use_mrope=True,
                                         dummy_kv_block=0), TypeError, "plan must be a ScratchPlan"),
    Case("stage stream count mismatch", "stream 1 into block 0",
         lambda w: stage_stream_metadata(w.arena, w.plan, 0, w.streams[1], block_size=16, use_mrope=True,
                                         dummy_kv_block=0), ValueError, "plan was made for 37"),
    Case("stage stream seed stride", "300 MRoPE tokens into a seed block",
         lambda w: stage_stream_metadata(w.arena, make_scratch_plan([300], 0, True, "seed"), 0,
                                         _stream(w, 2, proc_count=300, proc_start=0, mrope_positions=None,
                                                 block_table=np.arange(1, 20, dtype=np.int32)),
                                         block_size=16, use_mrope=True, dummy_kv_block=0), CapacityError,
         r"stream_block\[0\] needs [\d,]+ bytes but only 4,864"),
    # --- the JIT slot ----------------------------------------------------------------------------
    Case("slot meta wrong type", "place_h_state_slot(arena, None)", lambda w: place_h_state_slot(w.arena, None),
         TypeError, "meta must be a BatchedAttnMetadata"),
    Case("slot misplaced", "staged_bytes - 64 (the #110 advance)", lambda w: place_h_state_slot(w.arena, _bad_meta(w)),
         ValueError, "scratch_offset_bytes \\+ staged_bytes"),
    Case("upload wrong count", "upload([p, p])", lambda w: w.q12.h_slot.upload(w.state_ptrs()[:2]), ValueError,
         "needs exactly 3 pointers"),
    Case("upload NULL", "upload([p, 0, p])", lambda w: w.q12.h_slot.upload([w.p("states"), 0, w.p("states")]),
         ValueError, r"state_ptrs\[1\] must be a non-NULL device pointer in \(0, 2\*\*64\)"),
    Case("upload past 64 bits", "upload([2**64, ...])",
         lambda w: w.q12.h_slot.upload([1 << 64] + w.state_ptrs()[1:]), ValueError,
         r"state_ptrs\[0\] must be a non-NULL device pointer in \(0, 2\*\*64\), got 0x10000000000000000"),
    Case("upload float", "upload([4096.0, ...])", lambda w: w.q12.h_slot.upload([4096.0] + w.state_ptrs()[1:]),
         TypeError, r"state_ptrs\[0\] must be a device pointer \(int\), got float"),
    Case("upload misaligned", "upload([p + 2, ...])",
         lambda w: w.q12.h_slot.upload([w.p("states") + 2] + w.state_ptrs()[1:]), ValueError,
         r"state_ptrs\[0\] must be 4-byte aligned"),
    Case("upload uint64 array past 64 bits", "upload(np.uint64 [2**64 - 1, ...])",
         lambda w: w.q12.h_slot.upload(np.array([(1 << 64) - 1] + w.state_ptrs()[1:], np.uint64)), ValueError,
         r"state_ptrs\[0\] must be 4-byte aligned"),
    Case("upload int64 array negative", "upload(np.int64 [-4096, ...])",
         lambda w: w.q12.h_slot.upload(np.array([-4096] + w.state_ptrs()[1:], np.int64)), ValueError,
         r"state_ptrs\[0\] must be a non-NULL device pointer in \(0, 2\*\*64\), got -4096"),
    Case("upload not a sequence", "upload(4096)", lambda w: w.q12.h_slot.upload(4096), TypeError,
         "state_ptrs must be a sequence"),
    # --- Q12Pass ---------------------------------------------------------------------------------
    Case("pass arena wrong type", "Q12Pass(arena=dev)", lambda w: Q12Pass(w.dev, w.streams, block_size=16,
                                                                         use_mrope=True, dummy_kv_block=0),
         TypeError, "arena must be a ScratchArena"),
    Case("pass mode", "mode='fast'", lambda w: _pass(w, mode="fast"), ValueError, "mode must be one of"),
    Case("pass expand", "expand='gpu'", lambda w: _pass(w, expand="gpu"), ValueError, "expand must be one of"),
    Case("pass expand device with vision", "expand='device', a stream with mrope_positions",
         lambda w: _pass(w, _with(w, 1, mrope_positions=np.zeros((3, w.streams[1].proc_count), np.int32)),
                         expand="device"),
         ValueError, r"expand='device' writes text positions only, but streams\[\d+\] carries mrope_positions"),
    Case("pass is_mla 'False'", "Q12Pass(is_mla='False')", lambda w: _pass(w, is_mla="False"), TypeError,
         "is_mla must be a bool"),
    Case("pass varlen 1", "Q12Pass(varlen=1)", lambda w: _pass(w, varlen=1), TypeError, "varlen must be a bool"),
    Case("pass allow_chunk_zero 'no'", "Q12Pass(allow_chunk_zero='no')", lambda w: _pass(w, allow_chunk_zero="no"),
         TypeError, "allow_chunk_zero must be a bool"),
    Case("pass empty", "streams=[]", lambda w: _pass(w, []), ValueError, "at least one stream"),
    Case("pass NULL table", "block_table_dev=0", lambda w: _pass(w, _with(w, 2, block_table_dev=0)), ValueError,
         r"streams\[2\].block_table_dev"),
    Case("pass table uint64 wraps to -1", "block_table uint64 2**64 - 1",
         lambda w: _pass(w, _with(w, 0, block_table=np.full(8, (1 << 64) - 1, np.uint64))), ValueError,
         r"streams\[0\].block_table has entries outside int32"),
    Case("pass misaligned block table", "block_table_dev=ptr+1",
         lambda w: _pass(w, _with(w, 0, block_table_dev=w.streams[0].block_table_dev + 1)), ValueError,
         r"streams\[0\].block_table_dev must be 4-byte aligned"),
    Case("pass short table", "block_table[:2]", lambda w: _pass(w, _with(w, 0, block_table=w.streams[0].block_table[:2])),
         ValueError, r"streams\[0\].block_table has 2 entries but kv_len 53"),
    Case("pass chunks length", "chunks for 2 of 3 streams", lambda w: _pass(w, chunks=[(37, 37, 16, False)] * 2),
         ValueError, "chunks has 2 entries but there are 3 streams"),
    Case("pass chunks eff_len", "chunks eff_len != proc_count",
         lambda w: _pass(w, chunks=[(40, 36, 0, False), (5, 5, 0, False), (64, 64, 0, False)]), ValueError,
         r"chunks\[0\] has eff_len 36 but streams\[0\].proc_count is 37"),
    Case("pass batched refused", "mode='batched', policy='seed', streams at different starts",
         lambda w: _pass(w, mode="batched", policy="seed"), ValueError, "mode='batched' but the batch was refused"),
    Case("pass scratch too small", "per-stream blocks past the arena",
         lambda w: _pass(w, _with(w, 2, proc_count=2000, proc_start=0,
                                  block_table=np.arange(125, dtype=np.int32))),
         CapacityError, "per-stream metadata blocks needs"),
    Case("pass chunks above the arena", "mode='batched', arena_tokens=50 for 106 tokens",
         lambda w: _pass(w, chunks=[(s.proc_start + s.proc_count, s.proc_count, 0, False) for s in w.streams],
                         arena_tokens=50, mode="batched"), ValueError,
         "refused \\(arena\\): 106 packed tokens exceed the activation arena of 50 rows"),
    Case("pass block_size 0", "block_size=0", lambda w: _pass(w, block_size=0), ValueError,
         r"block_size must be in \[1, "),
    Case("attention NULL q", "q=0", lambda w: _attn(w, q=0), ValueError, "q must be a non-NULL device pointer"),
    Case("attention misaligned q", "q=ptr+2", lambda w: _attn(w, q=w.p("q") + 2), ValueError,
         "q must be 16-byte aligned"),
    Case("attention misaligned o", "o=ptr+8", lambda w: _attn(w, o=w.p("o") + 8), ValueError, "o must be 16-byte aligned"),
    Case("attention odd k", "k=ptr+1", lambda w: _attn(w, k=w.p("k") + 1), ValueError, "k must be 2-byte aligned"),
    Case("attention pointer None", "v=None", lambda w: _attn(w, v=None), TypeError, "v must be a device pointer"),
    Case("attention head_dim 96", "head_dim=96", lambda w: _attn(w, dataclasses.replace(ATTN, head_dim=96)),
         ValueError, "no attention kernel for head_dim=96"),
    Case("attention GQA", "Hq=3, Hkv=2", lambda w: _attn(w, dataclasses.replace(ATTN, num_q_heads=3)), ValueError,
         "num_q_heads 3 must be a multiple of shape.num_kv_heads 2"),
    Case("attention odd rotary", "rotary_dim=31", lambda w: _attn(w, dataclasses.replace(ATTN, rotary_dim=31)),
         ValueError, "rotary_dim must be even"),
    Case("attention mrope section shape", "mrope_section=(6, 5)",
         lambda w: _attn(w, dataclasses.replace(ATTN, mrope_section=(6, 5))), ValueError,
         r"mrope_section must be 3 ints"),
    Case("attention mrope section sum", "mrope_section=(6, 5, 6)",
         lambda w: _attn(w, dataclasses.replace(ATTN, mrope_section=(6, 5, 6))), ValueError,
         "must be 3 non-negative ints summing to 16"),
    Case("attention theta nan", "rope_theta=nan", lambda w: _attn(w, dataclasses.replace(ATTN, rope_theta=float("nan"))),
         ValueError, "shape.rope_theta must be a positive finite number"),
    Case("attention num_blocks 0", "num_blocks=0", lambda w: _attn(w, num_blocks=0), ValueError,
         r"num_blocks must be in \[1, "),
    Case("attention table past pools", "num_blocks = max id", lambda w: _attn(w, num_blocks=w.num_blocks - 1),
         ValueError, "past the pools' num_blocks"),
    Case("attention num_blocks overflow", "num_blocks=2**31", lambda w: _attn(w, num_blocks=1 << 31), ValueError,
         r"num_blocks must be in \[1, 134217727\]"),
    Case("attention shape type", "shape=GdnShape", lambda w: _attn(w, GDN), TypeError, "shape must be an AttentionShape"),
    Case("attention sliding_window 0", "sliding_window=0", lambda w: _attn(w, dataclasses.replace(ATTN, sliding_window=0)),
         ValueError, r"shape.sliding_window must be None \(full causal attention\) or the number of keys"),
    Case("attention sliding_window -1", "sliding_window=-1",
         lambda w: _attn(w, dataclasses.replace(ATTN, sliding_window=-1)), ValueError,
         r"shape.sliding_window must be None \(full causal attention\)"),
    Case("gdn state count", "2 state pointers for 3 streams", lambda w: _gdn(w, state_ptrs=[w.p("states")] * 2),
         ValueError, "state_ptrs needs exactly 3 pointers"),
    Case("gdn state misaligned", "state_ptrs[1]+2", lambda w: _gdn(w, state_ptrs=[w.p("states"), w.p("states") + 2,
                                                                                  w.p("states")]),
         ValueError, r"state_ptrs\[1\] must be 4-byte aligned"),
    Case("gdn state NULL", "state_ptrs[2]=0", lambda w: _gdn(w, state_ptrs=w.state_ptrs()[:2] + [0]), ValueError,
         r"state_ptrs\[2\] must be a non-NULL"),
    Case("stage_states empty", "stage_states([])", lambda w: w.q12.stage_states([]), TypeError,
         "rows must be a non-empty sequence"),
    Case("stage_states short row", "a row of 2 pointers for 3 streams",
         lambda w: w.q12.stage_states([w.state_ptrs(), w.state_ptrs()[:2]]), ValueError,
         r"rows\[1\] needs exactly 3 pointers"),
    Case("stage_states NULL", "rows[0][2]=0", lambda w: w.q12.stage_states([w.state_ptrs()[:2] + [0]]), ValueError,
         r"rows\[0\]\[2\] must be a non-NULL"),
    Case("stage_states past the arena", "100000 tables", lambda w: w.q12.stage_states([w.state_ptrs()] * 100000),
         CapacityError, r"state_tables needs .* state_rows=100000"),
    Case("max_arena_bytes no streams", "Q12Pass.max_arena_bytes(0, 16)", lambda w: Q12Pass.max_arena_bytes(0, 16),
         ValueError, "max_streams"),
    Case("max_arena_bytes policy", "policy='guess'", lambda w: Q12Pass.max_arena_bytes(2, 16, policy="guess"),
         ValueError, "policy must be one of"),
    Case("gdn misaligned q", "q=ptr+8", lambda w: _gdn(w, q=w.p("gq") + 8), ValueError, "q must be 16-byte aligned"),
    Case("gdn misaligned g", "g=ptr+2", lambda w: _gdn(w, g=w.p("g") + 2), ValueError, "g must be 4-byte aligned"),
    Case("gdn shape None", "shape=None", lambda w: _gdn(w, None), TypeError, "shape must be a GdnShape, got NoneType"),
    Case("gdn shape None overlapped", "shape=None, GdnConfig(schedule='overlapped')",
         lambda w: _gdn(w, None, config=GdnConfig(schedule="overlapped")), TypeError, "shape must be a GdnShape"),
    Case("gdn config type", "config='wy'", lambda w: _gdn(w, config="wy"), TypeError,
         "expected a GdnConfig or a GdnPlan, got str"),
    Case("gdn config value", "GdnConfig(schedule='flow')", lambda w: _gdn(w, config=GdnConfig(schedule="flow")),
         ValueError, "GdnConfig.schedule must be one of 'auto', 'fused', 'two_pass', 'overlapped', got 'flow'"),
    Case("gdn no kernel", "GdnConfig(schedule='overlapped', isa='mma')",
         lambda w: _gdn(w, config=GdnConfig(schedule="overlapped", isa="mma")), ValueError,
         "has no kernel .* the paths with kernels: chunked fused on mma, chunked two_pass on mma"),
    Case("gdn default without workspace", "GdnConfig(), no workspace", lambda w: _gdn(w, config=GdnConfig()),
         ValueError, r"needs workspace= .* of [\d,]+ bytes .*GdnConfig\(schedule='fused'\) runs without one"),
    Case("gdn tensors type", "tensors=(q, k, v, g, beta, o)", lambda w: _gdn(w, tensors=tuple(range(1, 7))),
         TypeError, "tensors must be a GdnTensors"),
    Case("gdn head_dim 96", "head_dim=96", lambda w: _gdn(w, GdnShape(2, 4, 96)), ValueError,
         "the GDN kernels have head_dim 64 and 128, not 96"),
    Case("gdn heads", "Hk=3, Hv=4", lambda w: _gdn(w, GdnShape(3, 4, 64)), ValueError,
         "num_v_heads 4 must be a multiple of shape.num_k_heads 3"),
    Case("gdn heads zero", "Hk=0", lambda w: _gdn(w, GdnShape(0, 4, 64)), ValueError,
         r"shape.num_k_heads must be in \[1, "),
    # --- launchers (q12drv.kernels.ops) ----------------------------------------------------------
    Case("kv_write device type", "device='emu'", lambda w: _op_kv_write(w, device="emu"), TypeError,
         "device must be a q12drv Device"),
    Case("kv_write meta type", "meta=None", lambda w: _op_kv_write(w, meta=None), TypeError,
         "meta must be a BatchedAttnMetadata"),
    Case("kv_write stale meta", "meta staged before arena.reset()",
         lambda w: _op_kv_write(w, meta=_stale_meta(w)), Q12Error, "this metadata is stale"),
    Case("rope stale meta", "meta staged before arena.reset()", lambda w: _op_rope(w, meta=_stale_meta(w)), Q12Error,
         "this metadata is stale"),
    Case("attention stale meta", "meta staged before arena.reset()",
         lambda w: _op_attention(w, meta=_stale_meta(w)), Q12Error, "this metadata is stale"),
    Case("gdn stale meta", "meta staged before arena.reset()", lambda w: _op_gdn(w, meta=_stale_meta(w)), Q12Error,
         "this metadata is stale"),
    Case("kv_write meta of a closed arena", "meta of a closed arena",
         lambda w: _op_kv_write(w, meta=_closed_meta(w)), Q12Error, "ScratchArena is closed"),
    Case("gdn meta of a closed arena", "meta of a closed arena", lambda w: _op_gdn(w, meta=_closed_meta(w)),
         Q12Error, "ScratchArena is closed"),
    Case("kv_write NULL k_pool", "k_pool=0", lambda w: _op_kv_write(w, k_pool=0), ValueError,
         "k_pool must be a non-NULL device pointer"),
    Case("kv_write num_blocks negative", "num_blocks=-1", lambda w: _op_kv_write(w, num_blocks=-1), ValueError,
         r"num_blocks must be in \[1, "),
    Case("kv_write head_dim float", "head_dim=64.0", lambda w: _op_kv_write(w, head_dim=64.0), TypeError,
         "head_dim must be an int"),
    Case("kv_write row not x8", "Hkv*D = 6", lambda w: _op_kv_write(w, num_kv_heads=2, head_dim=3), ValueError,
         "must be a multiple of 8"),
    Case("kv_write row overflow", "Hkv*D = 2**31", lambda w: _op_kv_write(w, num_kv_heads=1 << 16, head_dim=1 << 15),
         ValueError, "fit an int32"),
    Case("rope heads numpy", "num_q_heads=np.int64(2**40)",
         lambda w: _op_rope(w, num_q_heads=np.int64(1 << 40)), ValueError, "num_q_heads"),
    Case("gdn op heads float", "num_v_heads=4.0", lambda w: _op_gdn(w, shape=GdnShape(2, 4.0, 64)), TypeError,
         "shape.num_v_heads must be an int"),
    Case("rope theta zero", "theta=0", lambda w: _op_rope(w, theta=0.0), ValueError, "theta must be a positive finite"),
    Case("rope pointer float", "q=float", lambda w: _op_rope(w, q=float(w.p("q"))), TypeError,
         "q must be a device pointer"),
    Case("rope mrope sections", "sections=(6, 5)", lambda w: _op_rope(w, sections=(6, 5)), ValueError,
         "MRoPE sections"),
    Case("rope heads overflow", "num_q_heads=2**31", lambda w: _op_rope(w, num_q_heads=1 << 31), (OverflowError, ValueError),
         "num_q_heads"),
    Case("attention op scale", "scale=-1", lambda w: _op_attention(w, scale=-1.0), ValueError,
         "scale must be a positive finite number"),
    Case("attention op window -2", "window_left=-2", lambda w: _op_attention(w, window_left=-2), ValueError,
         r"window_left must be in \[-1, 2147483647\]"),
    Case("attention op window float", "window_left=4095.0", lambda w: _op_attention(w, window_left=4095.0), TypeError,
         "window_left must be an int"),
    Case("attention op misaligned pool", "v_pool=ptr+2", lambda w: _op_attention(w, v_pool=w.p("v_pool") + 2),
         ValueError, "v_pool must be 16-byte aligned"),
    Case("attention op pointer past 64 bits", "o=2**64", lambda w: _op_attention(w, o=1 << 64), ValueError,
         r"o must be a non-NULL device pointer in \(0, 2\*\*64\)"),
    Case("attention op decode, a long stream", "algo='decode' (streams of 37, 5, 64 tokens)",
         lambda w: _op_attention(w, algo="decode"), ValueError,
         r"at most 8 new tokens; this pass's longest stream has 64 \(streams\[2\]\)"),
    Case("pass attention decode, a long stream", "Q12Pass.attention(algo='decode')",
         lambda w: w.q12.attention(w.p("q"), w.p("k_pool"), w.p("v_pool"), w.p("o"), ATTN, num_blocks=w.num_blocks,
                                   algo="decode", num_splits=1), ValueError, "at most 8 new tokens"),
    Case("pass attention FP8 without scales", "Q12Pass.attention(algo='decode'), kv_dtype='fp8_e4m3', no k_scale",
         lambda w: w.q12.attention(w.p("q"), w.p("k_pool"), w.p("v_pool"), w.p("o"), ATTN_FP8,
                                   num_blocks=w.num_blocks, algo="decode", num_splits=1, v_scale=w.p("o")),
         ValueError, "shape.kv_dtype='fp8_e4m3' needs k_scale and v_scale"),
    Case("pass attention FP8 on a prefill kernel", "Q12Pass.attention(algo='auto'), kv_dtype='fp8_e4m3'",
         lambda w: w.q12.attention(w.p("q"), w.p("k_pool"), w.p("v_pool"), w.p("o"), ATTN_FP8,
                                   num_blocks=w.num_blocks, k_scale=w.p("o"), v_scale=w.p("o")),
         ValueError, "algo='auto' runs a prefill kernel, which reads bf16 pools; FP8 pools are read by algo='decode'"),
    Case("attention op FP8 on mma", "algo='mma', kv_dtype='fp8_e4m3'",
         lambda w: _op_attention(w, algo="mma", kv_dtype="fp8_e4m3", k_scale=w.p("o"), v_scale=w.p("o")), ValueError,
         "algo='mma' runs a prefill kernel, which reads bf16 pools; algo='decode' reads FP8 pools"),
    Case("attention op scales for bf16 pools", "algo='decode', k_scale= and v_scale= with kv_dtype='bf16'",
         lambda w: _op_attention(w, algo="decode", k_scale=w.p("o"), v_scale=w.p("o")), ValueError,
         "k_scale / v_scale given for bf16 pools: scales are for kv_dtype='fp8_e4m3'"),
    Case("gdn op misaligned h_state_ptrs", "h_state_ptrs=ptr+4",
         lambda w: _op_gdn(w, h_state_ptrs=int(w.q12.h_slot.ptr) + 4), ValueError, "h_state_ptrs must be 8-byte aligned"),
    Case("gdn op config", "plan_or_config='fast'", lambda w: _op_gdn(w, plan_or_config="fast"), TypeError,
         "expected a GdnConfig or a GdnPlan"),
    Case("gdn op head_dim 256", "head_dim=256", lambda w: _op_gdn(w, shape=GdnShape(2, 4, 256)), ValueError,
         "the GDN kernels have head_dim 64 and 128"),
    Case("gdn op two_pass no workspace", "GdnConfig(schedule='two_pass')",
         lambda w: _op_gdn(w, plan_or_config=GdnConfig(schedule="two_pass")), ValueError,
         r"schedule 'two_pass' on wgmma\) needs workspace= .* of [\d,]+ bytes"),
    Case("gdn op workspace short", "two_pass, workspace_bytes=16",
         lambda w: _op_gdn(w, plan_or_config=GdnConfig(schedule="two_pass"), workspace=w.p("go"), workspace_bytes=16),
         ValueError, r"workspace_bytes 16 is too small: the GDN plan \(schedule 'two_pass' on wgmma\) needs [\d,]+ bytes"),
    # the two-pass schedule's size is not enough for the overlapped schedule's records (3 streams of 64 tokens,
    # 4 value heads, d 64)
    Case("gdn op overlapped workspace short", "overlapped, the two-pass schedule's workspace",
         lambda w: _op_gdn(w, plan_or_config=GdnConfig(schedule="overlapped"), workspace=w.p("go"),
                           workspace_bytes=chunked_mma.t_workspace_bytes(3, 64, 2, 4)), ValueError,
         r"workspace_bytes 209,088 is too small: the GDN plan \(schedule 'overlapped' on wgmma\) needs 497,920 bytes"),
    Case("gdn op recurrent two_pass", "GdnConfig(math='recurrent', schedule='two_pass')",
         lambda w: _op_gdn(w, plan_or_config=GdnConfig(math="recurrent", schedule="two_pass")), ValueError,
         "math='recurrent' is one launch on fp32 CUDA cores"),
    Case("gdn op plan too small", "a plan for 1 stream of 64 tokens on 3 streams",
         lambda w: _op_gdn(w, plan_or_config=plan_gdn(FUSED, GDN, 1, 64, w.dev)), ValueError,
         r"the plan covers 1 stream\(s\) of at most 64 tokens, this launch has 3"),
    Case("gdn op plan of another shape", "a plan for GdnShape(2, 4, 128)",
         lambda w: _op_gdn(w, plan_or_config=plan_gdn(FUSED, GdnShape(2, 4, 128), 3, 64, w.dev)), ValueError,
         "the plan was made for GdnShape"),
]


@pytest.fixture(scope="module")
def world():
    dev = open_device("emu")
    w = World.build(dev)
    yield w
    w.close()
    dev.close()
    assert dev.driver.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(world, case):
    before = snapshot(world.dev, world.arena)
    with pytest.raises(case.exc) as info:
        case.call(world)
    assert re.search(case.match, str(info.value)), f"message {str(info.value)!r} lacks {case.match!r}"
    assert_same(before, snapshot(world.dev, world.arena))


def test_the_world_still_works_after_every_bad_input(world):
    # After all the refused calls: a fresh pass stages, verifies and runs its layers.
    from q12drv.core.staging import verify_readback

    q12 = world.new_pass()
    meta = q12.meta
    assert verify_readback(world.arena.read(meta.scratch_offset_bytes, meta.staged_bytes), meta, world.streams) == []
    world.upload_inputs()
    world.run_layers(q12)
    out = world.outputs()
    assert not np.any(np.frombuffer(out["o"], np.uint16) == 0xFFFF)
    assert world.arena.guard_intact()
    world.arena.check_consistent()


def test_snapshot_sees_a_one_byte_change(world):
    # The comparison the matrix relies on must notice a change anywhere it looks.
    before = snapshot(world.dev, world.arena)
    p = world.p("o") + 3
    old = world.dev.download(p, 1)
    world.dev.upload(p, np.frombuffer(bytes([old[0] ^ 1]), np.uint8))
    with pytest.raises(AssertionError, match="world o"):
        assert_same(before, snapshot(world.dev, world.arena))
    world.dev.upload(p, np.frombuffer(old, np.uint8))
    ring = world.arena.find_attachment("ring:h_state")
    ring.slots[0].array[0] ^= 1
    with pytest.raises(AssertionError, match="rings"):
        assert_same(before, snapshot(world.dev, world.arena))
    ring.slots[0].array[0] ^= 1
    assert_same(before, snapshot(world.dev, world.arena))


def test_every_public_function_is_in_the_matrix():
    # q12drv.__all__'s callables and the launchers: each appears in at least one case's input or call.
    text = " ".join(c.input + " " + c.id for c in CASES) + " " + Path(__file__).read_text()
    callables = [n for n in q12drv.__all__ if callable(getattr(q12drv, n)) and not isinstance(getattr(q12drv, n), type)
                 or n in ("ScratchArena", "Device", "DeviceArray", "DevicePtr", "StreamStageInfo", "HStateSlot")]
    callables += ["kv_write", "rope", "attention", "gdn", "Q12Pass", "attention_layer", "gdn_layer", "upload"]
    missing = [n for n in callables if n not in text]
    assert not missing, f"no bad-input case for {missing}"


# --- the command line -------------------------------------------------------------------------

CLI_CASES = [
    ("demo bad seed", ["demo", "--seed", "x"], 2, "invalid int value"),
    ("demo bad driver", ["demo", "--driver", "gpu"], 2, "invalid choice"),
    ("doctor bad driver", ["doctor", "--driver", "tpu"], 2, "invalid choice"),
    ("doctor bad arch", ["doctor", "--driver", "emu", "--arch", "sm_xx"], 1, "invalid value for --gpu-architecture"),
    ("demo unwritable dump", ["demo", "--driver", "emu", "--no-kernels", "--dump", "{tmp}/no/such/dir/d.npz"], 2,
     "cannot write the dump"),
    ("demo dump is a directory", ["demo", "--driver", "emu", "--no-kernels", "--dump", "{tmp}"], 2,
     "it is a directory"),
    ("inspect missing file", ["inspect", "{tmp}/missing.npz"], 2, "no such file"),
    ("inspect directory", ["inspect", "{tmp}"], 2, "is a directory"),
    ("inspect num-blocks 0", ["inspect", "--num-blocks", "0", "{dump}"], 2, "must be >= 1"),
    ("inspect num-blocks text", ["inspect", "--num-blocks", "many", "{dump}"], 2, "invalid"),
    ("inspect not a dump", ["inspect", "{tmp}/text.npz"], 2, "not an .npz (zip) archive"),
    ("diff one argument", ["diff", "{dump}"], 2, "required: B"),
    ("diff missing second", ["diff", "{dump}", "{tmp}/missing.npz"], 2, "no such file"),
    ("render no output", ["render", "{dump}"], 2, "required: -o/--output"),
    ("render dpi negative", ["render", "{dump}", "-o", "{tmp}/x.png", "--dpi", "-3"], 2, "must be >= 1"),
    ("render unwritable output", ["render", "{dump}", "-o", "{tmp}/no/such/dir/x.png"], 2, "cannot write"),
    ("sass unknown source", ["sass", "nope.cu"], 2, "unknown source 'nope.cu'; cuda_src/ has attention/decode.cu, attention/mma.cu"),
    ("sass unknown entry", ["sass", "kv_write.cu", "q12_nope"], 2, "has no entry q12_nope; its entries: q12_kv_write"),
    ("unknown command", ["explode"], 2, "invalid choice"),
    ("inspect named pipe", ["inspect", "{fifo}"], 2, "is a named pipe (FIFO), not a dump file"),
    ("inspect symlink to a pipe", ["inspect", "{fifo_link}"], 2, "is a named pipe (FIFO), not a dump file"),
    ("diff named pipe", ["diff", "{dump}", "{fifo}"], 2, "is a named pipe (FIFO)"),
    ("render named pipe", ["render", "{fifo}", "-o", "{tmp}/p.png"], 2, "is a named pipe (FIFO)"),
    ("render into a pipe", ["render", "{dump}", "-o", "{fifo}"], 2, "it exists and is not a regular file"),
    ("render over its input", ["render", "{dump}", "-o", "{dump}"], 2, "it is the dump being read"),
    ("render over its input by a link", ["render", "{dump}", "-o", "{dump_link}"], 2, "it is the dump being read"),
    ("inspect a device", ["inspect", "/dev/null"], 2, "is a device, not a dump file"),
    ("inspect member header without .npy", ["inspect", "{misnamed}"], 2, "member 'header' must be named 'header.npy'"),
    ("inspect past max-bytes", ["inspect", "--max-bytes", "4096", "{dump}"], 2, "raise the limit with --max-bytes"),
    ("diff past max-bytes", ["diff", "--max-bytes", "4096", "{dump}", "{dump}"], 2, "raise the limit with --max-bytes"),
    ("inspect max-bytes 0", ["inspect", "--max-bytes", "0", "{dump}"], 2, "must be >= 1"),
    ("demo unknown Q12DRV_DRIVER", ["Q12DRV_DRIVER=gpu", "demo", "--no-kernels"], 2,
     "driver must be one of auto, cuda, emu (argument or Q12DRV_DRIVER), got 'gpu'"),
    ("demo --driver auto, unknown Q12DRV_DRIVER", ["Q12DRV_DRIVER=tpu", "demo", "--driver", "auto", "--no-kernels"], 2,
     "got 'tpu'"),
]


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    import os
    import zipfile

    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "text.npz").write_text("hello, not a zip")
    dump = tmp / "pass.npz"
    assert cli_main(["demo", "--driver", "emu", "--no-kernels", "--dump", str(dump)]) == 0
    os.mkfifo(tmp / "fifo.npz")  # opening it for reading would wait for a writer forever
    (tmp / "fifo_link.npz").symlink_to(tmp / "fifo.npz")
    (tmp / "dump_link.npz").symlink_to(dump)
    with zipfile.ZipFile(dump) as src, zipfile.ZipFile(tmp / "misnamed.npz", "w") as dst:
        for info in src.infolist():
            dst.writestr("header" if info.filename == "header.npy" else info.filename, src.read(info))
    return {"tmp": str(tmp), "dump": str(dump), "fifo": str(tmp / "fifo.npz"), "fifo_link": str(tmp / "fifo_link.npz"),
            "dump_link": str(tmp / "dump_link.npz"), "misnamed": str(tmp / "misnamed.npz")}


def _env_and_argv(argv: list) -> tuple:
    """Leading ``NAME=VALUE`` items of a CLI case are its environment."""
    env = {}
    while argv and "=" in argv[0] and argv[0].split("=")[0].isupper():
        name, value = argv[0].split("=", 1)
        env[name] = value
        argv = argv[1:]
    return env, argv


@pytest.mark.parametrize("argv,status,fragment", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(cli_files, capsys, monkeypatch, argv, status, fragment):
    import os
    import threading

    env, argv = _env_and_argv([a.format(**cli_files) for a in argv])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = os.path.getsize(cli_files["dump"])
    outcome = {}

    def run():
        try:
            outcome["rc"] = cli_main(argv)
        except SystemExit as exc:  # argparse
            outcome["rc"] = exc.code

    worker = threading.Thread(target=run, daemon=True)  # a hang (a reader waiting on a pipe) fails, not blocks
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), f"q12drv {' '.join(argv)} still running after 60 s"
    captured = capsys.readouterr()
    err = captured.err + captured.out
    assert outcome["rc"] == status, err
    assert fragment in err, err
    assert "Traceback" not in err
    if status == 2 and "usage:" not in err:
        assert captured.err.count("\n") == 1, captured.err  # one line
    assert os.path.getsize(cli_files["dump"]) == before  # the dump read is never overwritten


# --- tests/README.md carries this matrix ------------------------------------------------------

def _exc_name(exc) -> str:
    return " or ".join(e.__name__ for e in exc) if isinstance(exc, tuple) else exc.__name__


def readme_table() -> str:
    """The bad-input table of tests/README.md, generated from CASES and CLI_CASES."""
    rows = ["| case | input | error | message contains | test |", "|---|---|---|---|---|"]
    for c in CASES:
        frag = re.sub(r"\[\\d,\]\+|\\d\+", "N", c.match).replace(".*", "...").replace("\\", "")
        rows.append(f"| {c.id} | `{c.input}` | `{_exc_name(c.exc)}` | `{frag}` | `test_bad_input[{c.id}]` |")
    for cid, argv, status, frag in CLI_CASES:
        env, argv = _env_and_argv(list(argv))
        prefix = "".join(f"{k}={v} " for k, v in env.items())
        rows.append(f"| {cid} | `{prefix}q12drv {' '.join(argv)}` | exit {status} | `{frag}` | "
                    f"`test_cli_bad_input[{cid}]` |")
    return "\n".join(rows)


def test_readme_table_is_current():
    text = (Path(__file__).parent / "README.md").read_text()
    start = text.index("<!-- bad-input table: generated -->")
    end = text.index("<!-- end of bad-input table -->")
    assert text[start:end].split("\n", 1)[1].strip() == readme_table(), (
        "tests/README.md's bad-input table is stale: regenerate it with "
        "python -c 'from tests.test_reliability_inputs import readme_table; print(readme_table())'")


# --- stale handles: a pass or a JIT slot from before the arena was reset or closed -----------------

def test_a_stale_pass_and_its_slot_refuse_to_write():
    from q12drv import Q12Error

    with open_device("emu") as dev:
        w = World.build(dev)
        old = w.q12
        new = w.new_pass()
        before = snapshot(dev, w.arena)
        with pytest.raises(Q12Error, match="belongs to an earlier pass"):
            old.h_slot.upload(w.state_ptrs())
        with pytest.raises(Q12Error, match="this Q12Pass is stale"):
            w.run_layers(old)
        assert_same(before, snapshot(dev, w.arena))
        w.run_layers(new)  # the current pass works
        slot = new.h_slot
        w.close()
        with pytest.raises(Q12Error, match="closed"):
            slot.upload(w.state_ptrs())
        with pytest.raises(Q12Error, match="closed"):
            w.run_layers(new)


def test_launchers_refuse_stale_and_closed_metadata():
    # ops.* take metadata from the caller: after arena.reset() its offsets may hold another pass's
    # bytes, after close() they are freed. Every launcher refuses it before enqueuing anything.
    with open_device("emu") as dev:
        w = World.build(dev)
        old = w.q12.meta
        _op_kv_write(w)  # current: fine
        w.new_pass()  # resets the arena and stages again at the same offsets
        before = snapshot(dev, w.arena)
        for op in (_op_kv_write, _op_rope, _op_attention, _op_gdn):
            with pytest.raises(Q12Error, match="this metadata is stale"):
                op(w, meta=old)
        assert_same(before, snapshot(dev, w.arena))
        w.close()
        for op in (_op_kv_write, _op_rope, _op_attention, _op_gdn):
            with pytest.raises(Q12Error, match="ScratchArena is closed"):
                op(w, meta=old)


def test_handmade_metadata_without_an_arena_is_not_refused():
    # A BatchedAttnMetadata built by hand (no arena) cannot be checked for staleness: launchers take it, and it
    # writes what the stager's metadata writes.
    with open_device("emu") as dev:
        pools = []
        for handmade in (False, True):
            w = World.build(dev, run_layers=False)
            meta = dataclasses.replace(w.q12.meta, arena=None, generation=None) if handmade else w.q12.meta
            before = w.outputs()["k_pool"]
            _op_kv_write(w, meta=meta)
            pools.append(w.outputs()["k_pool"])
            w.close()
    assert pools[0] != before and pools[1] == pools[0]


def test_an_arena_is_closed_with_its_device():
    # Device.close() frees every allocation, the arena's included: the arena then says it is closed and
    # refuses to hand out addresses in the freed memory; closing it afterwards is harmless.
    dev = open_device("emu")
    arena = ScratchArena(dev, 4096)
    arena.reserve("x", 64)
    assert not arena.closed
    dev.close()
    assert arena.closed and "closed" in repr(arena)
    for call in (lambda: arena.view(0, np.uint8, 1), lambda: arena.ptr(0), lambda: arena.read(0, 8),
                 lambda: arena.reserve("y", 8), arena.guard_intact):
        with pytest.raises(q12drv.Q12Error, match="this ScratchArena is closed"):
            call()
    arena.close()
    assert dev.driver.live_allocations() == {"device": 0, "pinned": 0, "modules": 0}


def test_the_emulator_runs_out_of_memory_as_a_gpu_does():
    # An allocation past what the emulated device holds fails with the real driver's error, before any host
    # memory is taken; what fits still allocates, and freeing gives the room back.
    from q12drv.core.driver import EmuDriver

    drv = EmuDriver()
    drv.memory.limit = 1 << 20
    with q12drv.Device(drv) as dev:
        a = dev.alloc(600 << 10)
        with pytest.raises(CudaError) as info:
            dev.alloc(600 << 10)
        assert (info.value.name, info.value.call) == ("CUDA_ERROR_OUT_OF_MEMORY", "cuMemAlloc")
        with pytest.raises(CudaError, match="cuMemHostAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
            dev.pinned(2 << 20)
        assert dev.driver.live_allocations()["device"] == 1
        a.free()
        dev.alloc(600 << 10).free()


def test_extreme_but_valid_numbers_stage_exactly():
    # The largest values the bounds admit stage without wrapping: kv_len = 2**31 - 1 (i32), positions
    # near 2**31 and MRoPE positions at 2**32 - 1 (u32), block ids 2**31 - 1 with 2**20-token blocks
    # (i64 slots near 2**51), pointers at 2**64 - 8.
    from q12drv.core.staging import verify_readback

    bs = 1 << 20
    kv_len = (1 << 31) - 1
    count = 10
    table = np.full(-(-kv_len // bs), (1 << 31) - 1, np.int64)
    table[:-1] = np.arange(table.size - 1)
    mp = np.stack([np.full(count, (1 << 32) - 1), np.arange(count), np.full(count, (1 << 31))]).astype(np.uint64)
    streams = [StreamStageInfo(kv_len - count, count, table, (1 << 64) - 8, (1 << 64) - 16, mp),
               StreamStageInfo(0, 1, np.zeros(1, np.int32), 8, 16)]
    with open_device("emu") as dev, ScratchArena(dev, 1 << 12) as arena:
        meta = stage_batched_attn_metadata(arena, streams, block_size=bs, use_mrope=True, scratch_offset_bytes=0,
                                           dummy_kv_block=(1 << 31) - 1)
        raw = arena.read(0, meta.staged_bytes)
        assert verify_readback(raw, meta, streams) == []
        slots = np.frombuffer(raw[meta.layout.field("slot_stacked").offset:][:8 * 11], np.int64)
        assert slots[count - 1] == ((1 << 31) - 1) * bs + (kv_len - 1) % bs
        assert list(meta.kv_lens_host) == [kv_len, 1]


def test_a_checked_shape_does_not_let_a_lookalike_through():
    # The per-pass memo of validated shapes must not accept an equal-looking float variant.
    with open_device("emu") as dev:
        w = World.build(dev)
        w.run_layers()  # ATTN and GDN are now validated for this pass
        before = snapshot(dev, w.arena)
        with pytest.raises(TypeError, match="num_blocks must be an int"):
            _attn(w, num_blocks=float(w.num_blocks))
        with pytest.raises(TypeError, match="shape.num_k_heads must be an int"):
            _gdn(w, GdnShape(2.0, 4, 64))
        assert_same(before, snapshot(dev, w.arena))
        w.close()
