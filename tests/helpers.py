"""Shared builders for tests: realistic stream inputs with device-resident block tables."""

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
    from q12drv.doctor import parse_ptxas_report

    report = {r.name: r for r in parse_ptxas_report(img.log)}
    for entry in entries:
        r = report.get(entry)
        assert r is not None, f"no ptxas report for {entry}:\n{img.log}"
        assert r.spill_stores == r.spill_loads == 0, f"{entry} spills: {r}"
        assert not stack or r.stack_frame == 0, f"{entry} uses a stack frame: {r}"
    return report
