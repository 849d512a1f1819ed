"""FP8 (e4m3) KV pools read by the decode attention kernel (``q12_attn_decode_fp8_d64`` / ``_d128`` / ``_d256``) on the
emulated driver: the numpy model (the kernels' own steps: the raw e4m3 values in the MMAs, ``scale * k_scale[h]``
folded into the scores' constant, ``v_scale[h]`` into the row's ``1 / L``) against a float64 reference on the
dequantized pools, and against the bf16 decode of the K/V the pools were quantized from; batched == per stream bit
for bit; split == unsplit; the launches through ``Q12Pass.attention`` and ``ops.attention``; bad input refused with
nothing written. The GPU side: tests/gpu/test_attention_decode_gpu.py.

Tolerances: against the float64 reference on the dequantized pools, the bf16 path's (relative L2 error below 4e-3,
every element within 2 bf16 ulps plus 4e-3); split against unsplit, the bf16 path's (1e-3, 1 ulp plus 2e-3).
Against the bf16 decode of the original K/V (Gaussian K and V, each KV head's scale its pool's amax / 448, as
``q12_kv_write_fp8`` quantizes): measured 2.8% to 3.7% relative L2 error a batch (mean 3.2%) and at most 4.0% a
stream over MODEL_CASES x 3 seeds, split or not: e4m3's 3 mantissa bits (a value's rounding error up to 2^-4 of it,
3.6% RMS); held below :data:`FP8_VS_BF16_BATCH` a batch and :data:`FP8_VS_BF16_STREAM` a stream.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from q12drv import stage_batched_attn_metadata
from q12drv.core.bf16 import from_bf16_bits
from q12drv.core.fp8 import E4M3_MAX, from_e4m3_bits
from q12drv.kernels import attention_decode as dec
from q12drv.kernels import kv_write as kw
from q12drv.kernels import ops
from q12drv.prefill import Q12Pass
from tests.helpers import rel_err, rel_err_bf16
from tests.test_interop import CAI
from tests.test_kernel_attention import make_case
from tests.test_kernel_attention_decode import MODEL_CASES, DecodeBatch, batch  # noqa: F401  (batch: a fixture)

FP8 = "fp8_e4m3"
#: The FP8 decode against the bf16 decode of the original K/V: relative L2 error bounds (measured: 3.7% and 4.0%).
FP8_VS_BF16_BATCH = 4.5e-2
FP8_VS_BF16_STREAM = 6e-2


def quantize(pool: np.ndarray, hkv: int, d: int, spread: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(e4m3 bytes, scales)`` of a bf16 pool as ``q12_kv_write_fp8`` writes it: each KV head's scale its values'
    amax / 448 (``spread``: times ``1 + h``, so the heads' scales differ by far and a head mix-up shows)."""
    x = from_bf16_bits(pool).reshape(-1, hkv, d)
    scale = np.abs(x).max(axis=(0, 2)) / E4M3_MAX * ((1 + np.arange(hkv)) if spread else 1)
    scale = scale.astype(np.float32)
    return kw.quantize_rows(pool.reshape(-1, hkv * d), scale, d).reshape(pool.shape), scale


