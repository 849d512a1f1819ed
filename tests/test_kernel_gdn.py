"""CPU tests of the Gated DeltaNet prefill kernels: compile report, numpy reference, emulator."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.helpers import FakeMem, rel_err, spill_free
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels import gdn
from q12drv.kernels.meta import Q12MetaC
from q12drv.kernels.registry import compile_defines

RAGGED = [1, 15, 16, 17, 63, 64, 65]


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


# --------------------------------------------------------------------------- compile


def test_entries_compile_without_spills():
    from q12drv.core.nvrtc import compile_source

    img = compile_source(gdn.SOURCE, defines=compile_defines(gdn.SOURCE), use_cache=False, verbose_resources=True)
    assert img.image
    for name, r in spill_free(img, gdn.ENTRIES).items():
        assert r.registers <= 128, f"{name}: more than 128 registers (< 4 CTAs/SM)"


def test_every_entry_takes_the_one_parameter_list():
    """Every GDN entry is declared ``void name(GDN_PARAMS)``: the host reads one parameter list, written once in
    gdn/common.cuh, for all of them."""
    from q12drv.core.launch import parse_signatures
    from q12drv.core.nvrtc import cuda_src_dir, local_headers
    from q12drv.kernels.registry import struct_types

    for mod in (gdn, gdn_chunk, gdn_wgmma):
        src = (cuda_src_dir() / mod.SOURCE).read_text()
        assert sorted(re.findall(r"(\w+)\(GDN_PARAMS\)", src)) == sorted(mod.ENTRIES), mod.SOURCE
        sigs = parse_signatures(src, struct_types(), local_headers(src))
        assert sorted(sigs) == sorted(mod.ENTRIES)
        for name, params in sigs.items():
            assert [p for p, _ in params] == ["m", "h_state_ptrs", "q", "k", "v", "g", "beta", "o", "num_k_heads",
                                              "num_v_heads", "workspace"], name


def contract_refused(source, name, bad):
    """A build of ``source`` whose contract define ``name`` is ``bad`` fails to compile (its static_assert)."""
    from q12drv.core.errors import NvrtcError
    from q12drv.core.nvrtc import compile_source

    good = compile_defines(source)
    defines = [d if d.split("=")[0] != name else f"{name}={bad}" for d in good]
    assert defines != list(good), name
    with pytest.raises(NvrtcError, match="differ from the host|differs from the host|do not fit"):
        compile_source(source, defines=defines, use_cache=False)
    missing = [d for d in good if d.split("=")[0] != name]
    with pytest.raises(NvrtcError, match="compile through q12drv"):
        compile_source(source, defines=missing, use_cache=False)


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
def test_reference_matches_textbook(hk, hv):
    rng = np.random.default_rng()
    inputs = make_inputs(rng, RAGGED, hk, hv, 16, 8)
    o_bits, fin = gdn.reference(*inputs)
    o_tb, fin_tb = textbook(*inputs)
    assert_bf16_close(o_bits, o_tb)
    np.testing.assert_allclose(fin, fin_tb, rtol=1e-6, atol=1e-7)


def test_reference_matches_chunked_wy_with_initial_state():
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [1, 17, 40, 16], 1, 2, 32, 16, state_scale=1.0)
    o_bits, fin = gdn.reference(*inputs)
    o_wy, fin_wy = chunked_wy(*inputs, C=16)
    assert_bf16_close(o_bits, o_wy)
    np.testing.assert_allclose(fin, fin_wy, rtol=1e-6, atol=1e-6)
    # the initial state matters: a zero one gives a different answer
    zero = list(inputs)
    zero[-1] = np.zeros_like(inputs[-1])
    assert not np.allclose(gdn.reference(*zero)[1], fin, atol=1e-3)


def test_reference_float32_close_to_float64():
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [70, 3], 1, 2, 64, 64)
    o64, f64 = gdn.reference(*inputs)
    o32, f32 = gdn.reference(*inputs, dtype=np.float32)
    a, b = from_bf16_bits(o64), from_bf16_bits(o32)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 5e-3
    assert np.linalg.norm(f64 - f32) / np.linalg.norm(f64) < 1e-5


def test_reference_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, cu, s0 = make_inputs(rng, [3], 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple"):
        gdn.reference(q, k, v, g, beta, cu, s0)


# --------------------------------------------------------------------------- emulator


GUARD = 64  # elements of guard around the output


def run_emulated(inputs, hk, hv, d, grid=None, block=None):
    """Emulate one launch over all streams of `inputs`; returns (o bits, states, guard-ok)."""
    q, k, v, g, beta, cu, s0 = inputs
    n = len(cu) - 1
    mem = FakeMem()
    T = int(cu[-1])
    _, pq = mem.hold(q)
    _, pk = mem.hold(k)
    _, pv = mem.hold(v)
    _, pg = mem.hold(g)
    _, pb = mem.hold(beta)
    obuf, po = mem.hold(np.full(T * hv * d + 2 * GUARD, 0xFFFF, np.uint16))
    po += GUARD * 2
    states = [mem.hold(s0[b].copy()) for b in range(n)]
    _, pptrs = mem.hold(np.array([p for _, p in states], np.uint64))
    _, pcu = mem.hold(cu.astype(np.int32))
    meta = Q12MetaC(cu_seqlens=pcu, batch_size=n, chunk_len=int(np.diff(cu).max()), total_tokens=T)
    args = dict(m=meta, h_state_ptrs=pptrs, q=pq, k=pk, v=pv, g=pg, beta=pb, o=po, num_k_heads=hk, num_v_heads=hv)
    ggrid, gblock, smem = gdn.geometry(n, hv, d)
    assert smem == 0
    gdn.EMULATORS[gdn.entry_name(d)](args, mem, grid or ggrid, block or gblock)
    guards_ok = bool((obuf[:GUARD] == 0xFFFF).all() and (obuf[-GUARD:] == 0xFFFF).all())
    o = obuf[GUARD:-GUARD].reshape(T, hv, d).copy()
    return o, np.stack([s for s, _ in states]), guards_ok


@pytest.mark.parametrize("d,hk,hv", [(64, 2, 4), (128, 1, 2)])
def test_emulator_matches_reference_and_updates_state_in_place(d, hk, hv):
    rng = np.random.default_rng()
    lens = [1, 17, 64] if d == 128 else RAGGED
    inputs = make_inputs(rng, lens, hk, hv, d, d)
    o, fin, guards_ok = run_emulated(inputs, hk, hv, d)
    assert guards_ok
    o_ref, fin_ref = gdn.reference(*inputs)
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
        run_emulated(inputs, hk, hv, d, grid=(hv * d // gdn.COLS_PER_CTA - 1, 2, 1))
    with pytest.raises(ValueError, match="grid"):
        run_emulated(inputs, hk, hv, d, grid=(hv * d // gdn.COLS_PER_CTA, 1, 1))
    with pytest.raises(ValueError, match="block"):
        run_emulated(inputs, hk, hv, d, block=(256, 1, 1))


def test_geometry():
    assert gdn.COLS_PER_CTA == 32
    assert gdn.geometry(8, 32, 128) == ((128, 8, 1), (128, 1, 1), 0)
    assert gdn.geometry(1, 6, 64) == ((12, 1, 1), (128, 1, 1), 0)
    with pytest.raises(ValueError):
        gdn.geometry(1, 32, 256)
    contract_refused(gdn.SOURCE, "Q12_GDN_RECURRENT_COLUMNS", 64)


# --------------------------------------------------------------------------- chunked (WY) kernel


from q12drv.kernels import gdn_chunk, gdn_wgmma  # noqa: E402


# numpy model of gdn/chunked_mma.cu vs the float64 token-by-token reference (measured: o ~3.7e-3, the
# bf16 rounding of o alone is ~2.5e-3; state 1e-4..3e-4). Bounds with margin:
CHUNK_O_REL, CHUNK_STATE_REL = 8e-3, 1e-3


@pytest.mark.parametrize("d,hk,hv,lens", [(64, 2, 4, RAGGED + [130, 0, 3]), (128, 1, 2, [1, 65, 200]), (32, 3, 3, [16, 17, 1])])
def test_chunked_model_matches_reference_on_ragged_streams(d, hk, hv, lens):
    rng = np.random.default_rng()
    inputs = make_inputs(rng, lens, hk, hv, d, d, state_scale=1.0)
    o_ref, fin_ref = gdn.reference(*inputs)
    o, fin = gdn_chunk.chunked_reference(*inputs)
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
    o_ref, fin_ref = gdn.reference(*inputs)
    o, fin = gdn_chunk.chunked_reference(*inputs, path=path)
    assert rel_err(from_bf16_bits(o), from_bf16_bits(o_ref)) < CHUNK_O_REL
    assert rel_err(fin, fin_ref) < CHUNK_STATE_REL
    with pytest.raises(ValueError, match="path must be one of 'mma', 'wgmma', 'overlapped'"):
        gdn_chunk.chunked_reference(*inputs, path="flow")


def test_chunked_model_chunk_size_independent_of_stream_splits():
    """A chunk never crosses a stream: batched model == each stream alone, bit for bit."""
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [17, 64, 65], 1, 2, 32, 32)
    o, fin = gdn_chunk.chunked_reference(*inputs)
    q, k, v, g, beta, cu, s0 = inputs
    for b in range(3):
        s, e = cu[b], cu[b + 1]
        o1, f1 = gdn_chunk.chunked_reference(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], np.array([0, e - s]), s0[b:b + 1])
        assert np.array_equal(o[s:e], o1) and np.array_equal(fin[b], f1[0])


def test_chunk_entries_compile_without_spills():
    from q12drv.core.nvrtc import compile_source

    img = compile_source(gdn_chunk.SOURCE, defines=compile_defines(gdn_chunk.SOURCE), use_cache=False,
                         verbose_resources=True)
    assert img.image
    spill_free(img, gdn_chunk.ENTRIES)


def test_chunk_smem_and_geometry():
    """The fused kernel's geometry; its shared memory is the source's (gdnc::Smem, a contract define)."""
    assert gdn_chunk.BV == 64
    assert gdn_chunk.geometry(8, 32, 128) == ((2, 32, 8), (128, 1, 1), gdn_chunk.smem_bytes(128))
    assert gdn_chunk.geometry(1, 32, 128) == ((2, 32, 1), (128, 1, 1), gdn_chunk.smem_bytes(128))
    assert gdn_chunk.geometry(1, 6, 64) == ((1, 6, 1), (128, 1, 1), gdn_chunk.smem_bytes(64))
    assert gdn_chunk.smem_bytes(128) <= 227 * 1024 // 2  # two CTAs per SM
    with pytest.raises(ValueError):
        gdn_chunk.geometry(1, 32, 256)
    with pytest.raises(ValueError):
        gdn_chunk.geometry(0, 32, 128)
    for name, bad in (("Q12_GDN_MMA_FUSED_SMEM_D128", 114944 + 16), ("Q12_GDN_SLICE", 32),
                      ("Q12_GDN_MMA_SEQUENTIAL_SMEM_1STAGE_D64", 1), ("Q12_GDN_TREC", 17440)):
        contract_refused(gdn_chunk.SOURCE, name, bad)


def test_split_pair_sizes_match_the_source():
    """The split pair's shared memory, record sizes and geometry: the host's numbers are the ones the
    source's static_asserts pin, so the launches ask for what the kernels lay out."""
    for d in (64, 128):
        assert gdn_chunk.seq_smem_bytes(d, 2) == 2 * gdn_chunk.seq_smem_bytes(d, 1), d
    assert gdn_chunk.tile_v_record_bytes() == 17424
    # occupancy the design relies on (227 KiB of shared memory per SM, 1 KiB reserved per CTA)
    assert 3 * (gdn_chunk.prep_smem_bytes(128) + 1024) <= 227 * 1024
    assert 2 * (gdn_chunk.seq_smem_bytes(128, 1) + 1024) <= 227 * 1024 < 2 * (gdn_chunk.seq_smem_bytes(128, 2) + 1024)
    # geometry: one precompute CTA per (chunk, key head, stream); the sequential grid is the fused one
    prep, seq = gdn_chunk.split_geometry(8, 2048, 16, 32, 128, 1)
    assert prep == ((32, 16, 8), (128, 1, 1), gdn_chunk.prep_smem_bytes(128))
    assert seq == ((2, 32, 8), (128, 1, 1), gdn_chunk.seq_smem_bytes(128, 1))
    assert gdn_chunk.split_geometry(1, 1, 16, 32, 64)[0][0] == (1, 16, 1)
    assert gdn_chunk.workspace_bytes(1, 8192, 16, 32, 128) == 128 * (16 * 49152 + 32 * 19200)
    assert gdn_chunk.workspace_bytes(3, 65, 2, 6, 64) == 3 * 2 * (2 * 24576 + 6 * 19200)
    # the sequential build: one buffer once the fused grid holds two CTAs per SM
    assert gdn_chunk.split_stages(8, 32, 128, 132) == 1 and gdn_chunk.split_stages(5, 32, 128, 132) == 1
    assert gdn_chunk.split_stages(1, 32, 128, 132) == 2 and gdn_chunk.split_stages(4, 32, 128, 132) == 2
    assert gdn_chunk.split_entries(128, 1) == ("q12_gdn_mma_precompute_d128", "q12_gdn_mma_sequential_1stage_d128")
    for entry in gdn_chunk.ENTRIES:
        assert gdn_chunk.entry_smem_bytes(entry) > 0
    with pytest.raises(ValueError, match="stages"):
        gdn_chunk.split_entries(128, 3)
    with pytest.raises(KeyError, match="not a gdn/chunked_mma.cu entry"):
        gdn_chunk.entry_smem_bytes("q12_gdn_recurrent_d128")
    with pytest.raises(ValueError):
        gdn_chunk.workspace_bytes(0, 64, 16, 32, 128)


