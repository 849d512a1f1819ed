"""The wgmma attention kernel's host side (``cuda_src/attention/wgmma.cu``): compile, tiles, geometry,
target architecture and the launch path on the emulated driver. Its numerics run on the GPU
(tests/gpu/test_attention_gpu.py runs every case on both kernels)."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan, stage_batched_attn_metadata
from q12drv.core.bf16 import to_bf16_bits
from q12drv.kernels import attention as attn
from q12drv.kernels import attention_wgmma as attnw
from q12drv.kernels import ops
from q12drv.core.errors import NvrtcError
from q12drv.core.launch import parse_signatures
from q12drv.kernels.meta import Q12MetaC, meta_defines
from q12drv.kernels.registry import compile_defines
from q12drv.core.nvrtc import ARCH_SPECIFIC_SOURCES, compile_source, cuda_src_dir, local_headers, target_arch
from tests.helpers import make_streams, spill_free


def test_compiles_for_sm_90a_without_spills_taking_the_launch_share_of_registers(kernel_build):
    # Warp specialization: the launch gives each of the 128 (CONSUMERS + 1) threads 65536 / threads registers
    # (rounded down to 8); setmaxnreg hands the producer's share to the consumers, so ptxas must have
    # taken the whole launch share (else setmaxnreg.inc would wait for registers that never come).
    img = kernel_build(attnw.SOURCE, "sm_90")
    assert img.arch == "sm_90a"
    report = spill_free(img, attnw.ENTRIES)
    src = (cuda_src_dir() / attnw.SOURCE).read_text()
    prod, cons = map(int, re.search(r"constexpr int kProdRegs = (\d+), kConsRegs = (\d+);", src).groups())
    assert prod % 8 == 0 and cons % 8 == 0 and 24 <= prod <= cons <= 256
    for d, entry in attnw.HEAD_DIMS.items():
        threads = attnw.TILES[d].threads
        assert threads == 128 * (attnw.CONSUMERS + 1) == 384
        assert report[entry].registers == 65536 // threads // 8 * 8 == 168, report[entry]
        assert 128 * prod + 128 * attnw.CONSUMERS * cons <= report[entry].registers * threads <= 65536


def test_target_arch():
    assert ARCH_SPECIFIC_SOURCES == {attnw.SOURCE, "gdn/chunked_wgmma.cu"}
    assert target_arch(attnw.SOURCE, "sm_90") == "sm_90a" == target_arch(attnw.SOURCE, "sm_90a")
    assert target_arch(attn.SOURCE, "sm_90") == "sm_90" and target_arch(attn.SOURCE, "sm_100") == "sm_100"
    with pytest.raises(ValueError, match="sm_90a"):
        target_arch(attnw.SOURCE, "sm_100")


def test_every_entry_takes_the_one_parameter_list():
    # Both sources declare their entries over ATTN_PARAMS (attention/common.cuh): the host reads one list.
    want = (("m", Q12MetaC), ("q", ctypes.c_uint64), ("k_pool", ctypes.c_uint64), ("v_pool", ctypes.c_uint64),
            ("o", ctypes.c_uint64), ("num_q_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
            ("block_size", ctypes.c_int32), ("scale", ctypes.c_float), ("window_left", ctypes.c_int32))
    for mod in (attn, attnw):
        src = (cuda_src_dir() / mod.SOURCE).read_text()
        sigs = parse_signatures(src, {"Q12Meta": Q12MetaC}, local_headers(src))
        assert sigs == {entry: want for entry in mod.ENTRIES}, mod.SOURCE


def test_tiles_geometry_and_smem():
    # Q, two K and two V stages, five mbarriers (full and empty per stage, the producer's Q one), 1 KiB to
    # align the swizzled tiles; three warpgroups (two consumers and the producer)
    assert {d: (t.block_n, t.threads, t.block_m, t.gqa_pack, t.smem) for d, t in attnw.TILES.items()} == {
        128: (128, 384, 128, True, (128 + 4 * 128) * 128 * 2 + 5 * 8 + 1024),
        256: (64, 384, 128, True, (128 + 4 * 64) * 256 * 2 + 5 * 8 + 1024)}
    assert attnw.smem_bytes(128) == 164904 and attnw.smem_bytes(256) == 197672
    assert all(attnw.smem_bytes(d) <= 227 * 1024 for d in attnw.HEAD_DIMS)
    grid, block, smem = attnw.geometry(3, 300, 16, 2, 128)
    assert grid == (-(-300 * 8 // 128), 2, 3) and block == (384, 1, 1) and smem == attnw.smem_bytes(128)
    assert attnw.geometry(3, 300, 16, 2, 256) == (grid, block, attnw.smem_bytes(256))
    assert attnw.geometry(1, 16, 16, 2, 256)[0] == (1, 2, 1)  # 16 tokens x 8 heads = 128 rows: one CTA
    assert attnw.geometry(1, 17, 16, 2, 256)[0] == (2, 2, 1)
    assert attnw.geometry(0, 0, 4, 4, 128)[0] == (1, 4, 1)
    for bad in (attnw.entry_for_head_dim, attnw.smem_bytes, lambda d: attnw.geometry(1, 1, 1, 1, d)):
        with pytest.raises(ValueError, match="no wgmma attention kernel for head_dim=64"):
            bad(64)
    with pytest.raises(ValueError, match="dividing"):
        attnw.geometry(1, 8, 6, 4, 128)


def test_contract_defines_and_a_host_that_disagrees_with_the_source():
    defs = tuple(f"{k}={v}" for k, v in attnw.CONTRACTS.items())
    assert defs == ("Q12_ATTN_WG_D128_THREADS=384", "Q12_ATTN_WG_D128_BLOCK_M=128", "Q12_ATTN_WG_D128_SMEM=164904",
                    "Q12_ATTN_WG_D256_THREADS=384", "Q12_ATTN_WG_D256_BLOCK_M=128", "Q12_ATTN_WG_D256_SMEM=197672")
    assert compile_defines(attnw.SOURCE) == tuple(meta_defines()) + defs
    for define in ("Q12_ATTN_WG_D128_THREADS=256", "Q12_ATTN_WG_D256_BLOCK_M=64", "Q12_ATTN_WG_D128_SMEM=164864"):
        name = define.split("=")[0]
        defines = [define if d.startswith(name + "=") else d for d in compile_defines(attnw.SOURCE)]
        with pytest.raises(NvrtcError, match="differ") as info:
            compile_source(attnw.SOURCE, defines=defines, use_cache=False)
        assert name.split("_")[3] + ": " in info.value.log  # the static_assert names the head dim
    with pytest.raises(NvrtcError, match="compile through q12drv"):
        compile_source(attnw.SOURCE, defines=tuple(meta_defines()), use_cache=False)


def test_auto_picks_wgmma_on_hopper_where_it_exists():
    assert ops.attention_entry("auto", 128) == attnw.HEAD_DIMS[128] == ops.attention_entry("auto", 128, "sm_90a")
    assert ops.attention_entry("auto", 256, "sm_90") == attnw.HEAD_DIMS[256]
    assert ops.attention_entry("auto", 64, "sm_90") == attn.HEAD_DIMS[64]  # no wgmma kernel for D=64
    assert ops.attention_entry("auto", 128, "sm_100") == attn.HEAD_DIMS[128]  # no wgmma off Hopper
    assert ops.attention_entry("mma", 128) == attn.HEAD_DIMS[128]
    with pytest.raises(ValueError, match="no wgmma attention kernel for head_dim=64"):
        ops.attention_entry("wgmma", 64)


def test_ops_routes_both_algos_on_the_emulator(emu):
    # On the emulator both entries run the same numpy reference: this pins the routing (entry,
    # geometry, arguments), not the numerics, which the GPU tests check.
    rng = np.random.default_rng(3)
    counts, hq, hkv, d, bs = [5, 19], 4, 2, 128, 16
    streams, tables = make_streams(emu, counts, [3, 0], rng=rng, block_size=bs)
    num_blocks = int(max(s.block_table.max() for s in streams)) + 1
    t = sum(counts)
    host = {"q": to_bf16_bits(rng.standard_normal((t, hq, d))),
            "kp": to_bf16_bits(rng.standard_normal((num_blocks, bs, hkv, d))),
            "vp": to_bf16_bits(rng.standard_normal((num_blocks, bs, hkv, d)))}
    bufs = {k: emu.alloc(v.nbytes, k) for k, v in host.items()}
    algos = ("auto", "mma", "wgmma")  # one-kernel algos ("decode" takes streams of at most 8 new tokens)
    outs = {a: emu.alloc(t * hq * d * 2, f"o {a}") for a in algos}
    outs_w = {a: emu.alloc(t * hq * d * 2, f"o {a} window") for a in algos}
    try:
        for k, v in host.items():
            emu.upload(bufs[k].ptr, v)
        with ScratchArena(emu, make_scratch_plan(counts, 0, False, "exact").total_bytes) as arena:
            meta = stage_batched_attn_metadata(arena, streams, block_size=bs, use_mrope=False,
                                               scratch_offset_bytes=0, dummy_kv_block=0)
            for algo, o in outs.items():  # "auto" is wgmma here (the emulator reports sm_90)
                ops.attention(emu, meta, bufs["q"].ptr, bufs["kp"].ptr, bufs["vp"].ptr, o.ptr, num_q_heads=hq,
                              num_kv_heads=hkv, head_dim=d, algo=algo)
                ops.attention(emu, meta, bufs["q"].ptr, bufs["kp"].ptr, bufs["vp"].ptr, outs_w[algo].ptr,
                              num_q_heads=hq, num_kv_heads=hkv, head_dim=d, algo=algo, window_left=4)
            with pytest.raises(ValueError, match="attention algo must be one of"):
                ops.attention(emu, meta, bufs["q"].ptr, bufs["kp"].ptr, bufs["vp"].ptr, outs["mma"].ptr,
                              num_q_heads=hq, num_kv_heads=hkv, head_dim=d, algo="fa3")
            emu.synchronize()
        got = {a: np.frombuffer(emu.download(o.ptr, t * hq * d * 2), np.uint16) for a, o in outs.items()}
        ref = attn.reference(host["q"], host["kp"], host["vp"], np.array([0, 5, 24]), np.array([8, 19]),
                             [s.block_table for s in streams], hq, hkv, bs, d ** -0.5)
        assert np.array_equal(got["wgmma"], ref.reshape(-1)) and np.array_equal(got["mma"], got["wgmma"])
        # the window reaches both kernels' launches
        got_w = {a: np.frombuffer(emu.download(o.ptr, t * hq * d * 2), np.uint16) for a, o in outs_w.items()}
        ref_w = attn.reference(host["q"], host["kp"], host["vp"], np.array([0, 5, 24]), np.array([8, 19]),
                               [s.block_table for s in streams], hq, hkv, bs, d ** -0.5, window_left=4)
        assert not np.array_equal(ref_w, ref)
        for algo in algos:
            assert np.array_equal(got_w[algo], ref_w.reshape(-1)), algo
    finally:
        for b in (*bufs.values(), *outs.values(), *outs_w.values()):
            b.free()
        tables.free()
