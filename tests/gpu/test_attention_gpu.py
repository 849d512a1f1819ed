"""GPU test of ``cuda_src/attention/mma.cu`` (mma.sync) and ``attention/wgmma.cu`` (wgmma, sm_90a) on a
real device (H200), self-contained: every case runs on every kernel that has its head dim.

torch is used only to allocate device memory and copy bytes (raw pointers); the kernel is
compiled with q12drv's NVRTC path and launched through ``cuda.bindings.driver``. Inputs are fresh
random every run (the seed is in every failure message); outputs are poisoned with 0xFFFF (a bf16
NaN) and guarded by poisoned elements on both sides.
"""

from __future__ import annotations

import ctypes
import secrets

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from q12drv.core.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402
from q12drv.kernels import attention as attn  # noqa: E402
from q12drv.kernels import attention_wgmma as attnw  # noqa: E402
from q12drv.kernels.meta import Q12MetaC  # noqa: E402
from q12drv.kernels.registry import compile_defines  # noqa: E402
from q12drv.core.nvrtc import compile_source  # noqa: E402
from tests.gpu.raw_harness import check  # noqa: E402
from tests.helpers import rel_err, rel_err_bf16, shuffled_tables  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GUARD = 256  # poisoned bf16 elements on each side of O


#: algo -> (kernel module, geometry(n, chunk_len, Hq, Hkv, D))
ALGOS = {
    "mma": (attn, lambda n, chunk, hq, hkv, d: attn.geometry(n, chunk, hq, d, num_kv_heads=hkv)),
    "wgmma": (attnw, lambda n, chunk, hq, hkv, d: attnw.geometry(n, chunk, hq, hkv, d)),
}


