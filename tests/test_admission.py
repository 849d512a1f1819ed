"""Admission: upstream's rules in order, with upstream's regression cases."""

import pytest

from q12drv.core.admission import RULES, check_kernel_batched_eligible
from q12drv.core.layout import q12_batched_scratch_bytes

BIG = 1 << 40


def admit(streams, *, n=None, arena=16388, mla=False, hd=256, scratch=BIG, k=8, mrope=False, zero=False,
          varlen=False, policy="seed"):
    return check_kernel_batched_eligible(streams, len(streams) if n is None else n, arena, mla, hd, scratch, k,
                                         mrope, zero, varlen, policy)


def uniform(n, L, start=4096, last=False):
    return [(L, L, start, last)] * n


def test_rejects_under_two_streams():
    for n in (0, 1):
        d = admit(uniform(n, 16))
        assert not d and d.rule == "too_few_streams"


def test_accepts_uniform():
    assert admit(uniform(2, 4096), arena=8192)
    assert admit(uniform(4, 2048))


@pytest.mark.parametrize("field,streams,rule", [
    ("chunk_len", [(16, 16, 4096, False), (32, 32, 4096, False)], "chunk_len_mismatch"),
    ("chunk_start", [(16, 16, 12288, False), (16, 16, 4096, False)], "chunk_start_mismatch"),
    ("is_last", [(16, 16, 4096, False), (16, 16, 4096, True)], "is_last_mismatch"),
])
def test_rejects_mismatch(field, streams, rule):
    d = admit(streams)
    assert not d and d.rule == rule, d


def test_varlen_admits_ragged_but_not_mixed_start():
    ragged = [(L, L, 0, False) for L in (1193, 900, 1400, 507)]
    assert not admit(ragged, zero=True)
    assert admit(ragged, zero=True, varlen=True)
    mixed = ragged[:3] + [(507, 507, 16, False)]
    assert admit(mixed, zero=True, varlen=True).rule == "chunk_start_mismatch"


def test_chunk_zero_needs_the_flag():
    assert admit(uniform(6, 1193, start=0), arena=8196).rule == "chunk_zero"
    assert admit(uniform(6, 1193, start=0), arena=8196, zero=True)
    assert admit(uniform(6, 25, start=1168), arena=8196)


def test_rejects_arena_overflow():
    assert admit(uniform(2, 4096), arena=4100).rule == "arena"
    assert admit(uniform(2, 8192), arena=8200).rule == "arena"


def test_effective_charge():
    warm = [(1193, 424, 4096, False), (1193, 400, 4096, False)]
    assert admit(warm, arena=1000)
    assert admit([(2000, 2000, 4096, False)] * 8, arena=8192).rule == "arena"
    zero = [(1193, 424, 4096, False), (1193, 0, 4096, False)]
    assert admit(zero).rule == "zero_length_stream"


def test_rejects_mla_and_large_head_dim():
    assert admit(uniform(2, 16), mla=True).rule == "mla"
    assert admit(uniform(2, 16), hd=512).rule == "head_dim"
    assert admit(uniform(2, 16), hd=256)


def test_scratch_footprint_regression_110():
    s = uniform(4, 935)
    refused = admit(s, scratch=348_840, mrope=True)
    assert not refused and refused.rule == "scratch" and "374,392" in refused.reason
    # at the SSOT size the seed stride cannot hold 935 MRoPE tokens of per-stream metadata (B9)
    b9 = admit(s, scratch=374_392, mrope=True)
    assert not b9 and b9.rule == "stream_block"
    assert admit(s, scratch=389_304, mrope=True, policy="exact")
    assert admit(s, scratch=389_303, mrope=True, policy="exact").rule == "scratch"
    # without MRoPE the seed size is exactly enough
    need = q12_batched_scratch_bytes(4, 935, 8, False)
    assert admit(s, scratch=need)
    assert admit(s, scratch=need - 1).rule == "scratch"


def test_varlen_packed_footprint_fits():
    ragged = [(L, L, 4096, False) for L in (2051, 2953, 3863, 4782)]
    scratch = q12_batched_scratch_bytes(8, -(-16388 // 8), 8, False)
    d = admit(ragged, arena=16388, scratch=scratch, varlen=True)
    assert d and d.plan.total_tokens == 13_649


def test_rule_order_is_upstreams():
    # a batch breaking every rule reports the first one
    streams = [(16, 16, 0, False), (32, 0, 8, True)]
    assert admit(streams[:1]).rule == RULES[0]
    assert admit([streams[0], (16, 0, 0, False)]).rule == "zero_length_stream"
    assert admit(streams, mla=True, hd=512).rule == "mla"
    assert admit(streams, hd=512).rule == "head_dim"
    assert admit(streams).rule == "chunk_start_mismatch"


def test_malformed_arguments_raise():
    with pytest.raises(ValueError):
        admit(uniform(2, 16), n=3)
    with pytest.raises(TypeError):
        admit([(16, 16, 0)] * 2)
    with pytest.raises(ValueError):
        admit([(16, 17, 0, False)] * 2)
    with pytest.raises(ValueError):
        admit(uniform(2, 16), policy="loose")


# --- the exact policy: decode steps and mixed batches; the kernel set --------------------------------

def test_exact_policy_admits_a_decode_step_and_a_mixed_batch():
    decode = [(1, 1, start, False) for start in (8191, 311, 40000, 7)]   # every stream one token past its cache
    mixed = [(2048, 2048, 4096, False), (1, 1, 311, True), (1, 1, 9000, False), (300, 300, 0, True)]
    for batch in (decode, mixed):
        assert admit(batch, policy="exact", varlen=True, zero=True)
        refused = admit(batch, policy="seed", varlen=True, zero=True)  # upstream's rule stays the seed policy's
        assert not refused and refused.rule in ("chunk_start_mismatch", "is_last_mismatch")
        assert "policy 'exact' admits" in refused.reason or refused.rule == "is_last_mismatch"


def test_chunk_zero_names_the_first_stream_at_zero():
    d = admit([(8, 8, 100, False), (8, 8, 0, False)], policy="exact", varlen=True, zero=False)
    assert not d and d.rule == "chunk_zero" and "stream 1" in d.reason
    assert admit([(8, 8, 100, False), (8, 8, 200, False)], policy="exact", varlen=True, zero=False)


def test_a_head_dim_without_a_kernel_is_refused_naming_the_kernels():
    batch = uniform(2, 16)
    d = check_kernel_batched_eligible(batch, 2, 16388, False, 96, BIG, 8, False, False, False,
                                      head_dims=frozenset({64, 128, 256}))
    assert not d and d.rule == "head_dim" and "96 has no attention kernel" in d.reason and "64, 128, 256" in d.reason
    assert check_kernel_batched_eligible(batch, 2, 16388, False, 128, BIG, 8, False, False, False,
                                         head_dims=frozenset({64, 128, 256}))


def test_a_pass_checks_the_devices_kernel_set(emu):
    from q12drv import ScratchArena
    from q12drv.prefill import Q12Pass
    from tests.helpers import make_streams

    streams, _keep = make_streams(emu, [20, 30], [0, 64])
    with ScratchArena(emu, 1 << 18) as arena:
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=96)
        assert not q12.batched and "96 has no attention kernel" in q12.reason
        q12 = Q12Pass(arena, streams, block_size=16, use_mrope=False, dummy_kv_block=0, head_dim=128)
        assert q12.batched  # streams at different starts: one batch under the pass's default policy
