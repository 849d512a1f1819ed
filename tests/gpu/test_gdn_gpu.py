"""GPU tests of the Gated DeltaNet kernels (H200): each plan's launches (q12drv.kernels.gdn.plan_gdn) made through
cuda.bindings directly, so that the records and flags in the workspace can be read back.

torch is used only to allocate device memory and copy bytes through raw pointers. Every run draws
fresh random inputs; outputs are poisoned (0xFFFF bf16 NaN) before a launch and every written
buffer (o and each stream's state) has guard bytes on both sides, checked afterwards.

Run ``python tests/gpu/test_gdn_gpu.py`` for a rough timing print (not a test).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels.gdn import GdnConfig, GdnShape, chunked_mma, chunked_wgmma, plan_gdn
from q12drv.kernels.gdn import recurrent as gdn
from q12drv.kernels.gdn.reference import reference
from q12drv.kernels.meta import Q12MetaC
from q12drv.kernels.registry import compile_defines
from tests.gpu.raw_harness import check
from tests.helpers import rel_err, shuffled_tables

pytestmark = pytest.mark.gpu

RAGGED = [1, 15, 16, 17, 63, 64, 65]
GUARD = 256  # bytes each side; keeps the payload 256-byte aligned
BLOCK_SIZE = 16


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


class Guarded:
    """A device buffer with guard bytes on both sides of its payload."""

    def __init__(self, torch, nbytes, fill=0xFF):
        self.torch = torch
        self.nbytes = int(nbytes)
        self.buf = torch.full((self.nbytes + 2 * GUARD,), fill, dtype=torch.uint8, device="cuda")
        self.buf[:GUARD] = 0xA5
        self.buf[GUARD + self.nbytes :] = 0x5A
        self.ptr = self.buf.data_ptr() + GUARD

    @classmethod
    def of(cls, torch, arr):
        arr = np.ascontiguousarray(arr)
        gb = cls(torch, arr.nbytes)
        gb.buf[GUARD : GUARD + arr.nbytes].copy_(torch.from_numpy(arr.reshape(-1).view(np.uint8).copy()))
        return gb

    def read(self, dtype, shape):
        return self.buf[GUARD : GUARD + self.nbytes].cpu().numpy().view(dtype).reshape(shape).copy()

    def guards_ok(self):
        head = self.buf[:GUARD].cpu().numpy()
        tail = self.buf[GUARD + self.nbytes :].cpu().numpy()
        return bool((head == 0xA5).all() and (tail == 0x5A).all())


@pytest.fixture(scope="module")
def kernels():
    torch = _torch()
    from cuda.bindings import driver as cu

    from q12drv.core.nvrtc import compile_source

    torch.zeros(1, device="cuda")
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(torch.cuda.current_device()))
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    img = compile_source(gdn.SOURCE, defines=compile_defines(gdn.SOURCE))
    mod = check(cu.cuModuleLoadData(img.image))
    funcs = {name: check(cu.cuModuleGetFunction(mod, name.encode())) for name in gdn.ENTRIES}
    yield torch, funcs
    check(cu.cuModuleUnload(mod))


def make_inputs(rng, lens, hk, hv, d, state_scale=0.5):
    """Random bf16 q/k/v, fp32 g (<= 0) and beta in (0, 1), a nonzero fp32 initial state per stream."""
    T = int(sum(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = to_bf16_bits(rng.normal(size=(T, hk, d)))
    k = to_bf16_bits(rng.normal(size=(T, hk, d)))
    v = to_bf16_bits(rng.normal(size=(T, hv, d)))
    g = (-np.abs(rng.normal(0.0, 0.3, size=(T, hv)))).astype(np.float32)
    g[rng.random(size=g.shape) < 0.2] = 0.0  # some tokens with no decay at all
    beta = (1.0 / (1.0 + np.exp(-rng.normal(size=(T, hv))))).astype(np.float32)
    s0 = (state_scale * rng.normal(size=(len(lens), hv, d, d))).astype(np.float32)
    return q, k, v, g, beta, cu, s0


def build_meta(torch, lens, rng):
    """All Q12Meta arrays for a fresh prefill of `lens` (block tables with random physical blocks)."""
    n = len(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kv_lens = np.asarray(lens, np.int32)
    positions = np.concatenate([np.arange(L, dtype=np.uint32) for L in lens])
    nblocks = [(L + BLOCK_SIZE - 1) // BLOCK_SIZE for L in lens]
    tables = shuffled_tables(rng, nblocks, sum(nblocks) + 8)
    slots = []
    for L, bt in zip(lens, tables):
        pos = np.arange(L)
        slots.append(bt[pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
    keep = [
        Guarded.of(torch, cu),
        Guarded.of(torch, kv_lens),
        Guarded.of(torch, positions),
        Guarded.of(torch, np.concatenate(slots)),
    ]
    bt_bufs = [Guarded.of(torch, t) for t in tables]
    sl_bufs = [Guarded.of(torch, np.array([L], np.uint32)) for L in lens]
    keep += bt_bufs + sl_bufs
    bt_ptrs = Guarded.of(torch, np.array([b.ptr for b in bt_bufs], np.uint64))
    sl_ptrs = Guarded.of(torch, np.array([b.ptr for b in sl_bufs], np.uint64))
    keep += [bt_ptrs, sl_ptrs]
    meta = Q12MetaC(
        positions=keep[2].ptr,
        positions_h=keep[2].ptr,
        positions_w=keep[2].ptr,
        slots=keep[3].ptr,
        block_table_ptrs=bt_ptrs.ptr,
        seq_len_ptrs=sl_ptrs.ptr,
        cu_seqlens=keep[0].ptr,
        kv_lens=keep[1].ptr,
        batch_size=n,
        chunk_len=int(max(lens)),
        total_tokens=int(cu[-1]),
        max_blocks_per_seq=int(max(nblocks)),
    )
    return meta, keep


def launch(funcs, name, grid, block, smem, values, dependent=False):
    """Launch ``name`` on the legacy stream; ``dependent``: with programmatic stream serialization (PDL),
    through q12drv's own driver call (``CudaDriver.launch_dependent``, what ``q12drv.kernels.gdn.gdn`` uses)."""
    from cuda.bindings import driver as cu

    arr = (ctypes.c_void_p * len(values))(*[ctypes.addressof(x) for x in values])
    if dependent:
        from q12drv.core.driver.cuda import CudaDriver

        CudaDriver().launch_dependent(funcs[name], grid, block, smem, cu.CUstream(0), ctypes.addressof(arr))
        return
    check(cu.cuLaunchKernel(funcs[name], *grid, *block, smem, cu.CUstream(0), ctypes.addressof(arr), 0))