@pytest.fixture(scope="module")
def kernels():
    """``{(algo, D): (CUfunction, geometry)}`` for both attention kernels."""
    from cuda.bindings import driver as cu

    torch.zeros(1, device="cuda")  # makes torch's primary context current on this thread
    funcs, modules = {}, []
    for algo, (mod, geo) in ALGOS.items():
        module = check(cu.cuModuleLoadData(compile_source(mod.SOURCE, defines=compile_defines(mod.SOURCE)).image))
        modules.append(module)
        for d, name in mod.HEAD_DIMS.items():
            f = check(cu.cuModuleGetFunction(module, name.encode()))
            check(cu.cuFuncSetAttribute(
                f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, mod.smem_bytes(d)))
            # Let the SM split its L1/shared storage for as many co-resident CTAs as possible.
            check(cu.cuFuncSetAttribute(
                f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
            funcs[algo, d] = (f, geo)
    yield funcs
    for module in modules:
        check(cu.cuModuleUnload(module))


def _dev(arr: np.ndarray):
    """Upload a numpy array's bytes (any dtype) to a new device tensor."""
    a = np.ascontiguousarray(arr)
    view = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    return torch.from_numpy(a.view(view).copy()).cuda()


def _host_u16(t) -> np.ndarray:
    return t.cpu().numpy().view(np.uint16)


class Case:
    """Random Q and pools plus host metadata; shuffled physical blocks per stream."""

    def __init__(self, rng, q_lens, prefixes, *, hq, hkv, d, bs, std=1.0):
        self.q_lens = np.asarray(q_lens, np.int64)
        self.kv_lens = (self.q_lens + np.asarray(prefixes, np.int64)).astype(np.int32)
        self.cu = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
        self.hq, self.hkv, self.d, self.bs = hq, hkv, d, bs
        nblk = [-(-int(k) // bs) for k in self.kv_lens]
        num_blocks = sum(nblk) + 4
        self.tables = shuffled_tables(rng, nblk, num_blocks)
        t = int(self.cu[-1])
        self.q = to_bf16_bits(rng.standard_normal((t, hq, d), dtype=np.float32) * std)
        self.k_pool = to_bf16_bits(rng.standard_normal((num_blocks, bs, hkv, d), dtype=np.float32) * std)
        self.v_pool = to_bf16_bits(rng.standard_normal((num_blocks, bs, hkv, d), dtype=np.float32))
        self.dq = _dev(self.q)
        self.dk = _dev(self.k_pool)
        self.dv = _dev(self.v_pool)
        self.dtables = [_dev(tb) for tb in self.tables]

    def meta(self, streams, keep):
        """Q12MetaC for ``streams`` (indices), packed back to back; device arrays go in ``keep``."""
        q_lens = self.q_lens[streams]
        kv = self.kv_lens[streams]
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        t = int(cu[-1])
        pos = np.concatenate([np.arange(k - ql, k) for ql, k in zip(q_lens, kv)]).astype(np.uint32)
        slots = np.concatenate(
            [
                self.tables[s][p // self.bs].astype(np.int64) * self.bs + p % self.bs
                for s, p in zip(streams, [np.arange(k - ql, k) for ql, k in zip(q_lens, kv)])
            ]
        )
        ptrs = np.array([self.dtables[s].data_ptr() for s in streams], np.uint64)
        arrs = {
            "pos": _dev(pos),
            "slots": _dev(slots),
            "bt": _dev(ptrs),
            "seq": _dev(kv.astype(np.uint32)),
            "cu": _dev(cu),
            "kv": _dev(kv.astype(np.int32)),
        }
        keep.extend(arrs.values())
        return Q12MetaC(
            positions=arrs["pos"].data_ptr(),
            positions_h=arrs["pos"].data_ptr(),
            positions_w=arrs["pos"].data_ptr(),
            slots=arrs["slots"].data_ptr(),
            block_table_ptrs=arrs["bt"].data_ptr(),
            seq_len_ptrs=arrs["seq"].data_ptr(),
            cu_seqlens=arrs["cu"].data_ptr(),
            kv_lens=arrs["kv"].data_ptr(),
            batch_size=len(streams),
            chunk_len=int(q_lens.max()),
            total_tokens=t,
            max_blocks_per_seq=max(len(self.tables[s]) for s in streams),
        )

    def run(self, kernel, streams, scale, grid_extra=(0, 0, 0), window_left=attn.NO_WINDOW):
        """Launch ``kernel`` (``(CUfunction, geometry)``) over ``streams`` (``window_left``: the kernels' argument,
        ``NO_WINDOW`` for none); return their O rows (uint16 bits) after checking the guards."""
        from cuda.bindings import driver as cu

        keep = []
        meta = self.meta(streams, keep)
        rows = int(meta.total_tokens)
        n_el = rows * self.hq * self.d
        obuf = torch.full((n_el + 2 * GUARD,), -1, dtype=torch.int16, device="cuda")
        o_ptr = obuf.data_ptr() + GUARD * 2
        if len(streams) == 1:  # Q rows of that stream alone, where they sit in the packed Q
            q_ptr = self.dq.data_ptr() + int(self.cu[streams[0]]) * self.hq * self.d * 2
        else:
            assert list(streams) == list(range(len(self.q_lens)))
            q_ptr = self.dq.data_ptr()
        func, geometry = kernel
        grid, block, smem = geometry(len(streams), int(meta.chunk_len), self.hq, self.hkv, self.d)
        grid = tuple(g + e for g, e in zip(grid, grid_extra))
        params = [
            meta,
            ctypes.c_uint64(q_ptr),
            ctypes.c_uint64(self.dk.data_ptr()),
            ctypes.c_uint64(self.dv.data_ptr()),
            ctypes.c_uint64(o_ptr),
            ctypes.c_int(self.hq),
            ctypes.c_int(self.hkv),
            ctypes.c_int(self.bs),
            ctypes.c_float(scale),
            ctypes.c_int(window_left),
        ]
        argv = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        check(cu.cuLaunchKernel(func, *grid, *block, smem, stream, ctypes.addressof(argv), 0))
        torch.cuda.synchronize()
        out = _host_u16(obuf)
        assert (out[:GUARD] == 0xFFFF).all() and (out[-GUARD:] == 0xFFFF).all(), "guard elements overwritten"
        return out[GUARD:-GUARD].reshape(rows, self.hq, self.d)


CASES = [
    # (d, block_size, Hq, Hkv, q_lens, prefixes (cached keys before the chunk), scale or None)
    (128, 16, 8, 2, [1, 15, 16, 17, 63, 64, 65, 1100], [0] * 8, None),
    (128, 64, 4, 1, [1, 15, 16, 17, 63, 64, 65, 1031], [0, 77, 5, 16, 1, 200, 64, 900], None),
    (128, 32, 4, 4, [129, 1, 255, 256, 257], [3, 999, 0, 128, 31], 0.3),
    (128, 128, 2, 1, [200, 1], [300, 0], None),
    (64, 16, 4, 4, [1, 17, 65, 1000, 128, 129], [999, 2, 63, 0, 128, 1], None),
    (64, 64, 4, 2, [1, 15, 16, 17, 63, 64, 65, 1100], [5, 0, 49, 16, 1, 0, 64, 17], None),
    (256, 16, 4, 1, [1, 15, 16, 17, 63, 64, 65, 1100], [0, 3, 0, 40, 1, 64, 0, 100], None),
    (256, 64, 2, 2, [1, 129, 300, 64], [700, 0, 40, 64], None),
    # The D=128 and 256 entries pack the G = Hq / Hkv heads of a kv head into CTA rows (GQA); D=64
    # uses one head per CTA. Group sizes 1, 2, 8 at every head dim, ragged lengths around
    # the 16-row warp tile and the CTA tile (block_m / G tokens with packing), chunked rows
    # (kv_len > q_len) and interleaved block tables (all streams' blocks shuffled together).
    (256, 16, 16, 2, [1, 15, 16, 17, 63, 64, 65, 1031], [0] * 8, None),
    (256, 16, 16, 2, [1, 15, 16, 17, 63, 64, 65, 1100], [9, 0, 700, 16, 1, 64, 33, 900], None),
    (256, 16, 8, 4, [1, 15, 16, 17, 63, 64, 65, 1025], [0, 77, 5, 16, 200, 64, 0, 40], None),
    (256, 32, 3, 3, [1, 15, 16, 17, 63, 64, 65, 1001], [0, 1, 2, 3, 127, 128, 129, 0], None),
    (256, 16, 8, 1, [1, 15, 17, 129, 1040], [500, 0, 3, 16, 17], None),
    (128, 16, 16, 2, [1, 15, 16, 17, 63, 64, 65, 1031], [0, 77, 5, 16, 200, 64, 900, 0], None),
    (128, 16, 8, 8, [1, 15, 16, 17, 63, 64, 65, 1100], [3, 0, 16, 1, 0, 64, 17, 0], None),
    (64, 16, 16, 2, [1, 15, 16, 17, 63, 64, 65, 1031], [0, 77, 5, 16, 200, 64, 900, 0], None),
    (64, 32, 8, 8, [1, 15, 16, 17, 63, 64, 65, 1100], [0] * 8, None),
]


def _fresh_case(q_lens, prefixes, **dims) -> tuple:
    """``(seed, Case)``: fresh random inputs, the seed for the failure messages."""
    seed = secrets.randbits(32)
    return seed, Case(np.random.default_rng(seed), q_lens, prefixes, **dims)


def _with_algos(cases, d_of=lambda c: c[0]):
    """``(algo, case)`` for every case and every kernel that has its head dim."""
    return [(algo, c) for c in cases for algo, (mod, _) in ALGOS.items() if d_of(c) in mod.HEAD_DIMS]


ALGO_CASES = _with_algos(CASES)


@pytest.mark.parametrize("algo,case", ALGO_CASES,
                         ids=[f"{a}-d{c[0]}-bs{c[1]}-gqa{c[2] // c[3]}-{i}" for i, (a, c) in enumerate(ALGO_CASES)])
def test_attention_matches_reference(kernels, algo, case):
    d, bs, hq, hkv, q_lens, prefixes, scale = case
    kernel = kernels[algo, d]
    seed, c = _fresh_case(q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d**-0.5 if scale is None else scale
    n = len(q_lens)
    out = c.run(kernel, list(range(n)), scale)
    assert not (out == 0xFFFF).any(), f"seed {seed}: some O rows were not written"
    ref = attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, hq, hkv, bs, scale)
    assert rel_err_bf16(out, ref) < 1e-2, f"seed {seed}: rel err {rel_err_bf16(out, ref):.3e}"
    for b in range(n):  # per stream, so a short stream cannot hide behind a long one
        s = slice(c.cu[b], c.cu[b + 1])
        err = rel_err_bf16(out[s], ref[s])
        assert err < 1e-2, f"seed {seed}: stream {b} (q {q_lens[b]}, kv {c.kv_lens[b]}) rel err {err:.3e}"
    # Batched == each stream alone, bit for bit.
    for b in range(n):
        one = c.run(kernel, [b], scale)
        assert np.array_equal(one, out[c.cu[b] : c.cu[b + 1]]), f"seed {seed}: stream {b} batched != alone"
    # A grid larger than needed (extra m-tiles, heads, streams) changes nothing.
    again = c.run(kernel, list(range(n)), scale, grid_extra=(1, 1, 2))
    assert np.array_equal(again, out), f"seed {seed}: oversized grid changed the output"


LONG = _with_algos([(64, 4, 1), (128, 4, 1), (256, 4, 1), (256, 16, 2), (128, 8, 8)])


@pytest.mark.parametrize("algo,dims", LONG, ids=[f"{a}-d{d}-{hq}-{hkv}" for a, (d, hq, hkv) in LONG])
def test_attention_chunked_long(kernels, algo, dims):
    d, hq, hkv = dims
    kernel = kernels[algo, d]
    # Chunked prefill: 2048 new rows on 6144 cached keys (kv 8192), plus a decode-like row.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    c = Case(rng, [2048, 1], [6144, 4000], hq=hq, hkv=hkv, d=d, bs=64)
    scale = d**-0.5
    out = c.run(kernel, [0, 1], scale)
    assert not (out == 0xFFFF).any(), f"seed {seed}: some O rows were not written"
    ref = attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, hq, hkv, 64, scale)
    for b in range(2):
        s = slice(c.cu[b], c.cu[b + 1])
        err = rel_err_bf16(out[s], ref[s])
        assert err < 1e-2, f"seed {seed}: stream {b} rel err {err:.3e}"
    one = c.run(kernel, [1], scale)
    assert np.array_equal(one, out[c.cu[1] : c.cu[2]]), f"seed {seed}: batched != alone"


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("d", [128, 256])
def test_attention_large_logits(kernels, algo, d):
    kernel = kernels[algo, d]
    # Peaked softmax (logits of order 10-50): the online max rescaling must stay accurate.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    c = Case(rng, [300, 70], [500, 0], hq=2, hkv=1, d=d, bs=16, std=4.0)
    out = c.run(kernel, [0, 1], 128**-0.5)
    ref = attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, 2, 1, 16, 128**-0.5)
    assert not (out == 0xFFFF).any()
    assert rel_err_bf16(out, ref) < 1e-2, f"seed {seed}: rel err {rel_err_bf16(out, ref):.3e}"


@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 2), (256, 16, 2)])
def test_attention_wgmma_agrees_with_mma(kernels, d, hq, hkv):
    # The two kernels round differently (wgmma vs mma.sync sums) but compute the same thing.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    c = Case(rng, [1, 63, 130, 700], [0, 5, 300, 64], hq=hq, hkv=hkv, d=d, bs=16)
    a = c.run(kernels["mma", d], [0, 1, 2, 3], d**-0.5)
    b = c.run(kernels["wgmma", d], [0, 1, 2, 3], d**-0.5)
    ref = attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, hq, hkv, 16, d**-0.5)
    assert rel_err_bf16(b, a) < 1e-2, f"seed {seed}: wgmma vs mma rel {rel_err_bf16(b, a):.3e}"
    # within a small factor of the mma.sync kernel's own error against the fp32 reference
    assert rel_err_bf16(b, ref) < 2 * rel_err_bf16(a, ref) + 1e-3, f"seed {seed}"


