"""The wgmma attention kernel's host side (``cuda_src/attn_wgmma.cu``): compile, tiles, geometry,
target architecture and the launch path on the emulated driver. Its numerics run on the GPU
(tests/gpu/test_attention_gpu.py runs every case on both kernels)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan, stage_batched_attn_metadata
from q12drv.core.bf16 import to_bf16_bits
from q12drv.kernels import attention as attn
from q12drv.kernels import attention_wgmma as attnw
from q12drv.kernels import ops
from q12drv.kernels.meta import meta_defines
from q12drv.core.nvrtc import ARCH_SPECIFIC_SOURCES, compile_source, cuda_src_dir, target_arch
from tests.helpers import make_streams, spill_free


def test_compiles_for_sm_90a_without_spills():
    img = compile_source(attnw.SOURCE, arch="sm_90", defines=meta_defines(), use_cache=False, verbose_resources=True)
    assert img.arch == "sm_90a"
    report = spill_free(img, attnw.ENTRIES)
    assert all(report[entry].registers <= 255 for entry in attnw.ENTRIES)


def test_target_arch():
    assert ARCH_SPECIFIC_SOURCES == {attnw.SOURCE, "gdn/chunked_wgmma.cu"}
    assert target_arch(attnw.SOURCE, "sm_90") == "sm_90a" == target_arch(attnw.SOURCE, "sm_90a")
    assert target_arch(attn.SOURCE, "sm_90") == "sm_90" and target_arch(attn.SOURCE, "sm_100") == "sm_100"
    with pytest.raises(ValueError, match="sm_90a"):
        target_arch(attnw.SOURCE, "sm_100")


def test_python_tiles_match_the_source():
    src = (cuda_src_dir() / attnw.SOURCE).read_text()
    for d, entry in attnw.HEAD_DIMS.items():
        knobs = ", ".join(f"ATTN_WG_D{d}_{k}" for k in attnw.DEFAULT_CONFIG[d])
        assert re.search(rf"void {entry}\(.*?attn_wgmma<{d}, {knobs}>", re.sub(r"\s+", " ", src)), entry
        # block = 128 (WG + WS) threads, as config()["threads"]
        assert f"__launch_bounds__((ATTN_WG_D{d}_WG + ATTN_WG_D{d}_WS) * 128, ATTN_WG_D{d}_WS) void {entry}(" in src
        for knob, want in attnw.DEFAULT_CONFIG[d].items():
            got = re.search(rf"#ifndef ATTN_WG_D{d}_{knob}\n#define ATTN_WG_D{d}_{knob} (\d+)\n#endif", src)
            assert got and int(got.group(1)) == want, f"ATTN_WG_D{d}_{knob}"


def test_config_geometry_and_smem():
    # Q, two K and two V stages, five mbarriers (full and empty per stage, the producer's Q one), 1 KiB to
    # align the swizzled tiles; three warpgroups (two consumers and the producer)
    assert attnw.smem_bytes(128) == 163840 + 40 + 1024 and attnw.smem_bytes(256) == 196608 + 40 + 1024
    no_ws = ("ATTN_WG_D128_WS=0",)
    assert attnw.config(128, no_ws + ("ATTN_WG_D128_WG=1", "ATTN_WG_D128_BN=64", "ATTN_WG_D128_MB=0",
                                      "ATTN_WG_D128_SW=0"))["smem"] == (64 + 256) * 128 * 2
    grid, block, smem = attnw.geometry(3, 300, 16, 2, 128)
    assert grid == (-(-300 * 8 // 128), 2, 3) and block == (384, 1, 1) and smem == attnw.smem_bytes(128)
    assert attnw.geometry(3, 300, 16, 2, 128, defines=no_ws)[1] == (256, 1, 1)
    assert attnw.geometry(1, 16, 16, 2, 256)[0] == (1, 2, 1)  # 16 tokens x 8 heads = 128 rows: one CTA
    assert attnw.geometry(1, 17, 16, 2, 256)[0] == (2, 2, 1)
    assert attnw.geometry(0, 0, 4, 4, 128)[0] == (1, 4, 1)
    assert attnw.geometry(2, 100, 4, 2, 256, defines=("ATTN_WG_D256_WG=1",))[0] == (-(-200 // 64), 2, 2)
    with pytest.raises(ValueError, match="no wgmma attention kernel for head_dim=64"):
        attnw.config(64)
    assert attnw.config(128, no_ws + ("ATTN_WG_D128_MB=0",))["smem"] == attnw.smem_bytes(128) - 40  # no mbarriers
    assert attnw.config(128, no_ws)["smem"] == attnw.smem_bytes(128) - 8  # no Q mbarrier
    assert attnw.config(128, ("ATTN_WG_D128_SW=0",))["smem"] == attnw.smem_bytes(128) - 1024  # no alignment slack
    with pytest.raises(ValueError, match="MB 0 or 1"):
        attnw.config(128, ("ATTN_WG_D128_MB=2",))
    with pytest.raises(ValueError, match="BN 64 or 128"):
        attnw.config(128, ("ATTN_WG_D128_BN=32",))
    with pytest.raises(ValueError, match="227 KiB"):
        attnw.config(256, ("ATTN_WG_D256_BN=128",))
    with pytest.raises(ValueError, match="dividing"):
        attnw.geometry(1, 8, 6, 4, 128)


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
    outs = {a: emu.alloc(t * hq * d * 2, f"o {a}") for a in ops.ATTN_ALGOS}
    try:
        for k, v in host.items():
            emu.upload(bufs[k].ptr, v)
        with ScratchArena(emu, make_scratch_plan(counts, 0, False, "exact").total_bytes) as arena:
            meta = stage_batched_attn_metadata(arena, streams, block_size=bs, use_mrope=False,
                                               scratch_offset_bytes=0, dummy_kv_block=0)
            for algo, o in outs.items():  # "auto" is wgmma here (the emulator reports sm_90)
                ops.attention(emu, meta, bufs["q"].ptr, bufs["kp"].ptr, bufs["vp"].ptr, o.ptr, num_q_heads=hq,
                              num_kv_heads=hkv, head_dim=d, algo=algo)
            with pytest.raises(ValueError, match="attention algo must be one of"):
                ops.attention(emu, meta, bufs["q"].ptr, bufs["kp"].ptr, bufs["vp"].ptr, outs["mma"].ptr,
                              num_q_heads=hq, num_kv_heads=hkv, head_dim=d, algo="fa3")
            emu.synchronize()
        got = {a: np.frombuffer(emu.download(o.ptr, t * hq * d * 2), np.uint16) for a, o in outs.items()}
        ref = attn.reference(host["q"], host["kp"], host["vp"], np.array([0, 5, 24]), np.array([8, 19]),
                             [s.block_table for s in streams], hq, hkv, bs, d ** -0.5)
        assert np.array_equal(got["wgmma"], ref.reshape(-1)) and np.array_equal(got["mma"], got["wgmma"])
    finally:
        for b in (*bufs.values(), *outs.values()):
            b.free()
        tables.free()


def _wgmma_builds():
    """``(name, defines, head dim, config)`` of every wgmma build tests/gpu/attn_variants.py measures,
    the default's included, per head dim its knobs set (the default at both)."""
    from tests.gpu.attn_variants import VARIANTS

    out = []
    for name, kind, defs in VARIANTS:
        if kind == "wgmma":
            dims = [d for d in attnw.HEAD_DIMS if any(x.startswith(f"ATTN_WG_D{d}_") for x in defs)] or list(attnw.HEAD_DIMS)
            out += [(name, defs, d, attnw.config(d, defs)) for d in dims]
    assert {n for n, _, _, c in out if c["WS"]} >= {"wg0-default", "wg4-st3"}
    return out


