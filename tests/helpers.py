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
