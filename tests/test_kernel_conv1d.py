"""The short convolution (q12drv.kernels.conv1d) on the emulated driver: against a float64 loop, states carried
across chunks, batched == per stream, bad input refused before anything is enqueued; the source compiles."""

from __future__ import annotations

import numpy as np
import pytest

from q12drv import ScratchArena, stage_batched_attn_metadata
from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits
from q12drv.kernels import conv1d as conv
from tests.helpers import make_streams, spill_free


def _bf16(rng, *shape, scale=1.0):
    return to_bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale)


class ConvCase:
    """A staged pass, its inputs in emulated device memory, and the states behind a pointer table."""

    def __init__(self, dev, counts, channels, width, *, starts=None, x_stride=None, y_stride=None, seed=0):
        rng = np.random.default_rng(seed)
        self.dev, self.counts, self.c, self.width = dev, counts, channels, width
        self.sx, self.sy = x_stride or channels, y_stride or channels
        t = sum(counts)
        self.streams, self._tables = make_streams(dev, counts, starts)
        self.arena = ScratchArena(dev, 1 << 16)
        self.meta = stage_batched_attn_metadata(self.arena, self.streams, block_size=16, use_mrope=False,
                                                scratch_offset_bytes=0, dummy_kv_block=0)
        self.x_host = _bf16(rng, t, self.sx)
        self.w_host = _bf16(rng, channels, width, scale=0.5)
        self.bias_host = _bf16(rng, channels, scale=0.1)
        self.states_host = [_bf16(rng, width - 1, channels) for _ in counts]
        self.x = dev.alloc(max(1, t * self.sx * 2))
        self.y = dev.alloc(max(1, t * self.sy * 2))
        self.w = dev.alloc(channels * width * 2)
        self.bias = dev.alloc(channels * 2)
        self.states = [dev.alloc((width - 1) * channels * 2) for _ in counts]
        self.ptrs = dev.alloc(8 * len(counts))
        dev.upload(self.x.ptr, self.x_host)
        dev.upload(self.w.ptr, self.w_host)
        dev.upload(self.bias.ptr, self.bias_host)
        for buf, s in zip(self.states, self.states_host):
            dev.upload(buf.ptr, s)
        dev.upload(self.ptrs.ptr, np.array([int(b.ptr) for b in self.states], np.uint64))
        dev.memset(self.y.ptr, 0xFF, t * self.sy * 2)

    def run(self, **kw):
        conv.conv1d(self.dev, self.meta, self.ptrs.ptr, self.x.ptr, self.y.ptr, self.w.ptr, channels=self.c,
                    width=self.width, bias=self.bias.ptr, x_stride=self.sx, y_stride=self.sy, **kw)
        t = sum(self.counts)
        y = self.dev.download_array(self.y.ptr, np.uint16, (t, self.sy))[:, :self.c]
        states = [self.dev.download_array(b.ptr, np.uint16, (self.width - 1, self.c)) for b in self.states]
        return y, states

    def expected(self, silu=True):
        x = from_bf16_bits(self.x_host[:, :self.c])
        cu = np.concatenate([[0], np.cumsum(self.counts)])
        return conv.reference(x, from_bf16_bits(self.w_host), [from_bf16_bits(s) for s in self.states_host], cu,
                              bias=from_bf16_bits(self.bias_host), silu=silu)

    def close(self):
        self.arena.close()


@pytest.mark.parametrize("width", conv.WIDTHS)
def test_matches_float64_and_moves_each_state_on(emu, width):
    case = ConvCase(emu, [37, 1, 70, 2], 48, width)
    y, states = case.run()
    want_y, want_states = case.expected()
    got = from_bf16_bits(y)
    assert np.max(np.abs(got - want_y) / (np.abs(want_y) + 1e-2)) < 1e-2  # one bf16 rounding
    for b in range(4):  # the state is the last W - 1 inputs: exact copies
        assert np.array_equal(from_bf16_bits(states[b]), want_states[b].astype(np.float32)), b
    case.close()


def test_identity_activation(emu):
    case = ConvCase(emu, [5, 9], 16, 4)
    y, _ = case.run(silu=False)
    want, _ = case.expected(silu=False)
    assert np.allclose(from_bf16_bits(y), want, rtol=1e-2, atol=1e-2)
    case.close()


def test_strided_rows_read_and_write_only_their_channels(emu):
    # x is the [q | k | v] slice of a wider projection (rows 64 apart), y keeps 8 spare elements a row
    case = ConvCase(emu, [20, 3], 40, 4, x_stride=64, y_stride=48)
    y_full_before = emu.download_array(case.y.ptr, np.uint16, (23, 48))
    y, _ = case.run()
    want, _ = case.expected()
    assert np.allclose(from_bf16_bits(y), want, rtol=1e-2, atol=1e-2)
    after = emu.download_array(case.y.ptr, np.uint16, (23, 48))
    assert np.array_equal(after[:, 40:], y_full_before[:, 40:])  # the spare columns untouched
    case.close()


