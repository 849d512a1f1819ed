"""CPU tests of the Gated DeltaNet kernels (q12drv.kernels.gdn): their declarations and compile report, the host
numbers the sources check, the numpy reference and the chunked kernels' model, the emulators."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers import FakeMem, rel_err, spill_free
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels.gdn import GdnConfig, GdnShape, chunked_mma, chunked_wgmma, plan_gdn, recurrent
from q12drv.kernels.gdn import reference as ref
from q12drv.kernels.meta import Q12MetaC
from q12drv.kernels.registry import compile_defines

RAGGED = [1, 15, 16, 17, 63, 64, 65]
MODULES = (recurrent, chunked_mma, chunked_wgmma)


def make_inputs(rng, lens, hk, hv, dk, dv, state_scale=0.5):
    """Random bf16 q/k/v, fp32 g (<= 0) and beta in (0, 1), a nonzero fp32 initial state."""
    T = int(sum(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = to_bf16_bits(rng.normal(size=(T, hk, dk)))
    k = to_bf16_bits(rng.normal(size=(T, hk, dk)))
    v = to_bf16_bits(rng.normal(size=(T, hv, dv)))
    g = (-np.abs(rng.normal(0.0, 0.4, size=(T, hv)))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.normal(size=(T, hv))))).astype(np.float32)
    s0 = (state_scale * rng.normal(size=(len(lens), hv, dk, dv))).astype(np.float32)
    return q, k, v, g, beta, cu, s0


def textbook(q, k, v, g, beta, cu, s0):
    """float64, one head at a time, closed form S_t = a (I - b k k^T) S + b k v^T, o = S^T q~."""
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    qf, kf, vf = (from_bf16_bits(x).astype(np.float64) for x in (q, k, v))
    o = np.zeros((T, hv, dv))
    fin = np.zeros(s0.shape)
    eye = np.eye(dk)
    for b in range(len(cu) - 1):
        for h in range(hv):
            kh = h * hk // hv
            S = s0[b, h].astype(np.float64)
            for t in range(cu[b], cu[b + 1]):
                kk = kf[t, kh] / np.sqrt(kf[t, kh] @ kf[t, kh] + 1e-6)
                qq = qf[t, kh] / np.sqrt(qf[t, kh] @ qf[t, kh] + 1e-6) / np.sqrt(dk)
                a, bt = np.exp(np.float64(g[t, h])), np.float64(beta[t, h])
                S = a * (eye - bt * np.outer(kk, kk)) @ S + bt * np.outer(kk, vf[t, h])
                o[t, h] = S.T @ qq
            fin[b, h] = S
    return o, fin


def chunked_wy(q, k, v, g, beta, cu, s0, C):
    """float64 chunked (WY) form of kernels.md A4.3, chunks of C tokens that never cross a stream."""
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    qf, kf, vf = (from_bf16_bits(x).astype(np.float64) for x in (q, k, v))
    o = np.zeros((T, hv, dv))
    fin = np.zeros(s0.shape)
    for b in range(len(cu) - 1):
        for h in range(hv):
            kh = h * hk // hv
            S = s0[b, h].astype(np.float64)
            for c0 in range(cu[b], cu[b + 1], C):
                c1 = min(c0 + C, cu[b + 1])
                K = kf[c0:c1, kh]
                K = K / np.sqrt((K * K).sum(-1, keepdims=True) + 1e-6)
                Q = qf[c0:c1, kh]
                Q = Q / np.sqrt((Q * Q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
                V = vf[c0:c1, h]
                bt = beta[c0:c1, h].astype(np.float64)
                gam = np.cumsum(g[c0:c1, h].astype(np.float64))
                L = c1 - c0
                Gam = np.exp(gam[:, None] - gam[None, :]) * np.tril(np.ones((L, L)))
                A = np.linalg.inv(np.eye(L) + np.tril(bt[:, None] * (K @ K.T) * Gam, -1))
                w = A @ ((bt * np.exp(gam))[:, None] * K)
                u = A @ (bt[:, None] * V)
                v_new = u - w @ S
                o[c0:c1, h] = (Q * np.exp(gam)[:, None]) @ S + ((Q @ K.T) * Gam) @ v_new
                S = np.exp(gam[-1]) * S + (K * np.exp(gam[-1] - gam)[:, None]).T @ v_new
            fin[b, h] = S
    return o, fin


def assert_bf16_close(bits, want, ulps=1.0):
    """bf16 `bits` equal the float64 `want` rounded, give or take `ulps` bf16 ulps (and 1e-6 absolute)."""
    got = from_bf16_bits(bits).astype(np.float64)
    tol = ulps * np.abs(want) * 2.0**-8 + 1e-6
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off, worst {np.max(np.abs(got - want) - tol)}"


# --------------------------------------------------------------------------- declarations, compile, contracts


def test_every_entry_takes_the_one_parameter_list():
    """Every GDN entry is declared ``void name(GDN_PARAMS)``: the host reads one parameter list, written once in
    gdn/common.cuh, for all of them; the registry knows each entry's source and emulator."""
    from q12drv.core.launch import parse_signatures
    from q12drv.core.nvrtc import cuda_src_dir, local_headers
    from q12drv.kernels.registry import ENTRIES, struct_types

    for mod in MODULES:
        src = (cuda_src_dir() / mod.SOURCE).read_text()
        assert sorted(re.findall(r"(\w+)\(GDN_PARAMS\)", src)) == sorted(mod.ENTRIES), mod.SOURCE
        sigs = parse_signatures(src, struct_types(), local_headers(src))
        assert sorted(sigs) == sorted(mod.ENTRIES)
        for name, params in sigs.items():
            assert [p for p, _ in params] == ["m", "h_state_ptrs", "q", "k", "v", "g", "beta", "o", "num_k_heads",
                                              "num_v_heads", "workspace"], name
            assert ENTRIES[name] == mod.SOURCE
        assert set(mod.EMULATORS) == set(mod.ENTRIES)


