"""CPU tests of the paged causal prefill attention kernel: compile, reference, emulator."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import FakeMem, shuffled_tables, spill_free
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels import attention as attn
from q12drv.kernels.meta import Q12MetaC, meta_defines
from q12drv.core.nvrtc import compile_source, cuda_src_dir

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


def textbook(q, k_pool, v_pool, cu, kv_lens, tables, hq, hkv, bs, scale):
    """float64, one row at a time, every key looked up through the block table."""
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
                keys = np.stack([kf[tables[b][p // bs], p % bs, kvh] for p in range(last + 1)])
                vals = np.stack([vf[tables[b][p // bs], p % bs, kvh] for p in range(last + 1)])
                logits = keys @ qf[cu[b] + r, h] * scale
                w = np.exp(logits - logits.max())
                out[cu[b] + r, h] = (w / w.sum()) @ vals
    return out


GUARD = 64  # uint16 guard elements on each side of O


def emulate_case(mem, q, k_pool, v_pool, cu, kv_lens, tables, hq, hkv, bs, scale, d, grid=None, block=None):
    """Upload into ``mem``, run the emulator, return (O rows, guarded buffer)."""
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
    }
    attn.EMULATORS[attn.entry_for_head_dim(d)](args, mem, grid or g, block or blk)
    return o_buf[GUARD:-GUARD].reshape(t_total, hq, d), o_buf


# ---------------------------------------------------------------------------------------------
# compile


def test_compiles_without_spills():
    img = compile_source(attn.SOURCE, defines=meta_defines(), use_cache=False, verbose_resources=True)
    report = spill_free(img, attn.ENTRIES)
    assert all(report[entry].registers <= 255 for entry in attn.ENTRIES)


def test_geometry():
    assert not attn.DEFAULT_CONFIG[64]["GQA"] and attn.DEFAULT_CONFIG[128]["GQA"] and attn.DEFAULT_CONFIG[256]["GQA"]
    grid, block, smem = attn.geometry(3, 300, 16, 64)
    assert grid == (-(-300 // attn.BLOCK_M[64]), 16, 3) and block == (attn.THREADS[64], 1, 1)
    assert attn.geometry(3, 300, 16, 64, num_kv_heads=2) == (grid, block, smem)  # Hkv unused without GQA
    # D128 packs the 8 query heads of a kv head into one CTA: rows are (token, head) pairs
    grid, block, _ = attn.geometry(3, 300, 16, 128, num_kv_heads=2)
    assert grid == (-(-300 * 8 // attn.BLOCK_M[128]), 2, 3) and block == (attn.THREADS[128], 1, 1)
    for d in attn.HEAD_DIMS:
        c = attn.DEFAULT_CONFIG[d]
        stages = c["ST"] or 2
        slots = 2 * attn.BLOCK_N[d] * 4 if c["PSMEM"] else 0
        pairs = c["NW"] // 2 * (32 * (attn.BLOCK_N[d] + 8) * 2 + 2 * 32 * 4) if c["DS"] else 0
        assert attn.smem_bytes(d) == (attn.BLOCK_M[d] + 2 * stages * attn.BLOCK_N[d]) * (d + 8) * 2 + slots + pairs
    assert attn.smem_bytes(256) == 222720 and attn.BLOCK_M[256] == 128  # D256: DS warp pairs, 8 warps x 32 rows / 2
    assert smem == attn.smem_bytes(64)
    bm = attn.BLOCK_M[64]
    assert attn.geometry(1, bm, 2, 64)[0] == (1, 2, 1)
    assert attn.geometry(1, bm + 1, 2, 64)[0] == (2, 2, 1)
    assert attn.geometry(0, 0, 2, 64)[0] == (1, 2, 1)
    # D=256 packs the G = Hq / Hkv query heads of a kv head into one CTA: grid (ceil(L * G / BM), Hkv, n).
    assert attn.DEFAULT_CONFIG[256]["GQA"]
    bm = attn.BLOCK_M[256]
    assert attn.geometry(3, 300, 16, 256, num_kv_heads=2)[0] == (-(-300 * 8 // bm), 2, 3)
    assert attn.geometry(1, bm, 4, 256, num_kv_heads=4)[0] == (1, 4, 1)  # group 1: as without packing
    assert attn.geometry(1, bm // 2 + 1, 4, 256, num_kv_heads=2)[0] == (2, 2, 1)
    assert attn.geometry(0, 0, 16, 256, num_kv_heads=2)[0] == (1, 2, 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        attn.geometry(3, 300, 16, 256)
    with pytest.raises(ValueError, match="num_kv_heads"):
        attn.geometry(3, 300, 16, 256, num_kv_heads=3)
    for d in attn.HEAD_DIMS:
        assert attn.smem_bytes(d) <= 227 * 1024
    with pytest.raises(ValueError):
        attn.entry_for_head_dim(96)


def test_python_tiles_match_the_source():
    # DEFAULT_CONFIG must be the defaults of the ATTN_D<d>_<KNOB> macros the entries instantiate.
    src = (cuda_src_dir() / attn.SOURCE).read_text()
    for d, entry in attn.HEAD_DIMS.items():
        m = re.search(rf"void {entry}\(.*?#endif\s*attn_prefill<(\d+), ((?:ATTN_D{d}_\w+(?:, )?)+)>", src, re.S)
        assert m, f"no instantiation found for {entry}"
        assert int(m.group(1)) == d
        knobs = [k.strip()[len(f"ATTN_D{d}_"):] for k in m.group(2).split(",")]
        assert knobs == ["BN", "NW", "MW", "QREG", "ST", "PSMEM", "GQA", "WSKIP", "DS"]
        for knob, want in attn.DEFAULT_CONFIG[d].items():
            got = re.search(rf"#ifndef ATTN_D{d}_{knob}\n#define ATTN_D{d}_{knob} (\d+)\n#endif", src)
            assert got, f"no default for ATTN_D{d}_{knob}"
            assert int(got.group(1)) == want, f"ATTN_D{d}_{knob}: source {got.group(1)}, python {want}"
        ds = attn.DEFAULT_CONFIG[d]["DS"]
        assert attn.BLOCK_M[d] == 16 * attn.WARPS[d] * attn.WARP_SUBTILES[d] // (2 if ds else 1)
        assert attn.THREADS[d] == 32 * attn.WARPS[d]
        assert attn.config(d) == {**attn.DEFAULT_CONFIG[d], "threads": attn.THREADS[d], "block_m": attn.BLOCK_M[d],
                                  "stages": attn.DEFAULT_CONFIG[d]["ST"] or 2, "smem": attn.smem_bytes(d)}


VARIANT = ("ATTN_D128_NW=8", "ATTN_D128_MW=1", "ATTN_D128_BN=64", "ATTN_D128_ST=3", "ATTN_D128_PSMEM=1",
           "ATTN_D128_GQA=1", "ATTN_D128_WSKIP=1")


def test_variant_config_and_geometry():
    cfg = attn.config(128, VARIANT + ("ATTN_D256_BN=16", "OTHER=3"))
    assert (cfg["BN"], cfg["NW"], cfg["MW"], cfg["ST"], cfg["PSMEM"], cfg["GQA"]) == (64, 8, 1, 3, 1, 1)
    assert cfg["threads"] == 256 and cfg["block_m"] == 128 and cfg["stages"] == 3
    assert cfg["smem"] == (128 + 2 * 3 * 64) * 136 * 2 + 2 * 64 * 4
    assert attn.config(256, VARIANT) == attn.config(256)  # other head dims keep their defaults
    legacy = attn.config(128, ("ATTN_D128_ST=0", "ATTN_D128_PSMEM=0"))
    assert legacy["smem"] == (legacy["block_m"] + 4 * 32) * 136 * 2  # the two-barrier ring: Q + 2 x (K, V) tiles
    # GQA packing: rows are (token, head) pairs of one kv head; grid y = Hkv.
    grid, block, smem = attn.geometry(3, 300, 16, 128, num_kv_heads=2, defines=VARIANT)
    assert grid == (-(-300 * 8 // 128), 2, 3) and block == (256, 1, 1) and smem == cfg["smem"]
    with pytest.raises(ValueError, match="num_kv_heads"):
        attn.geometry(3, 300, 16, 128, defines=VARIANT)
    # Without GQA the knobs only change the tile.
    g2, _, _ = attn.geometry(3, 300, 16, 128, defines=("ATTN_D128_ST=2", "ATTN_D128_BN=64", "ATTN_D128_NW=4",
                                                        "ATTN_D128_GQA=0"))
    assert g2 == (-(-300 // 128), 16, 3)
    with pytest.raises(ValueError, match="PSMEM"):
        attn.config(128, ("ATTN_D128_ST=0",))  # the default PSMEM=1 needs the one-barrier ring
    with pytest.raises(ValueError, match="ST"):
        attn.config(128, ("ATTN_D128_ST=1",))
    with pytest.raises(ValueError, match="split"):
        attn.config(128, ("ATTN_D128_BN=8",))



DS_VARIANT = ("ATTN_D256_MW=2", "ATTN_D256_DS=1", "ATTN_D256_BN=32", "ATTN_D256_ST=3")


def test_ds_config_and_geometry():
    # DS: warp pairs share 16 * MW rows, so the CTA holds NW * MW * 8 rows; smem adds per pair a P tile
    # [32][BN + 8] bf16 and row maxima / sums [2][32] fp32.
    # D256 ships DS (MW 2, BN 64, ST 2); D64 and D128 do not.
    assert [d for d, c in attn.DEFAULT_CONFIG.items() if c["DS"]] == [256]
    assert attn.DEFAULT_CONFIG[256]["MW"] == 2
    old = attn.config(256, ("ATTN_D256_DS=0", "ATTN_D256_MW=1"))  # the previous D256 default
    assert (old["block_m"], old["smem"]) == (128, 203264)
    cfg = attn.config(256, DS_VARIANT)
    assert (cfg["NW"], cfg["MW"], cfg["DS"], cfg["threads"], cfg["block_m"], cfg["stages"]) == (8, 2, 1, 256, 128, 3)
    assert cfg["smem"] == (128 + 2 * 3 * 32) * 264 * 2 + 2 * 32 * 4 + 4 * (32 * 40 * 2 + 2 * 32 * 4)
    assert cfg["smem"] <= 227 * 1024
    grid, block, smem = attn.geometry(3, 300, 16, 256, num_kv_heads=2, defines=DS_VARIANT)
    assert grid == (-(-300 * 8 // 128), 2, 3) and block == (256, 1, 1) and smem == cfg["smem"]
    four = attn.config(256, DS_VARIANT + ("ATTN_D256_NW=4", "ATTN_D256_ST=2"))
    assert four["block_m"] == 64 and four["threads"] == 128
    assert 2 * (four["smem"] + 1024) <= 228 * 1024  # two CTAs per SM
    assert attn.config(128, ("ATTN_D128_DS=1",))["block_m"] == 128  # D128 default MW=2, NW=8
    for bad in (("ATTN_D256_MW=1",), ("ATTN_D256_DS=1", "ATTN_D256_MW=2", "ATTN_D256_NW=3"),
                ("ATTN_D256_DS=1", "ATTN_D256_MW=2", "ATTN_D256_BN=48")):
        with pytest.raises(ValueError, match="DS|split"):
            attn.config(256, bad)


@pytest.mark.parametrize("d", [128, 256])
def test_emulator_ds_geometry(d):
    # The emulator accepts the DS grid (CTA rows NW * MW * 8, GQA-packed) and rejects a shorter one.
    defs = ("ATTN_D128_DS=1",) if d == 128 else DS_VARIANT
    rng = np.random.default_rng(5)
    hq, hkv = 8, 2
    q, kp, vp, cu, kv, tables = make_case(rng, [40, 3], [5, 0], hq=hq, hkv=hkv, d=d, bs=16)
    fn = attn.emulate_attention(d, defs)
    grid, block, _ = attn.geometry(2, 40, hq, d, num_kv_heads=hkv, defines=defs)
    assert grid == (-(-40 * 4 // 128), hkv, 2) and block == (256, 1, 1)
    mem = FakeMem()
    orig = attn.EMULATORS[attn.HEAD_DIMS[d]]
    attn.EMULATORS[attn.HEAD_DIMS[d]] = fn
    try:
        out, _ = emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1, d, grid=grid, block=block)
        assert np.array_equal(out, attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1))
        with pytest.raises(ValueError, match="grid"):
            emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1, d, grid=(grid[0] - 1, hkv, 2), block=block)
    finally:
        attn.EMULATORS[attn.HEAD_DIMS[d]] = orig


def test_variants_compile_without_spills():
    # The configurations tests/gpu/attn_variants.py measures (both kernels) must compile with no spills.
    from q12drv.kernels import attention_wgmma as attnw
    from tests.gpu.attn_variants import VARIANTS

    for name, kind, defs in VARIANTS:
        mod = {"mma": attn, "wgmma": attnw}[kind]
        img = compile_source(mod.SOURCE, defines=tuple(meta_defines()) + tuple(defs), use_cache=False,
                             verbose_resources=True)
        spill_free(img, [mod.HEAD_DIMS[d] for d in (128, 256)])
        for d in (128, 256):
            assert mod.config(d, defs)["smem"] <= 227 * 1024, f"{name} {mod.HEAD_DIMS[d]}: too much shared memory"


@pytest.mark.parametrize("defs", [(), VARIANT])
def test_emulator_gqa_geometry(defs):
    rng = np.random.default_rng(3)
    hq, hkv = 8, 2
    q, kp, vp, cu, kv, tables = make_case(rng, [40, 3], [5, 0], hq=hq, hkv=hkv, d=128, bs=16)
    fn = attn.emulate_attention(128, defs)
    grid, block, _ = attn.geometry(2, 40, hq, 128, num_kv_heads=hkv, defines=defs)
    mem = FakeMem()
    orig = attn.EMULATORS[attn.HEAD_DIMS[128]]
    attn.EMULATORS[attn.HEAD_DIMS[128]] = fn
    try:
        out, _ = emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1, 128, grid=grid, block=block)
        assert np.array_equal(out, attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1))
        if defs:  # one CTA row per (token, head): a grid sized for tokens alone is too short
            short = (-(-40 // attn.config(128, defs)["block_m"]), hkv, 2)
            with pytest.raises(ValueError, match="grid"):
                emulate_case(mem, q, kp, vp, cu, kv, tables, hq, hkv, 16, 0.1, 128, grid=short, block=block)
    finally:
        attn.EMULATORS[attn.HEAD_DIMS[128]] = orig


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


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=3),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    bs=st.sampled_from([16, 32]),
    scale=st.floats(0.02, 0.3),
    seed=st.integers(0, 2**31),
)
def test_reference_matches_textbook_random(lens, heads, bs, scale, seed):
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    q_lens, prefixes = zip(*lens)
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=64, bs=bs)
    want = textbook(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale)
    _check_close(attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale), want)


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
    bm = attn.BLOCK_M[256]
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