def test_split_emulators_check_the_launch_and_need_the_whole_workspace():
    """The split pair's emulators: the precompute entry checks its grid and that the workspace is mapped,
    the sequential entries run the fused emulator (the same float64 reference, so equal by construction
    here; the GPU test test_gdn_split_pair_equals_the_fused_kernel checks the kernels' bits); a workspace
    one byte short is refused as the GPU would fault on it."""
    rng = np.random.default_rng(5)
    hk, hv, d, lens = 2, 4, 64, [1, 70, 130]
    inputs = make_inputs(rng, lens, hk, hv, d, d)
    o_f, fin_f, _ = _run_chunk_emulated(inputs, hk, hv, d)
    for stages in gdn_chunk.SEQ_STAGES:
        o_s, fin_s, guards = _run_chunk_emulated(inputs, hk, hv, d, split=stages)
        assert guards
        np.testing.assert_array_equal(o_s, o_f)
        np.testing.assert_array_equal(fin_s, fin_f)
    with pytest.raises(IndexError, match="outside every allocation"):
        _run_chunk_emulated(inputs, hk, hv, d, split=2, ws_short=1)


def _run_chunk_emulated(inputs, hk, hv, d, grid=None, block=None, split=0, ws_short=0, pair="split", ws_fill=0,
                        skip_prep=False):
    """Run a GDN entry (``split`` 0: the fused kernel) or a pair (``pair`` "split", "wgmma" or "flow", the wgmma
    pair's flow form on 132 SMs, its flags cleared first as ops clears them; ``split``: the stages) on the
    emulated kernels; the workspace is exactly what the launches read and write (``ws_short`` bytes less),
    filled with ``ws_fill``; ``skip_prep``: the pair's second launch alone. Returns (o, final states, guards
    intact)."""
    q, k, v, g, beta, cu, s0 = inputs
    n = len(cu) - 1
    mem = FakeMem()
    T = int(cu[-1])
    ptrs = [mem.hold(x)[1] for x in (q, k, v, g, beta)]
    obuf, po = mem.hold(np.full(T * hv * d + 2 * GUARD, 0xFFFF, np.uint16))
    po += GUARD * 2
    states = [mem.hold(s0[b].copy()) for b in range(n)]
    _, pptrs = mem.hold(np.array([p for _, p in states], np.uint64))
    _, pcu = mem.hold(cu.astype(np.int32))
    meta = Q12MetaC(cu_seqlens=pcu, batch_size=n, chunk_len=int(np.diff(cu).max()), total_tokens=T)
    args = dict(m=meta, h_state_ptrs=pptrs, q=ptrs[0], k=ptrs[1], v=ptrs[2], g=ptrs[3], beta=ptrs[4], o=po,
                num_k_heads=hk, num_v_heads=hv)
    if split:  # a pair: "split", "wgmma" (two launches: the records, not the flags) or "flow"
        if pair == "split":
            nbytes = gdn_chunk.workspace_bytes(n, meta.chunk_len, hk, hv, d)
            geos = gdn_chunk.split_geometry(n, meta.chunk_len, hk, hv, d, split)
            names = gdn_chunk.split_entries(d, split)
        elif pair == "wgmma":
            nbytes = gdn_wgmma.workspace_bytes(n, meta.chunk_len, hk, hv, d, "pair")
            geos = gdn_wgmma.geometry(n, meta.chunk_len, hk, hv, d, split)
            names = gdn_wgmma.entries(d, split)
        elif pair == "wide":
            nbytes = gdn_wgmma.workspace_bytes(n, meta.chunk_len, hk, hv, d, "wide")
            geos = gdn_wgmma.wide_geometry(n, meta.chunk_len, hk, hv, d)
            names = gdn_wgmma.wide_entries(d)
        else:
            nbytes = gdn_wgmma.workspace_bytes(n, meta.chunk_len, hk, hv, d, "flow")
            flow = gdn_wgmma.flow_launches(n, meta.chunk_len, hk, hv, d, 132)
            names, geos = [e for e, *_ in flow], [(g, b, sm) for _, g, b, sm, _ in flow]
        ws, args["workspace"] = mem.hold(np.full(nbytes - ws_short, ws_fill, np.uint8))
        if pair == "flow":  # ops: the flags (and the item counter) cleared, then the launches
            ws[gdn_wgmma.flags_offset(n, meta.chunk_len, hk, hv, d):] = 0
        emulators = {**gdn_chunk.EMULATORS, **gdn_wgmma.EMULATORS}
        for entry, (ggrid, gblock, _) in list(zip(names, geos))[int(skip_prep):]:
            emulators[entry](args, mem, ggrid, gblock)
    else:
        ggrid, gblock, _ = gdn_chunk.geometry(n, hv, d)
        gdn_chunk.EMULATORS[gdn_chunk.entry_name(d)](args, mem, grid or ggrid, block or gblock)
    guards_ok = bool((obuf[:GUARD] == 0xFFFF).all() and (obuf[-GUARD:] == 0xFFFF).all())
    return obuf[GUARD:-GUARD].reshape(T, hv, d).copy(), np.stack([s for s, _ in states]), guards_ok