def test_recurrent_entries_compile_without_spills(kernel_build):
    img = kernel_build(recurrent.SOURCE)
    for name, r in spill_free(img, recurrent.ENTRIES).items():
        assert r.registers <= 128, f"{name}: more than 128 registers (< 4 CTAs/SM)"


def test_chunked_mma_entries_compile_without_spills(kernel_build):
    img = kernel_build(chunked_mma.SOURCE)
    spill_free(img, chunked_mma.ENTRIES)


def test_chunked_wgmma_entries_compile_for_sm90a_without_spills(kernel_build):
    """gdn/chunked_wgmma.cu compiles for sm_90a only (wgmma), every entry without spills or local memory."""
    from q12drv.core.nvrtc import target_arch

    assert target_arch(chunked_wgmma.SOURCE, "sm_90") == "sm_90a"
    with pytest.raises(ValueError, match="sm_90a"):
        target_arch(chunked_wgmma.SOURCE, "sm_80")
    img = kernel_build(chunked_wgmma.SOURCE)
    assert img.arch == "sm_90a"
    spill_free(img, chunked_wgmma.ENTRIES)


def test_the_modules_declare_their_contracts():
    """Each GDN module registers its host numbers for every build of its source (test_registry compiles each with
    a drifted and a missing value)."""
    from q12drv.kernels import registry

    for mod in MODULES:
        assert registry.CONTRACTS[mod.SOURCE] == tuple(f"{k}={v}" for k, v in mod.CONTRACTS.items())
        assert compile_defines(mod.SOURCE)[-len(mod.CONTRACTS):] == registry.CONTRACTS[mod.SOURCE]


def test_recurrent_geometry():
    assert recurrent.COLS_PER_CTA == 32
    assert recurrent.geometry(8, 32, 128) == ((128, 8, 1), (128, 1, 1), 0)
    assert recurrent.geometry(1, 6, 64) == ((12, 1, 1), (128, 1, 1), 0)
    with pytest.raises(ValueError, match="head_dim 64 and 128, not 256"):
        recurrent.geometry(1, 32, 256)