def run_gpu(torch, funcs, inputs, hk, hv, d, rng, decode=False, state_shift=0):
    """One launch over all streams of `inputs` (``decode``: the decode build): returns (o bits, final states, all
    guards intact). ``state_shift``: each state that many bytes past a 256-byte boundary (4: the alignment a state
    needs). Streams of no tokens are allowed (their output is nothing, their state untouched)."""
    q, k, v, g, beta, cu, s0 = inputs
    lens = np.diff(cu).tolist()
    n, T = len(lens), int(cu[-1])
    meta, keep = build_meta(torch, [max(L, 1) for L in lens], rng)
    cu_buf = Guarded.of(torch, cu.astype(np.int32))  # the real cu_seqlens
    meta.cu_seqlens, meta.total_tokens = cu_buf.ptr, T
    keep.append(cu_buf)
    bufs = [Guarded.of(torch, x) for x in (q, k, v, g, beta)]
    o = Guarded(torch, max(T, 1) * hv * d * 2, fill=0xFF)  # 0xFFFF = bf16 NaN
    if state_shift:
        states = [Guarded.of(torch, np.concatenate([np.zeros(state_shift, np.uint8), s0[b].view(np.uint8).ravel()]))
                  for b in range(n)]
        for st in states:
            st.ptr += state_shift
    else:
        states = [Guarded.of(torch, s0[b]) for b in range(n)]
    ptrs = Guarded.of(torch, np.array([s.ptr for s in states], np.uint64))
    grid, block, smem = (gdn.decode_geometry if decode else gdn.geometry)(n, hv, d)
    values = [meta, ctypes.c_uint64(ptrs.ptr)]
    values += [ctypes.c_uint64(b.ptr) for b in bufs] + [ctypes.c_uint64(o.ptr)]
    values += [ctypes.c_int(hk), ctypes.c_int(hv), ctypes.c_uint64(0)]   # no workspace
    torch.cuda.synchronize()
    launch(funcs, (gdn.decode_entry if decode else gdn.entry)(d), grid, block, smem, values)
    torch.cuda.synchronize()
    out = o.read(np.uint16, (max(T, 1), hv, d))[:T]
    fin = np.stack([s.buf[GUARD + state_shift:GUARD + state_shift + hv * d * d * 4].cpu().numpy().view(np.float32)
                    .reshape(hv, d, d).copy() for s in states])
    guards = all(b.guards_ok() for b in [o, ptrs, *states, *bufs, *keep])
    return out, fin, guards


CASES = [
    # (d, hk, hv, lens)
    (128, 16, 32, RAGGED),  # Qwen3-Next heads
    (128, 2, 4, [1100, 3, 64]),
    (64, 2, 6, RAGGED + [1030]),
    (64, 4, 4, [5, 64, 17]),
]


