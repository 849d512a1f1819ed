"""Shared builders for tests: realistic stream inputs with device-resident block tables, layer buffers,
relative errors."""

from __future__ import annotations

import numpy as np

from q12drv import StreamStageInfo


def make_streams(dev, counts, starts=None, *, block_size=16, num_blocks=None, rng=None, mrope_vision=(), interleave=True):
    """Streams with block tables in device memory; physical blocks interleave across streams.

    Returns (streams, tables_buffer) — keep the buffer alive while the metadata is used.
    """
    rng = rng or np.random.default_rng(0)
    n = len(counts)
    starts = list(starts) if starts is not None else [0] * n
    needed = [-(-(s + c) // block_size) for s, c in zip(starts, counts)]
    total_blocks = sum(needed)
    num_blocks = num_blocks or total_blocks + 1
    ids = rng.permutation(np.arange(1, num_blocks))[:total_blocks] if interleave else np.arange(1, total_blocks + 1)
    tables, off = [], 0
    for k in needed:
        tables.append(ids[off:off + k].astype(np.int32))
        off += k
    cap = max(needed)
    buf = dev.alloc(n * (cap * 4 + 8) + 64, "test block tables")
    streams = []
    for b, (s, c) in enumerate(zip(starts, counts)):
        t_off = b * cap * 4
        dev.upload(int(buf.ptr) + t_off, tables[b])
        seq_ptr = int(buf.ptr) + n * cap * 4 + 8 * b
        dev.upload(seq_ptr, np.array([s + c], dtype=np.uint32))
        mp = None
        if b in mrope_vision:
            mp = np.stack([np.full(c, s, np.int64), s + np.arange(c) // 4, s + np.arange(c) % 4]).astype(np.int64)
        streams.append(StreamStageInfo(s, c, tables[b], int(buf.ptr) + t_off, seq_ptr, mp))
    return streams, buf


def shuffled_tables(rng, blocks_per_stream, num_blocks) -> list:
    """Per-stream int32 block tables: consecutive slices of one random permutation of ``num_blocks`` blocks."""
    perm = rng.permutation(num_blocks)
    tables, at = [], 0
    for nb in blocks_per_stream:
        tables.append(perm[at:at + nb].astype(np.int32))
        at += nb
    return tables


def paged_streams(rng, lens, starts, block_size, num_blocks):
    """Block tables dealt round-robin from a random pool permutation (streams interleave), positions, slots."""
    need = [-(-(s + n) // block_size) for s, n in zip(starts, lens)]
    assert sum(need) <= num_blocks
    perm = iter(rng.permutation(num_blocks))
    tables = [[] for _ in lens]
    while any(len(t) < n for t, n in zip(tables, need)):
        for b, t in enumerate(tables):
            if len(t) < need[b]:
                t.append(int(next(perm)))
    tables = [np.array(t, dtype=np.int32) for t in tables]
    positions = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lens)]
    slots = [tb[p // block_size].astype(np.int64) * block_size + p % block_size for tb, p in zip(tables, positions)]
    return tables, positions, slots


def rel_err(a, b) -> float:
    """Relative L2 error of ``a`` against the reference ``b``, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rel_err_bf16(a_bits, b_bits) -> float:
    """:func:`rel_err` of two bf16 bit-pattern arrays."""
    from q12drv.core.bf16 import from_bf16_bits

    return rel_err(from_bf16_bits(a_bits), from_bf16_bits(b_bits))


class LayerBuffers:
    """Device buffers (optionally followed by a 0xA5 guard band) for one attention + one GDN layer's host inputs."""

    def __init__(self, dev, host: dict, *, label: str = "", guard: int = 0):
        self.dev, self.host, self.guard = dev, host, guard
        self.bufs = {k: dev.alloc(a.nbytes + guard, f"{label}{k}") for k, a in host.items()}

    def upload(self) -> None:
        """Write every host input (and its guard band) to its buffer."""
        for k, a in self.host.items():
            if self.guard:
                self.dev.memset(self.bufs[k].ptr, 0xA5, a.nbytes + self.guard)
            self.dev.upload(self.bufs[k].ptr, a)

    def p(self, k: str) -> int:
        """The device address of input ``k``."""
        return int(self.bufs[k].ptr)

    def states(self, n: int) -> list:
        """The addresses of the first ``n`` streams' GDN states."""
        return [self.p("states") + b * self.host["states"][0].nbytes for b in range(n)]

    def attention_args(self) -> tuple:
        """q, k, v, k_pool, v_pool, o: the pointer arguments of ``Q12Pass.attention_layer``."""
        return tuple(self.p(k) for k in ("q", "k", "v", "k_pool", "v_pool", "o"))

    def gdn_tensors(self):
        """gq, gk, gv, g, beta, go as a :class:`~q12drv.kernels.gdn.GdnTensors`."""
        from q12drv.kernels.gdn import GdnTensors

        return GdnTensors(*(self.p(k) for k in ("gq", "gk", "gv", "g", "beta", "go")))

    def gdn_args(self, n: int) -> tuple:
        """states, tensors: the pointer arguments of ``Q12Pass.gdn_layer`` for ``n`` streams."""
        return self.states(n), self.gdn_tensors()

    def get(self, k: str) -> np.ndarray:
        """Input ``k`` read back as its host array; asserts its guard band is intact."""
        raw = self.dev.download(self.bufs[k].ptr, self.host[k].nbytes + self.guard)
        assert raw[len(raw) - self.guard:] == b"\xa5" * self.guard, f"guard band after {k} overwritten"
        return np.frombuffer(raw[:len(raw) - self.guard], self.host[k].dtype).reshape(self.host[k].shape).copy()


class FakeMem:
    """Device memory for the kernels' emulators in unit tests: numpy arrays addressed by their host
    addresses, every view bounds-checked (a kernel emulator reading past an allocation raises)."""

    def __init__(self):
        self.allocs: list = []

    def hold(self, arr: np.ndarray) -> tuple:
        """Keep a contiguous copy of ``arr`` alive; return ``(array, address)``."""
        a = np.ascontiguousarray(arr)
        self.allocs.append(a)
        return a, a.ctypes.data

    def put(self, arr: np.ndarray) -> int:
        """Like :meth:`hold`, the address only."""
        return self.hold(arr)[1]

    def array(self, ptr: int, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        for a in self.allocs:
            base = a.ctypes.data
            if base <= ptr and ptr + nbytes <= base + a.nbytes:
                return a.reshape(-1).view(np.uint8)[ptr - base:ptr - base + nbytes].view(dtype).reshape(shape)
        raise IndexError(f"[{ptr:#x}, +{nbytes}) is outside every allocation")


def spill_free(img, entries, *, stack: bool = True) -> dict:
    """The ptxas report of ``entries`` in ``img`` (compiled with ``verbose_resources=True``), read with the
    doctor's parser; asserts each entry is there with no spill stores or loads (and, ``stack``, no stack
    frame). Returns ``{entry: KernelResources}`` for the caller's own register and smem checks."""
    from q12drv.tools.doctor import parse_ptxas_report

    report = {r.name: r for r in parse_ptxas_report(img.log)}
    for entry in entries:
        r = report.get(entry)
        assert r is not None, f"no ptxas report for {entry}:\n{img.log}"
        assert r.spill_stores == r.spill_loads == 0, f"{entry} spills: {r}"
        assert not stack or r.stack_frame == 0, f"{entry} uses a stack frame: {r}"
    return report
