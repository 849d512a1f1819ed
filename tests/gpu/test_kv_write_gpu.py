"""GPU test of ``q12_kv_write`` on the real device (H200): raw cuda.bindings launches.

torch is used only to allocate device memory and copy bytes; the kernel is compiled with
q12drv's NVRTC path and launched with ``cuLaunchKernel``. Self-contained on purpose.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from q12drv.kernels import kv_write as kw  # noqa: E402
from q12drv.kernels.meta import Q12MetaC  # noqa: E402

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.gpu.raw_harness import GUARD, POISON, Buf, Kernel  # noqa: E402
from tests.helpers import paged_streams  # noqa: E402


# ----------------------------------------------------------------------------- metadata
def make_meta(keep, slots_list, positions_list, tables, starts):
    lens = [len(s) for s in slots_list]
    cu = np.zeros(len(lens) + 1, np.int32)
    cu[1:] = np.cumsum(lens)
    slots = Buf(np.concatenate(slots_list).astype(np.int64))
    pos = Buf(np.concatenate(positions_list).astype(np.uint32))
    bts = [Buf(t) for t in tables]
    bt_ptrs = Buf(np.array([b.ptr for b in bts], np.uint64))
    kv_lens_np = np.array([s + n for s, n in zip(starts, lens)], np.int32)
    seqs = [Buf(np.array([x], np.uint32)) for x in kv_lens_np]
    seq_ptrs = Buf(np.array([b.ptr for b in seqs], np.uint64))
    cu_b = Buf(cu)
    kv_b = Buf(kv_lens_np)
    keep.extend([slots, pos, bt_ptrs, seq_ptrs, cu_b, kv_b, *bts, *seqs])
    return Q12MetaC(
        positions=pos.ptr,
        positions_h=pos.ptr,
        positions_w=pos.ptr,
        slots=slots.ptr,
        block_table_ptrs=bt_ptrs.ptr,
        seq_len_ptrs=seq_ptrs.ptr,
        cu_seqlens=cu_b.ptr,
        kv_lens=kv_b.ptr,
        batch_size=len(lens),
        chunk_len=max(lens),
        total_tokens=int(cu[-1]),
        max_blocks_per_seq=max(len(t) for t in tables),
    )


def rand_bf16(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32) * 4
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def run_kv_write(meta, k_ptr, v_ptr, kp_ptr, vp_ptr, row, num_slots, grid=None, block=None):
    g, b, smem = kw.geometry(int(meta.total_tokens), row)
    Kernel(kw.SOURCE, "q12_kv_write").launch(
        grid or g,
        block or b,
        smem,
        [
            meta,
            ctypes.c_uint64(k_ptr),
            ctypes.c_uint64(v_ptr),
            ctypes.c_uint64(kp_ptr),
            ctypes.c_uint64(vp_ptr),
            ctypes.c_int32(row),
            ctypes.c_int64(num_slots),
        ],
    )


LENS = [1, 15, 16, 17, 63, 64, 65, 1500]


def _case(rng, block_size, hkv, d, lens=LENS):
    starts = [int(x) for x in rng.integers(0, 3 * block_size, len(lens))]
    starts[0] = 0
    num_blocks = sum(-(-(s + n) // block_size) for s, n in zip(starts, lens)) + 7
    tables, positions, slots = paged_streams(rng, lens, starts, block_size, num_blocks)
    return starts, num_blocks, tables, positions, slots


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("hkv,d", [(2, 256), (8, 128), (1, 64), (4, 64)])
def test_kv_write_matches_reference(block_size, hkv, d):
    rng = np.random.default_rng()
    starts, num_blocks, tables, positions, slots = _case(rng, block_size, hkv, d)
    num_slots = num_blocks * block_size
    # Padding (< 0) and out-of-range slots must be skipped.
    slots[3][5] = -1
    slots[7][0] = -12345
    slots[4][2] = num_slots  # first slot past the pool
    slots[7][9] = num_slots + 10**9  # far past it
    T = sum(LENS)
    k = rand_bf16(rng, (T, hkv, d))
    v = rand_bf16(rng, (T, hkv, d))
    keep = []
    meta = make_meta(keep, slots, positions, tables, starts)
    kb, vb = Buf(k), Buf(v)
    shape = (num_blocks, block_size, hkv, d)
    kp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON)
    vp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON)
    run_kv_write(meta, kb.ptr, vb.ptr, kp.ptr, vp.ptr, hkv * d, num_slots)
    ref_k, ref_v = kw.reference(
        k, v, np.concatenate(slots), np.full(shape, POISON, np.uint16), np.full(shape, POISON, np.uint16)
    )
    np.testing.assert_array_equal(kp.read(np.uint16, shape), ref_k)
    np.testing.assert_array_equal(vp.read(np.uint16, shape), ref_v)
    np.testing.assert_array_equal(kb.read(np.uint16, k.shape), k)  # inputs untouched
    np.testing.assert_array_equal(vb.read(np.uint16, v.shape), v)
    for b in (kp, vp, kb, vb):
        b.check_guards()
    # The written rows are exactly the valid tokens.
    written = (kp.read(np.uint16, (num_slots, hkv * d)) != POISON).any(axis=1).sum()
    assert written == T - 4


@pytest.mark.parametrize("block_size", [16, 64])
def test_kv_write_batched_equals_per_stream(block_size):
    rng = np.random.default_rng()
    hkv, d = 2, 256
    starts, num_blocks, tables, positions, slots = _case(rng, block_size, hkv, d)
    slots[2][7] = -1
    T = sum(LENS)
    k = rand_bf16(rng, (T, hkv, d))
    v = rand_bf16(rng, (T, hkv, d))
    shape = (num_blocks, block_size, hkv, d)
    nbytes = int(np.prod(shape)) * 2
    keep = []
    kb, vb = Buf(k), Buf(v)
    kp_b, vp_b = Buf(nbytes=nbytes, fill=POISON), Buf(nbytes=nbytes, fill=POISON)
    meta = make_meta(keep, slots, positions, tables, starts)
    run_kv_write(meta, kb.ptr, vb.ptr, kp_b.ptr, vp_b.ptr, hkv * d, num_blocks * block_size)

    kp_1, vp_1 = Buf(nbytes=nbytes, fill=POISON), Buf(nbytes=nbytes, fill=POISON)
    cu = np.concatenate([[0], np.cumsum(LENS)])
    row_bytes = hkv * d * 2
    for b in range(len(LENS)):
        m1 = make_meta(keep, [slots[b]], [positions[b]], [tables[b]], [starts[b]])
        run_kv_write(
            m1, kb.ptr + int(cu[b]) * row_bytes, vb.ptr + int(cu[b]) * row_bytes, kp_1.ptr, vp_1.ptr, hkv * d,
            num_blocks * block_size,
        )  # fmt: skip
    np.testing.assert_array_equal(kp_b.read(np.uint16, shape), kp_1.read(np.uint16, shape))
    np.testing.assert_array_equal(vp_b.read(np.uint16, shape), vp_1.read(np.uint16, shape))
    for buf in (kp_b, vp_b, kp_1, vp_1):
        buf.check_guards()


def test_kv_write_any_grid_same_result():
    rng = np.random.default_rng()
    hkv, d, bs = 4, 128, 16
    starts, num_blocks, tables, positions, slots = _case(rng, bs, hkv, d)
    T = sum(LENS)
    k, v = rand_bf16(rng, (T, hkv, d)), rand_bf16(rng, (T, hkv, d))
    shape = (num_blocks, bs, hkv, d)
    keep = []
    meta = make_meta(keep, slots, positions, tables, starts)
    kb, vb = Buf(k), Buf(v)
    results = []
    for grid, block in (((1, 1, 1), (32, 1, 1)), ((3, 1, 1), (128, 1, 1)), (None, None), ((5000, 1, 1), (1024, 1, 1))):
        kp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON)
        vp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON)
        run_kv_write(meta, kb.ptr, vb.ptr, kp.ptr, vp.ptr, hkv * d, num_blocks * bs, grid=grid, block=block)
        kp.check_guards()
        vp.check_guards()
        results.append((kp.read(np.uint16, shape), vp.read(np.uint16, shape)))
    for r in results[1:]:
        np.testing.assert_array_equal(r[0], results[0][0])
        np.testing.assert_array_equal(r[1], results[0][1])


@pytest.mark.parametrize("hkv,d,offset", [(1, 12, 0), (3, 10, 0), (2, 64, 2)])
def test_kv_write_scalar_fallback(hkv, d, offset):
    # row_elems % 8 != 0, or a pool that is not 16-byte aligned: the 2-byte path.
    rng = np.random.default_rng()
    bs = 16
    lens = [1, 17, 65, 300]
    starts, num_blocks, tables, positions, slots = _case(rng, bs, hkv, d, lens)
    slots[1][0] = -1
    T = sum(lens)
    k, v = rand_bf16(rng, (T, hkv, d)), rand_bf16(rng, (T, hkv, d))
    shape = (num_blocks, bs, hkv, d)
    keep = []
    meta = make_meta(keep, slots, positions, tables, starts)
    kb, vb = Buf(k), Buf(v)
    kp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON, offset=offset)
    vp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON, offset=offset)
    run_kv_write(meta, kb.ptr, vb.ptr, kp.ptr, vp.ptr, hkv * d, num_blocks * bs)
    pk = np.full(shape, POISON, np.uint16)
    ref_k, ref_v = kw.reference(k, v, np.concatenate(slots), pk, pk)
    np.testing.assert_array_equal(kp.read(np.uint16, shape), ref_k)
    np.testing.assert_array_equal(vp.read(np.uint16, shape), ref_v)
    kp.check_guards()
    vp.check_guards()


def test_kv_write_int64_offsets():
    # A pool whose element offsets pass 2^31 (about 4.3 GB per pool): tokens land at the end.
    hkv, d, bs = 2, 256, 64
    row = hkv * d
    num_slots = ((2**31) // row + 3 * bs) // bs * bs
    free = torch.cuda.mem_get_info()[0]
    if free < 3 * num_slots * row * 2:
        pytest.skip("not enough device memory")
    rng = np.random.default_rng()
    T = 100
    slots = np.sort(rng.choice(np.arange(num_slots - 3 * bs, num_slots), T, replace=False)).astype(np.int64)
    slots[-1] = num_slots - 1  # the very last slot
    slots[0] = 5
    keep = []
    positions = [np.arange(T, dtype=np.int64)]
    tables = [np.arange(2, dtype=np.int32)]
    meta = make_meta(keep, [slots], positions, tables, [0])
    k, v = rand_bf16(rng, (T, hkv, d)), rand_bf16(rng, (T, hkv, d))
    kb, vb = Buf(k), Buf(v)
    kp = Buf(nbytes=num_slots * row * 2, fill=POISON)
    vp = Buf(nbytes=num_slots * row * 2, fill=POISON)
    run_kv_write(meta, kb.ptr, vb.ptr, kp.ptr, vp.ptr, row, num_slots)
    lo = (num_slots - 3 * bs) * row * 2
    tail_k = kp.t[GUARD + lo : GUARD + num_slots * row * 2].cpu().numpy().view(np.uint16).reshape(-1, row)
    tail_v = vp.t[GUARD + lo : GUARD + num_slots * row * 2].cpu().numpy().view(np.uint16).reshape(-1, row)
    exp_k = np.full((3 * bs, row), POISON, np.uint16)
    exp_v = exp_k.copy()
    sel = slots >= num_slots - 3 * bs
    exp_k[slots[sel] - (num_slots - 3 * bs)] = k.reshape(T, row)[sel]
    exp_v[slots[sel] - (num_slots - 3 * bs)] = v.reshape(T, row)[sel]
    np.testing.assert_array_equal(tail_k, exp_k)
    np.testing.assert_array_equal(tail_v, exp_v)
    head = kp.t[GUARD + 5 * row * 2 : GUARD + 6 * row * 2].cpu().numpy().view(np.uint16)
    np.testing.assert_array_equal(head, k.reshape(T, row)[0])
    # Nothing written anywhere else: count rows that are not all poison.
    written = (kp.t[GUARD : GUARD + num_slots * row * 2].view(torch.int16) != -1).view(-1, row).any(dim=1).sum().item()
    assert written == T
    kp.check_guards()
    vp.check_guards()
    del kp, vp
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- edges of the tiled kernel
# Groups take 2 tokens (rows > 32 chunks of 16 B) or 4 (rows <= 32 chunks) per iteration, lanes 2
# or 1 chunk per token and trip: token counts that are not multiples of that, rows of exactly one
# chunk, rows whose size is a multiple of 16 B but not of 64 B, rows of more than 2 x 32 chunks
# (several trips), and T = 1.
@pytest.mark.parametrize(
    "hkv,d",
    [(1, 8), (1, 24), (3, 40), (5, 64), (1, 264), (8, 256), (2, 256)],
    ids=["16B", "48B", "240B", "640B", "528B-33chunks", "4KiB", "1KiB"],
)
@pytest.mark.parametrize("lens", [[1], [3], [5, 2, 7], [1, 1, 1, 1, 1, 1, 1]], ids=["T1", "T3", "T14", "7x1"])
def test_kv_write_edges(hkv, d, lens):
    rng = np.random.default_rng()
    bs = 16
    starts, num_blocks, tables, positions, slots = _case(rng, bs, hkv, d, lens)
    if len(lens) > 2:
        slots[-1][0] = -1
    T = sum(lens)
    k, v = rand_bf16(rng, (T, hkv, d)), rand_bf16(rng, (T, hkv, d))
    shape = (num_blocks, bs, hkv, d)
    keep = []
    meta = make_meta(keep, slots, positions, tables, starts)
    kb, vb = Buf(k), Buf(v)
    pk = np.full(shape, POISON, np.uint16)
    ref_k, ref_v = kw.reference(k, v, np.concatenate(slots), pk, pk)
    for grid, block in ((None, None), ((1, 1, 1), (32, 1, 1)), ((2, 1, 1), (64, 1, 1))):
        kp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON)
        vp = Buf(nbytes=int(np.prod(shape)) * 2, fill=POISON)
        run_kv_write(meta, kb.ptr, vb.ptr, kp.ptr, vp.ptr, hkv * d, num_blocks * bs, grid=grid, block=block)
        np.testing.assert_array_equal(kp.read(np.uint16, shape), ref_k)
        np.testing.assert_array_equal(vp.read(np.uint16, shape), ref_v)
        kp.check_guards()
        vp.check_guards()


# ----------------------------------------------------------------------------- FP8 pools
@pytest.mark.parametrize("mode", ["batched", "per_stream"])
def test_fp8_kv_write_equals_torch_float8(gpu, mode):
    """``q12_kv_write_fp8`` through a pass against torch's own float8_e4m3fn conversion of ``x * (1 / scale)`` (fp32,
    clamped to +-448 as cvt.rn.satfinite saturates), bit for bit, at every token's slot; one head's scale small
    enough that its values saturate."""
    from q12drv import AttentionShape, Q12Pass, ScratchArena
    from tests.helpers import make_streams

    hkv, d, bs = 2, 128, 16
    counts, starts = [300, 1, 77, 16], [0, 40, 1000, 5]
    streams, tables = make_streams(gpu, counts, starts, block_size=bs)
    nb = int(max(s.block_table.max() for s in streams)) + 1
    dev = f"cuda:{gpu.ordinal}"
    g = torch.Generator(device=dev).manual_seed(5)
    t = sum(counts)
    k = (torch.randn(t, hkv, d, device=dev, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(t, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    ks = torch.tensor([3 * 4 / 448, 1e-3], device=dev)  # head 1 saturates
    vs = torch.tensor([0.01, 0.5], device=dev)
    kp, vp = (torch.zeros(nb, bs, hkv, d, dtype=torch.uint8, device=dev) for _ in range(2))
    shape = AttentionShape(4, hkv, d, d, kv_dtype="fp8_e4m3")
    with ScratchArena(gpu, 1 << 20) as arena:
        q12 = Q12Pass(arena, streams, block_size=bs, use_mrope=False, dummy_kv_block=0, head_dim=d, mode=mode)
        q12.kv_write(k.data_ptr(), v.data_ptr(), kp.data_ptr(), vp.data_ptr(), shape, num_blocks=nb,
                     k_scale=ks.data_ptr(), v_scale=vs.data_ptr())
        torch.cuda.synchronize()
    slots = torch.tensor(np.concatenate([s.block_table[(s.proc_start + np.arange(s.proc_count)) // bs] * bs
                                         + (s.proc_start + np.arange(s.proc_count)) % bs for s in streams]),
                         device=dev)

    def want(x, scale):
        y = (x.float() * torch.reciprocal(scale)[None, :, None]).clamp(-448, 448)
        return y.to(torch.float8_e4m3fn).view(torch.uint8)

    assert torch.equal(kp.view(-1, hkv, d)[slots], want(k, ks))
    assert torch.equal(vp.view(-1, hkv, d)[slots], want(v, vs))
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert not kp.view(-1, hkv, d)[untouched].any() and not vp.view(-1, hkv, d)[untouched].any()  # only the slots
    tables.free()