def test_chunk_emulator_runs_the_reference_in_place_and_checks_geometry():
    rng = np.random.default_rng()
    hk, hv, d = 2, 4, 64
    inputs = make_inputs(rng, [5, 0, 70], hk, hv, d, d)
    o, fin, guards_ok = _run_chunk_emulated(inputs, hk, hv, d)
    assert guards_ok
    o_ref, fin_ref = gdn.reference(*inputs)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(fin, fin_ref)
    np.testing.assert_array_equal(fin[1], inputs[-1][1])  # a stream of length 0 keeps its state
    # a grid larger than n x Hv is accepted (the extra CTAs return); grid.x and the block are exact
    o1, fin1, _ = _run_chunk_emulated(inputs, hk, hv, d, grid=(1, hv + 1, 4))
    np.testing.assert_array_equal(o1, o_ref)
    np.testing.assert_array_equal(fin1, fin_ref)
    with pytest.raises(ValueError, match="grid"):
        _run_chunk_emulated(inputs, hk, hv, d, grid=(1, hv - 1, 3))
    with pytest.raises(ValueError, match="grid"):
        _run_chunk_emulated(inputs, hk, hv, d, grid=(1, hv, 2))
    with pytest.raises(ValueError, match="grid"):
        _run_chunk_emulated(inputs, hk, hv, d, grid=(2, hv, 3))
    with pytest.raises(ValueError, match="grid"):  # the removed bv 16 geometry
        _run_chunk_emulated(inputs, hk, hv, d, grid=(4, hv, 3), block=(32, 1, 1))
    with pytest.raises(ValueError, match="block"):
        _run_chunk_emulated(inputs, hk, hv, d, block=(256, 1, 1))
    with pytest.raises(ValueError, match="block"):
        _run_chunk_emulated(inputs, hk, hv, d, block=(64, 1, 1))