def test_ws_builds_compile_for_sm_90a_and_take_the_launch_share_of_registers():
    # Warp specialization: the launch gives each of the 128 (WG + 1) threads 65536 / threads registers
    # (rounded down to 8); setmaxnreg hands the producer's share to the consumers, so ptxas must have
    # taken the whole launch share (else setmaxnreg.inc would wait for registers that never come).
    src = (cuda_src_dir() / attnw.SOURCE).read_text()
    prod, cons = map(int, re.search(r"constexpr int kProdRegs = (\d+), kConsRegs = (\d+);", src).groups())
    assert prod % 8 == 0 and cons % 8 == 0 and 24 <= prod <= cons <= 256
    images = {}
    for name, defs, d, cfg in _wgmma_builds():
        if not cfg["WS"]:
            continue
        img = images.get(name)
        if img is None:
            img = images[name] = compile_source(attnw.SOURCE, arch="sm_90", defines=tuple(meta_defines()) + tuple(defs),
                                                use_cache=False, verbose_resources=True)
        assert img.arch == "sm_90a"
        r = spill_free(img, attnw.ENTRIES)[attnw.HEAD_DIMS[d]]
        assert cfg["threads"] == 128 * (cfg["WG"] + 1), name
        assert r.registers == 65536 // cfg["threads"] // 8 * 8, f"{name} D{d}: {r}"
        assert 128 * prod + 128 * cfg["WG"] * cons <= r.registers * cfg["threads"] <= 65536, f"{name} D{d}"
        assert cfg["smem"] <= attnw.SMEM_LIMIT == 232448, f"{name} D{d}"