@pytest.mark.parametrize("d,hk,hv,lens", CASES, ids=[f"d{c[0]}-hk{c[1]}-hv{c[2]}-n{len(c[3])}" for c in CASES])
def test_gdn_prefill_matches_reference_and_is_batch_invariant(kernels, d, hk, hv, lens):
    torch, funcs = kernels
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d)
    o, fin, guards = run_gpu(torch, funcs, inputs, hk, hv, d, rng)
    assert guards, "a guard byte around a written buffer changed"
    of = from_bf16_bits(o)
    assert np.isfinite(of).all(), "output rows left unwritten (NaN poison) or non-finite"
    o_ref, fin_ref = reference(*inputs)
    cu = inputs[5]
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        eo = rel_err(of[s:e], from_bf16_bits(o_ref[s:e]))
        es = rel_err(fin[b], fin_ref[b])
        assert eo < 1e-2, f"stream {b} (len {e - s}): output rel err {eo:.3e}"
        assert es < 1e-4, f"stream {b} (len {e - s}): state rel err {es:.3e}"

    # batched == each stream alone (single-stream metadata, pointers at its rows), bit for bit
    q, k, v, g, beta, cu, s0 = inputs
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b : b + 1])
        o1, fin1, guards1 = run_gpu(torch, funcs, one, hk, hv, d, rng)
        assert guards1
        assert np.array_equal(o[s:e], o1), f"stream {b}: output differs batched vs alone"
        assert np.array_equal(fin[b], fin1[0]), f"stream {b}: final state differs batched vs alone"


DECODE_CASES = [
    # (d, hk, hv, lens): decode, speculative decode and empty streams; the tokens a chunk of the staging (4) and past
    (128, 16, 32, [1] * 8),
    (128, 16, 32, [4, 1, 0, 3, 2, 4, 0, 1]),
    (128, 2, 4, [9, 1, 5]),
    (64, 2, 6, [1, 4, 0, 2, 7]),
]


@pytest.mark.parametrize("d,hk,hv,lens", DECODE_CASES, ids=[f"d{c[0]}-hk{c[1]}-hv{c[2]}-{'-'.join(map(str, c[3]))}"
                                                           for c in DECODE_CASES])
def test_gdn_decode_build_matches_reference_and_is_batch_invariant(kernels, d, hk, hv, lens):
    """The recurrence's decode build: the float64 reference, the token-chunked build (same math, another summation
    order), batched == each stream alone bit for bit, a 4-byte-aligned state (scalar accesses) == a 16-byte-aligned
    one bit for bit, empty streams' states untouched, no byte written outside o and the states."""
    torch, funcs = kernels
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d)
    o, fin, guards = run_gpu(torch, funcs, inputs, hk, hv, d, rng, decode=True)
    assert guards, "a guard byte around a written buffer changed"
    of = from_bf16_bits(o)
    assert np.isfinite(of).all(), "output rows left unwritten (NaN poison) or non-finite"
    o_ref, fin_ref = reference(*inputs)
    q, k, v, g, beta, cu, s0 = inputs
    o_tc, fin_tc, _ = run_gpu(torch, funcs, inputs, hk, hv, d, rng)
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        if e == s:
            assert np.array_equal(fin[b], s0[b]), f"stream {b} has no tokens but its state changed"
            continue
        assert rel_err(of[s:e], from_bf16_bits(o_ref[s:e])) < 1e-2, f"stream {b}: output"
        assert rel_err(fin[b], fin_ref[b]) < 1e-4, f"stream {b}: state"
        assert rel_err(of[s:e], from_bf16_bits(o_tc[s:e])) < 1e-2 and rel_err(fin[b], fin_tc[b]) < 1e-5, b
    o4, fin4, guards4 = run_gpu(torch, funcs, inputs, hk, hv, d, rng, decode=True, state_shift=4)
    assert guards4 and np.array_equal(o4, o) and np.array_equal(fin4, fin), "scalar state accesses differ"
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b:b + 1])
        o1, fin1, guards1 = run_gpu(torch, funcs, one, hk, hv, d, rng, decode=True)
        assert guards1 and np.array_equal(o[s:e], o1) and np.array_equal(fin[b], fin1[0]), f"stream {b} alone"


# --------------------------------------------------------------------------- chunked (WY) kernels

CHUNK_O_REL, CHUNK_STATE_REL = 1e-2, 1e-3   # numpy model of the kernels: ~3.7e-3 and ~3e-4


def load_chunk_module(source=chunked_mma.SOURCE):
    """Compile gdn/chunked_mma.cu (or gdn/chunked_wgmma.cu), load it, opt in to its entries' dynamic shared memory;
    returns (module, {entry: CUfunction})."""
    from cuda.bindings import driver as cu

    from q12drv.core.nvrtc import compile_source

    mod_info = chunked_mma if source == chunked_mma.SOURCE else chunked_wgmma
    img = compile_source(source, defines=compile_defines(source))
    mod = check(cu.cuModuleLoadData(img.image))
    funcs = {}
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    for name in mod_info.ENTRIES:
        f = check(cu.cuModuleGetFunction(mod, name.encode()))
        check(cu.cuFuncSetAttribute(f, attr, mod_info.entry_smem(name)))
        funcs[name] = f
    return mod, funcs


@pytest.fixture(scope="module")
def chunk_kernels(kernels):
    from cuda.bindings import driver as cu

    torch, rec_funcs = kernels
    mod, funcs = load_chunk_module()
    wmod, wfuncs = load_chunk_module(source=chunked_wgmma.SOURCE)
    yield torch, {**funcs, **wfuncs}, rec_funcs
    check(cu.cuModuleUnload(mod))
    check(cu.cuModuleUnload(wmod))