# ---------------------------------------------------------------------------------------------
# sliding window: window_left = W, FlashAttention's window_size=(W, 0): the query at position p sees the keys
# p - W .. p (transformers' sliding_window is W + 1)


def torch_window_reference(c: Case, scale: float, window_left: int | None) -> np.ndarray:
    """fp32 torch SDPA per stream on K/V gathered through the block tables, with an explicit boolean mask
    ``p - window_left <= j <= p`` (``None``: ``j <= p``); GQA by repeating each kv head. Returns fp32 ``[T, Hq, D]``."""
    import torch.nn.functional as F

    g = c.hq // c.hkv
    kf = torch.from_numpy(c.k_pool.view(np.int16).astype(np.int32) << 16).cuda().view(torch.float32)
    vf = torch.from_numpy(c.v_pool.view(np.int16).astype(np.int32) << 16).cuda().view(torch.float32)
    qf = torch.from_numpy(c.q.view(np.int16).astype(np.int32) << 16).cuda().view(torch.float32)
    out = torch.zeros(qf.shape, dtype=torch.float32, device="cuda")
    for b in range(len(c.q_lens)):
        q_len, kv = int(c.q_lens[b]), int(c.kv_lens[b])
        pos = torch.arange(kv, device="cuda")
        table = torch.from_numpy(c.tables[b].astype(np.int64)).cuda()
        blk, off = table[pos // c.bs], pos % c.bs
        k = kf[blk, off].transpose(0, 1).repeat_interleave(g, dim=0)  # [Hq, kv, D]
        v = vf[blk, off].transpose(0, 1).repeat_interleave(g, dim=0)
        q = qf[int(c.cu[b]) : int(c.cu[b + 1])].transpose(0, 1)  # [Hq, q_len, D]
        p = kv - q_len + torch.arange(q_len, device="cuda")[:, None]  # each row's position
        mask = pos[None, :] <= p
        if window_left is not None:
            mask &= pos[None, :] >= p - window_left
        out[int(c.cu[b]) : int(c.cu[b + 1])] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out.cpu().numpy()



WINDOW_CASES = [
    # (d, block_size, Hq, Hkv, q_lens, prefixes, window_left): ragged streams, each with its own cached prefix;
    # windows 0 (the own key only), below, at and above a K/V tile (BN 32/64/128), and longer than a stream
    (64, 16, 4, 2, [1, 15, 16, 17, 63, 64, 65, 700], [0, 77, 5, 16, 1, 200, 64, 900], 0),
    (64, 64, 4, 4, [1, 17, 65, 300, 128, 129], [999, 2, 63, 0, 128, 1], 63),
    (64, 16, 8, 2, [1, 15, 200, 1000], [500, 0, 70, 3000], 300),
    (128, 16, 8, 2, [1, 15, 16, 17, 63, 64, 65, 700], [0, 77, 5, 16, 1, 200, 64, 900], 31),
    (128, 64, 16, 2, [1, 129, 300, 1000], [700, 0, 40, 2000], 127),
    (128, 16, 4, 1, [3, 200, 1100], [40, 1000, 5], 1000),
    (128, 64, 4, 4, [1, 15, 16, 17, 63, 64, 65, 700], [3, 0, 16, 1, 0, 64, 17, 0], 5),
    (256, 16, 16, 2, [1, 15, 16, 17, 63, 64, 65, 700], [9, 0, 700, 16, 1, 64, 33, 900], 64),
    (256, 64, 8, 1, [1, 17, 129, 1040], [500, 0, 3, 2000], 500),
    (256, 16, 4, 4, [2, 100, 513], [0, 7, 64], 0),
]
WINDOW_ALGO_CASES = _with_algos(WINDOW_CASES)


@pytest.mark.parametrize("algo,case", WINDOW_ALGO_CASES,
                         ids=[f"{a}-d{c[0]}-bs{c[1]}-gqa{c[2] // c[3]}-w{c[6]}-{i}"
                              for i, (a, c) in enumerate(WINDOW_ALGO_CASES)])
def test_window_matches_torch(kernels, algo, case):
    d, bs, hq, hkv, q_lens, prefixes, window = case
    kernel = kernels[algo, d]
    seed, c = _fresh_case(q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d**-0.5
    n = len(q_lens)
    out = c.run(kernel, list(range(n)), scale, window_left=window)
    assert not (out == 0xFFFF).any(), f"seed {seed}: some O rows were not written"
    ref = torch_window_reference(c, scale, window)
    got = from_bf16_bits(out)
    for b in range(n):  # per stream, so a short stream cannot hide behind a long one
        s = slice(c.cu[b], c.cu[b + 1])
        err = rel_err(got[s], ref[s])
        assert err < 1e-2, f"seed {seed}: stream {b} (q {q_lens[b]}, kv {c.kv_lens[b]}) rel err {err:.3e}"
    # the numpy reference (the emulator's) agrees with torch's
    assert rel_err(from_bf16_bits(attn.reference(c.q, c.k_pool, c.v_pool, c.cu, c.kv_lens, c.tables, hq, hkv, bs, scale,
                                            window_left=window)), ref) < 1e-2, f"seed {seed}"
    # the window changes the result where a row has more keys than it (else the case would test nothing)
    assert rel_err(torch_window_reference(c, scale, None), ref) > 1e-2, f"seed {seed}"
    # batched == each stream alone, bit for bit; an oversized grid changes nothing
    for b in range(n):
        one = c.run(kernel, [b], scale, window_left=window)
        assert np.array_equal(one, out[c.cu[b] : c.cu[b + 1]]), f"seed {seed}: stream {b} batched != alone"
    again = c.run(kernel, list(range(n)), scale, grid_extra=(1, 1, 2), window_left=window)
    assert np.array_equal(again, out), f"seed {seed}: oversized grid changed the output"


@pytest.mark.parametrize("algo,case", _with_algos([CASES[1], CASES[4], CASES[9]]),
                         ids=lambda x: x if isinstance(x, str) else f"d{x[0]}-bs{x[1]}")
def test_window_covering_the_context_is_full_causal_bit_for_bit(kernels, algo, case):
    # window_left >= the longest context - 1: every key of every row is in the window, so the kernels load the same
    # tiles and mask nothing more: the result is the no-window launch's, bit for bit
    d, bs, hq, hkv, q_lens, prefixes, scale = case
    seed, c = _fresh_case(q_lens, prefixes, hq=hq, hkv=hkv, d=d, bs=bs)
    scale = d**-0.5 if scale is None else scale
    n = len(q_lens)
    full = c.run(kernels[algo, d], list(range(n)), scale)
    for w in (int(c.kv_lens.max()) - 1, int(c.kv_lens.max()), 1 << 20):
        assert np.array_equal(c.run(kernels[algo, d], list(range(n)), scale, window_left=w), full), f"seed {seed}: {w}"


LONG_WINDOW = _with_algos([(64, 4, 1), (128, 16, 2), (256, 16, 2)])


@pytest.mark.parametrize("algo,dims", LONG_WINDOW, ids=[f"{a}-d{d}-{hq}-{hkv}" for a, (d, hq, hkv) in LONG_WINDOW])
def test_window_chunked_long(kernels, algo, dims):
    # Chunked prefill far past the window: 1024 new rows on 8192 cached keys, window 1000 (most key tiles skipped),
    # beside a decode-like row and a short fresh stream.
    d, hq, hkv = dims
    seed, c = _fresh_case([1024, 1, 300], [8192, 4000, 0], hq=hq, hkv=hkv, d=d, bs=64)
    scale = d**-0.5
    out = c.run(kernels[algo, d], [0, 1, 2], scale, window_left=1000)
    assert not (out == 0xFFFF).any(), f"seed {seed}: some O rows were not written"
    ref = torch_window_reference(c, scale, 1000)
    got = from_bf16_bits(out)
    for b in range(3):
        s = slice(c.cu[b], c.cu[b + 1])
        err = rel_err(got[s], ref[s])
        assert err < 1e-2, f"seed {seed}: stream {b} rel err {err:.3e}"
    one = c.run(kernels[algo, d], [0], scale, window_left=1000)
    assert np.array_equal(one, out[c.cu[0] : c.cu[1]]), f"seed {seed}: batched != alone"
