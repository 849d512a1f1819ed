"""CPU tests of the paged KV-cache write: NVRTC compile, numpy reference, emulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import FakeMem, paged_streams, spill_free
from q12drv.kernels import kv_write as kw
from q12drv.kernels.meta import Q12MetaC

POISON = 0xFFFF


# ----------------------------------------------------------------------------- fake device memory
# ----------------------------------------------------------------------------- metadata builder
def make_meta(mem: FakeMem, slots_list, positions_list, tables, starts):
    lens = [len(s) for s in slots_list]
    n = len(lens)
    cu = np.zeros(n + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lens)
    slots = np.concatenate(slots_list).astype(np.int64) if n else np.zeros(0, np.int64)
    pos = np.concatenate(positions_list).astype(np.uint32)
    kv_lens = np.array([s + l for s, l in zip(starts, lens)], dtype=np.int32)
    maxb = max(len(t) for t in tables)
    bt_ptrs = np.array([mem.put(t) for t in tables], dtype=np.uint64)
    seq = [mem.put(np.array([k], np.uint32)) for k in kv_lens]
    pp = mem.put(pos) if len(pos) else 0
    return Q12MetaC(
        positions=pp,
        positions_h=pp,
        positions_w=pp,
        slots=mem.put(slots) if len(slots) else 0,
        block_table_ptrs=mem.put(bt_ptrs),
        seq_len_ptrs=mem.put(np.array(seq, np.uint64)),
        cu_seqlens=mem.put(cu),
        kv_lens=mem.put(kv_lens),
        batch_size=n,
        chunk_len=max(lens),
        total_tokens=int(cu[-1]),
        max_blocks_per_seq=maxb,
    )


def rand_bf16(rng, shape):
    # Finite random bf16 bits (random sign/exponent/mantissa in a sane range).
    x = rng.standard_normal(shape).astype(np.float32) * 3
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def textbook_pools(k_rows, v_rows, tables, positions, block_size, kpool, vpool, skip=()):
    """Independent per-token loop: pool[block_table[pos // bs], pos % bs] = row."""
    kp = kpool.copy()
    vp = vpool.copy()
    t = 0
    for b, (tb, pos) in enumerate(zip(tables, positions)):
        for p in pos:
            if t not in skip:
                kp[tb[p // block_size], p % block_size] = k_rows[t]
                vp[tb[p // block_size], p % block_size] = v_rows[t]
            t += 1
    return kp, vp


# ----------------------------------------------------------------------------- compile
def test_compiles_without_spills(kernel_build):
    from q12drv.core.nvrtc import cuda_src_dir

    img = kernel_build(kw.SOURCE, "sm_90")
    assert img.image
    report = spill_free(img, kw.ENTRIES, stack=False)
    # Blocks of up to 1024 threads must launch, and the 4 CTAs of 256 per SM geometry() assumes
    # must fit: <= 64 registers (the kernel's __launch_bounds__(1024, 1)).
    regs = report[kw.ENTRIES[0]].registers
    assert regs * kw.MAX_THREADS <= 65536 and regs * kw.THREADS * kw._CTAS_PER_SM <= 65536, img.log
    # Streaming hints made it into the code (they are inline PTX).
    src = (cuda_src_dir() / kw.SOURCE).read_text()
    assert "ld.global.nc.L1::no_allocate.v4.u32" in src and "st.global.cs.v4.u32" in src


def test_entries_match_source():
    from q12drv.core.launch import parse_signatures
    from q12drv.core.nvrtc import cuda_src_dir

    sigs = parse_signatures((cuda_src_dir() / kw.SOURCE).read_text(), {"Q12Meta": Q12MetaC})
    assert tuple(sigs) == kw.ENTRIES
    assert [name for name, _ in sigs["q12_kv_write"]] == ["m", "k", "v", "k_pool", "v_pool", "row_elems", "num_slots"]
    assert set(kw.EMULATORS) == set(kw.ENTRIES)


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("block_size", [16, 64])
def test_reference_matches_textbook(block_size):
    rng = np.random.default_rng(1000 + block_size)
    hkv, d = 2, 16
    lens = [1, 15, 16, 17, 63, 65]
    starts = [0, 3, block_size - 1, 5, 0, block_size + 7]
    num_blocks = 40
    tables, positions, slots = paged_streams(rng, lens, starts, block_size, num_blocks)
    T = sum(lens)
    k = rand_bf16(rng, (T, hkv, d))
    v = rand_bf16(rng, (T, hkv, d))
    slot = np.concatenate(slots)
    # Padding and out-of-range tokens are skipped.
    skip = {0, 20, T - 1}
    slot[0] = -1
    slot[20] = -7
    slot[T - 1] = num_blocks * block_size  # first slot past the pool
    kp = np.full((num_blocks, block_size, hkv, d), POISON, np.uint16)
    vp = np.full_like(kp, POISON)
    ok, ov = kw.reference(k, v, slot, kp, vp)
    tk, tv = textbook_pools(k, v, tables, positions, block_size, kp, vp, skip=skip)
    np.testing.assert_array_equal(ok, tk)
    np.testing.assert_array_equal(ov, tv)
    # Inputs untouched, every non-skipped token written, nothing else.
    assert (kp == POISON).all()
    assert int((ok != POISON).any(axis=(2, 3)).sum()) == T - len(skip)


# ----------------------------------------------------------------------------- emulator
def _emulate(mem, meta, k, v, kp, vp, grid=None, block=None):
    row = k.shape[1] * k.shape[2]
    g, b, smem = kw.geometry(int(meta.total_tokens), row)
    assert smem == 0
    args = {
        "m": meta,
        "k": mem.put(k) if k.size else 0,
        "v": mem.put(v) if v.size else 0,
        "k_pool": kp.ctypes.data,
        "v_pool": vp.ctypes.data,
        "row_elems": row,
        "num_slots": kp.shape[0] * kp.shape[1],
    }
    kw.EMULATORS["q12_kv_write"](args, mem, grid or g, block or b)


def _pool_with_guards(mem, shape):
    """Pool allocation with guard rows on both sides; returns (whole, pool view)."""
    num_blocks, bs, h, d = shape
    whole = np.full((num_blocks * bs + 2 * 4, h, d), POISON, np.uint16)
    whole[:4] = 0x1234
    whole[-4:] = 0x4321
    mem.put(whole)
    pool = whole[4:-4].reshape(shape)  # a view: the emulator writes into `whole`
    assert pool.ctypes.data == whole.ctypes.data + 4 * h * d * 2
    return whole, pool


def _check_guards(whole):
    assert (whole[:4] == 0x1234).all() and (whole[-4:] == 0x4321).all()


@pytest.mark.parametrize("block_size", [16, 64])
def test_emulator_batched_equals_per_stream(block_size):
    rng = np.random.default_rng(7 + block_size)
    hkv, d = 2, 32
    lens = [1, 15, 16, 17, 63, 64, 65, 130]
    starts = [int(x) for x in rng.integers(0, 3 * block_size, len(lens))]
    num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, lens)) + 5
    tables, positions, slots = paged_streams(rng, lens, starts, block_size, num_blocks)
    slots[2][3] = -1  # a padding token inside a stream
    T = sum(lens)
    k = rand_bf16(rng, (T, hkv, d))
    v = rand_bf16(rng, (T, hkv, d))
    shape = (num_blocks, block_size, hkv, d)

    mem = FakeMem()
    meta = make_meta(mem, slots, positions, tables, starts)
    kw_b, kp_b = _pool_with_guards(mem, shape)
    vw_b, vp_b = _pool_with_guards(mem, shape)
    _emulate(mem, meta, k, v, kp_b, vp_b)
    _check_guards(kw_b)
    _check_guards(vw_b)

    mem1 = FakeMem()
    kw_1, kp_1 = _pool_with_guards(mem1, shape)
    vw_1, vp_1 = _pool_with_guards(mem1, shape)
    cu = np.concatenate([[0], np.cumsum(lens)])
    for b in range(len(lens)):
        meta1 = make_meta(mem1, [slots[b]], [positions[b]], [tables[b]], [starts[b]])
        sl = slice(cu[b], cu[b + 1])
        _emulate(mem1, meta1, k[sl], v[sl], kp_1, vp_1)
    _check_guards(kw_1)
    _check_guards(vw_1)
    np.testing.assert_array_equal(kp_b, kp_1)
    np.testing.assert_array_equal(vp_b, vp_1)

    skip = {int(cu[2]) + 3}
    pk = np.full(shape, POISON, np.uint16)
    tk, tv = textbook_pools(k, v, tables, positions, block_size, pk, pk, skip=skip)
    np.testing.assert_array_equal(kp_b, tk)
    np.testing.assert_array_equal(vp_b, tv)


def test_emulator_uses_total_tokens_and_skips_out_of_range():
    rng = np.random.default_rng(3)
    bs, hkv, d = 16, 1, 8
    tables, positions, slots = paged_streams(rng, [5], [0], bs, 4)
    slots[0][4] = 4 * bs + 100  # beyond the pool: must be skipped, not raise
    mem = FakeMem()
    meta = make_meta(mem, slots, positions, tables, [0])
    k = rand_bf16(rng, (5, hkv, d))
    v = rand_bf16(rng, (5, hkv, d))
    shape = (4, bs, hkv, d)
    whole_k, kp = _pool_with_guards(mem, shape)
    whole_v, vp = _pool_with_guards(mem, shape)
    meta.total_tokens = 3  # only the first 3 tokens belong to this pass
    _emulate(mem, meta, k, v, kp, vp)
    written = (kp.reshape(-1, hkv * d) != POISON).any(axis=1)
    assert sorted(np.flatnonzero(written)) == sorted(slots[0][:3].tolist())
    meta.total_tokens = 5
    _emulate(mem, meta, k, v, kp, vp)
    written = (kp.reshape(-1, hkv * d) != POISON).any(axis=1)
    assert int(written.sum()) == 4
    _check_guards(whole_k)
    _check_guards(whole_v)


@pytest.mark.parametrize(
    "grid,block",
    [((1, 2, 1), (256, 1, 1)), ((0, 1, 1), (256, 1, 1)), ((4, 1, 1), (100, 1, 1)), ((4, 1, 1), (32, 2, 1))],
)
def test_emulator_rejects_bad_launch(grid, block):
    rng = np.random.default_rng(0)
    tables, positions, slots = paged_streams(rng, [3], [0], 16, 2)
    mem = FakeMem()
    meta = make_meta(mem, slots, positions, tables, [0])
    k = rand_bf16(rng, (3, 1, 8))
    kp = np.zeros((2, 16, 1, 8), np.uint16)
    vp = np.zeros_like(kp)
    mem.put(kp)
    mem.put(vp)
    with pytest.raises(ValueError):
        _emulate(mem, meta, k, k, kp, vp, grid=grid, block=block)


def test_geometry():
    g, b, s = kw.geometry(1, 512)
    assert g == (1, 1, 1) and b == (256, 1, 1) and s == 0
    g, b, _ = kw.geometry(10**6, 512)
    assert g[0] == 132 * 4  # one resident wave: 4 CTAs of 256 per SM
    # Qwen3-Next rows (Hkv 2 x D 256 = 64 chunks): one warp per token pair -> 16 tokens per CTA
    g, _, _ = kw.geometry(1000, 512)
    assert g[0] == -(-1000 // 16)
    # row of 2 chunks -> 2 threads per group, 4 tokens per group -> 512 tokens per CTA
    g, _, _ = kw.geometry(1000, 16)
    assert g[0] == -(-1000 // 512)
    # 2-byte fallback (row % 8 != 0): 12 elements -> 16 threads per group, 4 tokens each
    g, _, _ = kw.geometry(1000, 12)
    assert g[0] == -(-1000 // 64)
    with pytest.raises(ValueError):
        kw.geometry(10, 64, threads=100)


@pytest.mark.parametrize("row_units,tok", [(1, 4), (2, 4), (32, 4), (33, 2), (64, 2), (128, 2), (512, 2)])
def test_tokens_per_group(row_units, tok):
    # kv_write.cu's kvw_config(): TOK 2 for rows of more than 32 chunks, else 4 (the contract defines
    # Q12_KVW_LONG_ROW_TOKENS / _SHORT_ROW_TOKENS check the host's numbers against it at compile time).
    assert kw.tokens_per_group(row_units) == tok


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**31),
)
def test_emulator_property_batched_vs_textbook(lens, block_size, seed):
    rng = np.random.default_rng(seed)
    starts = [int(x) for x in rng.integers(0, 20, len(lens))]
    num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, lens)) + 2
    tables, positions, slots = paged_streams(rng, lens, starts, block_size, num_blocks)
    T = sum(lens)
    k = rand_bf16(rng, (T, 1, 8))
    v = rand_bf16(rng, (T, 1, 8))
    shape = (num_blocks, block_size, 1, 8)
    mem = FakeMem()
    meta = make_meta(mem, slots, positions, tables, starts)
    wk, kp = _pool_with_guards(mem, shape)
    wv, vp = _pool_with_guards(mem, shape)
    _emulate(mem, meta, k, v, kp, vp)
    pk = np.full(shape, POISON, np.uint16)
    tk, tv = textbook_pools(k, v, tables, positions, block_size, pk, pk)
    np.testing.assert_array_equal(kp, tk)
    np.testing.assert_array_equal(vp, tv)
    _check_guards(wk)
    _check_guards(wv)