#: Each kernel build a plan can take -> (config, the SM count planned for: the rules then take that build; None:
#: the device's). One SM makes every grid "full" (one stage, the wide CTA); a million none.
KINDS = {"fused": (GdnConfig(schedule="fused"), None),
         "mma-2stage": (GdnConfig(schedule="two_pass", isa="mma"), 10 ** 6),
         "mma-1stage": (GdnConfig(schedule="two_pass", isa="mma"), 1),
         "wgmma-2stage": (GdnConfig(schedule="two_pass", isa="wgmma"), 10 ** 6),
         "wgmma-1stage": (GdnConfig(schedule="two_pass", isa="wgmma"), 1),   # d64; at d128 the wide CTA
         "wide": (GdnConfig(schedule="two_pass", isa="wgmma"), 1),
         "overlapped": (GdnConfig(schedule="overlapped"), None)}


def kind_plan(torch, kind, hk, hv, d, n, chunk_len):
    """The plan of build ``kind`` (:data:`KINDS`) for ``n`` streams of at most ``chunk_len`` tokens."""
    config, sms = KINDS[kind]
    sms = sms or torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_gdn(config, GdnShape(hk, hv, d), n, chunk_len, SimpleNamespace(arch="sm_90", sm_count=sms))
    want = {"mma-2stage": "2stage", "mma-1stage": "1stage", "wgmma-2stage": "2stage", "wide": "wide"}.get(kind)
    if kind == "wgmma-1stage":
        want = "wide" if d == 128 else "1stage"
    assert want is None or plan.build == want, (kind, plan.build)
    return plan


def run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, kind="fused", pdl=True, flags_out=None, records_out=None,
                  v_shift=0):
    """One chunked pass over all streams of ``inputs`` by the plan of ``kind`` (:func:`kind_plan`): its launches in
    order, a guarded workspace of the size it needs (0xFF bytes; the overlapped schedule's flags cleared first, as the
    launcher clears them), the sequential kernels launched with PDL as the launcher does (``pdl`` False: without).
    Returns (o bits, final states, guards intact). The overlapped schedule: ``flags_out``, a list, gets the ready
    flags and the item counter after the pass (u32); ``records_out``, a list, its records ([stream, chunk, value
    head, bytes] uint8). ``v_shift``: v that many bytes past a 256-byte boundary (8: the alignment v needs)."""
    q, k, v, g, beta, cu, s0 = inputs
    lens = np.diff(cu).tolist()
    n, T = len(lens), int(cu[-1])
    meta, keep = build_meta(torch, [max(L, 1) for L in lens], rng)
    cu_buf = Guarded.of(torch, cu.astype(np.int32))  # the real cu_seqlens (streams of length 0 allowed)
    meta.cu_seqlens = cu_buf.ptr
    meta.total_tokens = T
    keep.append(cu_buf)
    bufs = [Guarded.of(torch, x) for x in (q, k, v, g, beta)]
    vbuf = bufs[2]
    if v_shift:   # v's payload after v_shift zero bytes
        vbytes = np.ascontiguousarray(v).view(np.uint8).ravel()
        vbuf = Guarded.of(torch, np.concatenate([np.zeros(v_shift, np.uint8), vbytes]))
        bufs[2] = vbuf
    o = Guarded(torch, max(T, 1) * hv * d * 2, fill=0xFF)
    states = [Guarded.of(torch, s0[b]) for b in range(n)]
    ptrs = Guarded.of(torch, np.array([s.ptr for s in states], np.uint64))
    values = [meta, ctypes.c_uint64(ptrs.ptr)]
    values += [ctypes.c_uint64(b.ptr + (v_shift if b is vbuf else 0)) for b in bufs] + [ctypes.c_uint64(o.ptr)]
    values += [ctypes.c_int(hk), ctypes.c_int(hv)]
    chunk_len = int(meta.chunk_len)
    plan = kind_plan(torch, kind, hk, hv, d, n, chunk_len)
    zero, kernels = plan.launches(n, chunk_len)
    need = plan.workspace_bytes_for(n, chunk_len)
    ws = None
    if need:
        ws = Guarded(torch, need, fill=0xFF)
        keep.append(ws)
        if zero is not None:
            ws.buf[GUARD + zero[0]: GUARD + zero[0] + zero[1]] = 0
    values.append(ctypes.c_uint64(0 if ws is None else ws.ptr))
    torch.cuda.synchronize()
    for kern in kernels:
        launch(funcs, kern.entry, kern.grid, kern.block, kern.smem, values, dependent=kern.dependent and pdl)
    torch.cuda.synchronize()
    if plan.schedule == "overlapped" and flags_out is not None:
        count = chunked_wgmma.flag_count(n, chunk_len, hk)
        at = GUARD + zero[0]
        flags_out.append(ws.buf[at: at + 4 * count + 4].cpu().numpy().view(np.uint32).copy())
    if plan.schedule == "overlapped" and records_out is not None:
        rec = ws.buf[GUARD: GUARD + zero[0]].cpu().numpy()
        records_out.append(rec.reshape(n, chunked_mma.chunks(chunk_len), hv,
                                       chunked_wgmma.overlap_record_bytes(d)).copy())
    out = o.read(np.uint16, (max(T, 1), hv, d))[:T]
    fin = np.stack([s.read(np.float32, (hv, d, d)) for s in states])
    guards = all(b.guards_ok() for b in [o, ptrs, *states, *bufs, *keep])
    return out, fin, guards