def test_chunked_mma_sizes_and_geometry():
    """The fused kernel, the precompute and the mma sequential kernel: sizes, records, geometry, occupancy."""
    assert chunked_mma.SLICE == 64
    assert chunked_mma.fused_geometry(8, 32, 128) == ((2, 32, 8), (128, 1, 1), chunked_mma.fused_smem(128))
    assert chunked_mma.fused_geometry(1, 6, 64) == ((1, 6, 1), (128, 1, 1), chunked_mma.fused_smem(64))
    assert (chunked_mma.fused_smem(128), chunked_mma.fused_smem(64)) == (114944, 82176)
    assert chunked_mma.fused_smem(128) <= 227 * 1024 // 2  # two CTAs per SM
    with pytest.raises(ValueError):
        chunked_mma.fused_geometry(0, 32, 128)
    for d in (64, 128):
        assert chunked_mma.sequential_smem(d, 2) == 2 * chunked_mma.sequential_smem(d, 1), d
    assert chunked_mma.precompute_smem(128) == 64000 and chunked_mma.t_record_bytes() == 17424
    # occupancy the design relies on (227 KiB of shared memory per SM, 1 KiB reserved per CTA)
    assert 3 * (chunked_mma.precompute_smem(128) + 1024) <= 227 * 1024
    assert 2 * (chunked_mma.sequential_smem(128, 1) + 1024) <= 227 * 1024 < 2 * (chunked_mma.sequential_smem(128, 2)
                                                                                + 1024)
    assert chunked_mma.precompute_geometry(8, 2048, 16, 128) == ((32, 16, 8), (128, 1, 1), 64000)
    assert chunked_mma.precompute_geometry(1, 1, 16, 64)[0] == (1, 16, 1)
    assert chunked_mma.sequential_geometry(8, 32, 128, 1) == ((2, 32, 8), (128, 1, 1),
                                                              chunked_mma.sequential_smem(128, 1))
    assert chunked_mma.mma_workspace_bytes(1, 8192, 16, 32, 128) == 128 * (16 * 49152 + 32 * 19200)
    assert chunked_mma.mma_workspace_bytes(3, 65, 2, 6, 64) == 3 * 2 * (2 * 24576 + 6 * 19200)
    assert chunked_mma.t_workspace_bytes(1, 8192, 16, 32) == 128 * 32 * 17424
    # the sequential build: one buffer once the fused grid holds two CTAs per SM
    assert chunked_mma.sequential_stages(8, 32, 128, 132) == 1 and chunked_mma.sequential_stages(5, 32, 128, 132) == 1
    assert chunked_mma.sequential_stages(1, 32, 128, 132) == 2 and chunked_mma.sequential_stages(4, 32, 128, 132) == 2
    assert chunked_mma.sequential_entry(128, 1) == "q12_gdn_mma_sequential_1stage_d128"
    assert chunked_mma.precompute_entry(64, "wgmma") == "q12_gdn_wgmma_precompute_d64"
    for entry in chunked_mma.ENTRIES:
        assert chunked_mma.entry_smem(entry) > 0
    with pytest.raises(ValueError, match="stages"):
        chunked_mma.sequential_entry(128, 3)
    with pytest.raises(KeyError, match="not a gdn/chunked_mma.cu entry"):
        chunked_mma.entry_smem("q12_gdn_recurrent_d128")
    with pytest.raises(ValueError):
        chunked_mma.mma_workspace_bytes(0, 64, 16, 32, 128)


