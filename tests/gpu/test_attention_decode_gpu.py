"""GPU test of ``cuda_src/attention/decode.cu`` (split-KV decode attention) on a real device (H200).

Raw launches (torch allocates and copies, ``cuda.bindings`` launches the split kernel and the merge; the metadata
from ``tests/gpu/test_attention_gpu.py``'s :class:`Case`) against torch SDPA in fp32 on each stream's gathered K/V
(an independent reference), against the prefill kernels (``attention/mma.cu``, ``attention/wgmma.cu``) on the same
batch, batched against each stream alone bit for bit (the same ``num_splits``), split against unsplit, sliding
windows, an oversized grid, guard bands around O and a workspace poisoned with NaN (the merge must read only what the
splits wrote); then
once through q12drv's own path (``Q12Pass.attention(algo="decode")``, the merge as a programmatic dependent launch)
against the raw launches, bit for bit. FP8 pools: the case's bf16 pools written whole by ``q12_kv_write_fp8`` (each KV
head's scale its amax / 448), read by the FP8 split entries, against torch SDPA in fp32 on the dequantized gathered
K/V, against the bf16 decode of the case's own pools within the error ``tests/test_attention_decode_fp8.py`` states,
and against the emulator's model; and through ``Q12Pass.attention(algo="decode", k_scale=, v_scale=)``. Inputs are
fresh random every run (the seed is in every failure message).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from q12drv import ScratchArena, StreamStageInfo, make_scratch_plan  # noqa: E402
from q12drv.core.bf16 import from_bf16_bits  # noqa: E402
from q12drv.core.fp8 import E4M3_MAX, from_e4m3_bits  # noqa: E402
from q12drv.core.nvrtc import compile_source  # noqa: E402
from q12drv.kernels import attention_decode as dec  # noqa: E402
from q12drv.kernels import kv_write as kw  # noqa: E402
from q12drv.kernels.meta import Q12MetaC  # noqa: E402
from q12drv.kernels.registry import compile_defines  # noqa: E402
from q12drv.prefill import AttentionShape, Q12Pass  # noqa: E402
from tests.gpu.raw_harness import check  # noqa: E402
from tests.gpu.test_attention_gpu import ALGOS, Case, _fresh_case, kernels  # noqa: E402,F401  (kernels: a fixture)
from tests.helpers import rel_err, rel_err_bf16  # noqa: E402
from tests.test_attention_decode_fp8 import FP8_VS_BF16_BATCH, FP8_VS_BF16_STREAM  # noqa: E402
from tests.test_kernel_attention_decode import DecodeBatch, check_attention_layer_decode  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GUARD = 256  # poisoned bf16 elements on each side of O
SMS = 132


@pytest.fixture(scope="module")
def decode_kernels():
    """``{entry: CUfunction}`` of every decode entry (and ``q12_kv_write_fp8``), dynamic shared memory raised where the
    split kernels need it."""
    from cuda.bindings import driver as cu

    torch.zeros(1, device="cuda")
    module = check(cu.cuModuleLoadData(compile_source(dec.SOURCE, defines=compile_defines(dec.SOURCE)).image))
    writer = check(cu.cuModuleLoadData(compile_source(kw.SOURCE, defines=compile_defines(kw.SOURCE)).image))
    funcs = {"q12_kv_write_fp8": check(cu.cuModuleGetFunction(writer, b"q12_kv_write_fp8"))}
    for entry in dec.ENTRIES:
        funcs[entry] = check(cu.cuModuleGetFunction(module, entry.encode()))
    for d in dec.HEAD_DIMS:
        for entry, smem in ((dec.HEAD_DIMS[d], dec.TILES[d].smem), (dec.FP8_ENTRIES[d], dec.TILES[d].smem_fp8)):
            check(cu.cuFuncSetAttribute(
                funcs[entry], cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    yield funcs
    check(cu.cuModuleUnload(module))
    check(cu.cuModuleUnload(writer))


def _launch(func, grid, block, smem, params) -> None:
    from cuda.bindings import driver as cu

    argv = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
    stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
    check(cu.cuLaunchKernel(func, *grid, *block, smem, stream, ctypes.addressof(argv), 0))


def run_decode(funcs, c: Case, streams, scale: float, num_splits: int, grid_extra=(0, 0, 0),
               window_left: int = dec.NO_WINDOW, fp8: "Fp8Pools | None" = None) -> np.ndarray:
    """The split kernel (and with splits the merge) over ``streams`` of ``c`` (``window_left``: the kernels'
    argument; ``fp8``: the FP8 entries on those pools instead of the case's bf16 ones); their O rows (uint16 bits)
    after the guards are checked. The workspace is exactly the plan's, filled with NaN first."""
    keep = []
    meta = c.meta(streams, keep)
    rows = int(meta.total_tokens)
    obuf = torch.full((rows * c.hq * c.d + 2 * GUARD,), -1, dtype=torch.int16, device="cuda")
    o_ptr = obuf.data_ptr() + GUARD * 2
    q_ptr = c.dq.data_ptr() + (int(c.cu[streams[0]]) * c.hq * c.d * 2 if len(streams) == 1 else 0)
    assert len(streams) == 1 or list(streams) == list(range(len(c.q_lens)))
    plan = dec.DecodePlan(c.d, c.hq, c.hkv, num_splits, window_left, "bf16" if fp8 is None else "fp8_e4m3")
    ws = torch.full((max(4, plan.workspace_bytes_for(rows) // 4),), float("nan"), dtype=torch.float32, device="cuda")
    (grid, block, smem), merge = plan.launches(len(streams), int(meta.chunk_len))
    grid = tuple(g + e for g, e in zip(grid, grid_extra))
    pools = ([c.dk.data_ptr(), c.dv.data_ptr()] if fp8 is None else
             [fp8.k.data_ptr(), fp8.v.data_ptr(), fp8.ks.data_ptr(), fp8.vs.data_ptr()])
    _launch(funcs[plan.entry], grid, block, smem,
            [meta, ctypes.c_uint64(q_ptr), *map(ctypes.c_uint64, pools),
             ctypes.c_uint64(o_ptr), ctypes.c_uint64(ws.data_ptr() if merge else 0), ctypes.c_int(c.hq),
             ctypes.c_int(c.hkv), ctypes.c_int(c.bs), ctypes.c_float(scale), ctypes.c_int(window_left),
             ctypes.c_int(num_splits)])
    if merge is not None:
        mgrid = tuple(g + e for g, e in zip(merge[0], (grid_extra[0], 0, grid_extra[2])))
        _launch(funcs[plan.merge_entry], mgrid, merge[1], 0,
                [meta, ctypes.c_uint64(ws.data_ptr()), ctypes.c_uint64(o_ptr), ctypes.c_int(c.hq), ctypes.c_int(c.hkv),
                 ctypes.c_int(window_left), ctypes.c_int(num_splits)])
    torch.cuda.synchronize()
    out = obuf.cpu().numpy().view(np.uint16)
    assert (out[:GUARD] == 0xFFFF).all() and (out[-GUARD:] == 0xFFFF).all(), "guard elements overwritten"
    return out[GUARD:-GUARD].reshape(rows, c.hq, c.d)


def sdpa_fp32(c: Case, scale: float, window_left: int | None = None, fp8: "Fp8Pools | None" = None) -> np.ndarray:
    """torch SDPA in fp32 per stream on its gathered K/V (heads expanded for GQA; ``fp8``: the dequantized FP8 pools,
    ``e4m3 value * scale[h]`` in fp32), the bottom-right causal mask (and the sliding window, ``window_left`` keys
    left of the query) explicit: ``[T, Hq, D]`` float32."""
    import torch.nn.functional as F

    g = c.hq // c.hkv
    if fp8 is None:
        k_rows = torch.from_numpy(from_bf16_bits(c.k_pool).reshape(-1, c.hkv, c.d)).cuda()
        v_rows = torch.from_numpy(from_bf16_bits(c.v_pool).reshape(-1, c.hkv, c.d)).cuda()
    else:
        k_rows, v_rows = fp8.dequantized()
    qf = torch.from_numpy(from_bf16_bits(c.q)).cuda()
    out = torch.zeros_like(qf)
    for b in range(len(c.q_lens)):
        ql, kv = int(c.q_lens[b]), int(c.kv_lens[b])
        pos = torch.arange(kv, device="cuda")
        table = torch.from_numpy(c.tables[b].astype(np.int64)).cuda()
        slots = table[pos // c.bs] * c.bs + pos % c.bs
        k = k_rows[slots].permute(1, 0, 2).repeat_interleave(g, dim=0)[None]  # [1, Hq, kv, D]
        v = v_rows[slots].permute(1, 0, 2).repeat_interleave(g, dim=0)[None]
        qb = qf[c.cu[b]:c.cu[b + 1]].permute(1, 0, 2)[None]  # [1, Hq, q_len, D]
        mask = torch.ones(ql, kv, dtype=torch.bool, device="cuda").tril(diagonal=kv - ql)
        if window_left is not None:  # key j visible from token i when j >= kv - ql + i - window_left
            mask &= torch.ones(ql, kv, dtype=torch.bool, device="cuda").triu(diagonal=kv - ql - window_left)
        out[c.cu[b]:c.cu[b + 1]] = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)[0].permute(1, 0, 2)
    return out.cpu().numpy()


#: (D, block size, Hq, Hkv, q_lens, cached keys before the new tokens): ragged kv lengths around the key tiles, q_len
#: 1 to 8, GQA 1, 4, 8 and 16, the CTA's 1, 2 and 4 m-tiles (q_len * G up to 64 rows), blocks of 16, 32 and 64.
CASES = [
    (256, 16, 16, 2, [1] * 8, [0, 15, 16, 31, 300, 1000, 4095, 8000]),
    (256, 64, 16, 2, [4, 1, 4, 2, 3], [60, 199, 0, 7000, 1]),
    (256, 16, 8, 8, [1, 1, 8], [500, 70, 33]),
    (128, 16, 32, 8, [1, 4, 1, 4, 3], [31, 32, 513, 9999, 1]),
    (128, 64, 16, 4, [4, 4, 1, 8], [0, 127, 20000, 64]),
    (128, 16, 32, 2, [2, 4, 1], [17, 3333, 0]),
    (128, 32, 8, 1, [8, 1, 5], [100, 5000, 63]),
    (64, 16, 8, 2, [1, 2, 8, 1], [40, 1, 900, 12000]),
    (64, 64, 4, 4, [1, 8], [3, 640]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}-bs{c[1]}-gqa{c[2] // c[3]}-{i}" for i, c in enumerate(CASES)])
def test_decode_matches_sdpa_and_the_prefill_kernels(decode_kernels, kernels, case):
    d, bs, hq, hkv, q_lens, prefixes = case
    seed, c = _fresh_case(q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale, n = d ** -0.5, len(q_lens)
    ref = sdpa_fp32(c, scale)
    planned = dec.plan_decode(n, max(q_lens), int(c.kv_lens.max()), hq, hkv, d, num_sms=SMS).num_splits
    outs = {}
    for splits in sorted({1, planned, 7}):
        out = outs[splits] = run_decode(decode_kernels, c, list(range(n)), scale, splits)
        assert not (out == 0xFFFF).any(), f"seed {seed}, {splits} splits: some O rows were not written"
        for b in range(n):  # per stream, so a short stream cannot hide behind a long one
            s = slice(c.cu[b], c.cu[b + 1])
            err = rel_err(from_bf16_bits(out[s]), ref[s])
            assert err < 1e-2, f"seed {seed}, {splits} splits: stream {b} (q {q_lens[b]}, kv {c.kv_lens[b]}) rel {err:.3e}"
        # batched == each stream alone with the same split count, bit for bit
        for b in range(n):
            one = run_decode(decode_kernels, c, [b], scale, splits)
            assert np.array_equal(one, out[c.cu[b]:c.cu[b + 1]]), f"seed {seed}, {splits} splits: stream {b} differs"
        # a grid larger than needed (extra splits, kv heads, streams) changes nothing
        again = run_decode(decode_kernels, c, list(range(n)), scale, splits, grid_extra=(1, 1, 2))
        assert np.array_equal(again, out), f"seed {seed}, {splits} splits: oversized grid changed the output"
    for splits, out in outs.items():  # split == unsplit to fp32 reassociation before the bf16 rounding
        if splits == 1:
            continue
        assert rel_err_bf16(out, outs[1]) < 5e-3, f"seed {seed}: {splits} splits vs 1: {rel_err_bf16(out, outs[1]):.3e}"
    # the prefill kernels on the same batch: equal within bf16 tolerance, and no less accurate than them
    for algo, (mod, _) in ALGOS.items():
        if d not in mod.HEAD_DIMS:
            continue
        pre = c.run(kernels[algo, d], list(range(n)), scale)
        assert rel_err_bf16(outs[1], pre) < 1e-2, f"seed {seed}: decode vs {algo} {rel_err_bf16(outs[1], pre):.3e}"
        assert rel_err(from_bf16_bits(outs[planned]), ref) < 2 * rel_err(from_bf16_bits(pre), ref) + 1e-3, f"seed {seed}, {algo}"


#: (D, Hq, Hkv, window_left): the window inside one key tile, across tiles and splits, and longer than every stream.
WINDOWS = [(256, 16, 2, 0), (256, 16, 2, 5), (128, 32, 8, 100), (128, 16, 2, 4095), (64, 8, 2, 1000), (256, 8, 1, 70000)]


@pytest.mark.parametrize("d,hq,hkv,window", WINDOWS, ids=[f"d{w[0]}-w{w[3]}" for w in WINDOWS])
def test_decode_sliding_window(decode_kernels, kernels, d, hq, hkv, window):
    seed, c = _fresh_case([1, 4, 2, 1], [9000, 3000, 30, 40000], hq=hq, hkv=hkv, d=d, bs=16)
    scale = d ** -0.5
    ref = sdpa_fp32(c, scale, window)
    planned = dec.plan_decode(4, 4, int(c.kv_lens.max()), hq, hkv, d, num_sms=SMS, window_left=window).num_splits
    outs = {}
    for splits in sorted({1, planned, 6}):
        out = outs[splits] = run_decode(decode_kernels, c, [0, 1, 2, 3], scale, splits, window_left=window)
        assert not (out == 0xFFFF).any(), f"seed {seed}: some O rows were not written"
        for b in range(4):
            s = slice(c.cu[b], c.cu[b + 1])
            err = rel_err(from_bf16_bits(out[s]), ref[s])
            assert err < 1e-2, f"seed {seed}, {splits} splits: stream {b} rel {err:.3e}"
        one = run_decode(decode_kernels, c, [1], scale, splits, window_left=window)
        assert np.array_equal(one, out[c.cu[1]:c.cu[2]]), f"seed {seed}, {splits} splits: batched != alone"
    for algo, (mod, _) in ALGOS.items():  # the prefill kernels with the same window
        if d in mod.HEAD_DIMS:
            pre = c.run(kernels[algo, d], [0, 1, 2, 3], scale, window_left=window)
            assert rel_err_bf16(outs[1], pre) < 1e-2, f"seed {seed}: decode vs {algo}"


@pytest.mark.parametrize("d,hq,hkv", [(256, 16, 2), (128, 32, 8)])
def test_decode_long_context_many_splits(decode_kernels, d, hq, hkv):
    # 4 streams of 32k keys, decode and a 4-token speculative step: the split plan's count (16 or 4 on the H200) and
    # the most splits a plan takes.
    seed, c = _fresh_case([1, 4, 1, 1], [32767, 30000, 20000, 1], hq=hq, hkv=hkv, d=d, bs=64)
    scale = d ** -0.5
    ref = sdpa_fp32(c, scale)
    planned = dec.plan_decode(4, 4, int(c.kv_lens.max()), hq, hkv, d, num_sms=SMS).num_splits
    assert planned > 1
    for splits in (planned, dec.MAX_SPLITS):
        out = run_decode(decode_kernels, c, [0, 1, 2, 3], scale, splits)
        assert not (out == 0xFFFF).any(), f"seed {seed}: some O rows were not written"
        for b in range(4):
            s = slice(c.cu[b], c.cu[b + 1])
            err = rel_err(from_bf16_bits(out[s]), ref[s])
            assert err < 1e-2, f"seed {seed}, {splits} splits: stream {b} rel {err:.3e}"


@pytest.mark.parametrize("d", [128, 256])
def test_decode_large_logits(decode_kernels, d):
    # Peaked softmax (logits of order 10-50): the running max moves across tiles, key groups and splits.
    seed, c = _fresh_case([1, 4, 2], [3000, 700, 60], hq=8, hkv=1, d=d, bs=16, std=4.0)
    ref = sdpa_fp32(c, 128 ** -0.5)
    for splits in (1, 5):
        out = run_decode(decode_kernels, c, [0, 1, 2], 128 ** -0.5, splits)
        assert rel_err(from_bf16_bits(out), ref) < 1e-2, f"seed {seed}, {splits} splits"


@pytest.mark.parametrize("algo", ["decode", "auto"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_q12pass_decode_equals_the_raw_launches(gpu, decode_kernels, mode, kv_dtype, algo):
    # q12drv's own path (plan, workspace checks, the merge as a programmatic dependent launch; FP8 pools: the FP8
    # split entry and the scales, as tensors) on the raw case's tensors gives the raw launches' bits; algo="auto"
    # with the workspace runs it too (four streams: the plan splits their keys).
    seed, c = _fresh_case([1, 4, 1, 2], [5000, 700, 33, 12000], hq=16, hkv=2, d=256, bs=16)
    f8 = Fp8Pools(decode_kernels, c) if kv_dtype == "fp8_e4m3" else None
    streams = [StreamStageInfo(int(c.kv_lens[b] - c.q_lens[b]), int(c.q_lens[b]), c.tables[b],
                               c.dtables[b].data_ptr()) for b in range(4)]
    shape = AttentionShape(16, 2, 256, 256, kv_dtype=kv_dtype)
    kp, vp, extra = ((c.dk.data_ptr(), c.dv.data_ptr(), {"num_blocks": c.k_pool.shape[0]}) if f8 is None
                     else (f8.k, f8.v, {"k_scale": f8.ks, "v_scale": f8.vs}))  # FP8: tensors say their shapes
    o = torch.full((int(c.cu[-1]), 16, 256), -1, dtype=torch.int16, device="cuda")
    counts = [int(x) for x in c.q_lens]
    with ScratchArena(gpu, make_scratch_plan(counts, 0, False, "exact").total_bytes + 4096) as arena:
        p = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=256, mode=mode)
        plan = p.decode_plan(shape)
        need = p.decode_workspace_bytes(shape)
        ws = torch.full((need // 4,), float("nan"), dtype=torch.float32, device="cuda")
        p.attention(c.dq.data_ptr(), kp, vp, o.data_ptr(), shape, algo=algo, workspace=ws.data_ptr(),
                    workspace_bytes=need, **extra)
        gpu.synchronize()
    raw = run_decode(decode_kernels, c, [0, 1, 2, 3], 256 ** -0.5, plan.num_splits, fp8=f8)
    assert plan.num_splits > 1 and np.array_equal(o.cpu().numpy().view(np.uint16), raw), f"seed {seed}"


# ----------------------------------------------------------------------------- FP8 pools
class Fp8Pools:
    """The case's bf16 pools written whole into e4m3 pools by ``q12_kv_write_fp8`` (a raw launch: every pool slot one
    token, written to its own slot), each KV head's scale its pool's amax / 448 times ``1 + h`` (the heads' scales far
    apart, so a head reading another's shows); the bytes checked against the host quantizer
    (``kv_write.quantize_rows``, what the emulator writes) bit for bit."""

    def __init__(self, funcs, c: Case):
        hkv, d = c.hkv, c.d
        n = c.k_pool.size // (hkv * d)  # pool slots
        scales = [(np.abs(from_bf16_bits(p).reshape(-1, hkv, d)).max(axis=(0, 2)) / E4M3_MAX
                   * (1 + np.arange(hkv))).astype(np.float32) for p in (c.k_pool, c.v_pool)]
        self.ks_host, self.vs_host = scales
        self.ks, self.vs = (torch.from_numpy(x).cuda() for x in scales)
        self.k, self.v = (torch.zeros(c.k_pool.shape, dtype=torch.uint8, device="cuda") for _ in range(2))
        slots = torch.arange(n, dtype=torch.int64, device="cuda")
        meta = Q12MetaC(slots=slots.data_ptr(), total_tokens=n)
        grid, block, smem = kw.geometry_fp8(n, hkv * d, num_sms=SMS)
        _launch(funcs["q12_kv_write_fp8"], grid, block, smem,
                [meta, *map(ctypes.c_uint64, (c.dk.data_ptr(), c.dv.data_ptr(), self.k.data_ptr(), self.v.data_ptr(),
                                              self.ks.data_ptr(), self.vs.data_ptr())),
                 ctypes.c_int(d), ctypes.c_int(hkv * d), ctypes.c_longlong(n)])
        torch.cuda.synchronize()
        self.k_host, self.v_host = self.k.cpu().numpy(), self.v.cpu().numpy()
        for got, pool, scale in ((self.k_host, c.k_pool, self.ks_host), (self.v_host, c.v_pool, self.vs_host)):
            want = kw.quantize_rows(pool.reshape(n, hkv * d), scale, d).reshape(pool.shape)
            assert np.array_equal(got, want), "q12_kv_write_fp8 differs from the host quantizer"
        self.hkv, self.d = hkv, d

    def dequantized(self) -> tuple:
        """K and V pool rows ``[slots, Hkv, D]`` as fp32 device tensors: e4m3 value * its head's scale."""
        return tuple(torch.from_numpy(from_e4m3_bits(x).reshape(-1, self.hkv, self.d) * s[None, :, None]).cuda()
                     for x, s in ((self.k_host, self.ks_host), (self.v_host, self.vs_host)))

    def model(self, c: Case, scale: float, num_splits: int, window_left: int | None = None) -> np.ndarray:
        """The emulator's model of the FP8 entries on these pools."""
        return dec.model(c.q, self.k_host, self.v_host, c.cu, c.kv_lens, c.tables, c.hq, c.hkv, c.bs, scale,
                         num_splits, window_left, k_scale=self.ks_host, v_scale=self.vs_host)


#: CASES' D256, D128 and D64 shapes, GQA 8, 4, 16 and 1, q_len 1 to 8; and sliding windows on two of them.
FP8_CASES = [(c, None) for c in (CASES[0], CASES[1], CASES[3], CASES[5], CASES[7], CASES[8])] + \
    [(CASES[1], 70), (CASES[4], 1000)]


@pytest.mark.parametrize("case,window", FP8_CASES,
                         ids=[f"d{c[0]}-bs{c[1]}-gqa{c[2] // c[3]}-w{w}" for c, w in FP8_CASES])
def test_decode_reads_fp8_pools(decode_kernels, case, window):
    d, bs, hq, hkv, q_lens, prefixes = case
    seed, c = _fresh_case(q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    f8 = Fp8Pools(decode_kernels, c)
    scale, n = d ** -0.5, len(q_lens)
    wl = dec.window_argument(window)
    ref = sdpa_fp32(c, scale, window, fp8=f8)  # torch, fp32, on the dequantized gathered K/V
    planned = dec.plan_decode(n, max(q_lens), int(c.kv_lens.max()), hq, hkv, d, num_sms=SMS, window_left=window,
                              kv_dtype="fp8_e4m3").num_splits
    bf16 = run_decode(decode_kernels, c, list(range(n)), scale, 1, window_left=wl)  # the case's own bf16 pools
    outs = {}
    for splits in sorted({1, planned, 7}):
        out = outs[splits] = run_decode(decode_kernels, c, list(range(n)), scale, splits, window_left=wl, fp8=f8)
        assert not (out == 0xFFFF).any(), f"seed {seed}, {splits} splits: some O rows were not written"
        err = rel_err_bf16(out, bf16)
        assert err < FP8_VS_BF16_BATCH, f"seed {seed}, {splits} splits: vs the bf16 decode {err:.3e}"
        for b in range(n):
            s = slice(c.cu[b], c.cu[b + 1])
            err = rel_err(from_bf16_bits(out[s]), ref[s])
            assert err < 1e-2, f"seed {seed}, {splits} splits: stream {b} vs SDPA on the dequantized K/V rel {err:.3e}"
            err = rel_err_bf16(out[s], bf16[s])
            assert err < FP8_VS_BF16_STREAM, f"seed {seed}, {splits} splits: stream {b} vs the bf16 decode {err:.3e}"
            one = run_decode(decode_kernels, c, [b], scale, splits, window_left=wl, fp8=f8)
            assert np.array_equal(one, out[s]), f"seed {seed}, {splits} splits: stream {b} batched != alone"
        again = run_decode(decode_kernels, c, list(range(n)), scale, splits, grid_extra=(1, 1, 2), window_left=wl,
                           fp8=f8)
        assert np.array_equal(again, out), f"seed {seed}, {splits} splits: oversized grid changed the output"
        err = rel_err_bf16(out, f8.model(c, scale, splits, window))  # the emulator's model of these entries
        assert err < 4e-3, f"seed {seed}, {splits} splits: vs the emulator's model {err:.3e}"
    for splits, out in outs.items():
        if splits == 1:
            continue
        assert rel_err_bf16(out, outs[1]) < 5e-3, f"seed {seed}: {splits} splits vs 1"


def test_attention_layer_with_a_workspace_runs_the_decode_kernel_on_gpu(gpu, monkeypatch):
    """``attention_layer(..., workspace=)`` on the GPU: RoPE, the KV write and the split decode kernel give the bits
    of the three ops called one by one (the emulator test's body)."""
    made = []

    def batch(*args, **kw):
        made.append(DecodeBatch(gpu, *args, **kw))
        return made[-1]

    try:
        check_attention_layer_decode(gpu, batch, monkeypatch)
    finally:
        for b in made:
            b.close()