def check_chunked_result(o, fin, inputs):
    """A chunked kernel's outputs against the float64 reference, stream by stream: every output row written
    and finite, o and the final state within the chunked bounds, a stream of length 0 left untouched."""
    of = from_bf16_bits(o)
    assert np.isfinite(of).all(), "output rows left unwritten (NaN poison) or non-finite"
    o_ref, fin_ref = reference(*inputs)
    cu, s0 = inputs[5], inputs[6]
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            assert np.array_equal(fin[b], s0[b]), f"stream {b} (len 0): state changed"
            continue
        eo = rel_err(of[s:e], from_bf16_bits(o_ref[s:e]))
        es = rel_err(fin[b], fin_ref[b])
        assert eo < CHUNK_O_REL, f"stream {b} (len {e - s}): output rel err {eo:.3e}"
        assert es < CHUNK_STATE_REL, f"stream {b} (len {e - s}): state rel err {es:.3e}"


CHUNK_CASES = [
    # (d, hk, hv, lens)
    (128, 16, 32, RAGGED + [130]),          # Qwen3-Next heads
    (128, 2, 4, [1100, 3, 64, 0, 2049]),    # a stream of length 0 inside the batch
    (128, 1, 2, [8192]),
    (64, 2, 6, RAGGED + [1030]),
    (64, 16, 32, [5, 64, 17, 300]),
]


@pytest.mark.parametrize("d,hk,hv,lens", CHUNK_CASES, ids=[f"d{c[0]}-hk{c[1]}-hv{c[2]}-n{len(c[3])}" for c in CHUNK_CASES])
def test_gdn_chunk_matches_reference_and_is_batch_invariant(chunk_kernels, d, hk, hv, lens):
    torch, funcs, rec_funcs = chunk_kernels
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d)
    o, fin, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng)
    assert guards, "a guard byte around a written buffer changed"
    check_chunked_result(o, fin, inputs)
    q, k, v, g, beta, cu, s0 = inputs

    # batched == each stream alone, bit for bit
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b : b + 1])
        o1, fin1, guards1 = run_chunk_gpu(torch, funcs, one, hk, hv, d, rng)
        assert guards1
        assert np.array_equal(o[s:e], o1), f"stream {b}: output differs batched vs alone"
        assert np.array_equal(fin[b], fin1[0]), f"stream {b}: final state differs batched vs alone"


@pytest.mark.parametrize("d,hk,hv,lens", CHUNK_CASES, ids=[f"d{c[0]}-hk{c[1]}-hv{c[2]}-n{len(c[3])}" for c in CHUNK_CASES])
def test_gdn_mma_two_pass_equals_the_fused_kernel(chunk_kernels, d, hk, hv, lens):
    """The mma two-pass schedule (precompute, then the sequential kernel), both sequential builds: the fused
    kernel's bits (o and every final state), batched and for one stream alone, nothing written outside its
    workspace and outputs."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d)
    o_f, fin_f, _ = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng)
    q, k, v, g, beta, cu, s0 = inputs
    b = int(np.argmax(np.diff(cu)))  # the longest stream alone
    s, e = cu[b], cu[b + 1]
    one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b : b + 1])
    for kind in ("mma-2stage", "mma-1stage"):
        o_s, fin_s, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, kind)
        assert guards, f"{kind}: a guard byte around a written buffer (the workspace included) changed"
        assert np.array_equal(o_s, o_f), f"{kind}: output differs from the fused kernel's"
        assert np.array_equal(fin_s, fin_f), f"{kind}: final states differ from the fused kernel's"
        o1, fin1, guards1 = run_chunk_gpu(torch, funcs, one, hk, hv, d, rng, kind)
        assert guards1
        assert np.array_equal(o1, o_f[s:e]) and np.array_equal(fin1[0], fin_f[b]), f"{kind}: alone != fused"


@pytest.mark.parametrize("kind", ["wgmma-2stage", "wgmma-1stage"])
@pytest.mark.parametrize("d,hk,hv,lens", CHUNK_CASES, ids=[f"d{c[0]}-hk{c[1]}-hv{c[2]}-n{len(c[3])}" for c in CHUNK_CASES])
def test_gdn_wgmma_two_pass_matches_reference_and_is_batch_invariant(chunk_kernels, d, hk, hv, lens, kind):
    """The wgmma two-pass schedule (the T precompute, then the warpgroup-MMA sequential kernel), both builds (two
    stages; one stage at d64, the wide CTA at d128): the float64 reference within the chunked kernels' bounds,
    every output row written, guards (the workspace's included) intact, a stream of length 0 untouched, each stream
    alone == batched bit for bit, and the mma two-pass schedule's results to within the two solves' rounding."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d)
    o, fin, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, kind)
    assert guards, "a guard byte around a written buffer (the workspace included) changed"
    check_chunked_result(o, fin, inputs)
    o_split, fin_split, _ = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, "mma-2stage")
    of = from_bf16_bits(o)
    q, k, v, g, beta, cu, s0 = inputs
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        assert rel_err(fin[b], fin_split[b]) < 5e-4, f"stream {b}: state far from the mma schedule's"
        assert rel_err(of[s:e], from_bf16_bits(o_split[s:e])) < 1e-2, f"stream {b}: output far from the mma schedule's"
        one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b : b + 1])
        o1, fin1, guards1 = run_chunk_gpu(torch, funcs, one, hk, hv, d, rng, kind)
        assert guards1
        assert np.array_equal(o[s:e], o1), f"stream {b}: output differs batched vs alone"
        assert np.array_equal(fin[b], fin1[0]), f"stream {b}: final state differs batched vs alone"