def test_ops_gdn_algo_keyword(monkeypatch):
    from types import SimpleNamespace

    from q12drv.kernels import ops

    assert ops.GDN_ALGOS == ("chunked", "recurrent", "split", "wgmma")
    assert "gdn/chunked_mma.cu" in ops.SOURCES and ops.ENTRIES["q12_gdn_mma_fused_d128"] == "gdn/chunked_mma.cu"
    assert ops.ENTRIES["q12_gdn_wgmma_sequential_1stage_d128"] == "gdn/chunked_wgmma.cu"
    assert ops.ENTRIES["q12_gdn_wgmma_precompute_d128"] == "gdn/chunked_mma.cu"
    monkeypatch.setattr(ops, "_check", lambda device, meta: None)
    hopper = SimpleNamespace(arch="sm_90")
    with pytest.raises(ValueError, match="algo must be one of 'chunked', 'recurrent', 'split', 'wgmma', got 'fast'"):
        ops.gdn(hopper, None, 8, 16, 16, 8, 4, 4, 8, num_k_heads=1, num_v_heads=1, head_dim=64, algo="fast")
    with pytest.raises(ValueError, match="Hopper .* this device is sm_100"):
        ops.gdn(SimpleNamespace(arch="sm_100"), None, 8, 16, 16, 8, 4, 4, 8, num_k_heads=1, num_v_heads=1,
                head_dim=64, algo="wgmma")
    ops.check_gdn_algo("wgmma", "sm_90a")
    ops.check_gdn_algo("split", "sm_80")  # the mma.sync pairs run anywhere