def test_chunked_wgmma_sizes_and_geometry():
    """The wgmma sequential kernels' stages, the overlapped records and workspace, geometry and occupancy: one stage
    fits two CTAs per SM, two stages one; an overlapped precompute CTA fills an SM."""
    assert chunked_wgmma.stage_bytes(128) % 1024 == 0
    assert (chunked_wgmma.stage_bytes(128), chunked_wgmma.stage_bytes(64)) == (69632, 53248)
    assert chunked_wgmma.stage_bytes(128, 2) == 88064   # the wide CTA: two V and two O slices
    assert chunked_wgmma.sequential_smem(128, 2, 2) == chunked_wgmma.entry_smem(chunked_wgmma.WIDE_ENTRY) <= 227 * 1024
    assert chunked_wgmma.wide_geometry(8, 32) == ((1, 32, 8), (256, 1, 1), 176032)
    sm = 228 * 1024  # shared memory per SM (227 KiB for blocks + 1 KiB reserved per CTA)
    assert 2 * (chunked_wgmma.sequential_smem(64, 1) + 1024) <= sm
    assert chunked_wgmma.sequential_smem(128, 2) <= 227 * 1024 < 2 * (chunked_wgmma.sequential_smem(128, 2) + 1024)
    assert chunked_wgmma.sequential_geometry(8, 32, 64, 1) == ((1, 32, 8), (128, 1, 1),
                                                               chunked_wgmma.sequential_smem(64, 1))
    with pytest.raises(ValueError, match="at 128 the wide CTA"):
        chunked_wgmma.sequential_entry(128, 1)
    # the overlapped precompute's items: a value head's in the first 8 chunks, a key head's after them
    assert chunked_wgmma.OVERLAP_VH_CHUNKS == 8
    assert chunked_wgmma.overlap_items(1, 8192, 16, 32) == 8 * 32 + 120 * 16
    assert chunked_wgmma.overlap_items(2, 300, 16, 32) == 2 * 5 * 32   # every chunk in the first 8
    assert chunked_wgmma.overlap_ready_value(16, 32) == 2
    assert chunked_wgmma.overlap_record_bytes(128) == 16384 + 8192 + 512 + 16 + 2 * 8192 == 41488
    assert chunked_wgmma.overlap_record_bytes(64) == 8192 + 8192 + 512 + 16 + 2 * 8192 == 33296
    assert chunked_wgmma.overlap_record_offsets(128) == {"W": 0, "P": 16384, "EQ": 24576, "WK": 24832, "EGC": 25088,
                                                         "TB": 25104, "END": 41488}
    assert chunked_wgmma.stage_bytes(128, overlapped=True) == 92160
    assert chunked_wgmma.stage_bytes(64, overlapped=True) == 67584
    assert chunked_wgmma.sequential_smem(128, 2, overlapped=True) == 92160 + 92160 + 16 + 896 == 185232
    assert chunked_wgmma.overlapped_precompute_smem(128) == 3 * 64000 <= 227 * 1024
    assert chunked_wgmma.overlapped_precompute_smem(128) + 1024 + chunked_wgmma.sequential_smem(
        128, 2, overlapped=True) + 1024 > sm   # no sequential CTA beside a precompute CTA
    flow = 128 * 32 * 41488 + 4 * 128 * 16 + 16   # the records, the ready flags, the item counter
    assert chunked_wgmma.flags_offset(1, 8192, 16, 32, 128) == 128 * 32 * 41488
    assert chunked_wgmma.kq_offset(1, 8192, 16, 32, 128) == -(-flow // 128) * 128
    flow = -(-flow // 128) * 128 + 128 * 16 * 2 * 64 * 128 * 2   # then each (stream, chunk, key head)'s k and q tiles
    assert chunked_wgmma.overlapped_workspace_bytes(1, 8192, 16, 32, 128) == flow
    assert chunked_wgmma.flag_count(1, 8192, 16) == 128 * 16 and chunked_wgmma.flags_bytes(1, 64, 1) == 4 + 16
    prep, seq = chunked_wgmma.overlapped_geometry(1, 32, 128, 132)
    assert prep == ((68, 1, 1), (384, 1, 1), 192000)
    assert seq == ((2, 32, 1), (128, 1, 1), 185232)
    assert chunked_wgmma.overlapped_geometry(4, 32, 128, 132)[0][0] == (1, 1, 1)  # never an empty grid
    # the rules' building blocks
    assert chunked_wgmma.uses_overlapped(1, 8192, 32, 128, 132)
    assert not chunked_wgmma.uses_overlapped(2, 8192, 32, 128, 132)
    assert chunked_wgmma.uses_overlapped(2, 9000, 32, 64, 132)
    assert not chunked_wgmma.uses_overlapped(1, 8192, 32, 128, 127)
    assert not chunked_wgmma.uses_overlapped(1, 8191, 32, 128, 132)
    assert chunked_wgmma.uses_wide(8, 32, 128, 132) and chunked_wgmma.uses_wide(5, 32, 128, 132)
    assert not chunked_wgmma.uses_wide(4, 32, 128, 132) and not chunked_wgmma.uses_wide(8, 32, 64, 132)
    for entry in chunked_wgmma.ENTRIES:
        assert chunked_wgmma.entry_smem(entry) > 0
    with pytest.raises(ValueError, match="head_dim 64 and 128, not 256"):
        chunked_wgmma.overlap_record_bytes(256)
    with pytest.raises(KeyError, match="not a gdn/chunked_wgmma.cu entry"):
        chunked_wgmma.entry_smem("q12_gdn_mma_sequential_2stage_d128")


def test_sw128_unswizzle_inverts_the_kernels_swizzle():
    """chunked_wgmma.sw128_offset is gdn/chunk.cuh's sw128_off (the formula in the source), and sw128_unswizzle reads
    a tile written through it back in row order, for 64 and 128 columns; wrong sizes are refused."""
    from q12drv.core.nvrtc import cuda_src_dir
    src = (cuda_src_dir() / "gdn/chunk.cuh").read_text()
    assert "return (cg >> 3) * (GDN_C * 128) + r * 128 + (((cg & 7) ^ (r & 7)) << 4);" in src
    assert chunked_wgmma.sw128_offset(0, 0) == 0 and chunked_wgmma.sw128_offset(1, 0) == 128 + 16
    assert chunked_wgmma.sw128_offset(9, 8) == 8192 + 9 * 128 + 16
    rng = np.random.default_rng(3)
    for cols in (64, 128):
        tile = rng.integers(0, 1 << 16, (64, cols), dtype=np.uint16)
        raw = np.zeros(64 * cols, np.uint16)
        for r in range(64):
            for c in range(cols // 8):
                at = chunked_wgmma.sw128_offset(r, c) // 2
                raw[at: at + 8] = tile[r, 8 * c: 8 * c + 8]
        assert np.array_equal(chunked_wgmma.sw128_unswizzle(raw.view(np.uint8), cols), tile)
    with pytest.raises(ValueError, match="multiple of 64"):
        chunked_wgmma.sw128_unswizzle(np.zeros(64 * 32, np.uint16), 32)
    with pytest.raises(ValueError, match="is 16384 bytes, got 8192"):
        chunked_wgmma.sw128_unswizzle(np.zeros(64 * 64, np.uint16), 128)


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
def test_reference_matches_textbook(hk, hv):
    rng = np.random.default_rng()
    inputs = make_inputs(rng, RAGGED, hk, hv, 16, 8)
    o_bits, fin = ref.reference(*inputs)
    o_tb, fin_tb = textbook(*inputs)
    assert_bf16_close(o_bits, o_tb)
    np.testing.assert_allclose(fin, fin_tb, rtol=1e-6, atol=1e-7)


def test_reference_matches_chunked_wy_with_initial_state():
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [1, 17, 40, 16], 1, 2, 32, 16, state_scale=1.0)
    o_bits, fin = ref.reference(*inputs)
    o_wy, fin_wy = chunked_wy(*inputs, C=16)
    assert_bf16_close(o_bits, o_wy)
    np.testing.assert_allclose(fin, fin_wy, rtol=1e-6, atol=1e-6)
    # the initial state matters: a zero one gives a different answer
    zero = list(inputs)
    zero[-1] = np.zeros_like(inputs[-1])
    assert not np.allclose(ref.reference(*zero)[1], fin, atol=1e-3)


def test_reference_float32_close_to_float64():
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [70, 3], 1, 2, 64, 64)
    o64, f64 = ref.reference(*inputs)
    o32, f32 = ref.reference(*inputs, dtype=np.float32)
    a, b = from_bf16_bits(o64), from_bf16_bits(o32)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-3
    assert np.linalg.norm(f64 - f32) / np.linalg.norm(f64) < 1e-5


def test_reference_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, cu, s0 = make_inputs(rng, [3], 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple"):
        ref.reference(q, k, v, g, beta, cu, s0)


# numpy model of the chunked kernels vs the float64 token-by-token reference (measured: o ~3.7e-3, the
# bf16 rounding of o alone is ~2.5e-3; state 1e-4..3e-4). Bounds with margin:
CHUNK_O_REL, CHUNK_STATE_REL = 8e-3, 1e-3


@pytest.mark.parametrize("d,hk,hv,lens", [(64, 2, 4, RAGGED + [130, 0, 3]), (128, 1, 2, [1, 65, 200]),
                                          (32, 3, 3, [16, 17, 1])])
def test_chunked_model_matches_reference_on_ragged_streams(d, hk, hv, lens):
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d, d, state_scale=1.0)
    o_ref, fin_ref = ref.reference(*inputs)
    o, fin = ref.chunked_reference(*inputs)
    cu = inputs[5]
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        if e == s:
            np.testing.assert_array_equal(fin[b], inputs[-1][b])
            continue
        eo = rel_err(from_bf16_bits(o[s:e]), from_bf16_bits(o_ref[s:e]))
        es = rel_err(fin[b], fin_ref[b])
        assert eo < CHUNK_O_REL, f"stream {b} (len {e - s}): o rel err {eo:.2e}"
        assert es < CHUNK_STATE_REL, f"stream {b} (len {e - s}): state rel err {es:.2e}"


@pytest.mark.parametrize("path", ["mma", "wgmma", "overlapped"])
def test_chunked_model_long_stream(path):
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [1100], 1, 1, 64, 64, state_scale=1.0)
    o_ref, fin_ref = ref.reference(*inputs)
    o, fin = ref.chunked_reference(*inputs, path=path)
    assert rel_err(from_bf16_bits(o), from_bf16_bits(o_ref)) < CHUNK_O_REL
    assert rel_err(fin, fin_ref) < CHUNK_STATE_REL
    with pytest.raises(ValueError, match="path must be one of 'mma', 'wgmma', 'overlapped'"):
        ref.chunked_reference(*inputs, path="flow")