FORM_CASES = [(form, *c) for form in ("overlapped", "wide") for c in CHUNK_CASES if form == "overlapped" or c[0] == 128]


@pytest.mark.parametrize("form,d,hk,hv,lens", FORM_CASES,
                         ids=[f"{c[0]}-d{c[1]}-hk{c[2]}-hv{c[3]}-n{len(c[4])}" for c in FORM_CASES])
def test_gdn_wgmma_forms_against_the_two_stage_build(chunk_kernels, form, d, hk, hv, lens):
    """The wgmma schedules' other builds, batched and for the longest stream alone, guards intact, twice in a row
    (the same bits both times): the wide CTA (two warpgroups per value head, the chunk's tiles shared; d 128) gives
    the two-stage kernel's bits (the same sequential arithmetic); the overlapped schedule (precompute beside the
    sequential kernel, records released by ready flags, the second launch with PDL, its flags cleared again) takes
    fla's order V_new = U - W S: not the two-pass bits, so the float64 reference's bounds and the two-pass results
    within the mma-vs-wgmma margins; alone == batched bit for bit either way."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d)
    o_p, fin_p, _ = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, "wgmma-2stage")
    q, k, v, g, beta, cu, s0 = inputs
    runs = []
    for rep in range(2):
        o_f, fin_f, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, form)
        assert guards, "a guard byte around a written buffer (the workspace included) changed"
        runs.append((o_f, fin_f))
        if form == "wide":
            assert np.array_equal(o_f, o_p), f"run {rep}: the wide CTA's output differs from the two-stage kernel's"
            assert np.array_equal(fin_f, fin_p), f"run {rep}: the wide CTA's states differ from the two-stage kernel's"
            continue
        check_chunked_result(o_f, fin_f, inputs)
        of, op = from_bf16_bits(o_f), from_bf16_bits(o_p)
        for b in range(len(cu) - 1):
            s, e = cu[b], cu[b + 1]
            if e > s:
                assert rel_err(fin_f[b], fin_p[b]) < 5e-4, f"stream {b}: overlapped state far from the two-pass one"
                assert rel_err(of[s:e], op[s:e]) < 1e-2, f"stream {b}: overlapped output far from the two-pass one"
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1]), \
        f"the {form} build's two runs differ"
    b = int(np.argmax(np.diff(cu)))
    s, e = cu[b], cu[b + 1]
    one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b : b + 1])
    o1, fin1, guards1 = run_chunk_gpu(torch, funcs, one, hk, hv, d, rng, form)
    assert guards1
    assert np.array_equal(o1, runs[0][0][s:e]) and np.array_equal(fin1[0], runs[0][1][b]), \
        f"alone ({form}) != batched ({form})"


@pytest.mark.parametrize("d", [128, 64])
def test_gdn_overlapped_claims_every_item_once(chunk_kernels, d):
    """The overlapped schedule at 1 x 8192 (Hk 16, Hv 32: where the rules take it; 2176 items on the precompute's
    groups, about ten claims each: chunked_wgmma.overlap_items): twice, the same bits, guards intact, every flag at
    chunked_wgmma.overlap_ready_value, and the item counter at the item count plus one overshooting claim per group
    (each group claims until it gets none)."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, [8192], 16, 32, d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    groups = chunked_wgmma.OVERLAP_GROUPS * chunked_wgmma.overlapped_geometry(1, 32, d, sms)[0][0][0]
    got = []
    for _ in range(2):
        flags = []
        o, fin, guards = run_chunk_gpu(torch, funcs, inputs, 16, 32, d, rng, "overlapped", flags_out=flags)
        assert guards, "a guard byte around a written buffer (the workspace included) changed"
        got.append((o, fin))
        items, ready = chunked_wgmma.overlap_items(1, 8192, 16, 32), chunked_wgmma.overlap_ready_value(16, 32)
        assert flags[0].size == 128 * 16 + 1
        assert (flags[0][:-1] == ready).all(), \
            f"ready flags (expected {ready}) {np.unique(flags[0][:-1], return_counts=True)}"
        assert flags[0][-1] == items + groups, f"item counter {flags[0][-1]}, {items} items, {groups} groups"
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1]), "the two runs differ"