def test_builds_geometry_and_smem():
    want = {  # (threads, smem): Q + 2 ST stages of K and V, 2 ST (+ 1 with WS) mbarriers, 1 KiB alignment slack
        ("wg0-default", 128): (384, (128 + 4 * 128) * 128 * 2 + 5 * 8 + 1024),
        ("wg0-default", 256): (384, (128 + 4 * 64) * 256 * 2 + 5 * 8 + 1024),
        ("wg1-no-ws", 128): (256, (128 + 4 * 128) * 128 * 2 + 4 * 8 + 1024),
        ("wg1-no-ws", 256): (256, (128 + 4 * 64) * 256 * 2 + 4 * 8 + 1024),
        ("wg4-st3", 128): (384, (128 + 6 * 128) * 128 * 2 + 7 * 8 + 1024),
    }
    builds = {(name, d): defs for name, defs, d, _ in _wgmma_builds()}
    for (name, d), (threads, smem) in want.items():
        defs = builds[(name, d)]
        grid, block, got_smem = attnw.geometry(3, 300, 16, 2, d, defines=defs)
        assert grid == (-(-300 * 8 // 128), 2, 3) and block == (threads, 1, 1) and got_smem == smem, (name, d)
        assert attnw.smem_bytes(d, defs) == smem <= attnw.SMEM_LIMIT
    assert attnw.smem_bytes(128, builds[("wg4-st3", 128)]) == 230456
    for name, defs, d, cfg in _wgmma_builds():  # every build fits
        assert cfg["smem"] <= attnw.SMEM_LIMIT, (name, d)
    # the knobs' limits
    with pytest.raises(ValueError, match="ST 2"):
        attnw.config(128, ("ATTN_WG_D128_WS=0", "ATTN_WG_D128_ST=3"))  # three stages only with WS
    with pytest.raises(ValueError, match="WS is 0 or 1"):
        attnw.config(128, ("ATTN_WG_D128_MB=0",))
    for knob in ("PP", "OV", "PS"):  # measured and dropped
        assert all(knob not in attnw.DEFAULT_CONFIG[d] for d in attnw.HEAD_DIMS), knob
    with pytest.raises(ValueError, match="227 KiB"):
        attnw.config(256, ("ATTN_WG_D256_WS=1", "ATTN_WG_D256_ST=3"))  # 64 KiB Q + 192 KiB K/V
    with pytest.raises(ValueError, match="227 KiB"):
        attnw.config(128, ("ATTN_WG_D128_WS=1", "ATTN_WG_D128_ST=4"))
