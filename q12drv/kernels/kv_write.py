"""Paged KV-cache write (``cuda_src/kv_write.cu``): the host side.

Packed new keys and values ``[T, Hkv, D]`` (bf16) are copied into the K and V pools of one
attention layer, NHD ``[num_blocks, block_size, Hkv, D]``: packed token ``t`` goes to slot
``slots[t]`` (``block * block_size + offset``), i.e. its row of ``Hkv * D`` elements lands at
element offset ``slots[t] * Hkv * D`` of each pool. ``slots[t] < 0`` skips the token (padding),
and so does a slot ``>= num_blocks * block_size`` (the host validates slots before staging; the
kernel's check is the last line of defence).

Entry::

    q12_kv_write(Q12Meta m, const bf16* k, const bf16* v, bf16* k_pool, bf16* v_pool,
                 int row_elems, long long num_slots)

``row_elems = Hkv * D`` (a multiple of 8 for the 16-byte path), ``num_slots = num_blocks *
block_size``. FP8 (e4m3) pools::

    q12_kv_write_fp8(Q12Meta m, const bf16* k, const bf16* v, u8* k_pool, u8* v_pool,
                     const float* k_scale, const float* v_scale, int head_dim, int row_elems, long long num_slots)

store each value as ``e4m3(x * (1 / scale[h]))`` (round to nearest even, saturating to +-448: :mod:`q12drv.core.fp8`),
``scale[h]`` the caller's fp32 scale of KV head ``h`` (``[Hkv]`` each for K and V); attention reads ``q * scale``. The kernel walks the ``m.total_tokens`` tokens with a grid stride, so any grid
covers the work; :func:`geometry` sizes a persistent grid. Each lane issues all its loads of an
iteration (the slots and 8 chunks of 16 bytes) before its stores. The numbers the geometry relies on
are the kernel's (``kvw_config()`` in ``kv_write.cu``): :data:`CONTRACTS` passes them to every build,
which ``static_assert`` s them.
"""

from __future__ import annotations

import numpy as np

from ..core.bf16 import from_bf16_bits
from ..core.fp8 import to_e4m3_bits
from .grid import check_1d_launch, persistent_geometry
from .meta import Q12MetaC
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "THREADS",
    "MAX_THREADS",
    "CONTRACTS",
    "geometry",
    "tokens_per_group",
    "reference",
    "emulate_kv_write",
    "geometry_fp8",
    "check_fp8_head_dim",
    "quantize_rows",
    "reference_fp8",
    "emulate_kv_write_fp8",
    "EMULATORS",
]

SOURCE = "kv_write.cu"
ENTRIES = ("q12_kv_write", "q12_kv_write_fp8")

#: Threads per CTA of the launch :func:`geometry` returns.
THREADS = 256
#: Largest block the kernel launches with (``__launch_bounds__(1024, 1)``: at most 64 registers a thread).
MAX_THREADS = 1024
#: CTAs of :data:`THREADS` per SM of a persistent launch: the launch bounds guarantee 4 x 256 threads
#: their registers.
_CTAS_PER_SM = 4
_CHUNK_ELEMS = 8  # bf16 elements in a 16-byte chunk
_MAX_GROUP = 32  # threads per token group at most (a warp)
_LONG_ROW_TOKENS = 2  # tokens per group and iteration for rows of more than _MAX_GROUP chunks
_SHORT_ROW_TOKENS = 4  # the same for shorter rows
#: The host/device contract: the numbers :func:`geometry` and :func:`tokens_per_group` rely on, passed as
#: ``-D`` to every build of ``kv_write.cu`` and checked there against ``kvw_config()``.
CONTRACTS = {
    "Q12_KVW_THREADS": THREADS,
    "Q12_KVW_CTAS_PER_SM": _CTAS_PER_SM,
    "Q12_KVW_MAX_THREADS": MAX_THREADS,
    "Q12_KVW_CHUNK_ELEMS": _CHUNK_ELEMS,
    "Q12_KVW_MAX_GROUP": _MAX_GROUP,
    "Q12_KVW_LONG_ROW_TOKENS": _LONG_ROW_TOKENS,
    "Q12_KVW_SHORT_ROW_TOKENS": _SHORT_ROW_TOKENS,
}


def _group_size(row_units: int) -> int:
    """Threads per token in the kernel: smallest power of two >= row_units, at most a warp."""
    gs = 1
    while gs < row_units and gs < _MAX_GROUP:
        gs <<= 1
    return gs


def tokens_per_group(row_units: int) -> int:
    """Tokens a thread group takes per iteration (``TOK``): 2 for rows of more than 32 chunks
    (two 16-byte chunks of K and two of V per lane and token), else 4 (one chunk per lane and token).
    Either way a lane has 8 loads of 16 bytes in flight. ``row_units`` counts 16-byte chunks (or
    2-byte elements on the fallback path)."""
    return _LONG_ROW_TOKENS if row_units > _MAX_GROUP else _SHORT_ROW_TOKENS


