"""CPU tests of the split-KV decode attention kernel (``cuda_src/attention/decode.cu``): compile, the host/source
contract, the plan (split count, geometry, workspace), the numpy model against a float64 reference, the emulated
launches through ``ops.attention`` and ``Q12Pass.attention`` (``algo="decode"``), and bad input refused with nothing
written. Its numerics on the GPU: tests/gpu/test_attention_decode_gpu.py.

Tolerances (the model is float32 with the kernels' steps; the float64 reference rounds only the output to bf16):
against the reference, relative L2 error below 4e-3 and every element within 2 bf16 ulps (rtol 2^-6) plus 4e-3 (P
rounded to bf16 before P V, as the kernels do);
split against unsplit, relative L2 error below 1e-3 and every element within 1 bf16 ulp (rtol 2^-7) plus 2e-3 (the
splits change the order of the fp32 sums, and P is rounded to bf16 against each split's own running maximum).
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from q12drv import ScratchArena, make_scratch_plan, stage_batched_attn_metadata
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.core.errors import NvrtcError
from q12drv.core.launch import parse_signatures
from q12drv.core.nvrtc import compile_source, cuda_src_dir, local_headers
from q12drv.kernels import attention as attn
from q12drv.kernels import attention_decode as dec
from q12drv.kernels import ops
from q12drv.kernels.meta import Q12MetaC, meta_defines
from q12drv.kernels.registry import compile_defines
from q12drv.prefill import AttentionShape, Q12Pass
from tests.helpers import make_streams, rel_err_bf16, spill_free
from tests.test_kernel_attention import make_case

# ---------------------------------------------------------------------------------------------
# compile, tiles and the host/source contract


def test_compiles_without_spills(kernel_build):
    img = kernel_build(dec.SOURCE)
    report = spill_free(img, dec.ENTRIES)
    assert all(report[e].registers <= 255 for e in dec.ENTRIES)
    # 128 threads: two D=64 CTAs an SM by registers too (the split rule's slots count on it), FP8 pools too
    assert all(report[e[64]].registers * 128 * 2 <= 65536 for e in (dec.HEAD_DIMS, dec.FP8_ENTRIES))


def test_every_entry_takes_its_one_parameter_list():
    split = (("m", Q12MetaC), ("q", ctypes.c_uint64), ("k_pool", ctypes.c_uint64), ("v_pool", ctypes.c_uint64),
             ("o", ctypes.c_uint64), ("partial", ctypes.c_uint64), ("num_q_heads", ctypes.c_int32),
             ("num_kv_heads", ctypes.c_int32), ("block_size", ctypes.c_int32), ("scale", ctypes.c_float),
             ("window_left", ctypes.c_int32), ("num_splits", ctypes.c_int32))
    fp8 = split[:4] + (("k_scale", ctypes.c_uint64), ("v_scale", ctypes.c_uint64)) + split[4:]
    merge = (("m", Q12MetaC), ("partial", ctypes.c_uint64), ("o", ctypes.c_uint64), ("num_q_heads", ctypes.c_int32),
             ("num_kv_heads", ctypes.c_int32), ("window_left", ctypes.c_int32), ("num_splits", ctypes.c_int32))
    src = (cuda_src_dir() / dec.SOURCE).read_text()
    sigs = parse_signatures(src, {"Q12Meta": Q12MetaC}, local_headers(src))
    assert sigs == {**{e: split for e in dec.HEAD_DIMS.values()}, **{e: fp8 for e in dec.FP8_ENTRIES.values()},
                    **{e: merge for e in dec.MERGE_ENTRIES.values()}}


def test_tiles_and_smem():
    assert {d: (t.block_n, t.stages, t.threads, t.smem, t.ctas_per_sm()) for d, t in dec.TILES.items()} == {
        64: (64, 4, 128, (64 + 8 * 64) * 72 * 2 + 512, 2),
        128: (64, 4, 128, (64 + 8 * 64) * 136 * 2 + 512, 1),
        256: (32, 5, 128, (64 + 10 * 32) * 264 * 2 + 256, 1)}
    # FP8 pools: two bf16 tiles the MMAs read, then the e4m3 ring of unpadded rows; as many CTAs an SM as bf16 (so
    # the same split count and the same key partition)
    assert {d: (t.fp8_stages, t.smem_fp8, t.ctas_per_sm("fp8_e4m3")) for d, t in dec.TILES.items()} == {
        64: (8, (64 + 4 * 64) * 72 * 2 + 2 * 8 * 64 * 64 + 512, 2),
        128: (8, (64 + 4 * 64) * 136 * 2 + 2 * 8 * 64 * 128 + 512, 1),
        256: (7, (64 + 4 * 32) * 264 * 2 + 2 * 7 * 32 * 256 + 256, 1)}
    assert all(max(t.smem, t.smem_fp8) <= 227 * 1024 for t in dec.TILES.values())
    assert all(t.smem_for("fp8_e4m3") == t.smem_fp8 and t.smem_for("bf16") == t.smem for t in dec.TILES.values())
    # (m-tiles, key groups, keys of a tile per group) by CTA rows: every warp computes where BN allows
    assert [dec.TILES[128].key_groups(r) for r in (1, 16, 17, 32, 33, 64)] == \
        [(1, 4, 16), (1, 4, 16), (2, 2, 32), (2, 2, 32), (4, 1, 64), (4, 1, 64)]
    assert [dec.TILES[256].key_groups(r) for r in (8, 32, 64)] == [(1, 2, 16), (2, 2, 16), (4, 1, 32)]


def test_contract_defines_and_a_host_that_disagrees_with_the_source():
    defs = tuple(f"{k}={v}" for k, v in dec.CONTRACTS.items())
    assert "Q12_DECODE_MAX_Q_LEN=8" in defs and "Q12_DECODE_D256_BLOCK_N=32" in defs and len(defs) == 3 + 3 * 4
    assert compile_defines(dec.SOURCE) == tuple(meta_defines()) + defs
    for define, says in (("Q12_DECODE_D128_BLOCK_N=32", "D128: keys per tile"), ("Q12_DECODE_D64_SMEM=1024", "D64: "),
                         ("Q12_DECODE_D256_THREADS=256", "D256: threads"), ("Q12_DECODE_MAX_Q_LEN=16", "new tokens"),
                         ("Q12_DECODE_D128_FP8_SMEM=1024", "D128: shared memory (FP8 pools)"),
                         ("Q12_DECODE_MAX_ROWS=128", "CTA rows"), ("Q12_DECODE_MERGE_THREADS=256", "merge")):
        name = define.split("=")[0]
        defines = [define if d.startswith(name + "=") else d for d in compile_defines(dec.SOURCE)]
        with pytest.raises(NvrtcError, match="differ") as info:
            compile_source(dec.SOURCE, defines=defines, use_cache=False)
        assert says in info.value.log
    with pytest.raises(NvrtcError, match="compile through q12drv"):
        compile_source(dec.SOURCE, defines=tuple(meta_defines()), use_cache=False)


# ---------------------------------------------------------------------------------------------
# the plan: split count, partition, geometry, workspace

#: The issue's decode shapes: (streams, keys) x (Hq, Hkv, D) -> the split count on an H200 (132 SMs).
SHAPES = {(64, 8192, 16, 2, 256): 1, (16, 32768, 16, 2, 256): 4, (4, 131072, 16, 2, 256): 16,
          (64, 8192, 32, 8, 128): 1, (16, 32768, 32, 8, 128): 1, (4, 131072, 32, 8, 128): 4}


@pytest.mark.parametrize("shape,splits", SHAPES.items(), ids=[f"{n}x{k}-{hq}-{hkv}-d{d}" for n, k, hq, hkv, d in SHAPES])
def test_split_count_on_the_issue_shapes(shape, splits):
    n, kv, hq, hkv, d = shape
    plan = dec.plan_decode(n, 1, kv, hq, hkv, d, num_sms=132)
    assert plan.num_splits == splits
    fp8 = dec.plan_decode(n, 1, kv, hq, hkv, d, num_sms=132, kv_dtype="fp8_e4m3")  # FP8 pools: the same splits
    assert fp8 == dataclasses.replace(plan, kv_dtype="fp8_e4m3") and fp8.entry == dec.FP8_ENTRIES[d]
    # at least 95% of the H200's SMs busy in the one wave (the 128-CTA cases: 4 SMs idle)
    assert n * hkv * splits >= 0.95 * 132 and n * hkv * splits <= 132 or n * hkv >= 0.8 * 132


def test_split_count_rule():
    assert dec.split_count(132, 1000, 132) == 1  # a full wave already
    assert dec.split_count(106, 1000, 132) == 1  # 80% of the slots: no split
    assert dec.split_count(1, 4096, 132) == 61  # one CTA: within 95% of the best (64, the cap)
    assert dec.split_count(1, 1000, 132) == 63  # 64 would leave every split 16 tiles, as 63 does
    assert dec.split_count(8, 7, 132) == 1  # fewer than 2 x MIN_SPLIT_TILES tiles: no split
    assert dec.split_count(8, 8, 132) == 2
    assert dec.split_count(33, 4096, 132) == 4 and dec.split_count(32, 4096, 264) == 8
    assert dec.split_count(0, 100, 132) == 1


@pytest.mark.parametrize("kv,d,splits,q_len,window", [
    (1, 64, 1, 1, None), (64, 64, 2, 1, None), (65, 64, 2, 1, None), (1000, 128, 3, 4, None), (1000, 256, 7, 1, None),
    (1000, 256, 64, 8, None), (0, 128, 4, 1, None), (1000, 128, 3, 4, 100), (1000, 256, 7, 1, 0), (70, 64, 2, 8, 5),
    (1000, 256, 1, 2, 999), (1000, 256, 5, 2, 998)])
def test_split_ranges_partition_the_tiles(kv, d, splits, q_len, window):
    bn = dec.TILES[d].block_n
    n_tiles = -(-kv // bn)
    first = max(0, kv - q_len - window) if window is not None else 0  # the first key the first token sees
    ranges = dec.split_ranges(kv, d, splits, q_len, dec.window_argument(window))
    tiles = [t for t0, t1 in ranges for t in range(t0, t1)]
    assert tiles == list(range(first // bn, n_tiles))  # every tile a token sees once, in order, split by split
    assert len(ranges) <= splits and (splits == 1 or all(t1 > t0 for t0, t1 in ranges))
    if splits > 1 and n_tiles:
        assert len({t1 - t0 for t0, t1 in ranges[:-1]}) <= 1  # equal ranges but the last


def test_plan_geometry_and_workspace():
    plan = dec.plan_decode(3, 4, 900, 16, 2, 256, num_sms=132)
    assert plan == dec.DecodePlan(256, 16, 2, plan.num_splits, dec.NO_WINDOW) and plan.num_splits > 1
    # a window bounds the tiles a stream reads: 4 streams on 128k keys, 16 splits; with a 64-key window (3 tiles of 32
    # at most) too few tiles to split
    assert dec.plan_decode(4, 1, 131072, 16, 2, 256, num_sms=132).num_splits == 16
    assert dec.plan_decode(4, 1, 131072, 16, 2, 256, num_sms=132, window_left=63) == dec.DecodePlan(256, 16, 2, 1, 63)
    assert dec.plan_decode(4, 1, 131072, 16, 2, 256, num_sms=132, window_left=4095).num_splits > 1
    (grid, block, smem), merge = plan.launches(3, 4)
    assert grid == (plan.num_splits, 2, 3) and block == (128, 1, 1) and smem == dec.TILES[256].smem
    assert merge == ((4 * 16 // 4, 1, 3), (128, 1, 1), 0)  # D/8 = 32 threads a row: 4 rows a CTA
    assert plan.workspace_bytes_for(7) == plan.num_splits * 7 * 16 * 257 * 4
    fp8 = dataclasses.replace(plan, kv_dtype="fp8_e4m3")
    assert fp8.launches(3, 4) == (((plan.num_splits, 2, 3), (128, 1, 1), dec.TILES[256].smem_fp8), merge)
    assert fp8.merge_entry == plan.merge_entry and fp8.workspace_bytes_for(7) == plan.workspace_bytes_for(7)
    one = dec.plan_decode(3, 4, 900, 16, 2, 256, num_sms=132, num_splits=1)
    assert one.launches(3, 4)[1] is None and one.workspace_bytes_for(7) == 0 and one.merge_entry is None
    assert dec.DecodePlan(64, 8, 8, 2).launches(0, 0) == (((2, 8, 1), (128, 1, 1), dec.TILES[64].smem),
                                                          ((1, 1, 1), (128, 1, 1), 0))
    for bad, match in (({"num_splits": 0}, "num_splits"), ({"num_splits": 65}, "num_splits"),
                       ({"head_dim": 96}, "no decode attention kernel"), ({"num_kv_heads": 3}, "multiple"),
                       ({"kv_dtype": "fp8"}, "kv_dtype must be one of"),
                       ({"chunk_len": 9}, "at most 8 new tokens"), ({"chunk_len": 5, "num_kv_heads": 1},
                                                                    "at most 4 new tokens at 16 query heads")):
        args = dict(batch_size=3, chunk_len=4, max_kv_len=900, num_q_heads=16, num_kv_heads=2, head_dim=256,
                    num_sms=132)
        args.update(bad)
        with pytest.raises(ValueError, match=match):
            dec.plan_decode(**args)
    with pytest.raises(ValueError, match=r"longest stream has 9 \(streams\[2\]\)"):
        dec.check_rows(9, 16, 2, q_lens=[1, 4, 9])


# ---------------------------------------------------------------------------------------------
# the numpy model against a float64 reference

#: (q_lens, cached keys before the new tokens, Hq, Hkv, D, block size): ragged kv lengths, q_len 1 and 4, GQA 8:1
#: and 4:1, D 128 and 256 (and 64), blocks of 16 and 64; every case's tables a shuffled permutation of the pool.
MODEL_CASES = [
    ([1, 1, 1, 1, 1], [0, 15, 16, 300, 1000], 16, 2, 256, 16),
    ([4, 1, 4, 4], [60, 199, 0, 700], 16, 2, 256, 64),
    ([1, 4, 1, 4], [31, 32, 513, 999], 32, 8, 128, 16),
    ([4, 4, 1], [0, 127, 2000], 16, 4, 128, 64),
    ([1, 2, 8], [40, 1, 90], 8, 2, 64, 16),
    ([2, 4], [17, 333], 32, 2, 128, 16),  # 16 heads a kv head: 64 CTA rows at q_len 4
]
#: Sliding windows (keys left of the query) on MODEL_CASES[1] and [2]: none of a tile, inside one tile, across
#: splits, past every stream's keys.
WINDOWS = [0, 3, 40, 300, 5000]


def _close(got_bits, want, rtol, atol):
    np.testing.assert_allclose(from_bf16_bits(got_bits).astype(np.float64), from_bf16_bits(want).astype(np.float64),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[f"d{c[4]}-bs{c[5]}-g{c[2] // c[3]}-q{max(c[0])}" for c in MODEL_CASES])
def test_model_matches_the_float64_reference_split_or_not(case):
    q_lens, prefixes, hq, hkv, d, bs = case
    rng = np.random.default_rng(sum(prefixes) + d)
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d ** -0.5
    ref = attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, dtype=np.float64)
    one = dec.model(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, 1)
    assert rel_err_bf16(one, ref) < 4e-3
    _close(one, ref, 2 ** -6, 4e-3)
    for splits in (2, 5, 64):
        got = dec.model(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, splits)
        assert rel_err_bf16(got, one) < 1e-3, splits
        _close(got, one, 2 ** -7, 2e-3)
        # batched == each stream alone, bit for bit (a stream's work depends on its own rows and keys only)
        for b in range(len(q_lens)):
            s = slice(cu[b], cu[b + 1])
            alone = dec.model(q[s], kp, vp, np.array([0, q_lens[b]]), kv[b:b + 1], [tables[b]], hq, hkv, bs, scale,
                              splits)
            assert np.array_equal(alone, got[s]), (splits, b)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", MODEL_CASES[1:3], ids=["d256-bs64", "d128-bs16"])
def test_model_sliding_window(case, window):
    q_lens, prefixes, hq, hkv, d, bs = case
    rng = np.random.default_rng(window + d)
    q, kp, vp, cu, kv, tables = make_case(rng, q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d ** -0.5
    ref = attn.reference(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, dtype=np.float64, window_left=window)
    one = dec.model(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, 1, window)
    assert rel_err_bf16(one, ref) < 4e-3
    _close(one, ref, 2 ** -6, 4e-3)
    for splits in (3, 64):
        got = dec.model(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, splits, window)
        assert rel_err_bf16(got, one) < 1e-3, splits
        _close(got, one, 2 ** -7, 2e-3)
    if window >= max(kv):  # a window past every key is no window
        assert np.array_equal(one, dec.model(q, kp, vp, cu, kv, tables, hq, hkv, bs, scale, 1))


def test_model_is_bottom_right_causal_across_splits():
    # Token 0 of a 4-token stream must not see the last 3 keys, wherever the split boundary falls.
    rng = np.random.default_rng(7)
    q, kp, vp, cu, kv, tables = make_case(rng, [4], [200], hq=8, hkv=2, d=128, bs=16)
    for splits in (1, 4):
        base = dec.model(q, kp, vp, cu, kv, tables, 8, 2, 16, 0.1, splits)
        kp2 = kp.copy()
        last = int(kv[0]) - 1  # seen by token 3 only
        kp2[tables[0][last // 16], last % 16] = to_bf16_bits(rng.standard_normal((2, 128)) * 4)
        out = dec.model(q, kp2, vp, cu, kv, tables, 8, 2, 16, 0.1, splits)
        assert np.array_equal(out[:3], base[:3]) and not np.array_equal(out[3], base[3])


def test_model_large_logits():
    # Peaked softmax: the running max moves across tiles, key groups and splits.
    rng = np.random.default_rng(11)
    q, kp, vp, cu, kv, tables = make_case(rng, [1, 3], [700, 260], hq=8, hkv=1, d=128, bs=16)
    q = to_bf16_bits(from_bf16_bits(q) * 6)
    ref = attn.reference(q, kp, vp, cu, kv, tables, 8, 1, 16, 128 ** -0.5, dtype=np.float64)
    for splits in (1, 3, 11):
        assert rel_err_bf16(dec.model(q, kp, vp, cu, kv, tables, 8, 1, 16, 128 ** -0.5, splits), ref) < 6e-3


# ---------------------------------------------------------------------------------------------
# the emulated launches (ops.attention and Q12Pass.attention)


class DecodeBatch:
    """A decode batch on a device: streams of ``counts`` new tokens after ``starts`` cached ones, Q and the pools
    random, O poisoned (0xFFFF, a bf16 NaN), the workspace 0xA5."""

    def __init__(self, dev, counts, starts, hq, hkv, d, bs=16, seed=0):
        rng = np.random.default_rng(seed)
        self.dev, self.counts, self.hq, self.hkv, self.d, self.bs = dev, list(counts), hq, hkv, d, bs
        self.streams, self.tables = make_streams(dev, counts, starts, block_size=bs, rng=rng)
        self.num_blocks = int(max(int(s.block_table.max()) for s in self.streams)) + 1
        self.t = sum(counts)
        self.host = {"q": to_bf16_bits(rng.standard_normal((self.t, hq, d))),
                     "k_pool": to_bf16_bits(rng.standard_normal((self.num_blocks, bs, hkv, d))),
                     "v_pool": to_bf16_bits(rng.standard_normal((self.num_blocks, bs, hkv, d)))}
        self.bufs = {k: dev.alloc(v.nbytes, k) for k, v in self.host.items()}
        for k, v in self.host.items():
            dev.upload(self.bufs[k].ptr, v)
        self.o = dev.alloc(self.t * hq * d * 2, "o")
        self.ws = None
        self.shape = AttentionShape(hq, hkv, d, d)
        self.arena = ScratchArena(dev, make_scratch_plan(self.counts, 0, False, "exact").total_bytes + 4096)
        self.kv = np.array(counts) + np.array(starts)
        self.cu = np.concatenate([[0], np.cumsum(counts)])

    def workspace(self, nbytes: int) -> int:
        if self.ws is not None:
            self.ws.free()
        self.ws = self.dev.alloc(max(16, nbytes), "workspace")
        self.ws_bytes = nbytes
        return int(self.ws.ptr)

    def poison(self) -> None:
        self.dev.memset(self.o.ptr, 0xFF, self.t * self.hq * self.d * 2)
        if self.ws is not None:
            self.dev.memset(self.ws.ptr, 0xA5, max(16, self.ws_bytes))

    def ptrs(self) -> tuple:
        return tuple(int(self.bufs[k].ptr) for k in ("q", "k_pool", "v_pool")) + (int(self.o.ptr),)

    def out(self) -> np.ndarray:
        self.dev.synchronize()
        return np.frombuffer(self.dev.download(self.o.ptr, self.t * self.hq * self.d * 2), np.uint16).reshape(
            self.t, self.hq, self.d).copy()

    def refusal_pass(self, shape: AttentionShape, splits: int) -> tuple:
        """A batched pass over the streams and a workspace of what ``shape`` needs at ``splits`` splits, O and the
        workspace poisoned: ``(pass, workspace, its bytes)``; :meth:`unchanged` says later whether either changed."""
        p = Q12Pass(self.arena, self.streams, block_size=self.bs, use_mrope=False, dummy_kv_block=0, head_dim=self.d)
        need = p.decode_workspace_bytes(shape, splits)
        ws = self.workspace(need)
        self.poison()
        self._before = self._written()
        return p, ws, need

    def _written(self) -> tuple:
        return self.out().tobytes(), self.dev.download(self.ws.ptr, max(16, self.ws_bytes))

    def unchanged(self) -> bool:
        """O and the workspace as :meth:`refusal_pass` left them."""
        return self._written() == self._before

    def model(self, splits: int, window_left: int | None = None) -> np.ndarray:
        return dec.model(self.host["q"], self.host["k_pool"], self.host["v_pool"], self.cu, self.kv,
                         [s.block_table for s in self.streams], self.hq, self.hkv, self.bs, self.d ** -0.5, splits,
                         window_left)

    def close(self) -> None:
        self.dev.synchronize()
        for b in (*self.bufs.values(), self.o, self.ws):
            if b is not None:
                b.free()
        self.arena.close()
        self.tables.free()


@pytest.fixture
def batch(emu):
    made = []

    def make(*args, **kw):
        made.append(DecodeBatch(emu, *args, **kw))
        return made[-1]

    yield make
    for b in made:
        b.close()


@pytest.mark.parametrize("d,hq,hkv,window", [(128, 32, 8, None), (256, 16, 2, None), (64, 8, 1, None),
                                              (256, 16, 2, 100)])
def test_pass_batched_and_per_stream_equal_the_model(batch, d, hq, hkv, window):
    c = batch([1, 4, 1, 2, 1], [300, 45, 1000, 9, 0], hq, hkv, d)
    if window is not None:  # transformers' sliding_window counts the query's own key
        c.shape = dataclasses.replace(c.shape, sliding_window=window + 1)
    for splits in (None, 1, 3):
        outs = {}
        for mode in ("batched", "per_stream"):
            p = Q12Pass(c.arena, c.streams, block_size=c.bs, use_mrope=False, dummy_kv_block=0, head_dim=d, mode=mode)
            plan = p.decode_plan(c.shape, splits)
            need = p.decode_workspace_bytes(c.shape, splits)
            assert need == plan.workspace_bytes_for(c.t)
            ws = c.workspace(need)  # exactly what the plan needs: the emulator reads past nothing
            c.poison()
            p.attention(*c.ptrs()[:3], c.ptrs()[3], c.shape, num_blocks=c.num_blocks, algo="decode",
                        num_splits=splits, workspace=ws, workspace_bytes=need)
            outs[mode] = c.out()
        assert not (outs["batched"] == 0xFFFF).any(), "rows left unwritten"
        assert np.array_equal(outs["batched"], outs["per_stream"]), splits
        assert np.array_equal(outs["batched"], c.model(plan.num_splits, window)), splits
    assert plan.num_splits == 3


def test_ops_attention_decode_plans_from_the_metadata(batch, emu):
    c = batch([1, 1, 3], [2000, 70, 500], 16, 2, 256)
    meta = stage_batched_attn_metadata(c.arena, c.streams, block_size=c.bs, use_mrope=False, scratch_offset_bytes=0,
                                       dummy_kv_block=0)
    plan = dec.plan_decode(3, 3, 2001, 16, 2, 256, num_sms=emu.sm_count)
    assert plan.num_splits > 1  # 6 CTAs on 132 SMs
    ws = c.workspace(plan.workspace_bytes_for(c.t))
    c.poison()
    ops.attention(emu, meta, *c.ptrs(), num_q_heads=16, num_kv_heads=2, head_dim=256, algo="decode", workspace=ws,
                  workspace_bytes=c.ws_bytes)
    got = c.out()
    assert np.array_equal(got, c.model(plan.num_splits))
    ref = attn.reference(c.host["q"], c.host["k_pool"], c.host["v_pool"], c.cu, c.kv,
                         [s.block_table for s in c.streams], 16, 2, c.bs, 256 ** -0.5, dtype=np.float64)
    assert rel_err_bf16(got, ref) < 4e-3
    # one split: no workspace needed, none read
    c.poison()
    ops.attention(emu, meta, *c.ptrs(), num_q_heads=16, num_kv_heads=2, head_dim=256, algo="decode", num_splits=1)
    assert np.array_equal(c.out(), c.model(1))
    # a sliding window reaches the launches
    c.poison()
    ops.attention(emu, meta, *c.ptrs(), num_q_heads=16, num_kv_heads=2, head_dim=256, algo="decode", window_left=299,
                  num_splits=1)
    assert np.array_equal(c.out(), c.model(1, 299)) and not np.array_equal(c.model(1, 299), c.model(1))


def test_auto_runs_the_decode_kernel_where_it_splits_the_keys_given_a_workspace(batch, emu, monkeypatch):
    """``algo="auto"`` (``Q12Pass.attention`` and ``ops.attention``): the decode kernel for a decode batch whose plan
    splits the keys when a workspace is given (its bits: ``algo="decode"``'s); a prefill kernel without one, where
    one split suffices, and for a batch the decode kernel does not take."""
    ran = []
    real = dec.enqueue_decode
    monkeypatch.setattr(dec, "enqueue_decode", lambda *a, **k: ran.append(a[2].num_splits) or real(*a, **k))
    c = batch([1, 1, 3], [2000, 70, 500], 16, 2, 256)
    p = Q12Pass(c.arena, c.streams, block_size=c.bs, use_mrope=False, dummy_kv_block=0, head_dim=256)
    splits = p.decode_plan(c.shape).num_splits
    assert splits > 1 and dec.auto_runs(p.decode_plan(c.shape)) and not dec.auto_runs(p.decode_plan(c.shape, 1))
    need = p.decode_workspace_bytes(c.shape)
    ws = c.workspace(need)
    def run(algo, **kw):
        c.poison()
        p.attention(*c.ptrs(), c.shape, num_blocks=c.num_blocks, algo=algo, **kw)
        return c.out()

    assert p.attention_workspace_bytes(c.shape) == need > 0  # what "auto" uses: the decode plan's
    decode = run("decode", workspace=ws, workspace_bytes=need)
    assert ran == [splits] and np.array_equal(decode, c.model(splits))
    ran.clear()
    assert np.array_equal(run("auto", workspace=ws, workspace_bytes=need), decode) and ran == [splits]
    ran.clear()
    prefill = run("auto")  # no workspace: no split, a prefill kernel
    assert ran == [] and not (prefill == 0xFFFF).any() and rel_err_bf16(prefill, decode) < 4e-3
    assert np.array_equal(run("auto", workspace=ws, workspace_bytes=need, num_splits=1), prefill) and ran == []
    # the same rule per call (ops.attention, from the metadata staged in place of the pass's)
    c.arena.reset()
    meta = stage_batched_attn_metadata(c.arena, c.streams, block_size=c.bs, use_mrope=False, scratch_offset_bytes=0,
                                       dummy_kv_block=0)
    planned = []
    real_plan = dec.plan_decode
    monkeypatch.setattr(dec, "plan_decode", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    assert dec.auto_algo(emu, meta, 16, 2, 256) == "decode"
    assert dec.auto_algo(emu, meta, 16, 2, 256, num_splits=1) == "auto"
    for _ in range(2):  # planned once for the metadata: auto's choice and the launch, layer after layer
        c.poison()
        ops.attention(emu, meta, *c.ptrs(), num_q_heads=16, num_kv_heads=2, head_dim=256, workspace=ws,
                      workspace_bytes=need)
    assert np.array_equal(c.out(), decode) and ran == [splits, splits] and planned == [1, 1]  # (the two auto_algo's)
    # a batch the decode kernel does not take (9 new tokens) runs a prefill kernel whatever is given
    assert not dec.takes(9, 16, 2, 256) and dec.takes(8, 16, 2, 256) and not dec.takes(5, 16, 1, 256)
    assert not dec.takes(1, 16, 2, 96) and not dec.takes(1, 16, 0, 256) and not dec.takes(1.0, 16, 2, 256)
    long = batch([9, 1], [100, 2000], 16, 2, 256)
    ran.clear()
    q12 = Q12Pass(long.arena, long.streams, block_size=long.bs, use_mrope=False, dummy_kv_block=0, head_dim=256)
    assert q12.attention_workspace_bytes(long.shape) == 0
    wide = batch([1] * 64, [100] * 64, 16, 2, 256)  # 128 CTAs fill the SMs: one split, the wgmma kernel, no workspace
    q64 = Q12Pass(wide.arena, wide.streams, block_size=wide.bs, use_mrope=False, dummy_kv_block=0, head_dim=256)
    assert q64.decode_plan(wide.shape).num_splits == 1 and q64.attention_workspace_bytes(wide.shape) == 0
    long.poison()
    q12.attention(*long.ptrs(), long.shape, num_blocks=long.num_blocks, workspace=long.workspace(1 << 20))
    assert ran == [] and not (long.out() == 0xFFFF).any()


def test_attention_layer_with_a_workspace_runs_the_decode_kernel_where_auto_does(batch, emu, monkeypatch):
    """``attention_layer(..., workspace=)``: RoPE, the KV write and then the decode kernel where ``attention``'s
    ``"auto"`` runs it, the bits of the three ops called one by one; a small workspace is refused before RoPE runs."""
    check_attention_layer_decode(emu, batch, monkeypatch)


def check_attention_layer_decode(emu, batch, monkeypatch) -> None:
    """The body of the test above, on any device (``tests/gpu/test_attention_decode_gpu.py`` runs it on the GPU)."""
    ran = []
    real = dec.enqueue_decode
    monkeypatch.setattr(dec, "enqueue_decode", lambda *a, **k: ran.append(1) or real(*a, **k))
    c = batch([1, 1, 3], [2000, 70, 500], 16, 2, 256)
    rng = np.random.default_rng(5)
    kv = {n: to_bf16_bits(rng.standard_normal((c.t, 2, 256))) for n in ("k", "v")}
    bufs = {n: emu.alloc(x.nbytes, n) for n, x in kv.items()}
    p = Q12Pass(c.arena, c.streams, block_size=c.bs, use_mrope=False, dummy_kv_block=0, head_dim=256)
    need = p.decode_workspace_bytes(c.shape)
    ws = c.workspace(need)
    q, kp, vp, o = c.ptrs()
    k, v = int(bufs["k"].ptr), int(bufs["v"].ptr)

    def fresh():  # Q, K and the pools as the batch made them (RoPE works in place; the KV write fills the pools)
        for n, x in c.host.items():
            emu.upload(c.bufs[n].ptr, x)
        for n, x in kv.items():
            emu.upload(bufs[n].ptr, x)
        c.poison()

    fresh()
    p.rope(q, k, c.shape)
    p.kv_write(k, v, kp, vp, c.shape, num_blocks=c.num_blocks)
    p.attention(q, kp, vp, o, c.shape, num_blocks=c.num_blocks, algo="decode", workspace=ws, workspace_bytes=need)
    ops_one_by_one = c.out()
    assert ran == [1]
    fresh()
    p.attention_layer(q, k, v, kp, vp, o, c.shape, num_blocks=c.num_blocks, workspace=ws, workspace_bytes=need)
    assert np.array_equal(c.out(), ops_one_by_one) and ran == [1, 1]
    fresh()
    with pytest.raises(ValueError, match="workspace"):
        p.attention_layer(q, k, v, kp, vp, o, c.shape, num_blocks=c.num_blocks, workspace=ws, workspace_bytes=need - 4)
    emu.synchronize()  # nothing ran: Q and K as they were (no RoPE), O still poisoned
    assert ran == [1, 1] and (c.out() == 0xFFFF).all()
    assert emu.download(c.bufs["q"].ptr, c.host["q"].nbytes) == c.host["q"].tobytes()
    assert emu.download(bufs["k"].ptr, kv["k"].nbytes) == kv["k"].tobytes()
    p.attention_layer(q, k, v, kp, vp, o, c.shape, num_blocks=c.num_blocks)  # no workspace: a prefill kernel
    assert ran == [1, 1] and not (c.out() == 0xFFFF).any()
    for b in bufs.values():
        b.free()


@settings(max_examples=300, deadline=None)
@given(chunk=st.integers(-1, 20), hq=st.integers(0, 80), hkv=st.integers(0, 20),
       d=st.sampled_from([32, 64, 96, 128, 256]))
def test_takes_is_what_plan_decode_accepts(chunk, hq, hkv, d):
    """``takes`` (what ``algo="auto"`` asks before it plans) and ``plan_decode``'s refusals are one rule: a batch is
    taken exactly when a plan for it is made."""
    try:
        dec.plan_decode(1, chunk, 100, hq, hkv, d, num_sms=132)
        accepted = chunk > 0
    except (ValueError, TypeError):
        accepted = False
    assert dec.takes(chunk, hq, hkv, d) == accepted, (chunk, hq, hkv, d)


def test_bad_input_is_refused_with_nothing_written(batch, emu):
    c = batch([1, 2, 1], [500, 600, 700], 16, 2, 128)
    long = batch([1, 9], [5, 20], 16, 2, 128, seed=1)
    p, ws, need = c.refusal_pass(c.shape, 2)
    q, kp, vp, o = c.ptrs()
    call = lambda **kw: p.attention(q, kp, vp, o, c.shape, num_blocks=c.num_blocks, **{  # noqa: E731
        "algo": "decode", "num_splits": 2, "workspace": ws, "workspace_bytes": need, **kw})
    cases = [
        ({"workspace": None}, "needs workspace= .* of 66,048 bytes"),
        ({"workspace_bytes": need - 1}, "too small"),
        ({"workspace": ws + 8}, "16-byte aligned"),
        ({"num_splits": 0}, "num_splits"),
        ({"num_splits": 65}, "num_splits"),
        ({"num_splits": 2.0}, "num_splits must be an int"),
    ]
    for kw, match in cases:
        emu.driver.start_trace()
        with pytest.raises((TypeError, ValueError), match=match):
            call(**kw)
        assert emu.driver.stop_trace() == [], kw  # no launch, no copy
    pl = Q12Pass(long.arena, long.streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=128)
    lq, lkp, lvp, lo = long.ptrs()
    with pytest.raises(ValueError, match=r"at most 8 new tokens; this pass's longest stream has 9 \(streams\[1\]\)"):
        pl.attention(lq, lkp, lvp, lo, long.shape, num_blocks=long.num_blocks, algo="decode", num_splits=1)
    with pytest.raises(ValueError, match="longest stream has 9"):
        ops.attention(emu, pl.meta, lq, lkp, lvp, lo, num_q_heads=16, num_kv_heads=2, head_dim=128, algo="decode")
    # decode is no one-kernel algo: the layer refuses it before its first launch
    with pytest.raises(ValueError, match="not attention_layer"):
        p.attention_layer(q, q, q, kp, vp, o, c.shape, num_blocks=c.num_blocks, algo="decode")
    with pytest.raises(ValueError, match="not one kernel"):
        ops.attention_entry("decode", 128)
    assert c.unchanged()
    # and the same call with its arguments right runs
    emu.driver.start_trace()
    call()
    assert [x for x in emu.driver.stop_trace() if "Launch" in x] == ["cuLaunchKernel", "cuLaunchKernel"]


def test_emulator_checks_its_launch(batch, emu):
    c = batch([1, 3], [100, 200], 8, 2, 128)
    meta = stage_batched_attn_metadata(c.arena, c.streams, block_size=c.bs, use_mrope=False, scratch_offset_bytes=0,
                                       dummy_kv_block=0)
    plan = dec.DecodePlan(128, 8, 2, 3)
    ws = c.workspace(plan.workspace_bytes_for(c.t))
    (grid, block, smem), (mgrid, mblock, _) = plan.launches(2, 3)
    from q12drv.kernels.meta import meta_struct

    args = {"m": meta_struct(meta), "q": int(c.bufs["q"].ptr), "k_pool": int(c.bufs["k_pool"].ptr),
            "v_pool": int(c.bufs["v_pool"].ptr), "o": int(c.o.ptr), "partial": ws, "num_q_heads": 8,
            "num_kv_heads": 2, "block_size": 16, "scale": 128 ** -0.5, "window_left": dec.NO_WINDOW, "num_splits": 3}
    split, merge = dec.EMULATORS[plan.entry], dec.EMULATORS[plan.merge_entry]
    mem = emu.driver.memory
    with pytest.raises(ValueError, match="grid"):
        split(args, mem, (2, 2, 2), block)
    with pytest.raises(ValueError, match="block"):
        split(args, mem, grid, (256, 1, 1))
    with pytest.raises(ValueError, match="scale"):
        split({**args, "scale": -1.0}, mem, grid, block)
    with pytest.raises(ValueError, match="window_left"):
        split({**args, "window_left": -1}, mem, grid, block)
    margs = {k: args[k] for k in ("m", "partial", "o", "num_q_heads", "num_kv_heads", "window_left", "num_splits")}
    with pytest.raises(ValueError, match="grid"):
        merge(margs, mem, (mgrid[0] - 1, 1, 2), mblock)
    split(args, mem, grid, block)
    merge(margs, mem, mgrid, mblock)
    assert np.array_equal(c.out(), c.model(3))
