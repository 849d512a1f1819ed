"""The host mirror of ``cuda_src/q12_meta.cuh``: the metadata struct the kernels take by value.

The C struct and this ctypes structure must agree byte for byte. The offsets are not trusted:
:func:`meta_defines` turns this mirror's offsets into ``-D`` options, and the header
``static_assert``s each one, so a drifted mirror fails to compile instead of reading garbage.
"""

from __future__ import annotations

import ctypes

__all__ = ["Q12MetaC", "META_FIELDS", "meta_defines", "meta_from_staged", "meta_struct"]

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


def meta_defines() -> list[str]:
    """The ``-D`` macros through which the header checks this mirror's layout at compile time."""
    defines = [f"Q12_META_SIZE={ctypes.sizeof(Q12MetaC)}"]
    for name, _ in META_FIELDS:
        defines.append(f"Q12_META_OFF_{name.upper()}={getattr(Q12MetaC, name).offset}")
    return defines


def meta_from_staged(meta) -> Q12MetaC:
    """Build the by-value struct from a :class:`q12drv.staging.BatchedAttnMetadata`."""
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