@pytest.mark.parametrize("case", [0, 3], ids=["d128-hv32", "d64-hv6"])
def test_gdn_overlapped_p_records_are_causal(chunk_kernels, case):
    """Every overlapped record's P tile (P[t][j] = exp(gamma_t - gamma_j) (rq q_t . rk k_j) for j <= t) is exactly zero above
    the diagonal, for every value head of every key head: the precompute's items do a key head's value heads one
    after the other in the same shared memory, where the previous head's T tiles once took P's upper blocks (their
    bf16 lo parts, about 1e-4 of P: within the float64 check's tolerance, so only this test sees them)."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng(21)
    d, hk, hv, lens = CHUNK_CASES[case]
    assert hv > hk, "the case needs several value heads a key head"
    inputs = make_inputs(rng, lens, hk, hv, d)
    records = []
    o, fin, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, "overlapped", records_out=records)
    assert guards
    check_chunked_result(o, fin, inputs)
    p0 = chunked_wgmma.overlap_record_offsets(d)["P"]
    C = chunked_mma.CHUNK
    upper = np.triu(np.ones((C, C), bool), 1)
    bad = []
    for b, L in enumerate(lens):
        for ci in range(-(-L // C)):
            for h in range(hv):
                p = chunked_wgmma.sw128_unswizzle(records[0][b, ci, h, p0: p0 + 2 * C * C], C)
                if (p[upper] != 0).any():
                    bad.append((b, ci, h, int((p[upper] != 0).sum())))
    assert not bad, (f"{len(bad)} P records with nonzero entries above the diagonal (stream, chunk, value head, "
                     f"count): {bad[:6]}")


@pytest.mark.parametrize("case", [0, 3], ids=["d128-hv32", "d64-hv6"])
def test_gdn_overlapped_v_8_byte_aligned_gives_the_same_bits(chunk_kernels, case):
    """v 8 bytes past a 16-byte boundary (the alignment v needs): the overlapped sequential kernel copies its V slice
    by 8-byte pieces instead of 16-byte ones (issue_v_sw128), and the pass gives the aligned v's bits, guards
    intact."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng(23)
    d, hk, hv, lens = CHUNK_CASES[case]
    inputs = make_inputs(rng, lens, hk, hv, d)
    o16, fin16, guards16 = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, "overlapped")
    o8, fin8, guards8 = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, "overlapped", v_shift=8)
    assert guards16 and guards8
    check_chunked_result(o16, fin16, inputs)
    assert np.array_equal(o8, o16) and np.array_equal(fin8, fin16), "v 8-byte aligned: not the aligned v's bits"


@pytest.mark.parametrize("kind,case", [("wgmma-1stage", 3), ("wgmma-2stage", 0), ("wide", 0)])
def test_gdn_wgmma_pdl_launch_equals_the_plain_one(chunk_kernels, kind, case):
    """The wgmma two-pass sequential kernel launched with PDL (as the launcher launches it: it loads its inputs and
    state while the precompute finishes, then waits for it) gives the bits of the same kernel launched after the
    precompute, twice, guards intact. Each run's workspace starts as 0xFF bytes: a record copied before the
    precompute stored it would show as different bits (or NaN)."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng()
    d, hk, hv, lens = CHUNK_CASES[case]
    inputs = make_inputs(rng, lens, hk, hv, d)
    o_p, fin_p, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, kind, pdl=False)
    assert guards
    for rep in range(2):
        o, fin, guards = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng, kind)
        assert guards, "a guard byte around a written buffer (the workspace included) changed"
        assert np.array_equal(o, o_p) and np.array_equal(fin, fin_p), f"run {rep}: the PDL launch's bits differ"


@pytest.mark.parametrize("d", [64, 128])
def test_gdn_wgmma_takes_streams_longest_first_over_many(chunk_kernels, d):
    """The wgmma two-pass sequential kernels give grid row z the z-th longest stream (gdnw::longest_first). With
    more streams than a CTA has threads (300 against 128 and 256: the ranking's tiled loop), lengths 0..139 with
    ties and zeros: every stream computed exactly once (every row written, the float64 reference's bounds, states of
    length-0 streams untouched, guards), both builds (two stages; one stage at d64, the wide CTA at d128, the
    two-stage kernel's bits); the longest stream and two tied ones alone == batched."""
    torch, funcs, _ = chunk_kernels
    rng = np.random.default_rng()
    lens = rng.integers(0, 140, 300)
    lens[[3, 150, 299]] = 139   # a three-way tie at the top, and zeros
    lens[[0, 7, 298]] = 0
    inputs = make_inputs(rng, lens.tolist(), 1, 2, d)
    results = {}
    for kind in ("wgmma-2stage", "wgmma-1stage"):
        o, fin, guards = run_chunk_gpu(torch, funcs, inputs, 1, 2, d, rng, kind)
        assert guards, f"{kind}: a guard byte around a written buffer (the workspace included) changed"
        check_chunked_result(o, fin, inputs)
        results[kind] = o, fin
    assert np.array_equal(results["wgmma-1stage"][0], results["wgmma-2stage"][0]) and \
        np.array_equal(results["wgmma-1stage"][1], results["wgmma-2stage"][1]), "the two builds differ over 300 streams"
    q, k, v, g, beta, cu, s0 = inputs
    for b in (3, 150, 299, int(np.argmin(np.where(lens > 0, lens, 10**9)))):
        s, e = cu[b], cu[b + 1]
        one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b: b + 1])
        o1, fin1, guards1 = run_chunk_gpu(torch, funcs, one, 1, 2, d, rng, "wgmma-1stage")
        assert guards1
        assert np.array_equal(o1, results["wgmma-1stage"][0][s:e]) and \
            np.array_equal(fin1[0], results["wgmma-1stage"][1][b]), \
            f"stream {b} (len {e - s}) alone != batched"


