"""The short convolution on the GPU, against torch's depthwise ``conv1d`` per stream (fp32 over the same bf16
values): outputs, carried states, chunked == one shot, batched == per stream bit for bit, padded streams."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from q12drv import ScratchArena, stage_batched_attn_metadata  # noqa: E402
from q12drv.kernels import conv1d as conv  # noqa: E402
from tests.helpers import make_streams  # noqa: E402

pytestmark = pytest.mark.gpu

F = torch.nn.functional


def torch_reference(x, w, states, counts):
    """fp32 torch conv1d per stream over (state rows, new rows), SiLU; the new states."""
    outs, new_states, at = [], [], 0
    width = w.shape[1]
    for b, n in enumerate(counts):
        seq = torch.cat([states[b].float(), x[at:at + n].float()])  # [W - 1 + n, C]
        y = F.conv1d(seq.t().unsqueeze(0), w.float().unsqueeze(1), groups=w.shape[0])[0].t()  # [n, C]
        outs.append(F.silu(y))
        new_states.append(seq[-(width - 1):].to(torch.bfloat16))
        at += n
    return torch.cat(outs), new_states


def run(dev, counts, x, w, states, starts=None, stream=None):
    """q12drv's kernel over one pass of ``counts`` tokens; ``states`` (bf16 [W - 1, C] each) updated in place."""
    streams, keep = make_streams(dev, counts, starts)
    y = torch.empty_like(x)
    ptrs = torch.tensor([s.data_ptr() for s in states], dtype=torch.int64, device="cuda")
    with ScratchArena(dev, 1 << 20) as arena:
        meta = stage_batched_attn_metadata(arena, streams, block_size=16, use_mrope=False, scratch_offset_bytes=0,
                                           dummy_kv_block=0, stream=torch.cuda.current_stream().cuda_stream)
        conv.conv1d(dev, meta, ptrs.data_ptr(), x.data_ptr(), y.data_ptr(), w.data_ptr(), channels=x.shape[1],
                    width=w.shape[1], stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
    return y


@pytest.mark.parametrize("width", conv.WIDTHS)
def test_against_torch_conv1d(gpu, width):
    g = torch.Generator(device="cuda").manual_seed(width)
    counts = [1, 2, 3, 17, 31, 32, 33, 63, 64, 65, 700, 2048]  # segment and ring edges
    c = 8192 + 64  # Qwen3-Next's 2*16*128 + 32*128, plus a partial CTA of channel groups
    x = torch.randn(sum(counts), c, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.5 * torch.randn(c, width, device="cuda", generator=g)).to(torch.bfloat16)
    states = [torch.randn(width - 1, c, device="cuda", generator=g).to(torch.bfloat16) for _ in counts]
    want_y, want_states = torch_reference(x, w, [s.clone() for s in states], counts)
    y = run(gpu, counts, x, w, states)
    err = (y.float() - want_y).abs() / (want_y.abs() + 1e-2)
    assert err.max().item() < 8e-3  # one bf16 rounding of the fp32 result
    for b in range(len(counts)):
        assert torch.equal(states[b], want_states[b]), b


def test_chunked_equals_one_shot_and_batched_equals_alone(gpu):
    g = torch.Generator(device="cuda").manual_seed(7)
    c, width = 4096, 4
    x = torch.randn(3000, c, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(c, width, device="cuda", generator=g).to(torch.bfloat16)
    zero = torch.zeros(width - 1, c, device="cuda", dtype=torch.bfloat16)
    one_state = [zero.clone()]
    y_once = run(gpu, [3000], x, w, one_state)
    chunked_state, ys, at = [zero.clone()], [], 0
    for n in (1000, 1, 2, 1997):
        ys.append(run(gpu, [n], x[at:at + n].contiguous(), w, chunked_state, starts=[at]))
        at += n
    assert torch.equal(torch.cat(ys), y_once) and torch.equal(chunked_state[0], one_state[0])
    # three streams batched against each alone
    counts = [1000, 3, 1997]
    states = [torch.randn(width - 1, c, device="cuda", generator=g).to(torch.bfloat16) for _ in counts]
    alone_states = [s.clone() for s in states]
    y_b = run(gpu, counts, x, w, states)
    at = 0
    for b, n in enumerate(counts):
        y_a = run(gpu, [n], x[at:at + n].contiguous(), w, alone_states[b:b + 1])
        assert torch.equal(y_a, y_b[at:at + n]) and torch.equal(alone_states[b], states[b]), b
        at += n