def test_chunked_model_chunk_size_independent_of_stream_splits():
    """A chunk never crosses a stream: batched model == each stream alone, bit for bit."""
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [17, 64, 65], 1, 2, 32, 32)
    o, fin = ref.chunked_reference(*inputs)
    q, k, v, g, beta, cu, s0 = inputs
    for b in range(3):
        s, e = cu[b], cu[b + 1]
        o1, f1 = ref.chunked_reference(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s]), s0[b:b + 1])
        assert np.array_equal(o[s:e], o1) and np.array_equal(fin[b], f1[0])


def test_wgmma_model_matches_reference_and_the_block_solve():
    """The wgmma path's numpy model (T = (I + A)^-1 rounded to bf16, one product) stays within the chunked
    kernels' error budget and within a few bf16 roundings of the block-solve model."""
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [1, 63, 130, 300], 2, 4, 64, 64, state_scale=1.0)
    o_ref, fin_ref = ref.reference(*inputs)
    o_b, fin_b = ref.chunked_reference(*inputs)
    o_t, fin_t = ref.chunked_reference(*inputs, path="wgmma")
    assert rel_err(from_bf16_bits(o_t), from_bf16_bits(o_ref)) < CHUNK_O_REL
    assert rel_err(fin_t, fin_ref) < CHUNK_STATE_REL
    assert rel_err(fin_t, fin_b) < 5e-4
    assert rel_err(from_bf16_bits(o_t), from_bf16_bits(o_b)) < 4e-3
    # the identity solve is T itself: T (I + A) = I to the solve's precision on a random chunk
    C = 64
    A = np.tril(rng.normal(0, 0.1, size=(1, C, C)), -1).astype(np.float32)
    Dinv = np.zeros_like(A, dtype=np.float64)
    for i in range(4):
        sl = slice(16 * i, 16 * i + 16)
        Dinv[:, sl, sl] = np.linalg.inv(np.eye(16) + A[:, sl, sl].astype(np.float64))
    blk = np.arange(C) // 16
    Aoff = A * (blk[:, None] != blk[None, :])
    T = ref._block_solve(np.broadcast_to(np.eye(C, dtype=np.float32), (1, C, C)), Aoff, Dinv)
    np.testing.assert_allclose(T[0] @ (np.eye(C) + A[0]), np.eye(C), atol=1e-5)