@pytest.mark.parametrize("d", [64, 128])
def test_gdn_chunk_agrees_with_recurrent(chunk_kernels, d):
    torch, funcs, rec_funcs = chunk_kernels
    rng = np.random.default_rng()
    hk, hv = (16, 32) if d == 128 else (2, 4)
    inputs = make_inputs(rng, [1, 63, 64, 65, 700], hk, hv, d)
    o_c, fin_c, _ = run_chunk_gpu(torch, funcs, inputs, hk, hv, d, rng)
    o_r, fin_r, _ = run_gpu(torch, rec_funcs, inputs, hk, hv, d, rng)
    assert rel_err(from_bf16_bits(o_c), from_bf16_bits(o_r)) < CHUNK_O_REL
    assert rel_err(fin_c, fin_r) < CHUNK_STATE_REL


def _bench():
    """Rough timings of the recurrent kernel (CUDA events), printed; Qwen3-Next heads (Hk 16, Hv 32, d 128)."""
    import torch
    from cuda.bindings import driver as cu

    from q12drv.core.nvrtc import compile_source

    torch.zeros(1, device="cuda")
    check(cu.cuInit(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(ctx))
    mod = check(cu.cuModuleLoadData(compile_source(gdn.SOURCE, defines=compile_defines(gdn.SOURCE)).image))
    funcs = {nm: check(cu.cuModuleGetFunction(mod, nm.encode())) for nm in gdn.ENTRIES}
    hk, hv, d = 16, 32, 128
    import os

    configs = [(1, 2048), (1, 8192), (4, 2048), (8, 2048), (16, 2048)]
    if os.environ.get("GDN_BENCH_ONLY"):  # e.g. "8x2048" (for profilers)
        configs = [tuple(int(x) for x in os.environ["GDN_BENCH_ONLY"].split("x"))]
    for n, L in configs:
        T = n * L
        cu_np = (np.arange(n + 1) * L).astype(np.int32)
        cu_t = torch.from_numpy(cu_np).cuda()
        q = torch.randn(T, hk, d, device="cuda").bfloat16()
        k = torch.randn(T, hk, d, device="cuda").bfloat16()
        v = torch.randn(T, hv, d, device="cuda").bfloat16()
        g = -torch.rand(T, hv, device="cuda") * 0.3
        beta = torch.rand(T, hv, device="cuda")
        o = torch.empty(T, hv, d, device="cuda", dtype=torch.bfloat16)
        st = torch.randn(n, hv, d, d, device="cuda")
        ptrs = torch.tensor([st[i].data_ptr() for i in range(n)], dtype=torch.uint64, device="cuda")
        meta = Q12MetaC(cu_seqlens=cu_t.data_ptr(), batch_size=n, chunk_len=L, total_tokens=T)
        vals = [meta, ctypes.c_uint64(ptrs.data_ptr())]
        vals += [ctypes.c_uint64(x.data_ptr()) for x in (q, k, v, g, beta, o)] + [ctypes.c_int(hk), ctypes.c_int(hv)]
        vals.append(ctypes.c_uint64(0))   # no workspace
        grid, block, smem = gdn.geometry(n, hv, d)
        for _ in range(2):
            launch(funcs, gdn.entry(d), grid, block, smem, vals)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 5
        e0.record()
        for _ in range(reps):
            launch(funcs, gdn.entry(d), grid, block, smem, vals)
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / reps
        tflops = 4 * T * hv * d * d / (ms * 1e-3) / 1e12
        print(f"n={n:2d} L={L:5d}: {ms:.3f} ms  {T / ms / 1e3:.2f} M tok/s  {tflops:.1f} metric-TFLOPS")


if __name__ == "__main__":
    _bench()
