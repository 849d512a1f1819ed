"""GPU test of ``q12_rope`` on the real device (H200): raw cuda.bindings launches.

torch is used only to allocate device memory and copy bytes; the kernel is compiled with
q12drv's NVRTC path and launched with ``cuLaunchKernel``. Self-contained on purpose.
RoPE works in place, so there is no output to poison: instead the dims >= rotary_dim must come
back bit for bit, and guard bytes around Q and K must be intact.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402
from q12drv.kernels import rope  # noqa: E402
from q12drv.kernels.meta import Q12MetaC  # noqa: E402

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.gpu.raw_harness import Buf, Kernel  # noqa: E402
from tests.helpers import rel_err  # noqa: E402


# ----------------------------------------------------------------------------- metadata and launch
def make_meta(keep, pos_t, pos_h, pos_w, lens):
    cu = np.zeros(len(lens) + 1, np.int32)
    cu[1:] = np.cumsum(lens)
    bt = Buf(pos_t.astype(np.uint32))
    bh = Buf(pos_h.astype(np.uint32))
    bw = Buf(pos_w.astype(np.uint32))
    bcu = Buf(cu)
    bkv = Buf(np.array(lens, np.int32))
    keep.extend([bt, bh, bw, bcu, bkv])
    return Q12MetaC(
        positions=bt.ptr,
        positions_h=bh.ptr,
        positions_w=bw.ptr,
        slots=0,
        block_table_ptrs=0,
        seq_len_ptrs=0,
        cu_seqlens=bcu.ptr,
        kv_lens=bkv.ptr,
        batch_size=len(lens),
        chunk_len=max(lens),
        total_tokens=int(cu[-1]),
        max_blocks_per_seq=0,
    )


def run_rope(meta, q_ptr, k_ptr, hq, hkv, d, rd, theta, mode, sec, grid=None, block=None, table=rope.NO_TABLE):
    g, b, smem = rope.geometry(int(meta.total_tokens), hq, hkv, d, rd)
    Kernel(rope.SOURCE, "q12_rope").launch(
        grid or g,
        block or b,
        smem,
        [
            meta,
            ctypes.c_uint64(q_ptr),
            ctypes.c_uint64(k_ptr),
            ctypes.c_int32(hq),
            ctypes.c_int32(hkv),
            ctypes.c_int32(d),
            ctypes.c_int32(rd),
            ctypes.c_float(theta),
            ctypes.c_int32(mode),
            ctypes.c_int32(sec[0]),
            ctypes.c_int32(sec[1]),
            ctypes.c_int32(sec[2]),
            table,
        ],
    )


def rand_bf16(rng, shape):
    return to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * 2)


def make_positions(rng, lens, mode, big=True):
    starts = rng.integers(0, 1_000_000 if big else 4000, len(lens))
    pos_t = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.uint32)
    if mode == 0:
        return pos_t, pos_t.copy(), pos_t.copy()
    T = len(pos_t)
    return pos_t, rng.integers(0, 512, T).astype(np.uint32), rng.integers(0, 512, T).astype(np.uint32)


def assert_close(out_bits, ref_bits, what):
    out = from_bf16_bits(out_bits).astype(np.float64)
    ref = from_bf16_bits(ref_bits).astype(np.float64)
    rel = rel_err(out, ref)
    assert rel < 1e-2, f"{what}: relative error {rel}"
    # Kernel and reference differ only in sincosf (<= 2 ulp fp32) and fp32 vs float64 rotation:
    # at most 1 bf16 ulp on a tiny fraction of elements.
    ulp_off = np.abs(out - ref) > 2.0**-7 * np.abs(ref) + 1e-6
    assert not ulp_off.any(), f"{what}: {ulp_off.sum()} elements off by more than 1 bf16 ulp"
    differ = (out_bits != ref_bits).mean()
    assert differ < 0.01, f"{what}: {differ:.2%} elements differ from the reference"


LENS = [1, 15, 16, 17, 63, 64, 65, 1100]
CONFIGS = [
    # D, rd, Hq, Hkv, theta, mode, sections
    pytest.param(256, 64, 16, 2, 1e7, 0, (0, 0, 0), id="qwen3next"),
    pytest.param(256, 64, 16, 4, 1e7, 2, (11, 11, 10), id="qwen35-interleaved"),
    pytest.param(128, 128, 28, 4, 1e6, 1, (16, 24, 24), id="qwen2vl-chunked"),
    pytest.param(128, 128, 32, 8, 5e6, 2, (24, 20, 20), id="qwen3vl-interleaved"),
    pytest.param(64, 64, 8, 8, 1e4, 0, (0, 0, 0), id="d64-plain"),
    pytest.param(128, 96, 4, 2, 1e6, 1, (16, 16, 16), id="d128-rd96"),
    pytest.param(256, 128, 3, 1, 1e7, 2, (22, 21, 21), id="d256-rd128"),
    pytest.param(64, 40, 5, 1, 1e4, 0, (0, 0, 0), id="scalar-rd40"),
    pytest.param(100, 50, 3, 2, 1e6, 1, (5, 10, 10), id="scalar-d100"),
]


@pytest.mark.parametrize("d,rd,hq,hkv,theta,mode,sec", CONFIGS)
def test_rope_matches_reference(d, rd, hq, hkv, theta, mode, sec):
    rng = np.random.default_rng()
    T = sum(LENS)
    pos_t, pos_h, pos_w = make_positions(rng, LENS, mode)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    keep = []
    meta = make_meta(keep, pos_t, pos_h, pos_w, LENS)
    qb, kb = Buf(q), Buf(k)
    run_rope(meta, qb.ptr, kb.ptr, hq, hkv, d, rd, theta, mode, sec)
    qo, ko = qb.read(np.uint16, q.shape), kb.read(np.uint16, k.shape)
    qb.check_guards()
    kb.check_guards()
    rq, rk = rope.reference(q, k, pos_t, rd, theta, mode, sec, pos_h, pos_w)
    assert_close(qo, rq, "q")
    assert_close(ko, rk, "k")
    np.testing.assert_array_equal(qo[..., rd:], q[..., rd:])
    np.testing.assert_array_equal(ko[..., rd:], k[..., rd:])
    # HF's bf16 formula (cos/sin rounded to bf16) within bf16 tolerance.
    for x, out in ((q, qo), (k, ko)):
        hf = from_bf16_bits(rope.hf_style_reference(x, pos_t, rd, theta, mode, sec, pos_h, pos_w))
        o = from_bf16_bits(out)
        assert np.linalg.norm(o - hf) / np.linalg.norm(hf) < 1e-2


@pytest.mark.parametrize("d,rd,hq,hkv,theta,mode,sec", CONFIGS)
def test_rope_batched_equals_per_stream(d, rd, hq, hkv, theta, mode, sec):
    rng = np.random.default_rng()
    T = sum(LENS)
    pos_t, pos_h, pos_w = make_positions(rng, LENS, mode)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    keep = []
    qb, kb = Buf(q), Buf(k)
    run_rope(make_meta(keep, pos_t, pos_h, pos_w, LENS), qb.ptr, kb.ptr, hq, hkv, d, rd, theta, mode, sec)
    qo, ko = qb.read(np.uint16, q.shape), kb.read(np.uint16, k.shape)
    cu = np.concatenate([[0], np.cumsum(LENS)])
    for b in range(len(LENS)):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        q1, k1 = Buf(q[sl]), Buf(k[sl])
        m1 = make_meta(keep, pos_t[sl], pos_h[sl], pos_w[sl], [LENS[b]])
        run_rope(m1, q1.ptr, k1.ptr, hq, hkv, d, rd, theta, mode, sec)
        np.testing.assert_array_equal(q1.read(np.uint16, q[sl].shape), qo[sl])
        np.testing.assert_array_equal(k1.read(np.uint16, k[sl].shape), ko[sl])
        q1.check_guards()
        k1.check_guards()


@pytest.mark.parametrize("mode,sec", [(1, (16, 24, 24)), (2, (24, 20, 20)), (1, (0, 64, 0)), (2, (0, 32, 32))])
def test_mrope_equal_streams_is_plain_rope_bitwise(mode, sec):
    rng = np.random.default_rng()
    d, rd, hq, hkv = 128, 128, 8, 2
    T = sum(LENS)
    pos_t, _, _ = make_positions(rng, LENS, 0)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    keep = []
    qa, ka, qb, kb = Buf(q), Buf(k), Buf(q), Buf(k)
    run_rope(make_meta(keep, pos_t, pos_t, pos_t, LENS), qa.ptr, ka.ptr, hq, hkv, d, rd, 1e6, 0, (0, 0, 0))
    run_rope(make_meta(keep, pos_t, pos_t.copy(), pos_t.copy(), LENS), qb.ptr, kb.ptr, hq, hkv, d, rd, 1e6, mode, sec)
    np.testing.assert_array_equal(qa.read(np.uint16, q.shape), qb.read(np.uint16, q.shape))
    np.testing.assert_array_equal(ka.read(np.uint16, k.shape), kb.read(np.uint16, k.shape))


def test_rope_any_grid_and_scalar_path_same_bits():
    # Grid size, block size, and the 2-byte fallback (misaligned pointers) give identical bits.
    rng = np.random.default_rng()
    d, rd, hq, hkv, theta, mode, sec = 256, 64, 16, 2, 1e7, 2, (11, 11, 10)
    T = sum(LENS)
    pos_t, pos_h, pos_w = make_positions(rng, LENS, mode)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    keep = []
    meta = make_meta(keep, pos_t, pos_h, pos_w, LENS)
    outs = []
    for grid, block, offset in (
        (None, None, 0),
        ((1, 1, 1), (32, 1, 1), 0),
        ((7, 1, 1), (512, 1, 1), 0),
        ((5000, 1, 1), (64, 1, 1), 0),
        (None, None, 2),  # q and k 2 bytes off 16-byte alignment: scalar path
    ):
        qb, kb = Buf(q, offset=offset), Buf(k, offset=offset)
        run_rope(meta, qb.ptr, kb.ptr, hq, hkv, d, rd, theta, mode, sec, grid=grid, block=block)
        qb.check_guards()
        kb.check_guards()
        outs.append((qb.read(np.uint16, q.shape), kb.read(np.uint16, k.shape)))
    for o in outs[1:]:
        np.testing.assert_array_equal(o[0], outs[0][0])
        np.testing.assert_array_equal(o[1], outs[0][1])


def test_rope_large_positions_and_tokens():
    # Positions near 2^24 (fp32 integer limit) and beyond, many tokens: still matches the reference.
    rng = np.random.default_rng()
    d, rd, hq, hkv, theta = 256, 64, 16, 2, 1e7
    lens = [3000, 5]
    T = sum(lens)
    pos_t = np.concatenate([np.arange(16_777_000, 16_777_000 + 3000), [2**31, 2**32 - 1, 0, 1, 7]]).astype(np.uint32)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    keep = []
    qb, kb = Buf(q), Buf(k)
    run_rope(make_meta(keep, pos_t, pos_t, pos_t, lens), qb.ptr, kb.ptr, hq, hkv, d, rd, theta, 0, (0, 0, 0))
    rq, rk = rope.reference(q, k, pos_t, rd, theta)
    assert_close(qb.read(np.uint16, q.shape), rq, "q")
    assert_close(kb.read(np.uint16, k.shape), rk, "k")
    qb.check_guards()
    kb.check_guards()


# ----------------------------------------------------------------------------- edges of the per-warp kernel
# A warp takes G tokens per iteration (G > 1 for small heads: token counts not a multiple of G),
# units past 32 * units_per_lane (rope_config() in rope.cu) per token go in further batches
# (Qwen2-VL above), and a warp whose slice of the angle buffer is too small for one token's angles
# (rd 1024 with 512 threads) takes the direct path. T = 1 everywhere.
EDGE_CONFIGS = [
    pytest.param(64, 16, 1, 1, 1e4, 0, (0, 0, 0), id="G48-rd16"),
    pytest.param(32, 32, 2, 1, 1e4, 2, (6, 5, 5), id="G16-interleaved"),
    pytest.param(1024, 1024, 2, 1, 1e6, 1, (200, 156, 156), id="rd1024"),
    pytest.param(256, 256, 12, 2, 1e6, 0, (0, 0, 0), id="batches-224units"),
]


@pytest.mark.parametrize("d,rd,hq,hkv,theta,mode,sec", EDGE_CONFIGS)
@pytest.mark.parametrize("lens", [[1], [47], [49, 1, 3]], ids=["T1", "T47", "T53"])
def test_rope_edges(d, rd, hq, hkv, theta, mode, sec, lens):
    rng = np.random.default_rng()
    T = sum(lens)
    pos_t, pos_h, pos_w = make_positions(rng, lens, mode)
    q = rand_bf16(rng, (T, hq, d))
    k = rand_bf16(rng, (T, hkv, d))
    keep = []
    meta = make_meta(keep, pos_t, pos_h, pos_w, lens)
    rq, rk = rope.reference(q, k, pos_t, rd, theta, mode, sec, pos_h, pos_w)
    outs = []
    for grid, block in ((None, None), ((1, 1, 1), (512, 1, 1)), ((3, 1, 1), (32, 1, 1))):
        qb, kb = Buf(q), Buf(k)
        run_rope(meta, qb.ptr, kb.ptr, hq, hkv, d, rd, theta, mode, sec, grid=grid, block=block)
        qo, ko = qb.read(np.uint16, q.shape), kb.read(np.uint16, k.shape)
        qb.check_guards()
        kb.check_guards()
        assert_close(qo, rq, "q")
        assert_close(ko, rk, "k")
        np.testing.assert_array_equal(qo[..., rd:], q[..., rd:])
        np.testing.assert_array_equal(ko[..., rd:], k[..., rd:])
        outs.append((qo, ko))
    for o in outs[1:]:  # any grid, any block, the direct path: the same bits
        np.testing.assert_array_equal(o[0], outs[0][0])
        np.testing.assert_array_equal(o[1], outs[0][1])


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4096},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
], ids=lambda p: p["rope_type"])
def test_scaled_rope_against_transformers_rotary_classes(params):
    """A RopeScaling table (transformers' own frequencies and attention factor) on the GPU against transformers'
    LlamaRotaryEmbedding + apply_rotary_pos_emb in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=32768, rope_parameters=dict(params))
    d, hq, hkv = config.head_dim, 8, 2
    scaling = rope.RopeScaling.from_transformers(config)
    rng = np.random.default_rng(9)
    lens = [1, 300, 77]
    pos = np.concatenate([np.sort(rng.integers(0, 30000, n)) for n in lens]).astype(np.uint32)
    t = len(pos)
    keep = []
    meta = make_meta(keep, pos, pos, pos, lens)
    q, k = rand_bf16(rng, (t, hq, d)), rand_bf16(rng, (t, hkv, d))
    bq, bk = Buf(q.copy()), Buf(k.copy())
    run_rope(meta, bq.ptr, bk.ptr, hq, hkv, d, d, params["rope_theta"], 0, (0, 0, 0), table=scaling.table())
    torch.cuda.synchronize()
    emb = LlamaRotaryEmbedding(config).cuda()
    cos, sin = emb(torch.zeros(1, t, d, device="cuda"), torch.tensor(pos.astype(np.int64), device="cuda")[None])
    tq = torch.tensor(from_bf16_bits(q), device="cuda").transpose(0, 1)[None]
    tk = torch.tensor(from_bf16_bits(k), device="cuda").transpose(0, 1)[None]
    want_q, want_k = apply_rotary_pos_emb(tq, tk, cos.float(), sin.float())
    for buf, want, shape in ((bq, want_q, q.shape), (bk, want_k, k.shape)):
        got = from_bf16_bits(buf.read(np.uint16, shape))
        w = want[0].transpose(0, 1).cpu().numpy()
        assert np.abs(got - w).max() / np.abs(w).max() < 8e-3, params["rope_type"]