def test_overlapped_model_keeps_the_wgmma_error():
    """fla's order V_new = U - W S (the overlapped schedule's records: T diag(beta) and T diag(beta EK) as hi + lo
    pairs from the fp32 T, U in fp32, W in bf16) keeps the state's error within 2x of the wgmma two-pass schedule's;
    o's error is o's rounding either way."""
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, [256, 129], 2, 4, 128, 128)
    o_ref, fin_ref = ref.reference(*inputs)
    _, fin_t = ref.chunked_reference(*inputs, path="wgmma")
    o_f, fin_f = ref.chunked_reference(*inputs, path="overlapped")
    err_t, err_f = (float(np.max(np.abs(f - fin_ref))) for f in (fin_t, fin_f))
    assert err_f < 2 * err_t
    assert rel_err(from_bf16_bits(o_f), from_bf16_bits(o_ref)) < CHUNK_O_REL


# --------------------------------------------------------------------------- emulators


GUARD = 64  # elements of guard around the output


class Launch:
    """One GDN launch's arguments in fake device memory: inputs, o with a guard, the states, the metadata."""

    def __init__(self, inputs, hk, hv, d):
        q, k, v, g, beta, cu, s0 = inputs
        self.n, self.T, self.hv, self.d = len(cu) - 1, int(cu[-1]), hv, d
        self.mem = mem = FakeMem()
        ptrs = [mem.hold(x)[1] for x in (q, k, v, g, beta)]
        self.obuf, po = mem.hold(np.full(self.T * hv * d + 2 * GUARD, 0xFFFF, np.uint16))
        self.states = [mem.hold(s0[b].copy()) for b in range(self.n)]
        _, pptrs = mem.hold(np.array([p for _, p in self.states], np.uint64))
        _, pcu = mem.hold(cu.astype(np.int32))
        self.meta = Q12MetaC(cu_seqlens=pcu, batch_size=self.n, chunk_len=int(np.diff(cu).max()), total_tokens=self.T)
        self.args = dict(m=self.meta, h_state_ptrs=pptrs, q=ptrs[0], k=ptrs[1], v=ptrs[2], g=ptrs[3], beta=ptrs[4],
                         o=po + GUARD * 2, num_k_heads=hk, num_v_heads=hv, workspace=0)

    def result(self):
        """(o bits, final states, the guards around o intact)."""
        guards_ok = bool((self.obuf[:GUARD] == 0xFFFF).all() and (self.obuf[-GUARD:] == 0xFFFF).all())
        o = self.obuf[GUARD:-GUARD].reshape(self.T, self.hv, self.d).copy()
        return o, np.stack([s for s, _ in self.states]), guards_ok


