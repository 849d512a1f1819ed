"""The host mirrors of the structs the kernels take by value: ``Q12Meta`` (``cuda_src/q12_meta.cuh``,
every kernel) and ``Q12Tail`` (``cuda_src/expand_meta.cu``, the per-stream fields as launch parameters).

The C structs and these ctypes structures must agree byte for byte. The offsets are not trusted:
:func:`meta_defines` turns the mirrors' offsets and sizes into ``-D`` options, and the sources
``static_assert`` each one, so a drifted mirror fails to compile instead of reading garbage.
"""

from __future__ import annotations

import ctypes

__all__ = ["Q12MetaC", "META_FIELDS", "Q12TailC", "TAIL_STREAMS", "meta_defines", "meta_from_staged", "meta_struct"]

#: (C field name, ctypes type) in declaration order; the only list of the struct's fields.
META_FIELDS = (
    ("positions", ctypes.c_uint64),
    ("positions_h", ctypes.c_uint64),
    ("positions_w", ctypes.c_uint64),
    ("slots", ctypes.c_uint64),
    ("block_table_ptrs", ctypes.c_uint64),
    ("seq_len_ptrs", ctypes.c_uint64),
    ("cu_seqlens", ctypes.c_uint64),
    ("kv_lens", ctypes.c_uint64),
    ("batch_size", ctypes.c_uint32),
    ("chunk_len", ctypes.c_uint32),
    ("total_tokens", ctypes.c_uint32),
    ("max_blocks_per_seq", ctypes.c_uint32),
)


class Q12MetaC(ctypes.Structure):
    """ctypes mirror of ``struct Q12Meta`` (80 bytes, 8-byte aligned)."""

    _fields_ = list(META_FIELDS)


#: Streams a :class:`Q12TailC` holds: the launch-parameter path of the device expansion takes at most
#: this many (its parameter block is then about 1.6 KiB, well inside the 4 KiB every driver accepts).
TAIL_STREAMS = 64


class Q12TailC(ctypes.Structure):
    """ctypes mirror of ``struct Q12Tail``: the stacked block's per-stream fields for at most
    :data:`TAIL_STREAMS` streams, in the block's field order (entries past the batch unused)."""

    _fields_ = [
        ("block_table_ptrs", ctypes.c_uint64 * TAIL_STREAMS),
        ("seq_len_ptrs", ctypes.c_uint64 * TAIL_STREAMS),
        ("cu_seqlens", ctypes.c_int32 * (TAIL_STREAMS + 1)),
        ("kv_lens", ctypes.c_int32 * TAIL_STREAMS),
    ]


def meta_defines() -> list[str]:
    """The ``-D`` macros through which the sources check these mirrors' layouts at compile time."""
    defines = [f"Q12_META_SIZE={ctypes.sizeof(Q12MetaC)}"]
    for name, _ in META_FIELDS:
        defines.append(f"Q12_META_OFF_{name.upper()}={getattr(Q12MetaC, name).offset}")
    defines += [f"Q12_TAIL_STREAMS={TAIL_STREAMS}", f"Q12_TAIL_SIZE={ctypes.sizeof(Q12TailC)}"]
    return defines


def meta_from_staged(meta) -> Q12MetaC:
    """Build the by-value struct from a :class:`q12drv.core.staging.BatchedAttnMetadata`."""
    # positional, in META_FIELDS order (the pointers are DevicePtr, an int subclass ctypes takes as is)
    return Q12MetaC(meta.positions_stacked, meta.positions_h_stacked, meta.positions_w_stacked, meta.slot_stacked,
                    meta.block_table_ptrs, meta.seq_len_ptrs, meta.cu_seqlens, meta.kv_lens, meta.batch_size,
                    meta.chunk_len, meta.total_tokens, meta.max_blocks_per_seq)


def meta_struct(meta) -> Q12MetaC:
    """``meta``'s by-value struct, built on first use and kept on the (immutable) metadata object: every
    launch of a pass copies the same one into its argument block."""
    c = meta.__dict__.get("_q12_struct")
    if c is None:
        c = meta.__dict__["_q12_struct"] = meta_from_staged(meta)  # frozen dataclass: its dict, not setattr
    return c
