"""CPU tests of the paged causal prefill attention kernel: compile, reference, emulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import FakeMem, shuffled_tables, spill_free
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels import attention as attn
from q12drv.core.errors import NvrtcError
from q12drv.kernels.meta import Q12MetaC, meta_defines
from q12drv.kernels.registry import compile_defines
from q12drv.core.nvrtc import compile_source

# ---------------------------------------------------------------------------------------------
# helpers


def _bf16(rng, shape, std=1.0):
    return to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * std)


def make_case(rng, q_lens, prefixes, *, hq, hkv, d, bs, spare_blocks=3):
    """Random Q and pools; each stream gets shuffled physical blocks (no sharing)."""
    q_lens = np.asarray(q_lens, dtype=np.int64)
    kv_lens = q_lens + np.asarray(prefixes, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    nblk = [-(-int(k) // bs) for k in kv_lens]
    num_blocks = sum(nblk) + spare_blocks
    tables = shuffled_tables(rng, nblk, num_blocks)
    q = _bf16(rng, (int(cu[-1]), hq, d))
    k_pool = _bf16(rng, (num_blocks, bs, hkv, d))
    v_pool = _bf16(rng, (num_blocks, bs, hkv, d))
    return q, k_pool, v_pool, cu, kv_lens.astype(np.int32), tables


def textbook(q, k_pool, v_pool, cu, kv_lens, tables, hq, hkv, bs, scale, window_left=None):
    """float64, one row at a time, every key looked up through the block table; with ``window_left`` the keys
    ``last - window_left .. last`` of each row (an explicit window)."""
    qf = from_bf16_bits(q).astype(np.float64)
    kf = from_bf16_bits(k_pool).astype(np.float64)
    vf = from_bf16_bits(v_pool).astype(np.float64)
    out = np.zeros(q.shape, dtype=np.float64)
    grp = hq // hkv
    for b in range(len(kv_lens)):
        q_len = int(cu[b + 1] - cu[b])
        kv = int(kv_lens[b])
        for h in range(hq):
            kvh = h // grp
            for r in range(q_len):
                last = kv - q_len + r
                first = 0 if window_left is None else max(0, last - window_left)
                keys = np.stack([kf[tables[b][p // bs], p % bs, kvh] for p in range(first, last + 1)])
                vals = np.stack([vf[tables[b][p // bs], p % bs, kvh] for p in range(first, last + 1)])
                logits = keys @ qf[cu[b] + r, h] * scale
                w = np.exp(logits - logits.max())
                out[cu[b] + r, h] = (w / w.sum()) @ vals
    return out


GUARD = 64  # uint16 guard elements on each side of O


def emulate_case(mem, q, k_pool, v_pool, cu, kv_lens, tables, hq, hkv, bs, scale, d, grid=None, block=None,
                 window_left=attn.NO_WINDOW):
    """Upload into ``mem``, run the emulator (``window_left``: the kernel's argument), return (O rows, guarded
    buffer)."""
    n = len(kv_lens)
    t_total = int(cu[-1])
    o_buf = np.full(t_total * hq * d + 2 * GUARD, 0xFFFF, dtype=np.uint16)
    o_buf, o_ptr = mem.hold(o_buf)
    o_ptr += GUARD * 2
    table_ptrs = np.array([mem.put(np.asarray(t, np.int32)) for t in tables], dtype=np.uint64)
    pos = np.concatenate([np.arange(k - (cu[i + 1] - cu[i]), k) for i, k in enumerate(kv_lens)]).astype(np.uint32)
    meta = Q12MetaC(
        positions=mem.put(pos),
        positions_h=mem.put(pos),
        positions_w=mem.put(pos),
        slots=mem.put(np.zeros(max(t_total, 1), np.int64)),
        block_table_ptrs=mem.put(table_ptrs),
        seq_len_ptrs=mem.put(np.asarray(kv_lens, np.uint32)),
        cu_seqlens=mem.put(np.asarray(cu, np.int32)),
        kv_lens=mem.put(np.asarray(kv_lens, np.int32)),
        batch_size=n,
        chunk_len=int(np.max(np.diff(cu))),
        total_tokens=t_total,
        max_blocks_per_seq=max(len(t) for t in tables),
    )
    g, blk, _ = attn.geometry(n, int(np.max(np.diff(cu))), hq, d, num_kv_heads=hkv)
    args = {
        "m": meta,
        "q": mem.put(q),
        "k_pool": mem.put(k_pool),
        "v_pool": mem.put(v_pool),
        "o": o_ptr,
        "num_q_heads": hq,
        "num_kv_heads": hkv,
        "block_size": bs,
        "scale": float(scale),
        "window_left": window_left,
    }
    attn.EMULATORS[attn.entry_for_head_dim(d)](args, mem, grid or g, block or blk)
    return o_buf[GUARD:-GUARD].reshape(t_total, hq, d), o_buf


# ---------------------------------------------------------------------------------------------
# compile, tiles and the host/source contract


def test_compiles_without_spills(kernel_build):
    img = kernel_build(attn.SOURCE)
    report = spill_free(img, attn.ENTRIES)
    assert all(report[entry].registers <= 255 for entry in attn.ENTRIES)


def test_tiles_and_geometry():
    assert set(attn.TILES) == set(attn.HEAD_DIMS) and all(attn.TILES[d].head_dim == d for d in attn.TILES)
    assert {d: (t.threads, t.block_m, t.gqa_pack, t.smem) for d, t in attn.TILES.items()} == {
        64: (256, 128, False, 55808), 128: (256, 256, True, 104704), 256: (256, 128, True, 222720)}
    for d, t in attn.TILES.items():
        # Q tile + two K and two V stages, padded rows, the [2][BN] slot array (+ the warp pairs' P tiles
        # and row statistics at D256)
        pairs = 4 * (32 * (t.block_n + 8) * 2 + 2 * 32 * 4) if t.dim_split else 0
        assert attn.smem_bytes(d) == t.smem == (t.block_m + 4 * t.block_n) * (d + 8) * 2 + 8 * t.block_n + pairs
        assert t.smem <= 227 * 1024
    grid, block, smem = attn.geometry(3, 300, 16, 64)
    assert grid == (-(-300 // 128), 16, 3) and block == (256, 1, 1) and smem == attn.smem_bytes(64)
    assert attn.geometry(3, 300, 16, 64, num_kv_heads=2) == (grid, block, smem)  # Hkv unused without GQA
    assert attn.geometry(1, 128, 2, 64)[0] == (1, 2, 1)
    assert attn.geometry(1, 129, 2, 64)[0] == (2, 2, 1)
    assert attn.geometry(0, 0, 2, 64)[0] == (1, 2, 1)
    # D128 and D256 pack the G = Hq / Hkv query heads of a kv head into one CTA: grid (ceil(L * G / BM), Hkv, n)
    grid, block, _ = attn.geometry(3, 300, 16, 128, num_kv_heads=2)
    assert grid == (-(-300 * 8 // 256), 2, 3) and block == (256, 1, 1)
    assert attn.geometry(3, 300, 16, 256, num_kv_heads=2)[0] == (-(-300 * 8 // 128), 2, 3)
    assert attn.geometry(1, 128, 4, 256, num_kv_heads=4)[0] == (1, 4, 1)  # group 1: as without packing
    assert attn.geometry(1, 65, 4, 256, num_kv_heads=2)[0] == (2, 2, 1)
    assert attn.geometry(0, 0, 16, 256, num_kv_heads=2)[0] == (1, 2, 1)
    for d in (128, 256):
        with pytest.raises(ValueError, match="num_kv_heads"):
            attn.geometry(3, 300, 16, d)
        with pytest.raises(ValueError, match="num_kv_heads"):
            attn.geometry(3, 300, 16, d, num_kv_heads=3)
    with pytest.raises(ValueError, match="batch_size"):
        attn.geometry(-1, 300, 16, 64)
    for bad in (attn.entry_for_head_dim, attn.smem_bytes, lambda d: attn.geometry(1, 1, 1, d)):
        with pytest.raises(ValueError, match="no attention kernel for head_dim=96"):
            bad(96)


def test_contract_defines_are_registered_for_every_compile():
    defs = tuple(f"{k}={v}" for k, v in attn.CONTRACTS.items())
    assert len(defs) == 4 * len(attn.HEAD_DIMS)
    assert "Q12_ATTN_D256_SMEM=222720" in defs and "Q12_ATTN_D64_GQA=0" in defs and "Q12_ATTN_D128_BLOCK_M=256" in defs
    assert compile_defines(attn.SOURCE) == tuple(meta_defines()) + defs


@pytest.mark.parametrize("define", ["Q12_ATTN_D64_THREADS=128", "Q12_ATTN_D128_BLOCK_M=128", "Q12_ATTN_D256_GQA=0",
                                    "Q12_ATTN_D256_SMEM=203264"])
def test_a_host_that_disagrees_with_the_source_fails_to_compile(define):
    name = define.split("=")[0]
    defines = [define if d.startswith(name + "=") else d for d in compile_defines(attn.SOURCE)]
    assert define in defines
    with pytest.raises(NvrtcError, match="differ") as info:
        compile_source(attn.SOURCE, defines=defines, use_cache=False)
    assert name.split("_")[2] + ": " in info.value.log  # the static_assert names the head dim
    with pytest.raises(NvrtcError, match="compile through q12drv"):  # a missing one has no default
        compile_source(attn.SOURCE, defines=[d for d in defines if not d.startswith(name + "=")], use_cache=False)


@pytest.mark.parametrize("d", [128, 256])
def test_emulator_gqa_geometry(d):
    # The entries' CTA rows are (token, head) pairs: the emulator accepts the packed grid and rejects one
    # sized for tokens alone.
    rng = np.random.default_rng(3)
    hq, hkv = 8, 2
    q, kp, vp, cu, kv, tables = make_case(rng, [300, 3], [5, 0], hq=hq, hkv=hkv, d=d, bs=16)
    bm = attn.TILES[d].block_m
    grid, block, _ = attn.geometry(2, 300, hq, d, num_kv_heads=hkv)
    assert grid == (-(-300 * 4 // bm), hkv, 2) and block == (256, 1, 1)
    mem = FakeMem()
    out, _ = emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1, d, grid=grid, block=block)
    assert np.array_equal(out, attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1))
    with pytest.raises(ValueError, match="grid"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1, d, grid=(-(-300 // bm), hkv, 2), block=block)


# ---------------------------------------------------------------------------------------------
# reference vs textbook


def _check_close(got_bits, want, rtol=8e-3, atol=2e-3):
    got = from_bf16_bits(got_bits).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "q_lens,prefixes,hq,hkv,d,bs",
    [
        ([1, 15, 16, 17], [0, 0, 0, 0], 4, 2, 64, 16),
        ([17, 1, 33], [15, 40, 31], 4, 1, 64, 16),  # chunked: keys already cached, straddling blocks
        ([5, 64, 65], [64, 0, 3], 2, 2, 128, 64),
        ([3, 20], [50, 7], 2, 1, 256, 16),
    ],
)
def test_reference_matches_textbook(q_lens, prefixes, hq, hkv, d, bs):
    rng = np.random.default_rng(sum(q_lens) + d + bs)
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d**-0.5
    want = textbook(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale)
    _check_close(attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale), want)
    _check_close(attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, dtype=np.float64, row_chunk=4), want)


@settings(max_examples=16, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=3),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    bs=st.sampled_from([16, 32]),
    scale=st.floats(0.02, 0.3),
    window=st.one_of(st.none(), st.integers(0, 70)),  # window_left, None: full causal
    seed=st.integers(0, 2**31),
)
def test_reference_matches_textbook_random(lens, heads, bs, scale, window, seed):
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    q_lens, prefixes = zip(*lens)
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=64, bs=bs)
    want = textbook(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, window_left=window)
    _check_close(attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, window_left=window), want)


def test_reference_is_bottom_right_causal():
    # Row r of a chunk must see the cached prefix: changing a key it may not see changes nothing,
    # changing one it may see changes its output.
    rng = np.random.default_rng(7)
    q, kp, vp, cu, kv, tables = make_case(rng, [4], [6], hq=1, hkv=1, d=64, bs=16)
    base = attn.reference(q, kp, vp, cu, kv, tables, 1, 1, 16, 0.125)
    kp2 = kp.copy()
    kp2[tables[0][0], 7] = _bf16(rng, (1, 64), std=4.0)  # key 7: seen by rows 1.. (bound 6 + r)
    out = attn.reference(q, kp2, vp, cu, kv, tables, 1, 1, 16, 0.125)
    assert np.array_equal(out[0], base[0])
    assert not np.array_equal(out[1:], base[1:])


# ---------------------------------------------------------------------------------------------
# emulator


@pytest.mark.parametrize("d", [64, 128, 256])
def test_emulator_batched_equals_single_streams(d):
    rng = np.random.default_rng(d)
    hq, hkv, bs = 4, 2, 16
    q_lens, prefixes = [1, 17, 130, 16], [0, 33, 2, 40]
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    mem = FakeMem()
    out, buf = emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, bs, d**-0.5, d)
    assert (buf[:GUARD] == 0xFFFF).all() and (buf[-GUARD:] == 0xFFFF).all()
    assert not (out == 0xFFFF).any(), "some O rows were not written"
    assert np.array_equal(out, attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, d**-0.5))
    for b in range(len(q_lens)):
        cu1 = np.array([0, q_lens[b]], np.int32)
        one, _ = emulate_case(mem, q[cu[b] : cu[b + 1]], kp, vp, cu1, kv[b : b + 1], [tables[b]], hq, hkv, bs, d**-0.5, d)
        assert np.array_equal(one, out[cu[b] : cu[b + 1]]), f"stream {b} differs batched vs alone"


def test_emulator_rejects_short_grid_and_bad_block():
    rng = np.random.default_rng(1)
    q, kp, vp, cu, kv, tables = make_case(rng, [200, 3], [0, 0], hq=2, hkv=1, d=64, bs=16)
    mem = FakeMem()
    with pytest.raises(ValueError, match="grid"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, 2, 1, 16, 0.125, 64, grid=(1, 2, 2))
    with pytest.raises(ValueError, match="grid"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, 2, 1, 16, 0.125, 64, grid=(2, 1, 2))
    with pytest.raises(ValueError, match="block"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, 2, 1, 16, 0.125, 64, block=(96, 1, 1))
    with pytest.raises(ValueError, match="scale"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, 2, 1, 16, -0.125, 64)
    # D=256 packs GQA groups: a grid sized per (token, q head) is too short in x.
    q, kp, vp, cu, kv, tables = make_case(rng, [200, 3], [0, 0], hq=4, hkv=1, d=256, bs=16)
    bm = attn.TILES[256].block_m
    with pytest.raises(ValueError, match="grid"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, 4, 1, 16, 0.0625, 256, grid=(-(-200 // bm), 4, 2))
    out, _ = emulate_case(mem, q, kp, vp, cu, kv, tables, 4, 1, 16, 0.0625, 256, grid=(-(-800 // bm), 1, 2))
    assert np.array_equal(out, attn.reference(q, kp, vp, cu, kv, tables, 4, 1, 16, 0.0625))


def test_emulator_reads_only_through_mem():
    # A block table pointing past the pool must fail in mem, as the kernel would read garbage.
    rng = np.random.default_rng(2)
    q, kp, vp, cu, kv, tables = make_case(rng, [20], [0], hq=1, hkv=1, d=64, bs=16, spare_blocks=0)
    bad = [tables[0].copy()]
    bad[0][1] = kp.shape[0] + 5
    with pytest.raises(IndexError):
        emulate_case(FakeMem(), q, kp, vp, cu, kv, bad, 1, 1, 16, 0.125, 64)


# ---------------------------------------------------------------------------------------------
# sliding window (window_left: FlashAttention's window_size=(window_left, 0))


WINDOW_CASES = [
    # (q_lens, prefixes, hq, hkv, d, bs, window_left): ragged streams, each with its own cached prefix
    ([1, 15, 16, 17], [0, 40, 3, 16], 4, 2, 64, 16, 0),
    ([1, 15, 16, 17], [0, 40, 3, 16], 4, 2, 64, 16, 5),
    ([17, 1, 33], [15, 40, 31], 4, 1, 64, 16, 16),
    ([5, 64, 65], [64, 0, 3], 2, 2, 128, 64, 63),
    ([5, 64, 65], [64, 0, 3], 2, 2, 128, 64, 64),
    ([3, 20, 70], [50, 7, 100], 4, 1, 256, 16, 33),
    ([40, 2], [200, 1], 8, 2, 128, 16, 100),
]


@pytest.mark.parametrize("q_lens,prefixes,hq,hkv,d,bs,window", WINDOW_CASES)
def test_reference_window_matches_textbook(q_lens, prefixes, hq, hkv, d, bs, window):
    rng = np.random.default_rng(sum(q_lens) + d + bs + window)
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d**-0.5
    want = textbook(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, window_left=window)
    got = attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, window_left=window)
    _check_close(got, want)
    _check_close(attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, dtype=np.float64, row_chunk=3,
                                window_left=window), want)
    # the window matters here: full causal attention differs from it on the rows with more keys than the window
    full = textbook(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale)
    assert not np.allclose(full, want, rtol=8e-3, atol=2e-3)


def test_window_at_least_the_context_is_full_causal():
    # window_left >= kv_len - 1 leaves every key of every row in the window: bit for bit the full-causal result,
    # in the reference and through the emulated kernel (whose argument for none is NO_WINDOW)
    rng = np.random.default_rng(11)
    q, kp, vp, cu, kv, tables = make_case(rng, [1, 30, 70], [0, 33, 9], hq=4, hkv=2, d=128, bs=16)
    full = attn.reference(q, kp, vp, cu, kv, tables, 4, 2, 16, 0.1)
    for w in (int(kv.max()) - 1, int(kv.max()), 10**6, attn.NO_WINDOW):
        assert np.array_equal(attn.reference(q, kp, vp, cu, kv, tables, 4, 2, 16, 0.1, window_left=w), full), w
    mem = FakeMem()
    out, _ = emulate_case(mem, q, kp, vp, cu, kv, tables, 4, 2, 16, 0.1, 128)
    assert np.array_equal(out, full)
    out_w, _ = emulate_case(mem, q, kp, vp, cu, kv, tables, 4, 2, 16, 0.1, 128, window_left=int(kv.max()) - 1)
    assert np.array_equal(out_w, full)
    # one key short of the longest row's context: that row changes
    short = attn.reference(q, kp, vp, cu, kv, tables, 4, 2, 16, 0.1, window_left=int(kv.max()) - 2)
    assert not np.array_equal(short, full)


@pytest.mark.parametrize("d", [64, 256])
def test_window_zero_sees_only_its_own_key(d):
    # window_left 0: one key, weight exactly 1, so each row's output is its own position's V (bf16, exact)
    rng = np.random.default_rng(d + 1)
    hq, hkv, bs = 4, 2, 16
    q, kp, vp, cu, kv, tables = make_case(rng, [1, 19, 40], [7, 0, 33], hq=hq, hkv=hkv, d=d, bs=bs)
    out, _ = emulate_case(FakeMem(), q, kp, vp, cu, kv, tables, hq, hkv, bs, d**-0.5, d, window_left=0)
    for b in range(len(kv)):
        for r in range(int(cu[b + 1] - cu[b])):
            p = int(kv[b]) - int(cu[b + 1] - cu[b]) + r
            own = vp[tables[b][p // bs], p % bs]  # [Hkv, D]
            assert np.array_equal(out[cu[b] + r], np.repeat(own, hq // hkv, axis=0)), (b, r)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_emulator_window_batched_equals_single_streams(d):
    # ragged streams with their own cache offsets, one launch for all of them and one per stream
    rng = np.random.default_rng(d + 7)
    hq, hkv, bs, w = 4, 2, 16, 20
    q_lens, prefixes = [1, 17, 130, 16], [0, 33, 2, 40]
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    mem = FakeMem()
    out, buf = emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, bs, d**-0.5, d, window_left=w)
    assert (buf[:GUARD] == 0xFFFF).all() and (buf[-GUARD:] == 0xFFFF).all()
    assert np.array_equal(out, attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, d**-0.5, window_left=w))
    _check_close(out, textbook(q, kp, vp, cu, kv, tables, hq, hkv, bs, d**-0.5, window_left=w))
    for b in range(len(q_lens)):
        cu1 = np.array([0, q_lens[b]], np.int32)
        one, _ = emulate_case(mem, q[cu[b] : cu[b + 1]], kp, vp, cu1, kv[b : b + 1], [tables[b]], hq, hkv, bs,
                              d**-0.5, d, window_left=w)
        assert np.array_equal(one, out[cu[b] : cu[b + 1]]), f"stream {b} differs batched vs alone"


def test_window_argument():
    assert attn.NO_WINDOW == 2**31 - 1
    assert attn.window_argument(None) == attn.window_argument(-1) == attn.NO_WINDOW
    assert attn.window_argument(np.int64(-1)) == attn.NO_WINDOW
    assert attn.window_argument(0) == 0 and attn.window_argument(np.int32(4095)) == 4095
    assert attn.window_argument(2**31 - 1) == attn.NO_WINDOW
    for bad in (-2, -4096, 2**31):
        with pytest.raises(ValueError, match=r"window_left must be in \[-1, 2147483647\]"):
            attn.window_argument(bad)
    for bad in (True, 4.0, "4"):
        with pytest.raises(TypeError, match="window_left must be an int"):
            attn.window_argument(bad)


def test_emulator_refuses_a_negative_window_argument():
    # the kernels take window_left >= 0 (NO_WINDOW for none); the host never passes -1 through
    rng = np.random.default_rng(5)
    q, kp, vp, cu, kv, tables = make_case(rng, [20], [3], hq=2, hkv=1, d=64, bs=16)
    mem = FakeMem()
    with pytest.raises(ValueError, match="window_left must be >= 0"):
        emulate_case(mem, q, kp, vp, cu, kv, tables, 2, 1, 16, 0.125, 64, window_left=-1)


def test_window_matches_transformers_sliding_window_mask():
    # transformers' sliding_window W (masking_utils: key j visible to query p when j > p - W and j <= p) is
    # window_left = W - 1, what AttentionShape(sliding_window=W) passes
    torch = pytest.importorskip("torch")
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from q12drv.prefill import AttentionShape

    n, bs = 40, 16
    rng = np.random.default_rng(13)
    q, kp, vp, cu, kv, tables = make_case(rng, [n], [0], hq=1, hkv=1, d=64, bs=bs)
    slots = tables[0][np.arange(n) // bs] * bs + np.arange(n) % bs
    qf, kf, vf = (from_bf16_bits(x).astype(np.float64).reshape(-1, 64) for x in (q, kp, vp))
    logits = qf @ kf[slots].T * 0.125
    for w in (1, 2, 5, 16, 39, 40, 100):
        fn = masking_utils.sliding_window_causal_mask_function(w)
        idx = torch.arange(n)
        mask = fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).numpy()  # [query, key]
        assert mask.shape == (n, n) and mask.dtype == bool
        left = AttentionShape(1, 1, 64, 64, sliding_window=w).window_left
        assert left == w - 1
        e = np.where(mask, np.exp(logits - np.where(mask, logits, -np.inf).max(axis=1, keepdims=True)), 0)
        want = (e / e.sum(axis=1, keepdims=True)) @ vf[slots]  # attention under transformers' own mask
        _check_close(attn.reference(q, kp, vp, cu, kv, tables, 1, 1, bs, 0.125, window_left=left), want[:, None])