EMULATORS = {**recurrent.EMULATORS, **chunked_mma.EMULATORS, **chunked_wgmma.EMULATORS}
HOPPER = SimpleNamespace(arch="sm_90", sm_count=132)
ONE_SM = SimpleNamespace(arch="sm_90", sm_count=1)   # a device where every grid is full: the other builds


def run_emulated(inputs, hk, hv, d, grid=None, block=None):
    """Emulate the recurrent entry over all streams of ``inputs``; returns (o bits, states, guard-ok)."""
    L = Launch(inputs, hk, hv, d)
    ggrid, gblock, smem = recurrent.geometry(L.n, hv, d)
    assert smem == 0
    recurrent.EMULATORS[recurrent.entry(d)](L.args, L.mem, grid or ggrid, block or gblock)
    return L.result()


def run_plan_emulated(inputs, hk, hv, d, config=GdnConfig(schedule="fused"), device=HOPPER, grid=None, block=None,
                      ws_short=0, ws_fill=0, skip=0):
    """Emulate the launches of ``config``'s plan for ``inputs`` on ``device`` (its flags zeroed first, as the
    launcher does) through exactly the workspace they need (``ws_short`` bytes less), filled with ``ws_fill``;
    ``skip``: leave out that many first launches; ``grid``/``block``: instead of the plan's."""
    L = Launch(inputs, hk, hv, d)
    plan = plan_gdn(config, GdnShape(hk, hv, d), L.n, int(L.meta.chunk_len), device)
    zero, kernels = plan.launches(L.n, int(L.meta.chunk_len))
    need = plan.workspace_bytes_for(L.n, int(L.meta.chunk_len))
    if need:
        ws, L.args["workspace"] = L.mem.hold(np.full(need - ws_short, ws_fill, np.uint8))
        if zero is not None:
            ws[zero[0]: zero[0] + zero[1]] = 0
    for kern in kernels[skip:]:
        EMULATORS[kern.entry](L.args, L.mem, grid or kern.grid, block or kern.block)
    return L.result()


@pytest.mark.parametrize("d,hk,hv", [(64, 2, 4), (128, 1, 2)])
def test_emulator_matches_reference_and_updates_state_in_place(d, hk, hv):
    rng = np.random.default_rng()
    lens = [1, 17, 64] if d == 128 else RAGGED
    inputs = make_inputs(rng, lens, hk, hv, d, d)
    o, fin, guards_ok = run_emulated(inputs, hk, hv, d)
    assert guards_ok
    o_ref, fin_ref = ref.reference(*inputs)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(fin, fin_ref)
    assert not np.array_equal(fin, inputs[-1])


def test_emulator_batched_equals_per_stream_bitwise():
    rng = np.random.default_rng()
    hk, hv, d = 2, 4, 64
    inputs = make_inputs(rng, RAGGED, hk, hv, d, d)
    o, fin, _ = run_emulated(inputs, hk, hv, d)
    q, k, v, g, beta, cu, s0 = inputs
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        one = (q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s], np.int32), s0[b : b + 1])
        o1, fin1, _ = run_emulated(one, hk, hv, d)
        assert np.array_equal(o[s:e], o1), f"stream {b}: output differs batched vs alone"
        assert np.array_equal(fin[b], fin1[0]), f"stream {b}: state differs batched vs alone"