def test_a_prompt_in_chunks_equals_the_prompt_at_once(emu):
    # 70 tokens at once, then the same 70 in chunks of 30, 1 and 39: the same outputs and final state
    rng = np.random.default_rng(3)
    c, width = 32, 4
    x = _bf16(rng, 70, c)
    w = _bf16(rng, c, width, scale=0.5)
    s0 = np.zeros((width - 1, c), np.uint16)

    def run(pieces):
        state = emu.alloc((width - 1) * c * 2)
        emu.upload(state.ptr, s0)
        ptrs = emu.alloc(8)
        emu.upload(ptrs.ptr, np.array([int(state.ptr)], np.uint64))
        wbuf = emu.alloc(c * width * 2)
        emu.upload(wbuf.ptr, w)
        outs, at = [], 0
        for n in pieces:
            streams, _keep = make_streams(emu, [n], [at])
            with ScratchArena(emu, 4096) as arena:
                meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False,
                                                   scratch_offset_bytes=0, dummy_kv_block=0)
                xb, yb = emu.alloc(n * c * 2), emu.alloc(n * c * 2)
                emu.upload(xb.ptr, x[at:at + n])
                conv.conv1d(emu, meta, ptrs.ptr, xb.ptr, yb.ptr, wbuf.ptr, channels=c, width=width)
                outs.append(emu.download_array(yb.ptr, np.uint16, (n, c)))
            at += n
        return np.concatenate(outs), emu.download_array(state.ptr, np.uint16, (width - 1, c))

    y1, s1 = run([70])
    y2, s2 = run([30, 1, 39])
    assert np.array_equal(y1, y2) and np.array_equal(s1, s2)
    assert np.array_equal(s1, x[-3:])


def test_batched_equals_each_stream_alone(emu):
    counts = [33, 2, 64, 1]
    batched = ConvCase(emu, counts, 24, 4, seed=5)
    y_b, st_b = batched.run()
    at = 0
    for b, n in enumerate(counts):
        alone = ConvCase(emu, [n], 24, 4, seed=99)
        alone.x_host = batched.x_host[at:at + n]
        emu.upload(alone.x.ptr, alone.x_host)
        emu.upload(alone.w.ptr, batched.w_host)
        emu.upload(alone.bias.ptr, batched.bias_host)
        emu.upload(alone.states[0].ptr, batched.states_host[b])
        y_a, st_a = alone.run()
        assert np.array_equal(y_a, y_b[at:at + n]) and np.array_equal(st_a[0], st_b[b]), b
        alone.close()
        at += n
    batched.close()


def test_bad_input_is_refused_before_anything_runs(emu):
    case = ConvCase(emu, [4, 4], 16, 4)
    before = emu.download_array(case.y.ptr, np.uint16, (8, 16))
    common = dict(channels=16, width=4)
    cases = [
        (dict(common, channels=12), ValueError, "channels must be a multiple of 8"),
        (dict(common, width=5), ValueError, "widths \\(2, 3, 4\\), not 5"),
        (dict(common, x_stride=12), ValueError, "x_stride must be >= channels \\(16\\) and a multiple of 8"),
        (dict(common, silu=1), TypeError, "silu must be a bool"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            conv.conv1d(emu, case.meta, case.ptrs.ptr, case.x.ptr, case.y.ptr, case.w.ptr, **kw)
    with pytest.raises(ValueError, match="x must be 16-byte aligned"):
        conv.conv1d(emu, case.meta, case.ptrs.ptr, case.x.ptr + 2, case.y.ptr, case.w.ptr, **common)
    with pytest.raises(ValueError, match="w must be 16-byte aligned"):  # the taps are read as 16-byte vectors
        conv.conv1d(emu, case.meta, case.ptrs.ptr, case.x.ptr, case.y.ptr, case.w.ptr + 2, **common)
    with pytest.raises(ValueError, match="overlap"):  # in place would feed outputs to later tokens
        conv.conv1d(emu, case.meta, case.ptrs.ptr, case.x.ptr, case.x.ptr, case.w.ptr, **common)
    with pytest.raises(ValueError, match="state_ptrs must be 8-byte aligned"):
        conv.conv1d(emu, case.meta, case.ptrs.ptr + 4, case.x.ptr, case.y.ptr, case.w.ptr, **common)
    assert np.array_equal(emu.download_array(case.y.ptr, np.uint16, (8, 16)), before)
    case.close()


def test_geometry():
    assert conv.geometry(8, 2048, 8192) == ((8, 2048 // conv.SEGMENT, 8), (128, 1, 1), 0)
    assert conv.geometry(3, 1, 8) == ((1, 1, 3), (128, 1, 1), 0)


def test_compiles_without_spills(kernel_build):
    img = kernel_build(conv.SOURCE)
    spill_free(img, conv.ENTRIES)
