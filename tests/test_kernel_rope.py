"""CPU tests of RoPE / MRoPE: NVRTC compile, numpy reference, emulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import FakeMem, spill_free
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels import rope
from q12drv.kernels.meta import Q12MetaC


# ----------------------------------------------------------------------------- fake device memory
def rand_bf16(rng, shape, scale=2.0):
    return to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale)


def make_meta(mem: FakeMem, pos_t, pos_h=None, pos_w=None, lens=None):
    T = len(pos_t)
    lens = [T] if lens is None else list(lens)
    cu = np.zeros(len(lens) + 1, np.int32)
    cu[1:] = np.cumsum(lens)
    pt = mem.put(np.asarray(pos_t, np.uint32))
    ph = pt if pos_h is None else mem.put(np.asarray(pos_h, np.uint32))
    pw = pt if pos_w is None else mem.put(np.asarray(pos_w, np.uint32))
    return Q12MetaC(
        positions=pt,
        positions_h=ph,
        positions_w=pw,
        slots=0,
        block_table_ptrs=0,
        seq_len_ptrs=0,
        cu_seqlens=mem.put(cu),
        kv_lens=mem.put(np.array(lens, np.int32)),
        batch_size=len(lens),
        chunk_len=max(lens),
        total_tokens=T,
        max_blocks_per_seq=0,
    )


def emulate(mem, meta, q, k, d, rd, theta, mode=0, sections=(0, 0, 0), grid=None, block=None, scaling=None):
    """Run the emulator in place on q, k (numpy arrays registered in mem)."""
    hq, hkv = q.shape[1], k.shape[1]
    g, b, smem = rope.geometry(int(meta.total_tokens), hq, hkv, d, rd)
    assert smem == 0
    args = {
        "m": meta,
        "q": q.ctypes.data,
        "k": k.ctypes.data,
        "num_q_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": d,
        "rotary_dim": rd,
        "theta": float(theta),
        "mrope_mode": mode,
        "sec_t": sections[0],
        "sec_h": sections[1],
        "sec_w": sections[2],
        "table": rope.NO_TABLE if scaling is None else scaling.table(),
    }
    rope.EMULATORS["q12_rope"](args, mem, grid or g, block or b)


# ----------------------------------------------------------------------------- textbook (HF structure, float64)
def textbook(x_bits, pos3, rd, theta, mode, sections):
    """HF's structure in float64: freqs, cat(freqs, freqs), MRoPE selection HF's way, rotate_half."""
    x = from_bf16_bits(x_bits).astype(np.float64)
    half = rd // 2
    inv = float(theta) ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)  # [half]
    freqs3 = pos3.astype(np.float64)[:, :, None] * inv[None, None, :]  # [3, T, half]
    if mode == 0:
        freqs = freqs3[0]
        emb = np.concatenate([freqs, freqs], axis=-1)
    elif mode == 1:
        # Qwen2-VL apply_multimodal_rotary_pos_emb: split emb by mrope_section * 2, chunk i takes stream i % 3.
        emb3 = np.concatenate([freqs3, freqs3], axis=-1)  # [3, T, rd]
        bounds = np.cumsum(list(sections) * 2)[:-1]
        chunks = np.split(emb3, bounds, axis=-1)
        emb = np.concatenate([c[i % 3] for i, c in enumerate(chunks)], axis=-1)
    else:
        # Qwen3-VL / Qwen3.5 interleaved: start from T, overwrite slice(offset, 3*sec, 3) from H and W.
        freqs = freqs3[0].copy()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, sections[dim] * 3, 3)
            freqs[..., idx] = freqs3[dim][..., idx]
        emb = np.concatenate([freqs, freqs], axis=-1)
    cos = np.cos(emb)[:, None, :]
    sin = np.sin(emb)[:, None, :]
    xr = x[..., :rd]
    rot_half = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = x.copy()
    out[..., :rd] = xr * cos + rot_half * sin
    return out


def assert_close_bf16(out_bits, ref64, what):
    out = from_bf16_bits(out_bits).astype(np.float64)
    # One bf16 rounding of a value computed slightly differently: 1 ulp (2^-8 relative) + tiny abs.
    tol = 2.0**-7 * np.abs(ref64) + 1e-3
    bad = np.abs(out - ref64) > tol
    assert not bad.any(), f"{what}: {bad.sum()} elements off, max err {np.abs(out - ref64).max()}"


# ----------------------------------------------------------------------------- compile
def test_compiles_without_spills(kernel_build):
    img = kernel_build(rope.SOURCE, "sm_90")
    assert img.image
    report = spill_free(img, rope.ENTRIES, stack=False)
    # The largest block the emulator accepts must be launchable: registers x threads <= 64K.
    regs = report[rope.ENTRIES[0]].registers
    assert regs * rope.MAX_THREADS <= 65536, img.log
    # The persistent grid assumes rope._CTAS_PER_SM resident CTAs of rope.THREADS per SM.
    assert regs * rope.THREADS * rope._CTAS_PER_SM <= 65536, img.log
    smem = report[rope.ENTRIES[0]].static_smem
    assert smem * rope._CTAS_PER_SM <= 227 * 1024 and smem <= 48 * 1024, img.log


def test_entries_match_source():
    from q12drv.core.launch import parse_signatures
    from q12drv.core.nvrtc import cuda_src_dir

    sigs = parse_signatures((cuda_src_dir() / rope.SOURCE).read_text(), {"Q12Meta": Q12MetaC,
                                                                           "RopeTable": rope.RopeTableC})
    assert tuple(sigs) == rope.ENTRIES
    assert [name for name, _ in sigs["q12_rope"]] == [
        "m", "q", "k", "num_q_heads", "num_kv_heads", "head_dim", "rotary_dim", "theta",
        "mrope_mode", "sec_t", "sec_h", "sec_w", "table",
    ]  # fmt: skip
    assert set(rope.EMULATORS) == set(rope.ENTRIES)


# ----------------------------------------------------------------------------- maps and frequencies
def test_axis_maps_of_real_models():
    # Qwen3.5 [11, 11, 10] interleaved over 32 frequencies.
    ax = rope.axis_map(32, rope.MROPE_INTERLEAVED, (11, 11, 10))
    assert np.flatnonzero(ax == 0).tolist() == list(range(0, 31, 3))
    assert np.flatnonzero(ax == 1).tolist() == list(range(1, 32, 3))
    assert np.flatnonzero(ax == 2).tolist() == list(range(2, 30, 3))
    # Qwen3-VL [24, 20, 20] over 64: T gets {0, 3, ..., 57} and {60..63}.
    ax = rope.axis_map(64, rope.MROPE_INTERLEAVED, (24, 20, 20))
    assert np.flatnonzero(ax == 0).tolist() == list(range(0, 58, 3)) + [60, 61, 62, 63]
    assert (ax == 1).sum() == 20 and (ax == 2).sum() == 20
    # Qwen2-VL [16, 24, 24] chunked over 64.
    ax = rope.axis_map(64, rope.MROPE_CHUNKED, (16, 24, 24))
    assert ax.tolist() == [0] * 16 + [1] * 24 + [2] * 24
    assert (rope.axis_map(7, rope.MROPE_OFF) == 0).all()


@pytest.mark.parametrize("rd,theta", [(64, 1e7), (128, 1e6), (128, 1e4), (32, 5e6)])
def test_inv_freq(rd, theta):
    inv = rope.inv_freq(rd, theta)
    assert inv.dtype == np.float32 and inv.shape == (rd // 2,)
    exact = float(theta) ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    # within 1 fp32 ulp of the exact value (two roundings)
    assert np.all(np.abs(inv.astype(np.float64) - exact) <= 1.2e-7 * exact)
    # and exactly HF's fp32 chain: 1 / fl32(theta ** fl32(2j / rd))
    e = np.arange(0, rd, 2).astype(np.float32) / np.float32(rd)
    p = np.float32(np.float64(theta) ** e.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(inv, np.float32(1) / p)


# ----------------------------------------------------------------------------- reference
CASES = [
    # D, rd, Hq, Hkv, theta, mode, sections
    (64, 64, 4, 2, 1e4, 0, (0, 0, 0)),
    (128, 128, 4, 1, 1e6, 1, (16, 24, 24)),
    (128, 128, 2, 2, 5e6, 2, (24, 20, 20)),
    (256, 64, 4, 2, 1e7, 2, (11, 11, 10)),
    (256, 64, 3, 1, 1e7, 0, (0, 0, 0)),
    (128, 96, 2, 1, 1e4, 1, (8, 20, 20)),
]


@pytest.mark.parametrize("d,rd,hq,hkv,theta,mode,sec", CASES)
def test_reference_matches_textbook(d, rd, hq, hkv, theta, mode, sec):
    rng = np.random.default_rng(d + rd + mode)
    T = 37
    pos3 = rng.integers(0, 3000, (3, T)).astype(np.uint32)
    if mode == 0:
        pos3[1:] = pos3[0]
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    qo, ko = rope.reference(q, k, pos3[0], rd, theta, mode, sec, pos3[1], pos3[2])
    assert_close_bf16(qo, textbook(q, pos3, rd, theta, mode, sec), "q")
    assert_close_bf16(ko, textbook(k, pos3, rd, theta, mode, sec), "k")
    # Dims >= rd untouched, bit for bit; inputs untouched.
    np.testing.assert_array_equal(qo[..., rd:], q[..., rd:])
    np.testing.assert_array_equal(ko[..., rd:], k[..., rd:])
    assert (qo[..., :rd] != q[..., :rd]).any()


@pytest.mark.parametrize("d,rd,hq,hkv,theta,mode,sec", CASES)
def test_reference_vs_hf_bf16_formula(d, rd, hq, hkv, theta, mode, sec):
    # Large positions too (MRoPE temporal positions reach ~1e6); HF rounds cos/sin to bf16.
    rng = np.random.default_rng(5 + d + mode)
    T = 50
    pos3 = rng.integers(0, 1_000_000, (3, T)).astype(np.uint32)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    qo, ko = rope.reference(q, k, pos3[0], rd, theta, mode, sec, pos3[1], pos3[2])
    for x, out in ((q, qo), (k, ko)):
        hf = from_bf16_bits(rope.hf_style_reference(x, pos3[0], rd, theta, mode, sec, pos3[1], pos3[2]))
        o = from_bf16_bits(out)
        rel = np.linalg.norm(o - hf) / np.linalg.norm(hf)
        assert rel < 1e-2, rel


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(1, 20),
    half8=st.integers(1, 8),
    mode=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
    big=st.booleans(),
)
def test_mrope_with_equal_streams_is_plain_rope_bitwise(T, half8, mode, seed, big):
    rng = np.random.default_rng(seed)
    rd = 16 * half8
    half = rd // 2
    cut = sorted(rng.integers(0, half + 1, 2).tolist())
    sec = (cut[0], cut[1] - cut[0], half - cut[1])
    d = rd + 8 * int(rng.integers(0, 3))
    pos = rng.integers(0, 2_000_000 if big else 5000, T).astype(np.uint32)
    q = rand_bf16(rng, (T, 2, d))
    k = rand_bf16(rng, (T, 1, d))
    plain = rope.reference(q, k, pos, rd, 1e6, 0)
    mr = rope.reference(q, k, pos, rd, 1e6, mode, sec, pos.copy(), pos.copy())
    np.testing.assert_array_equal(plain[0], mr[0])
    np.testing.assert_array_equal(plain[1], mr[1])
    # emulator: same property, and the plain emulator equals the reference
    mem = FakeMem()
    q0, k0, q1, k1 = (mem.put(a.copy()) for a in (q, k, q, k))
    q0a, k0a, q1a, k1a = (mem.array(p, np.uint16, a.shape) for p, a in ((q0, q), (k0, k), (q1, q), (k1, k)))
    emulate(mem, make_meta(mem, pos), q0a, k0a, d, rd, 1e6, 0)
    emulate(mem, make_meta(mem, pos, pos.copy(), pos.copy()), q1a, k1a, d, rd, 1e6, mode, sec)
    np.testing.assert_array_equal(q0a, q1a)
    np.testing.assert_array_equal(k0a, k1a)
    np.testing.assert_array_equal(q0a, plain[0])


# ----------------------------------------------------------------------------- emulator
@pytest.mark.parametrize("d,rd,hq,hkv,theta,mode,sec", CASES)
def test_emulator_batched_equals_per_stream(d, rd, hq, hkv, theta, mode, sec):
    rng = np.random.default_rng(11 * d + mode)
    lens = [1, 15, 16, 17, 63, 64, 65]
    T = sum(lens)
    starts = rng.integers(0, 100_000, len(lens))
    pos_t = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.uint32)
    pos_h = pos_t if mode == 0 else rng.integers(0, 64, T).astype(np.uint32)
    pos_w = pos_t if mode == 0 else rng.integers(0, 64, T).astype(np.uint32)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))

    mem = FakeMem()
    qb = mem.array(mem.put(q.copy()), np.uint16, q.shape)
    kb = mem.array(mem.put(k.copy()), np.uint16, k.shape)
    emulate(mem, make_meta(mem, pos_t, pos_h, pos_w, lens), qb, kb, d, rd, theta, mode, sec)

    cu = np.concatenate([[0], np.cumsum(lens)])
    for b in range(len(lens)):
        sl = slice(cu[b], cu[b + 1])
        m1 = FakeMem()
        q1 = m1.array(m1.put(q[sl].copy()), np.uint16, q[sl].shape)
        k1 = m1.array(m1.put(k[sl].copy()), np.uint16, k[sl].shape)
        emulate(m1, make_meta(m1, pos_t[sl], pos_h[sl], pos_w[sl]), q1, k1, d, rd, theta, mode, sec)
        np.testing.assert_array_equal(qb[sl], q1)
        np.testing.assert_array_equal(kb[sl], k1)

    ref_q, ref_k = rope.reference(q, k, pos_t, rd, theta, mode, sec, pos_h, pos_w)
    np.testing.assert_array_equal(qb, ref_q)
    np.testing.assert_array_equal(kb, ref_k)


def test_emulator_plain_mode_never_reads_h_w_streams():
    rng = np.random.default_rng(2)
    T, d, rd = 9, 64, 32
    mem = FakeMem()
    pos = np.arange(T, dtype=np.uint32) + 100
    meta = make_meta(mem, pos)
    meta.positions_h = 0x10  # unmapped: reading it raises in FakeMem
    meta.positions_w = 0x20
    q = mem.array(mem.put(rand_bf16(rng, (T, 2, d))), np.uint16, (T, 2, d))
    k = mem.array(mem.put(rand_bf16(rng, (T, 1, d))), np.uint16, (T, 1, d))
    q0 = q.copy()
    emulate(mem, meta, q, k, d, rd, 1e4, 0)
    assert (q != q0).any()
    with pytest.raises(IndexError):
        emulate(mem, meta, q, k, d, rd, 1e4, 1, (4, 6, 6))


def test_emulator_uses_total_tokens_only():
    rng = np.random.default_rng(4)
    T, d, rd = 10, 64, 64
    mem = FakeMem()
    pos = np.arange(T, dtype=np.uint32) + 7
    meta = make_meta(mem, pos)
    meta.total_tokens = 6
    qa = rand_bf16(rng, (T, 2, d))
    ka = rand_bf16(rng, (T, 1, d))
    q = mem.array(mem.put(qa.copy()), np.uint16, qa.shape)
    k = mem.array(mem.put(ka.copy()), np.uint16, ka.shape)
    emulate(mem, meta, q, k, d, rd, 1e4, 0)
    np.testing.assert_array_equal(q[6:], qa[6:])
    np.testing.assert_array_equal(k[6:], ka[6:])
    rq, rk = rope.reference(qa[:6], ka[:6], pos[:6], rd, 1e4)
    np.testing.assert_array_equal(q[:6], rq)
    np.testing.assert_array_equal(k[:6], rk)


@pytest.mark.parametrize(
    "grid,block,rd,d",
    [
        ((1, 2, 1), (256, 1, 1), 64, 64),
        ((0, 1, 1), (256, 1, 1), 64, 64),
        ((4, 1, 1), (48, 1, 1), 64, 64),
        ((4, 1, 1), (1024, 1, 1), 64, 64),  # too many registers for 1024 threads
        ((4, 1, 1), (256, 1, 1), 66, 64),  # rotary_dim > head_dim: the kernel traps
        ((4, 1, 1), (256, 1, 1), 63, 64),  # odd rotary_dim
    ],
)
def test_emulator_rejects_bad_launch(grid, block, rd, d):
    rng = np.random.default_rng(0)
    mem = FakeMem()
    meta = make_meta(mem, np.arange(3, dtype=np.uint32))
    q = mem.array(mem.put(rand_bf16(rng, (3, 1, d))), np.uint16, (3, 1, d))
    k = mem.array(mem.put(rand_bf16(rng, (3, 1, d))), np.uint16, (3, 1, d))
    with pytest.raises(ValueError):
        emulate(mem, meta, q, k, d, rd, 1e4, 0, grid=grid, block=block)


def test_check_params_and_geometry():
    rope.check_params(256, 64, 2, (11, 11, 10))
    with pytest.raises(ValueError):
        rope.check_params(256, 64, 2, (11, 11, 11))
    with pytest.raises(ValueError):
        rope.check_params(64, 128)
    with pytest.raises(ValueError):
        rope.check_params(64, 64, 3, (32, 0, 0))
    g, b, s = rope.geometry(1, 16, 2, 256, 64)
    assert g == (1, 1, 1) and b == (256, 1, 1) and s == 0
    # Qwen3-Next: 18 heads x 4 units = 72 units -> 96 // 72 = 1 token per warp, 8 per CTA
    assert rope.tokens_per_warp(16, 2, 256, 64) == 1
    g, _, _ = rope.geometry(301, 16, 2, 256, 64)
    assert g[0] == -(-301 // 8)
    g, _, _ = rope.geometry(10**6, 28, 4, 128, 128)
    assert g[0] == 132 * rope._CTAS_PER_SM
    # small heads: 2 heads x 1 unit (rd 16) -> 48 tokens per warp (angle slice 512 / 8 = 64 >= 48)
    assert rope.tokens_per_warp(1, 1, 64, 16) == 48
    # rd 1024 with 512 threads: a warp's slice (4096 / 16 = 256) is too small -> direct path, G = 1
    assert rope.tokens_per_warp(1, 1, 1024, 1024, threads=512) == 1
    assert rope.tokens_per_warp(1, 1, 1024, 1024) == 1
    with pytest.raises(ValueError, match="threads must be a multiple of 32"):
        rope.geometry(10, 16, 2, 256, 64, threads=1024)
    # floor bytes: rotary dims read + written, plus positions
    assert rope.floor_bytes(10, 16, 2, 64) == 2 * 10 * 18 * 64 * 2 + 40
    assert rope.floor_bytes(10, 16, 2, 64, mrope_mode=2) == 2 * 10 * 18 * 64 * 2 + 120


# ----------------------------------------------------------------------------- scaled rotary embeddings
def test_a_table_equal_to_thetas_gives_the_same_bits():
    mem = FakeMem()
    rng = np.random.default_rng(4)
    d, rd, theta = 128, 64, 1e6
    pos = rng.integers(0, 200_000, size=37).astype(np.uint32)
    meta = make_meta(mem, pos)
    q0, k0 = rand_bf16(rng, (37, 4, d)), rand_bf16(rng, (37, 2, d))
    a_q, a_k, b_q, b_k = (mem.array(mem.put(x.copy()), np.uint16, x.shape) for x in (q0, k0, q0, k0))
    emulate(mem, meta, a_q, a_k, d, rd, theta)
    emulate(mem, meta, b_q, b_k, d, rd, theta, scaling=rope.RopeScaling(tuple(rope.inv_freq(rd, theta))))
    assert np.array_equal(a_q, b_q) and np.array_equal(a_k, b_k)


def test_the_table_and_its_attention_factor_are_what_rotates():
    rng = np.random.default_rng(5)
    d, rd = 64, 32
    x = rand_bf16(rng, (9, 2, d))
    pos = np.arange(100, 109, dtype=np.uint32)
    table = rope.RopeScaling(tuple(rope.inv_freq(rd, 1e4) / 8), attention_factor=1.25)
    got, _ = rope.reference(x, x[:, :1], pos, rd, 1e4, scaling=table)
    ang = pos[:, None].astype(np.float64) * np.array(table.inv_freq)[None, :]
    xf = from_bf16_bits(x).astype(np.float64)
    c, s = np.cos(ang)[:, None, :] * 1.25, np.sin(ang)[:, None, :] * 1.25
    want = xf.copy()
    want[..., :16] = xf[..., :16] * c - xf[..., 16:32] * s
    want[..., 16:32] = xf[..., 16:32] * c + xf[..., :16] * s
    assert np.array_equal(got, to_bf16_bits(want.astype(np.float32)))


def test_rope_scaling_refuses_bad_tables():
    with pytest.raises(ValueError, match="positive and finite"):
        rope.RopeScaling((1.0, -0.5))
    with pytest.raises(ValueError, match="a table holds 1..256"):
        rope.RopeScaling(tuple([1.0] * 257))
    with pytest.raises(ValueError, match="attention_factor must be a positive finite number"):
        rope.RopeScaling((1.0,), attention_factor=float("nan"))
    with pytest.raises(TypeError, match="inv_freq must be a sequence of numbers"):
        rope.RopeScaling("fast")
    from q12drv.kernels import ops

    with pytest.raises(ValueError, match="has 4 frequencies but rotary_dim 64 needs 32"):
        ops.rope_table(rope.RopeScaling((1.0, 0.5, 0.25, 0.125)), 64)
    with pytest.raises(TypeError, match="scaling must be a q12drv.kernels.rope.RopeScaling"):
        ops.rope_table({"rope_type": "linear"}, 64)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4096},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "default", "rope_theta": 1e7},
], ids=lambda p: p["rope_type"])
def test_scaled_rope_matches_transformers_rotary_classes(params):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32768, rope_parameters=dict(params))
    d = config.head_dim
    seq_len = 20000 if params["rope_type"] == "dynamic" else None
    scaling = rope.RopeScaling.from_transformers(config, seq_len=seq_len)
    rng = np.random.default_rng(6)
    pos = rng.integers(0, 20000, size=24).astype(np.int64)
    q, k = rand_bf16(rng, (24, 4, d)), rand_bf16(rng, (24, 2, d))
    got_q, got_k = rope.reference(q, k, pos.astype(np.uint32), d, params["rope_theta"], scaling=scaling)
    emb = LlamaRotaryEmbedding(config)
    if seq_len is not None:  # the dynamic type's table for this length, as transformers makes it at run time
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        emb.inv_freq, emb.attention_scaling = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=seq_len)
    x = torch.zeros(1, 24, d, dtype=torch.float32)
    cos, sin = emb(x, torch.tensor(pos)[None])
    tq = torch.tensor(from_bf16_bits(q)).transpose(0, 1)[None].float()
    tk = torch.tensor(from_bf16_bits(k)).transpose(0, 1)[None].float()
    want_q, want_k = apply_rotary_pos_emb(tq, tk, cos.float(), sin.float())
    for got, want in ((got_q, want_q), (got_k, want_k)):
        w = want[0].transpose(0, 1).numpy()
        err = np.abs(from_bf16_bits(got) - w).max() / np.abs(w).max()
        assert err < 8e-3, (params["rope_type"], err)  # bf16 rounding of the output; fp32 angles on both sides
