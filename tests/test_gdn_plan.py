"""The GDN plan's rules on the emulated driver (q12drv.kernels.gdn.plan): what each "auto" resolves to for a device
and a batch, what is refused (naming what exists), a plan's launches for a smaller launch, and a pass that plans once
from its whole batch and runs that plan batched and per stream."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from q12drv import ScratchArena, make_scratch_plan
from q12drv.kernels.gdn import GdnConfig, GdnPlan, GdnShape, GdnTensors, chunked_mma, chunked_wgmma, plan_gdn
from q12drv.prefill import Q12Pass
from tests.helpers import make_streams

H200 = SimpleNamespace(arch="sm_90", sm_count=132)
A100 = SimpleNamespace(arch="sm_80", sm_count=108)
QWEN = GdnShape(16, 32, 128)


def _path(plan: GdnPlan) -> tuple:
    return plan.math, plan.schedule, plan.isa, plan.build, tuple(k.entry for k in plan.kernels)


@pytest.mark.parametrize("shape,n,tokens,want", [
    (QWEN, 1, 8192, ("overlapped", "wgmma", "", chunked_wgmma.overlapped_entries(128))),   # few CTAs, one long stream
    (QWEN, 1, 2048, ("two_pass", "wgmma", "2stage", (chunked_mma.precompute_entry(128, "wgmma"),
                                                      chunked_wgmma.sequential_entry(128, 2)))),
    (QWEN, 8, 2048, ("two_pass", "wgmma", "wide", (chunked_mma.precompute_entry(128, "wgmma"),
                                                   chunked_wgmma.WIDE_ENTRY))),           # a full device at d128
    (GdnShape(16, 32, 64), 16, 2048, ("two_pass", "wgmma", "1stage", (chunked_mma.precompute_entry(64, "wgmma"),
                                                                      chunked_wgmma.sequential_entry(64, 1)))),
    (QWEN, 2, 8192, ("two_pass", "wgmma", "2stage", (chunked_mma.precompute_entry(128, "wgmma"),
                                                     chunked_wgmma.sequential_entry(128, 2)))),   # 2 x 64 CTAs: half
])
def test_the_default_on_hopper_is_what_the_rules_say(shape, n, tokens, want):
    plan = plan_gdn(GdnConfig(), shape, n, tokens, H200)
    assert (plan.schedule, plan.isa, plan.build, tuple(k.entry for k in plan.kernels)) == want
    assert plan.workspace_bytes == plan.workspace_bytes_for(n, tokens) > 0
    assert plan.numerics == ("overlapped" if plan.schedule == "overlapped" else "wgmma")
    assert [k.dependent for k in plan.kernels] == [False, True]   # the sequential kernel by PDL
    assert (plan.zero is not None) == (plan.schedule == "overlapped")


def test_the_default_elsewhere_is_the_mma_two_pass_schedule():
    for n, stages in ((1, 2), (8, 1)):
        plan = plan_gdn(GdnConfig(), QWEN, n, 2048, A100)
        assert _path(plan) == ("chunked", "two_pass", "mma", f"{stages}stage",
                               (chunked_mma.precompute_entry(128), chunked_mma.sequential_entry(128, stages)))
        assert plan.workspace_bytes == chunked_mma.mma_workspace_bytes(n, 2048, 16, 32, 128)
        assert plan.numerics == "mma" and [k.dependent for k in plan.kernels] == [False, False]


@pytest.mark.parametrize("device", [H200, A100], ids=["sm_90", "sm_80"])
def test_a_decode_step_runs_the_recurrence_by_default(device):
    from q12drv.kernels.gdn import recurrent
    from q12drv.kernels.gdn.plan import DECODE_MAX_TOKENS, RECURRENT_MAX_TOKENS

    assert (RECURRENT_MAX_TOKENS, DECODE_MAX_TOKENS) == (8, 8)
    for n, tokens in ((64, 1), (256, 1), (64, 4), (64, 8)):  # decode, speculative decode: the decode build
        plan = plan_gdn(GdnConfig(), QWEN, n, tokens, device)
        assert _path(plan) == ("recurrent", "fused", "fp32", "decode", (recurrent.decode_entry(128),))
        assert plan.workspace_bytes == 0 and plan.config.math == "auto"
        assert plan.kernels[0].grid == (32 * 128 // 64, n, 1) and plan.kernels[0].block == (256, 1, 1)
    for tokens in (9, 64):  # the recurrence asked for, past the decode build's bound: its token-chunked build
        plan = plan_gdn(GdnConfig(math="recurrent"), QWEN, 64, tokens, device)
        assert _path(plan) == ("recurrent", "fused", "fp32", "", (recurrent.entry(128),))
    assert plan_gdn(GdnConfig(), QWEN, 64, 9, device).math == "chunked"  # past the bound: the chunked form
    # the recurrence asked for: its decode build up to the bound, the token-chunked one past it
    assert plan_gdn(GdnConfig(math="recurrent"), QWEN, 64, 4, device).build == "decode"
    long = plan_gdn(GdnConfig(math="recurrent"), QWEN, 64, 9, device)
    assert (long.build, long.kernels[0].entry) == ("", recurrent.entry(128))
    # a choice of schedule, isa or math is the chunked form's (or the asked math), whatever the length
    assert plan_gdn(GdnConfig(schedule="two_pass"), QWEN, 64, 1, device).math == "chunked"
    assert plan_gdn(GdnConfig(isa="mma"), QWEN, 64, 1, device).math == "chunked"
    assert plan_gdn(GdnConfig(math="chunked"), QWEN, 64, 1, device).math == "chunked"


def test_each_choice_resolves_the_other_autos():
    fused = plan_gdn(GdnConfig(schedule="fused"), QWEN, 8, 2048, H200)   # no wgmma fused kernel: mma
    assert _path(fused) == ("chunked", "fused", "mma", "", (chunked_mma.fused_entry(128),))
    assert fused.workspace_bytes == 0 and fused.kernels[0].grid == (2, 32, 8)
    mma = plan_gdn(GdnConfig(isa="mma"), QWEN, 1, 8192, H200)           # no mma overlapped kernel: two-pass
    assert (mma.schedule, mma.isa, mma.build) == ("two_pass", "mma", "2stage")
    rec = plan_gdn(GdnConfig(math="recurrent"), QWEN, 1, 8192, A100)
    assert _path(rec) == ("recurrent", "fused", "fp32", "", ("q12_gdn_recurrent_d128",))
    assert rec.numerics == "recurrent" and rec.workspace_bytes == 0
    # a forced schedule whatever the rules say: the overlapped one on a full device keeps one precompute CTA
    ov = plan_gdn(GdnConfig(schedule="overlapped"), QWEN, 8, 2048, H200)
    assert ov.schedule == "overlapped" and ov.kernels[0].grid == (1, 1, 1)
    assert ov.workspace_bytes == chunked_wgmma.overlapped_workspace_bytes(8, 2048, 16, 32, 128)
    two = plan_gdn(GdnConfig(schedule="two_pass"), QWEN, 1, 8192, H200)
    assert (two.schedule, two.isa) == ("two_pass", "wgmma")


def test_combinations_without_a_kernel_are_refused_naming_what_exists():
    exists = ("the paths with kernels: chunked fused on mma, chunked two_pass on mma, chunked two_pass on wgmma, "
              "chunked overlapped on wgmma, recurrent (schedule 'fused')")
    for config in (GdnConfig(schedule="overlapped", isa="mma"), GdnConfig(schedule="fused", isa="wgmma")):
        with pytest.raises(ValueError, match=r"has no kernel \(schedule .* on isa .*\); " + exists.replace("(", r"\(")
                           .replace(")", r"\)")):
            plan_gdn(config, QWEN, 1, 64, H200)
    for config in (GdnConfig(math="recurrent", schedule="two_pass"), GdnConfig(math="recurrent", isa="mma")):
        with pytest.raises(ValueError, match="math='recurrent' is one launch on fp32 CUDA cores"):
            plan_gdn(config, QWEN, 1, 64, H200)
    for config in (GdnConfig(isa="wgmma"), GdnConfig(schedule="overlapped")):
        with pytest.raises(ValueError, match=r"needs warpgroup MMA \(Hopper, sm_90\), this device is sm_80: use "
                                             r"isa='mma' \(the schedules 'fused' and 'two_pass'\)"):
            plan_gdn(config, QWEN, 1, 64, A100)
    for field, bad in (("math", "wy"), ("schedule", "flow"), ("isa", None), ("schedule", "pair")):
        with pytest.raises(ValueError, match=f"GdnConfig.{field} must be one of"):
            GdnConfig(**{field: bad})
    with pytest.raises(TypeError, match="config must be a GdnConfig"):
        plan_gdn("auto", QWEN, 1, 64, H200)
    with pytest.raises(TypeError, match="shape must be a GdnShape"):
        plan_gdn(GdnConfig(), (16, 32, 128), 1, 64, H200)
    with pytest.raises(ValueError, match="the GDN kernels have head_dim 64 and 128, not 96"):
        plan_gdn(GdnConfig(), GdnShape(16, 32, 96), 1, 64, H200)
    with pytest.raises(ValueError, match="shape.num_v_heads 24 must be a multiple of shape.num_k_heads 16"):
        plan_gdn(GdnConfig(), GdnShape(16, 24, 128), 1, 64, H200)
    with pytest.raises(ValueError, match=r"n_streams must be in \[1, "):
        plan_gdn(GdnConfig(), QWEN, 0, 64, H200)


def test_a_plan_launches_a_smaller_launch_with_its_own_kernels():
    """A plan covers launches of fewer streams and tokens with the same entries (a pass run stream by stream), their
    geometry and workspace that launch's; it refuses more, another shape, or a device without its instruction set;
    plans are immutable and made once per distinct input."""
    plan = plan_gdn(GdnConfig(), QWEN, 8, 2048, H200)
    assert plan is plan_gdn(GdnConfig(), GdnShape(16, 32, 128), 8, 2048, H200)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.schedule = "fused"
    zero, kernels = plan.launches(1, 100)
    assert [k.entry for k in kernels] == [k.entry for k in plan.kernels]   # the wide CTA for one stream too
    assert zero is None and kernels[0].grid == (2, 16, 1) and kernels[1].grid == (1, 32, 1)
    assert plan.workspace_bytes_for(1, 100) == chunked_mma.t_workspace_bytes(1, 100, 16, 32) < plan.workspace_bytes
    plan.check_covers(QWEN, 8, 2048, "sm_90a")
    for args, msg in (((QWEN, 9, 64, "sm_90"), r"covers 8 stream\(s\) of at most 2048 tokens, this launch has 9"),
                      ((QWEN, 1, 2049, "sm_90"), "up to 2049"), ((GdnShape(16, 32, 64), 1, 64, "sm_90"), "made for"),
                      ((QWEN, 1, 64, "sm_80"), "need warpgroup MMA")):
        with pytest.raises(ValueError, match=msg):
            plan.check_covers(*args)
    ov = plan_gdn(GdnConfig(), QWEN, 1, 8192, H200)
    zero, kernels = ov.launches(1, 64)   # the flags of the smaller launch's workspace layout
    assert zero == (chunked_wgmma.flags_offset(1, 64, 16, 32, 128), chunked_wgmma.flags_bytes(1, 64, 16))


def test_a_pass_plans_once_from_its_batch_and_runs_that_plan_per_stream(emu, monkeypatch):
    """A long stream beside short ones: alone, the long stream would take the overlapped schedule (a few CTAs, 8192
    tokens), the batch does not (its grid takes more than half of the SMs). The pass plans once from its whole
    batch, batched and per stream alike, and launches that plan's kernels for every stream: so both modes give
    the same bits on the GPU (tests/gpu/test_prefill_gpu.py checks them)."""
    monkeypatch.setattr(emu, "sm_count", 8)
    shape = GdnShape(1, 2, 64)
    counts = [8192, 64, 1]
    assert plan_gdn(GdnConfig(), shape, 1, 8192, emu).schedule == "overlapped"   # the long stream alone
    streams, _ = make_streams(emu, counts, block_size=64)
    rng = np.random.default_rng(3)
    t = sum(counts)
    host = {"gq": rng.integers(0, 1 << 14, (t, 1, 64), dtype=np.uint16),
            "gk": rng.integers(0, 1 << 14, (t, 1, 64), dtype=np.uint16),
            "gv": rng.integers(0, 1 << 14, (t, 2, 64), dtype=np.uint16),
            "g": (-rng.random((t, 2)) * 0.1).astype(np.float32), "beta": rng.random((t, 2)).astype(np.float32),
            "go": np.zeros((t, 2, 64), np.uint16), "st": np.zeros((3, 2, 64, 64), np.float32)}
    bufs = {k: emu.alloc(a.nbytes, k) for k, a in host.items()}
    outs, plans = {}, {}
    try:
        tensors = GdnTensors(*(int(bufs[k].ptr) for k in ("gq", "gk", "gv", "g", "beta", "go")))
        states = [int(bufs["st"].ptr) + b * host["st"][0].nbytes for b in range(3)]
        with ScratchArena(emu, make_scratch_plan(counts, 0, False, "exact").total_bytes + 4096) as arena:
            for mode in ("batched", "per_stream"):
                for k, a in host.items():
                    emu.upload(bufs[k].ptr, a)
                q12 = Q12Pass(arena, streams, block_size=64, use_mrope=False, dummy_kv_block=0, mode=mode,
                              policy="exact")
                plan = plans[mode] = q12.gdn_plan(shape)
                assert (plan.n_streams, plan.max_tokens) == (3, 8192)
                need = q12.gdn_workspace_bytes(shape)
                assert need == plan.workspace_bytes_for(*((3, 8192) if mode == "batched" else (1, 8192)))
                ws = emu.alloc(need, "gdn workspace")
                launched = []
                real = emu.driver.launch
                monkeypatch.setattr(emu.driver, "launch", lambda f, *a: (launched.append(f.name), real(f, *a))[1])
                q12.gdn_layer(states, tensors, shape, workspace=int(ws.ptr), workspace_bytes=need)
                emu.synchronize()
                monkeypatch.setattr(emu.driver, "launch", real)
                ws.free()
                assert launched == [k.entry for k in plan.kernels] * (1 if mode == "batched" else 3), mode
                outs[mode] = (emu.download(bufs["go"].ptr, host["go"].nbytes),
                              emu.download(bufs["st"].ptr, host["st"].nbytes))
    finally:
        for b in bufs.values():
            b.free()
    assert plans["batched"] == plans["per_stream"] and plans["batched"].schedule == "two_pass"
    assert outs["batched"] == outs["per_stream"]