def dequantized_reference(q, k8, v8, ks, vs, cu, kv_lens, tables, hq, hkv, bs, scale, window_left=None) -> np.ndarray:
    """Paged causal attention in float64 on the dequantized pools (``e4m3 value * scale[h]``), each stream's keys
    gathered through its block table, bottom-right causal (and ``window_left`` keys left of the query): ``[T, Hq, D]``
    float64, written independently of the kernels' model."""
    g = hq // hkv
    kf = from_e4m3_bits(k8).astype(np.float64).reshape(-1, hkv, k8.shape[-1]) * ks.astype(np.float64)[None, :, None]
    vf = from_e4m3_bits(v8).astype(np.float64).reshape(-1, hkv, v8.shape[-1]) * vs.astype(np.float64)[None, :, None]
    qf = from_bf16_bits(q).astype(np.float64)
    out = np.zeros(qf.shape)
    for b in range(len(kv_lens)):
        kv, s0, s1 = int(kv_lens[b]), int(cu[b]), int(cu[b + 1])
        pos = np.arange(kv)
        slots = np.asarray(tables[b], np.int64)[pos // bs] * bs + pos % bs
        for i in range(s1 - s0):
            last = kv - (s1 - s0) + i
            first = 0 if window_left is None else max(0, last - window_left)
            for h in range(hq):
                k = kf[slots[first:last + 1], h // g]  # [keys, D]
                logits = k @ qf[s0 + i, h] * scale
                p = np.exp(logits - logits.max())
                out[s0 + i, h] = (p / p.sum()) @ vf[slots[first:last + 1], h // g]
    return out


def _case(case, seed, spread=True):
    q_lens, prefixes, hq, hkv, d, bs = case
    q, kp, vp, cu, kv, tables = make_case(np.random.default_rng(seed), q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    k8, ks = quantize(kp, hkv, d, spread)
    v8, vs = quantize(vp, hkv, d, spread)
    return q, kp, vp, k8, v8, ks, vs, cu, kv, tables


def _close(got_bits, want, rtol, atol):
    np.testing.assert_allclose(from_bf16_bits(got_bits).astype(np.float64), want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# the numpy model


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("case", MODEL_CASES, ids=[f"d{c[4]}-bs{c[5]}-g{c[2] // c[3]}-q{max(c[0])}" for c in MODEL_CASES])
def test_fp8_model_matches_the_float64_reference_on_the_dequantized_pools(case, window):
    q_lens, _, hq, hkv, d, bs = case
    q, _, _, k8, v8, ks, vs, cu, kv, tables = _case(case, 3 + d)
    scale = d ** -0.5
    ref = dequantized_reference(q, k8, v8, ks, vs, cu, kv, tables, hq, hkv, bs, scale, window)
    run = lambda splits, qq=q, c=cu, k=kv, t=tables: dec.model(qq, k8, v8, c, k, t, hq, hkv, bs, scale, splits,  # noqa: E731
                                                              window, k_scale=ks, v_scale=vs)
    one = run(1)
    assert rel_err(from_bf16_bits(one), ref) < 4e-3
    _close(one, ref, 2 ** -6, 4e-3)
    for splits in (2, 5, 64):
        got = run(splits)
        assert rel_err_bf16(got, one) < 1e-3, splits
        _close(got, from_bf16_bits(one).astype(np.float64), 2 ** -7, 2e-3)
        for b in range(len(q_lens)):  # batched == each stream alone, bit for bit
            s = slice(cu[b], cu[b + 1])
            alone = run(splits, q[s], np.array([0, q_lens[b]]), kv[b:b + 1], [tables[b]])
            assert np.array_equal(alone, got[s]), (splits, b)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[f"d{c[4]}-bs{c[5]}-g{c[2] // c[3]}-q{max(c[0])}" for c in MODEL_CASES])
def test_fp8_decode_against_the_bf16_decode_of_the_original_kv(case):
    q_lens, _, hq, hkv, d, bs = case
    for seed in range(3):
        q, kp, vp, k8, v8, ks, vs, cu, kv, tables = _case(case, 100 * seed + d, spread=False)
        for splits in (1, 5):
            bf16 = dec.model(q, kp, vp, cu, kv, tables, hq, hkv, bs, d ** -0.5, splits)
            fp8 = dec.model(q, k8, v8, cu, kv, tables, hq, hkv, bs, d ** -0.5, splits, k_scale=ks, v_scale=vs)
            err = rel_err_bf16(fp8, bf16)
            assert 1e-2 < err < FP8_VS_BF16_BATCH, (seed, splits, err)  # e4m3's rounding, no more
            for b in range(len(q_lens)):
                s = slice(cu[b], cu[b + 1])
                assert rel_err_bf16(fp8[s], bf16[s]) < FP8_VS_BF16_STREAM, (seed, splits, b)


def test_fp8_model_folds_the_scales_into_the_math():
    # (scale * k_scale) is one constant: scale / 2 with k_scale * 2 gives the same bits; v_scale multiplies the row's
    # 1 / L, so v_scale * 2 doubles every output exactly; each head reads its own scales.
    case = MODEL_CASES[2]
    _, _, hq, hkv, d, bs = case
    q, _, _, k8, v8, ks, vs, cu, kv, tables = _case(case, 5)
    run = lambda scale, k, v: dec.model(q, k8, v8, cu, kv, tables, hq, hkv, bs, scale, 3, k_scale=k, v_scale=v)  # noqa: E731
    base = run(0.125, ks, vs)
    assert np.array_equal(run(0.0625, ks * 2, vs), base)
    assert np.array_equal(from_bf16_bits(run(0.125, ks, vs * 2)), 2 * from_bf16_bits(base))
    other = vs.copy()
    other[1] *= 3
    moved = from_bf16_bits(run(0.125, ks, other)).reshape(len(q), hkv, hq // hkv, d)
    want = from_bf16_bits(base).reshape(len(q), hkv, hq // hkv, d)
    assert np.array_equal(np.delete(moved, 1, axis=1), np.delete(want, 1, axis=1))  # the other heads untouched
    assert not np.array_equal(moved[:, 1], want[:, 1])
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        dec.model(q, k8, v8, cu, kv, tables, hq, hkv, bs, 0.1, 1, k_scale=ks)
    with pytest.raises(ValueError, match="scales are for kv_dtype='fp8_e4m3'"):  # bf16 pools with scales
        dec.model(q, np.zeros(4, np.uint16), np.zeros(4, np.uint16), cu, kv, tables, hq, hkv, bs, 0.1, 1, k_scale=ks,
                  v_scale=vs)
    with pytest.raises(ValueError, match="both be uint16"):
        dec.model(q, k8, np.zeros(4, np.uint16), cu, kv, tables, hq, hkv, bs, 0.1, 1, k_scale=ks, v_scale=vs)


# ---------------------------------------------------------------------------------------------
# the emulated launches


class Fp8Batch:
    """A :class:`~tests.test_kernel_attention_decode.DecodeBatch` plus its pools quantized to e4m3 (per-head scales,
    spread apart) in device buffers of their own."""

    def __init__(self, c: DecodeBatch):
        self.c = c
        self.k8, self.ks = quantize(c.host["k_pool"], c.hkv, c.d, spread=True)
        self.v8, self.vs = quantize(c.host["v_pool"], c.hkv, c.d, spread=True)
        self.bufs = {}
        for name, a in (("k8", self.k8), ("v8", self.v8), ("ks", self.ks), ("vs", self.vs)):
            self.bufs[name] = c.dev.alloc(a.nbytes, name)
            c.dev.upload(self.bufs[name].ptr, a)
        self.shape = dataclasses.replace(c.shape, kv_dtype=FP8)

    def ptr(self, name: str) -> int:
        return int(self.bufs[name].ptr)

    def model(self, splits: int) -> np.ndarray:
        c = self.c
        return dec.model(c.host["q"], self.k8, self.v8, c.cu, c.kv, [s.block_table for s in c.streams], c.hq, c.hkv,
                         c.bs, c.d ** -0.5, splits, k_scale=self.ks, v_scale=self.vs)

    def close(self) -> None:
        for b in self.bufs.values():
            b.free()


@pytest.fixture
def fp8_batch(batch):
    made = []

    def make(*args, **kw):
        made.append(Fp8Batch(batch(*args, **kw)))
        return made[-1]

    yield make
    for b in made:
        b.close()


@pytest.mark.parametrize("d,hq,hkv", [(128, 32, 8), (256, 16, 2), (64, 8, 1)])
def test_pass_reads_fp8_pools_batched_and_per_stream_as_the_model(fp8_batch, d, hq, hkv):
    f = fp8_batch([1, 4, 1, 2, 1], [300, 45, 1000, 9, 0], hq, hkv, d)
    c = f.c
    q, o = int(c.bufs["q"].ptr), int(c.o.ptr)
    for splits in (None, 1, 3):
        outs = {}
        for mode in ("batched", "per_stream"):
            p = Q12Pass(c.arena, c.streams, block_size=c.bs, use_mrope=False, dummy_kv_block=0, head_dim=d, mode=mode)
            plan = p.decode_plan(f.shape, splits)
            assert plan.kv_dtype == FP8 and plan.entry == dec.FP8_ENTRIES[d]
            assert plan.num_splits == p.decode_plan(c.shape, splits).num_splits  # the bf16 plan's split count
            need = p.decode_workspace_bytes(f.shape, splits)
            ws = c.workspace(need)
            c.poison()
            c.dev.driver.start_trace()
            p.attention(q, f.ptr("k8"), f.ptr("v8"), o, f.shape, num_blocks=c.num_blocks, algo="decode",
                        num_splits=splits, workspace=ws, workspace_bytes=need, k_scale=f.ptr("ks"),
                        v_scale=f.ptr("vs"))
            launches = [x for x in c.dev.driver.stop_trace() if "Launch" in x]
            assert len(launches) == (1 + (plan.num_splits > 1)) * (1 if mode == "batched" else len(c.counts))
            outs[mode] = c.out()
        c.poison()  # algo="auto" reads FP8 pools with the decode kernel (the one that reads them)
        p.attention(q, f.ptr("k8"), f.ptr("v8"), o, f.shape, num_blocks=c.num_blocks, num_splits=splits, workspace=ws,
                    workspace_bytes=need, k_scale=f.ptr("ks"), v_scale=f.ptr("vs"))
        assert np.array_equal(c.out(), outs["per_stream"]), splits
        assert not (outs["batched"] == 0xFFFF).any(), "rows left unwritten"
        assert np.array_equal(outs["batched"], outs["per_stream"]), splits
        assert np.array_equal(outs["batched"], f.model(plan.num_splits)), splits
    assert plan.num_splits == 3


def test_ops_attention_reads_fp8_pools(fp8_batch, emu):
    f = fp8_batch([1, 1, 3], [2000, 70, 500], 16, 2, 256)
    c = f.c
    meta = stage_batched_attn_metadata(c.arena, c.streams, block_size=c.bs, use_mrope=False, scratch_offset_bytes=0,
                                       dummy_kv_block=0)
    plan = dec.plan_decode(3, 3, 2001, 16, 2, 256, num_sms=emu.sm_count, kv_dtype=FP8)
    assert plan.num_splits > 1
    ws = c.workspace(plan.workspace_bytes_for(c.t))
    q, o = int(c.bufs["q"].ptr), int(c.o.ptr)
    heads = dict(num_q_heads=16, num_kv_heads=2, head_dim=256, algo="decode", kv_dtype=FP8, k_scale=f.ptr("ks"),
                 v_scale=f.ptr("vs"))
    c.poison()
    ops.attention(emu, meta, q, f.ptr("k8"), f.ptr("v8"), o, **heads, workspace=ws, workspace_bytes=c.ws_bytes)
    got = c.out()
    assert np.array_equal(got, f.model(plan.num_splits))
    ref = dequantized_reference(c.host["q"], f.k8, f.v8, f.ks, f.vs, c.cu, c.kv, [s.block_table for s in c.streams],
                                16, 2, c.bs, 256 ** -0.5)
    assert rel_err(from_bf16_bits(got), ref) < 4e-3
    c.poison()  # one split: no workspace
    ops.attention(emu, meta, q, f.ptr("k8"), f.ptr("v8"), o, **heads, num_splits=1)
    assert np.array_equal(c.out(), f.model(1))
    # pool tensors say their type: bytes (torch's float8_e4m3fn reads the same) pass
    pool = (c.num_blocks, c.bs, 2, 256)
    c.poison()
    ops.attention(emu, meta, q, CAI(f.ptr("k8"), pool, "|u1"), CAI(f.ptr("v8"), pool, "|u1"), o, **heads,
                  num_splits=1)
    assert np.array_equal(c.out(), f.model(1))


def test_bad_fp8_input_is_refused_with_nothing_written(fp8_batch, emu):
    f = fp8_batch([1, 2, 1], [500, 600, 700], 16, 2, 128)
    c = f.c
    p, ws, need = c.refusal_pass(f.shape, 2)
    q, kp, vp, o = c.ptrs()
    k8, v8, ks, vs = f.ptr("k8"), f.ptr("v8"), f.ptr("ks"), f.ptr("vs")
    pool = (c.num_blocks, c.bs, 2, 128)
    args = {"q": q, "k_pool": k8, "v_pool": v8, "o": o, "shape": f.shape, "algo": "decode", "num_splits": 2,
            "workspace": ws, "workspace_bytes": need, "k_scale": ks, "v_scale": vs}

    def call(**kw):
        a = {**args, **kw}
        p.attention(a.pop("q"), a.pop("k_pool"), a.pop("v_pool"), a.pop("o"), a.pop("shape"), num_blocks=c.num_blocks,
                    **a)

    decode_hint = r"FP8 pools are read by algo='decode' \(passes whose every stream has at most 8 new tokens"
    cases = [
        ({"k_scale": None}, "shape.kv_dtype='fp8_e4m3' needs k_scale and v_scale"),
        ({"v_scale": None}, "needs k_scale and v_scale"),
        ({"shape": c.shape, "k_pool": kp, "v_pool": vp}, "scales are for shape.kv_dtype='fp8_e4m3'"),
        ({"algo": "mma"}, decode_hint),
        ({"algo": "wgmma"}, decode_hint),
        ({"k_scale": ks + 2}, "k_scale must be 4-byte aligned"),
        ({"v_pool": v8 + 8}, "v_pool must be 16-byte aligned"),
        # bf16 pools given to an FP8 shape, and FP8 pools to a bf16 shape (tensors say their type)
        ({"k_pool": CAI(kp, pool, "<V2"), "v_pool": CAI(vp, pool, "<V2")}, "k_pool must be f8e4m3 or u8, got a bf16"),
        ({"shape": c.shape, "k_scale": None, "v_scale": None, "k_pool": CAI(k8, pool, "|u1"),
          "v_pool": CAI(v8, pool, "|u1")}, "k_pool must be bf16, got a u8"),
        ({"k_pool": CAI(k8, (c.num_blocks, c.bs, 2, 64), "|u1")}, r"k_pool must have shape"),
        ({"shape": dataclasses.replace(f.shape, kv_dtype="fp8")}, "shape.kv_dtype must be one of"),
        ({"workspace": None}, "needs workspace="),
    ]
    for bad, match in cases:
        emu.driver.start_trace()
        with pytest.raises((TypeError, ValueError), match=match):
            call(**bad)
        assert emu.driver.stop_trace() == [], bad  # no launch, no copy
    # the one-kernel layer refuses FP8 pools, naming the decode path
    with pytest.raises(ValueError, match=r"an attention layer runs a prefill kernel, .*" + decode_hint):
        p.attention_layer(q, q, q, k8, v8, o, f.shape, num_blocks=c.num_blocks)
    # algo="auto" reads FP8 pools with the decode kernel; a pass that kernel does not take (9 new tokens) is refused
    long = fp8_batch([9, 1], [100, 50], 16, 2, 128).c
    lp = Q12Pass(long.arena, long.streams, block_size=long.bs, use_mrope=False, dummy_kv_block=0, head_dim=128)
    long.poison()
    before = long.out()
    emu.driver.start_trace()
    with pytest.raises(ValueError, match=r"algo='auto' runs a prefill kernel, which reads bf16 pools; " + decode_hint):
        lp.attention(long.ptrs()[0], f.ptr("k8"), f.ptr("v8"), long.ptrs()[3], f.shape, num_blocks=c.num_blocks,
                     k_scale=ks, v_scale=vs)
    assert emu.driver.stop_trace() == [] and np.array_equal(long.out(), before)
    # ops.attention: the same refusals
    meta = p.meta
    heads = dict(num_q_heads=16, num_kv_heads=2, head_dim=128)
    for bad, match in (({"algo": "decode", "kv_dtype": FP8}, "kv_dtype='fp8_e4m3' needs k_scale and v_scale"),
                      ({"algo": "decode", "kv_dtype": FP8, "k_scale": ks}, "needs k_scale and v_scale"),
                      ({"algo": "decode", "k_scale": ks, "v_scale": vs}, "scales are for kv_dtype='fp8_e4m3'"),
                      ({"algo": "mma", "kv_dtype": FP8, "k_scale": ks, "v_scale": vs},
                       r"algo='mma' runs a prefill kernel, which reads bf16 pools; algo='decode' reads FP8 pools"),
                      ({"algo": "auto", "kv_dtype": FP8}, "needs k_scale and v_scale"),
                      ({"algo": "decode", "kv_dtype": "e4m3"}, "kv_dtype must be one of")):
        emu.driver.start_trace()
        with pytest.raises(ValueError, match=match):
            ops.attention(emu, meta, q, k8, v8, o, **heads, num_splits=1, **bad)
        assert emu.driver.stop_trace() == [], bad
    assert c.unchanged()
    # and the same call with its arguments right runs (the FP8 split entry, then the merge)
    emu.driver.start_trace()
    call()
    assert [x for x in emu.driver.stop_trace() if "Launch" in x] == ["cuLaunchKernel", "cuLaunchKernel"]
    assert np.array_equal(c.out(), f.model(2))