def geometry(
    total_tokens: int, row_elems: int, *, num_sms: int = 132, threads: int = THREADS
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """Launch geometry of ``q12_kv_write``.

    A group of :func:`_group_size` threads takes :func:`tokens_per_group` consecutive tokens per
    iteration; the grid covers T once in such tiles, capped at one resident wave (a persistent
    grid: the kernel's grid-stride loop covers the rest).

    Parameters
    ----------
    total_tokens : int
        T, the packed token count of the pass (host-known; the kernel reads ``m.total_tokens``).
    row_elems : int
        ``Hkv * D``, elements of one token's K (or V) row.
    num_sms : int
        SMs of the device (132 on the H200); caps the persistent grid at 4 CTAs per SM.
    threads : int
        Threads per CTA, a multiple of 32, at most :data:`MAX_THREADS`.

    Returns
    -------
    tuple
        ``(grid, block, dynamic_smem_bytes)``; no dynamic shared memory.

    Raises
    ------
    ValueError
        ``row_elems`` not positive, or ``threads`` not a multiple of 32 in ``[32, MAX_THREADS]``.
    """
    if row_elems <= 0:
        raise ValueError(f"row_elems must be positive, got {row_elems}")
    units = row_elems // _CHUNK_ELEMS if row_elems % _CHUNK_ELEMS == 0 else row_elems
    per_cta = threads // _group_size(units) * tokens_per_group(units)
    return persistent_geometry("q12_kv_write", total_tokens, per_cta, threads, max_threads=MAX_THREADS,
                               num_sms=num_sms, ctas_per_sm=_CTAS_PER_SM)


def _write_rows(k, v, slots, k_pool, v_pool) -> None:
    """The copy itself, in place on ``k_pool`` / ``v_pool`` (writable arrays or views)."""
    k = np.asarray(k)
    v = np.asarray(v)
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    t = slots.shape[0]
    if k.shape[0] != t or v.shape != k.shape:
        raise ValueError(f"k {k.shape} / v {v.shape} do not match {t} slots")
    row = int(np.prod(k.shape[1:], dtype=np.int64))
    if row <= 0:
        return
    if k_pool.shape != v_pool.shape or k_pool.size % row:
        raise ValueError(f"pools {k_pool.shape} / {v_pool.shape} are not whole rows of {row}")
    if not (k_pool.flags.c_contiguous and v_pool.flags.c_contiguous):
        raise ValueError("pools must be C-contiguous (written in place through a flat view)")
    num_slots = k_pool.size // row
    keep = (slots >= 0) & (slots < num_slots)
    flat_k = k_pool.reshape(num_slots, row)
    flat_v = v_pool.reshape(num_slots, row)
    flat_k[slots[keep]] = k.reshape(t, row)[keep]
    flat_v[slots[keep]] = v.reshape(t, row)[keep]


def reference(
    k: np.ndarray,
    v: np.ndarray,
    slots: np.ndarray,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel leaves in the pools (pure copy; returns new arrays, inputs untouched).

    Parameters
    ----------
    k, v : numpy.ndarray
        uint16 bf16 bits, ``[T, Hkv, D]`` (or any ``[T, ...]`` whose trailing size is the row).
    slots : numpy.ndarray
        int64 ``[T]`` slot per token; ``< 0`` or ``>= num_slots`` skips it.
    k_pool, v_pool : numpy.ndarray
        uint16 bf16 bits, ``[num_blocks, block_size, Hkv, D]`` (or ``[num_slots, ...]``).

    Returns
    -------
    tuple of numpy.ndarray
        The updated ``(k_pool, v_pool)``, same shapes as given.

    Notes
    -----
    Two valid tokens with the same slot race in the kernel (either row may win); here the later
    one wins. The host never stages duplicate slots within one pass.
    """
    out_k = np.array(k_pool, dtype=np.uint16, copy=True)
    out_v = np.array(v_pool, dtype=np.uint16, copy=True)
    _write_rows(k, v, slots, out_k, out_v)
    return out_k, out_v


def emulate_kv_write(args: dict, mem, grid, block) -> None:
    """Emulated-driver stand-in for ``q12_kv_write``: reads metadata and tensors through ``mem``.

    Parameters
    ----------
    args : dict
        Kernel parameters by name (``m`` a :class:`Q12MetaC`, pointers and ints as ``int``).
    mem : object
        Emulated device memory; ``mem.array(ptr, dtype, shape)`` is a writable view.
    grid, block : tuple of int
        The launch geometry.

    Raises
    ------
    ValueError
        If the launch shape is not one the kernel handles (it needs a 1-D grid and a 1-D block
        of whole warps; the grid-stride loop covers any grid size).
    """
    check_1d_launch("q12_kv_write", grid, block, MAX_THREADS)
    m: Q12MetaC = args["m"]
    row = int(args["row_elems"])
    num_slots = int(args["num_slots"])
    t = int(m.total_tokens)
    if row <= 0 or t == 0:
        return
    if num_slots < 0:
        raise ValueError(f"num_slots must be >= 0, got {num_slots}")
    slots = np.array(mem.array(m.slots, np.int64, (t,)))
    k = mem.array(args["k"], np.uint16, (t, row))
    v = mem.array(args["v"], np.uint16, (t, row))
    k_pool = mem.array(args["k_pool"], np.uint16, (num_slots, row))
    v_pool = mem.array(args["v_pool"], np.uint16, (num_slots, row))
    # Same copy as :func:`reference`, done in place on the views (no copy of the whole pools).
    _write_rows(k, v, slots, k_pool, v_pool)


def check_fp8_head_dim(head_dim: int, what: str = "head_dim") -> None:
    """ValueError unless ``head_dim`` suits ``q12_kv_write_fp8``, whose 16-byte chunks of 8 values lie in one head
    (one scale)."""
    if head_dim % _CHUNK_ELEMS:
        raise ValueError(f"an FP8 KV write needs {what} % {_CHUNK_ELEMS} == 0 (16-byte chunks of one head), got "
                         f"{head_dim}")


def geometry_fp8(total_tokens: int, row_elems: int, *, num_sms: int = 132, threads: int = THREADS) -> tuple:
    """Launch geometry of ``q12_kv_write_fp8``: one thread per 16-byte chunk of a row (``row_elems / 8`` a token), a
    persistent grid of at most 4 CTAs an SM (the kernel's grid stride covers the rest)."""
    if row_elems <= 0 or row_elems % _CHUNK_ELEMS:
        raise ValueError(f"row_elems must be a positive multiple of {_CHUNK_ELEMS}, got {row_elems}")
    return persistent_geometry("q12_kv_write_fp8", total_tokens * (row_elems // _CHUNK_ELEMS), threads, threads,
                               max_threads=MAX_THREADS, num_sms=num_sms, ctas_per_sm=_CTAS_PER_SM)


def quantize_rows(x_bits: np.ndarray, scale: np.ndarray, head_dim: int) -> np.ndarray:
    """e4m3 bytes of bf16 rows ``x_bits`` (uint16, ``[T, Hkv * head_dim]``) scaled by ``1 / scale[h]`` as the kernel
    does: ``x * rcp(scale)`` in fp32, each product rounded once."""
    t, row = x_bits.shape
    x = from_bf16_bits(x_bits).reshape(t, row // head_dim, head_dim)
    inv = (np.float32(1) / np.asarray(scale, np.float32)).astype(np.float32)
    return to_e4m3_bits(x * inv[None, :, None]).reshape(t, row)


def reference_fp8(k: np.ndarray, v: np.ndarray, slots: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
                  k_scale: np.ndarray, v_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What ``q12_kv_write_fp8`` leaves in uint8 pools ``[num_slots or num_blocks, ..., Hkv, D]`` for bf16 bits ``k``,
    ``v`` ``[T, Hkv, D]`` and fp32 scales ``[Hkv]`` (new arrays; the inputs untouched)."""
    k, v = np.asarray(k, np.uint16), np.asarray(v, np.uint16)
    t, hkv, d = k.shape
    out_k, out_v = np.array(k_pool, np.uint8, copy=True), np.array(v_pool, np.uint8, copy=True)
    _write_rows(quantize_rows(k.reshape(t, hkv * d), k_scale, d), quantize_rows(v.reshape(t, hkv * d), v_scale, d),
                slots, out_k, out_v)
    return out_k, out_v


def emulate_kv_write_fp8(args: dict, mem, grid, block) -> None:
    """Emulated-driver stand-in for ``q12_kv_write_fp8`` (see :func:`emulate_kv_write`)."""
    check_1d_launch("q12_kv_write_fp8", grid, block, MAX_THREADS)
    m: Q12MetaC = args["m"]
    row, d, num_slots = int(args["row_elems"]), int(args["head_dim"]), int(args["num_slots"])
    t = int(m.total_tokens)
    if row <= 0 or d <= 0 or d % _CHUNK_ELEMS or row % d or t == 0:
        return
    slots = np.array(mem.array(m.slots, np.int64, (t,)))
    hkv = row // d
    k = quantize_rows(np.array(mem.array(args["k"], np.uint16, (t, row))),
                      np.array(mem.array(args["k_scale"], np.float32, (hkv,))), d)
    v = quantize_rows(np.array(mem.array(args["v"], np.uint16, (t, row))),
                      np.array(mem.array(args["v_scale"], np.float32, (hkv,))), d)
    _write_rows(k, v, slots, mem.array(args["k_pool"], np.uint8, (num_slots, row)),
                mem.array(args["v_pool"], np.uint8, (num_slots, row)))


EMULATORS = {"q12_kv_write": emulate_kv_write, "q12_kv_write_fp8": emulate_kv_write_fp8}

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS)