def test_wgmma_pair_sizes_match_the_source():
    """The wgmma pair's stages, records and geometry: the host's numbers are the ones gdn/chunked_wgmma.cu
    checks (contract defines); one stage fits two CTAs per SM, two stages one."""
    assert gdn_wgmma.stage_bytes(128) % 1024 == 0 and gdn_wgmma.stage_bytes(128) >= 32768 + 17424 + 2 * 64 * 72 * 2
    assert (gdn_wgmma.stage_bytes(128), gdn_wgmma.stage_bytes(64)) == (69632, 53248)
    assert gdn_wgmma.stage_bytes(128, 2) == 88064   # the wide form: two V and two O slices
    # the wide form: two stages, one CTA of 256 threads a SM (both slices' warpgroups)
    assert gdn_wgmma.seq_smem_bytes(128, 2, 2) == gdn_wgmma.entry_smem_bytes(gdn_wgmma.WIDE_ENTRY) <= 227 * 1024
    assert gdn_wgmma.wide_geometry(8, 2048, 16, 32, 128)[1] == ((1, 32, 8), (256, 1, 1), 176032)
    for name, bad in (("Q12_GDN_WGMMA_SEQUENTIAL_SMEM_2STAGE_D128", 1), ("Q12_GDN_WGMMA_SEQUENTIAL_SMEM_WIDE_D128", 1),
                      ("Q12_GDN_OVERLAP_REC_D64", 57872), ("Q12_GDN_OVERLAP_VH_CHUNKS", 0),
                      ("Q12_GDN_OVERLAP_PRECOMPUTE_SMEM_D128", 150000)):
        contract_refused(gdn_wgmma.SOURCE, name, bad)
    with pytest.raises(ValueError, match="head_dim 128 only"):
        gdn_wgmma.wide_entries(64)
    sm = 228 * 1024  # shared memory per SM (227 KiB for blocks + 1 KiB reserved per CTA)
    assert 2 * (gdn_wgmma.seq_smem_bytes(128, 1) + 1024) <= sm < 2 * (gdn_wgmma.seq_smem_bytes(128, 2) + 1024)
    assert gdn_wgmma.seq_smem_bytes(128, 2) <= 227 * 1024
    prep, seq = gdn_wgmma.geometry(8, 2048, 16, 32, 128, 1)
    assert prep == ((32, 16, 8), (128, 1, 1), gdn_chunk.prep_smem_bytes(128))
    assert seq == ((2, 32, 8), (128, 1, 1), gdn_wgmma.seq_smem_bytes(128, 1))
    # no K records: one tile V record per (chunk, value head) for the two-launch and wide forms; the flow form's
    # larger records (W, P, EQ, WK, exp(gamma_C), then T diag(beta) hi + lo: GDN_WG_USEQ 1, the default; or U^T in
    # fp32 per 64-column slice), then one flag per (chunk, key head); "any" (the default) is the largest
    assert gdn_wgmma.workspace_bytes(1, 8192, 16, 32, 128, "pair") == 128 * 32 * 17424
    assert gdn_wgmma.workspace_bytes(1, 8192, 16, 32, 128, "wide") == 128 * 32 * 17424
    # the flow precompute's items: a value head's in the first 8 chunks, a key head's after them
    assert gdn_wgmma.FLOW_VH_CHUNKS == 8
    assert gdn_wgmma.flow_items(1, 8192, 16, 32) == 8 * 32 + 120 * 16
    assert gdn_wgmma.flow_items(2, 300, 16, 32) == 2 * 5 * 32   # every chunk in the first 8
    assert gdn_wgmma.flow_ready_value(16, 32) == 2
    assert gdn_wgmma.flow_record_bytes(128) == 16384 + 8192 + 512 + 16 + 2 * 8192 == 41488
    assert gdn_wgmma.flow_record_bytes(64) == 8192 + 8192 + 512 + 16 + 2 * 8192 == 33296
    assert gdn_wgmma.flow_record_offsets(128) == {"W": 0, "P": 16384, "EQ": 24576, "WK": 24832, "EGC": 25088,
                                                  "TB": 25104, "END": 41488}
    assert gdn_wgmma.stage_bytes(128, uws=True) == 92160 and gdn_wgmma.stage_bytes(64, uws=True) == 67584
    assert gdn_wgmma.entry_smem_bytes("q12_gdn_wgmma_overlapped_sequential_d128") == \
        gdn_wgmma.seq_smem_bytes(128, 2, uws=True) \
        <= 227 * 1024
    flow = 128 * 32 * 41488 + 4 * 128 * 16 + 16   # the records, the ready flags, the item counter
    assert gdn_wgmma.kq_offset(1, 8192, 16, 32, 128) == -(-flow // 128) * 128
    flow = -(-flow // 128) * 128 + 128 * 16 * 2 * 64 * 128 * 2   # then each item's k and q tiles
    assert gdn_wgmma.workspace_bytes(1, 8192, 16, 32, 128, "flow") == flow
    assert gdn_wgmma.workspace_bytes(1, 8192, 16, 32, 128) == flow
    assert gdn_wgmma.flags_offset(1, 8192, 16, 32, 128) == 128 * 32 * 41488
    with pytest.raises(ValueError, match="form must be one of 'any', 'pair', 'flow', 'wide', got 'auto'"):
        gdn_wgmma.workspace_bytes(1, 8192, 16, 32, 128, "auto")
    assert [gdn_wgmma.resolve_form("auto", n, t, 32, 128, 132) for n, t in ((1, 8192), (8, 2048), (1, 2048))] == \
        ["flow", "wide", "pair"]
    assert gdn_wgmma.resolve_form("pair", 1, 8192, 32, 128, 132) == "pair"
    assert gdn_wgmma.entries(128, 1) == ("q12_gdn_wgmma_precompute_d128", "q12_gdn_wgmma_sequential_1stage_d128")
    assert gdn_wgmma.stages(8, 32, 128, 132) == 1 and gdn_wgmma.stages(1, 32, 128, 132) == 2
    for entry in gdn_wgmma.ENTRIES:
        assert gdn_wgmma.entry_smem_bytes(entry) > 0
    with pytest.raises(ValueError, match="head_dim 64 and 128, not 256"):
        gdn_wgmma.workspace_bytes(1, 64, 1, 1, 256)
    with pytest.raises(ValueError, match="stages"):
        gdn_wgmma.entries(128, 3)
    with pytest.raises(KeyError, match="not a gdn/chunked_wgmma.cu entry"):
        gdn_wgmma.entry_smem_bytes("q12_gdn_mma_sequential_2stage_d128")


def test_wgmma_entries_compile_for_sm90a_without_spills():
    """gdn/chunked_wgmma.cu compiles for sm_90a only (wgmma), every entry without spills or local memory."""
    from q12drv.core.nvrtc import compile_source, target_arch

    assert target_arch(gdn_wgmma.SOURCE, "sm_90") == "sm_90a"
    with pytest.raises(ValueError, match="sm_90a"):
        target_arch(gdn_wgmma.SOURCE, "sm_80")
    img = compile_source(gdn_wgmma.SOURCE, defines=compile_defines(gdn_wgmma.SOURCE), use_cache=False,
                         verbose_resources=True)
    assert img.arch == "sm_90a"
    spill_free(img, gdn_wgmma.ENTRIES)
    spill_free(compile_source(gdn_chunk.SOURCE, defines=compile_defines(gdn_chunk.SOURCE), verbose_resources=True),
               [gdn_chunk.tile_prep_entry(d) for d in (64, 128)])


def test_wgmma_model_matches_reference_and_the_block_solve():
    """The wgmma pair's numpy model (T = (I + A)^-1 rounded to bf16, one product) stays within the chunked
    kernels' error budget and within a few bf16 roundings of the block-solve model."""
    rng = np.random.default_rng()
    inputs = make_inputs(rng, [1, 63, 130, 300], 2, 4, 64, 64, state_scale=1.0)
    o_ref, fin_ref = gdn.reference(*inputs)
    o_b, fin_b = gdn_chunk.chunked_reference(*inputs)
    o_t, fin_t = gdn_chunk.chunked_reference(*inputs, path="wgmma")
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
    T = gdn_chunk._block_solve(np.broadcast_to(np.eye(C, dtype=np.float32), (1, C, C)), Aoff, Dinv)
    np.testing.assert_allclose(T[0] @ (np.eye(C) + A[0]), np.eye(C), atol=1e-5)


def test_overlapped_model_keeps_the_wgmma_error():
    """fla's order V_new = U - W S (the flow form's records: T diag(beta) and T diag(beta EK) as hi + lo pairs from
    the fp32 T, U in fp32, W in bf16) keeps the state's error within 2x of the wgmma pair's; o's error is o's
    rounding either way."""
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, [256, 129], 2, 4, 128, 128)
    o_ref, fin_ref = gdn.reference(*inputs)
    _, fin_t = gdn_chunk.chunked_reference(*inputs, path="wgmma")
    o_f, fin_f = gdn_chunk.chunked_reference(*inputs, path="overlapped")
    err_t, err_f = (float(np.max(np.abs(f - fin_ref))) for f in (fin_t, fin_f))
    assert err_f < 2 * err_t
    assert rel_err(from_bf16_bits(o_f), from_bf16_bits(o_ref)) < CHUNK_O_REL


def test_wgmma_emulators_check_the_launch_and_need_the_whole_workspace():
    """The wgmma pair on the emulated driver: its precompute entry checks its grid and maps the tile-format
    workspace, its sequential entries run the float64 reference (so the fused result, by construction); a
    workspace one byte short is refused as the GPU would fault on it."""
    rng = np.random.default_rng(6)
    hk, hv, d, lens = 2, 4, 64, [1, 70, 130]
    inputs = make_inputs(rng, lens, hk, hv, d, d)
    o_f, fin_f, _ = _run_chunk_emulated(inputs, hk, hv, d)
    for stages in gdn_wgmma.STAGES:
        o_s, fin_s, guards = _run_chunk_emulated(inputs, hk, hv, d, split=stages, pair="wgmma")
        assert guards
        np.testing.assert_array_equal(o_s, o_f)
        np.testing.assert_array_equal(fin_s, fin_f)
    # the split pair's (smaller) workspace is too small for the tile format
    with pytest.raises(IndexError, match="outside every allocation"):
        _run_chunk_emulated(inputs, hk, hv, d, split=1, pair="wgmma", ws_short=1)


def test_wgmma_flow_form_sizes_rule_and_launches():
    """The flow form: a precompute CTA fills an SM (no sequential CTA beside it), the rule takes it while the
    sequential CTAs leave half of the SMs, the precompute gets the SMs they leave, and ops clears the flags and
    the item counter (after the records) before two launches, the second with programmatic stream serialization."""
    from q12drv.kernels import ops

    sm = 228 * 1024
    assert gdn_wgmma.prep_flow_smem_bytes(128) == 3 * 64000 <= 227 * 1024
    assert gdn_wgmma.prep_flow_smem_bytes(128) + 1024 + gdn_wgmma.seq_smem_bytes(128, 2, uws=True) + 1024 > sm
    assert gdn_wgmma.seq_smem_bytes(128, 2, uws=True) == 92160 + 92160 + 16 + 896 == 185232 <= 227 * 1024
    assert gdn_wgmma.uses_flow(1, 8192, 32, 128, 132) and not gdn_wgmma.uses_flow(2, 8192, 32, 128, 132)
    assert gdn_wgmma.uses_flow(2, 9000, 32, 64, 132) and not gdn_wgmma.uses_flow(1, 8192, 32, 128, 127)
    assert not gdn_wgmma.uses_flow(1, 8191, 32, 128, 132)  # 1 x 2048 measured slower in the flow form
    prep, seq = gdn_wgmma.flow_geometry(1, 8192, 16, 32, 128, 132)
    assert prep == ((68, 1, 1), (384, 1, 1), 192000)
    assert seq == ((2, 32, 1), (128, 1, 1), gdn_wgmma.seq_smem_bytes(128, 2, uws=True))   # the flow stages
    assert gdn_wgmma.flow_geometry(4, 64, 1, 32, 128, 132)[0][0] == (1, 1, 1)  # never an empty grid
    zero, launches = ops._gdn_launches("wgmma", 1, 8192, 16, 32, 128, 132)
    assert zero == (gdn_wgmma.flags_offset(1, 8192, 16, 32, 128), 4 * 128 * 16 + 16)   # the flags, the counter
    assert launches == gdn_wgmma.flow_launches(1, 8192, 16, 32, 128, 132) == (
        ("q12_gdn_wgmma_overlapped_precompute_d128", (68, 1, 1), (384, 1, 1), 192000, False),
        ("q12_gdn_wgmma_overlapped_sequential_d128", (2, 32, 1), (128, 1, 1), 185232, True))
    assert gdn_wgmma.flag_count(1, 8192, 16) == 128 * 16 and gdn_wgmma.flags_bytes(1, 64, 1) == 4 + 16
    for n, chunk_len, form in ((8, 2048, "wide"), (1, 2048, "pair"), (8, 2048, "pair")):
        # the rules: a full device at d 128 takes the wide form, few CTAs the pair; form= overrides them every way
        zero, launches = ops._gdn_launches("wgmma", n, chunk_len, 16, 32, 128, 132, form)
        assert zero is None and [dep for *_, dep in launches] == [False, True]   # the sequential kernel by PDL
        assert (ops._gdn_launches("wgmma", n, chunk_len, 16, 32, 128, 132) == (zero, launches)) == (n == 1 or
                                                                                                   form == "wide")
        assert (launches[1][0] == gdn_wgmma.WIDE_ENTRY) == (form == "wide")
        zero, launches = ops._gdn_launches("wgmma", n, chunk_len, 16, 32, 128, 132, "flow")
        assert zero == (gdn_wgmma.flags_offset(n, chunk_len, 16, 32, 128), gdn_wgmma.flags_bytes(n, chunk_len, 16))
        assert [(e, dep) for e, *_, dep in launches] == [("q12_gdn_wgmma_overlapped_precompute_d128", False),
                                                         ("q12_gdn_wgmma_overlapped_sequential_d128", True)]
    assert gdn_wgmma.uses_wide(8, 32, 128, 132) and gdn_wgmma.uses_wide(5, 32, 128, 132)
    assert not gdn_wgmma.uses_wide(4, 32, 128, 132) and not gdn_wgmma.uses_wide(8, 32, 64, 132)
    assert [e for e, *_ in ops._gdn_launches("wgmma", 16, 2048, 16, 32, 64, 132)[1]] == list(gdn_wgmma.entries(64, 1))
    zero, launches = ops._gdn_launches("wgmma", 1, 8192, 16, 32, 128, 132, "pair")
    assert zero is None and [e for e, *_ in launches] == list(gdn_wgmma.entries(128, 2))
    zero, launches = ops._gdn_launches("wgmma", 8, 2048, 16, 32, 128, 132, "wide")
    assert zero is None and [(e, g, b) for e, g, b, *_ in launches] == [
        ("q12_gdn_wgmma_precompute_d128", (32, 16, 8), (128, 1, 1)),
        ("q12_gdn_wgmma_sequential_wide_d128", (1, 32, 8), (256, 1, 1))]
    with pytest.raises(ValueError, match="head_dim 128 only"):
        ops.check_gdn_form("wgmma", "wide", 64)
    for algo, form, msg in (("wgmma", "fast", "form must be one of 'auto', 'pair', 'flow', 'wide'"),
                            ("wgmma", None, "form must be one of"),
                            ("split", "flow", "algo='split' has one form: leave form='auto'"),
                            ("chunked", "pair", "algo='chunked' has one form")):
        with pytest.raises(ValueError, match=msg):
            ops.check_gdn_form(algo, form)
    for algo in ops.GDN_ALGOS:
        ops.check_gdn_form(algo, "auto")
    assert gdn_wgmma.entry_smem_bytes("q12_gdn_wgmma_overlapped_precompute_d64") == 3 * gdn_chunk.prep_smem_bytes(64)


@pytest.mark.parametrize("pair,d", [("flow", 64), ("wide", 128)])
def test_wgmma_form_emulators_give_the_fused_result_through_their_workspace(pair, d):
    """The flow and wide forms on the emulated driver: the fused kernel's result through exactly their workspace,
    filled with garbage (the flow form's flags cleared first, as ops clears them); one byte short faults."""
    rng = np.random.default_rng(16)
    hk, hv, lens = 2, 4, [1, 0, 130]
    inputs = make_inputs(rng, lens, hk, hv, d, d)
    o_f, fin_f, _ = _run_chunk_emulated(inputs, hk, hv, d)
    o_s, fin_s, guards = _run_chunk_emulated(inputs, hk, hv, d, split=2, pair=pair, ws_fill=0xFF)
    assert guards
    np.testing.assert_array_equal(o_s, o_f)
    np.testing.assert_array_equal(fin_s, fin_f)
    with pytest.raises(IndexError, match="outside every allocation"):
        _run_chunk_emulated(inputs, hk, hv, d, split=2, pair=pair, ws_short=1)


def test_wgmma_flow_emulator_needs_the_precompute_and_the_wide_one_its_launch():
    """The flow form's sequential kernel without the precompute (flags 0, as after the clear) is refused, as the GPU
    would wait forever; the wide kernel refuses a one-warpgroup launch shape."""
    rng = np.random.default_rng(16)
    inputs = make_inputs(rng, [1, 0, 130], 2, 4, 64, 64)
    with pytest.raises(RuntimeError, match="would wait forever: 8 ready flags"):
        _run_chunk_emulated(inputs, 2, 4, 64, split=2, pair="flow", skip_prep=True)
    with pytest.raises(ValueError, match=r"needs grid \(1, Hv, n\) and block \(256, 1, 1\)"):
        gdn_wgmma.EMULATORS[gdn_wgmma.WIDE_ENTRY]({}, None, (2, 4, 3), (128, 1, 1))


def test_sw128_unswizzle_inverts_the_kernels_swizzle():
    """gdn_wgmma.sw128_offset is gdn/chunk.cuh's sw128_off (the formula in the source), and sw128_unswizzle reads a
    tile written through it back in row order, for 64 and 128 columns; wrong sizes are refused."""
    from q12drv.core.nvrtc import cuda_src_dir
    src = (cuda_src_dir() / "gdn/chunk.cuh").read_text()
    assert "return (cg >> 3) * (GDN_C * 128) + r * 128 + (((cg & 7) ^ (r & 7)) << 4);" in src
    assert gdn_wgmma.sw128_offset(0, 0) == 0 and gdn_wgmma.sw128_offset(1, 0) == 128 + 16
    assert gdn_wgmma.sw128_offset(9, 8) == 8192 + 9 * 128 + 16
    rng = np.random.default_rng(3)
    for cols in (64, 128):
        tile = rng.integers(0, 1 << 16, (64, cols), dtype=np.uint16)
        raw = np.zeros(64 * cols, np.uint16)
        for r in range(64):
            for c in range(cols // 8):
                at = gdn_wgmma.sw128_offset(r, c) // 2
                raw[at: at + 8] = tile[r, 8 * c: 8 * c + 8]
        assert np.array_equal(gdn_wgmma.sw128_unswizzle(raw.view(np.uint8), cols), tile)
    with pytest.raises(ValueError, match="multiple of 64"):
        gdn_wgmma.sw128_unswizzle(np.zeros(64 * 32, np.uint16), 32)
    with pytest.raises(ValueError, match="is 16384 bytes, got 8192"):
        gdn_wgmma.sw128_unswizzle(np.zeros(64 * 64, np.uint16), 128)
