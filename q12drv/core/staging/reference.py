"""Expected metadata, computed the slow and obvious way, to check staged bytes against.

The stager packs with vectorised numpy; this module builds the same fields stream by stream
from the seed's definitions, independently, so that a read-back can be verified field by field
(used by ``q12drv demo``, the tests and the GPU checks).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .metadata import BatchedAttnMetadata, StreamStageInfo, unpack_metadata

__all__ = ["expected_fields", "verify_readback"]


def expected_fields(streams: Sequence[StreamStageInfo], *, block_size: int, use_mrope: bool, dummy_kv_block: int) -> dict:
    """Every stacked field as the seed defines it, built per stream."""
    pos, h, w, slots, cu, kv = [], [], [], [], [0], []
    for s in streams:
        p = np.arange(s.proc_start, s.proc_start + s.proc_count, dtype=np.int64)
        table = np.asarray(s.block_table, dtype=np.int64)
        phys = np.array([table[q // block_size] for q in p], dtype=np.int64)
        phys[phys < 0] = dummy_kv_block
        slots.append(phys * block_size + p % block_size)
        if s.mrope_positions is not None:
            mp = np.asarray(s.mrope_positions, dtype=np.int64)
            pos.append(mp[0]); h.append(mp[1]); w.append(mp[2])
        else:
            pos.append(p); h.append(p); w.append(p)
        cu.append(cu[-1] + s.proc_count)
        kv.append(s.proc_start + s.proc_count)
    out = {"positions_stacked": np.concatenate(pos).astype(np.uint32)}
    if use_mrope:
        out["positions_h_stacked"] = np.concatenate(h).astype(np.uint32)
        out["positions_w_stacked"] = np.concatenate(w).astype(np.uint32)
    out["slot_stacked"] = np.concatenate(slots).astype(np.int64)
    out["block_table_ptrs"] = np.array([s.block_table_dev for s in streams], dtype=np.uint64)
    out["seq_len_ptrs"] = np.array([s.seq_len_dev for s in streams], dtype=np.uint64)
    out["cu_seqlens"] = np.array(cu, dtype=np.int32)
    out["kv_lens"] = np.array(kv, dtype=np.int32)
    return out


def verify_readback(raw: bytes, meta: BatchedAttnMetadata, streams: Sequence[StreamStageInfo]) -> list:
    """Compare staged bytes read back from the device with :func:`expected_fields`.

    Returns
    -------
    list of str
        One line per mismatching field (name, first bad index, got, expected); empty when all
        fields and pads are right.
    """
    got = unpack_metadata(raw, meta.layout)
    want = expected_fields(streams, block_size=meta.block_size, use_mrope=meta.use_mrope, dummy_kv_block=meta.dummy_kv_block)
    problems = []
    for name, expected in want.items():
        actual = got[name]
        if actual.shape != expected.shape or not np.array_equal(actual, expected):
            if actual.shape != expected.shape:
                problems.append(f"{name}: shape {actual.shape} != expected {expected.shape}")
                continue
            i = int(np.flatnonzero(actual != expected)[0])
            problems.append(f"{name}[{i}] = {actual[i]} but expected {expected[i]}")
    if got["_pads"].any():
        problems.append(f"pad bytes not zero: {got['_pads'].tolist()}")
    if not np.array_equal(meta.cu_seqlens_host, want["cu_seqlens"]):
        problems.append("cu_seqlens_host differs from the staged cu_seqlens")
    if not np.array_equal(meta.kv_lens_host, want["kv_lens"]):
        problems.append("kv_lens_host differs from the staged kv_lens")
    return problems