def test_emulator_rejects_short_grid_and_bad_block():
    rng = np.random.default_rng(1)
    hk, hv, d = 1, 2, 64
    inputs = make_inputs(rng, [3, 5], hk, hv, d, d)
    with pytest.raises(ValueError, match="grid"):
        run_emulated(inputs, hk, hv, d, grid=(hv * d // recurrent.COLS_PER_CTA - 1, 2, 1))
    with pytest.raises(ValueError, match="grid"):
        run_emulated(inputs, hk, hv, d, grid=(hv * d // recurrent.COLS_PER_CTA, 1, 1))
    with pytest.raises(ValueError, match="block"):
        run_emulated(inputs, hk, hv, d, block=(256, 1, 1))


def test_fused_emulator_runs_the_reference_in_place_and_checks_geometry():
    rng = np.random.default_rng()
    hk, hv, d = 2, 4, 64
    inputs = make_inputs(rng, [5, 0, 70], hk, hv, d, d)
    o, fin, guards_ok = run_plan_emulated(inputs, hk, hv, d)
    assert guards_ok
    o_ref, fin_ref = ref.reference(*inputs)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(fin, fin_ref)
    np.testing.assert_array_equal(fin[1], inputs[-1][1])  # a stream of length 0 keeps its state
    # a grid larger than n x Hv is accepted (the extra CTAs return); grid.x and the block are exact
    o1, fin1, _ = run_plan_emulated(inputs, hk, hv, d, grid=(1, hv + 1, 4))
    np.testing.assert_array_equal(o1, o_ref)
    np.testing.assert_array_equal(fin1, fin_ref)
    for grid, block, what in (((1, hv - 1, 3), None, "grid"), ((1, hv, 2), None, "grid"), ((2, hv, 3), None, "grid"),
                              ((4, hv, 3), (32, 1, 1), "grid"), (None, (256, 1, 1), "block"),
                              (None, (64, 1, 1), "block")):
        with pytest.raises(ValueError, match=what):
            run_plan_emulated(inputs, hk, hv, d, grid=grid, block=block)


#: name -> (config, the device planned for, head dim): every kernel the plans can launch.
SCHEDULES = {"recurrent": (GdnConfig(math="recurrent"), HOPPER, 64),
             "mma two-pass, 2 stages": (GdnConfig(schedule="two_pass", isa="mma"), HOPPER, 64),
             "mma two-pass, 1 stage": (GdnConfig(schedule="two_pass", isa="mma"), ONE_SM, 128),
             "wgmma two-pass, 2 stages": (GdnConfig(schedule="two_pass", isa="wgmma"), HOPPER, 128),
             "wgmma two-pass, 1 stage": (GdnConfig(schedule="two_pass", isa="wgmma"), ONE_SM, 64),
             "wgmma two-pass, wide": (GdnConfig(schedule="two_pass", isa="wgmma"), ONE_SM, 128),
             "overlapped": (GdnConfig(schedule="overlapped"), HOPPER, 64)}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_gives_the_reference_through_exactly_its_workspace(name):
    """Every plan on the emulated kernels: the float64 reference's result (the GPU tests check the kernels' bits)
    through exactly its workspace, filled with garbage (the overlapped flags zeroed first, as the launcher does);
    one byte short faults."""
    config, device, d = SCHEDULES[name]
    rng = np.random.default_rng(16)
    hk, hv, lens = 2, 4, [1, 0, 130]
    inputs = make_inputs(rng, lens, hk, hv, d, d)
    o_ref, fin_ref = ref.reference(*inputs)
    o, fin, guards = run_plan_emulated(inputs, hk, hv, d, config, device, ws_fill=0xFF)
    assert guards
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(fin, fin_ref)
    if plan_gdn(config, GdnShape(hk, hv, d), 3, 130, device).workspace_bytes:
        with pytest.raises(IndexError, match="outside every allocation"):
            run_plan_emulated(inputs, hk, hv, d, config, device, ws_short=1)


def test_overlapped_sequential_emulator_needs_the_precompute_and_the_wide_one_its_launch():
    """The overlapped sequential kernel without its precompute (flags 0, as after the clear) is refused, as the GPU
    would wait forever; the wide kernel refuses a one-warpgroup launch shape."""
    rng = np.random.default_rng(16)
    inputs = make_inputs(rng, [1, 0, 130], 2, 4, 64, 64)
    with pytest.raises(RuntimeError, match="would wait forever: 8 ready flags"):
        run_plan_emulated(inputs, 2, 4, 64, GdnConfig(schedule="overlapped"), skip=1)
    inputs = make_inputs(rng, [5, 9], 1, 2, 128, 128)
    with pytest.raises(ValueError, match=r"needs grid.x = 1"):
        run_plan_emulated(inputs, 1, 2, 128, GdnConfig(schedule="two_pass", isa="wgmma"), ONE_SM, skip=1,
                          grid=(2, 2, 2), block=(128, 1, 1))
