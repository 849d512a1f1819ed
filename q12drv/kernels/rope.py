"""RoPE / MRoPE in place on packed Q and K (``cuda_src/rope.cu``): the host side.

NeoX pairing over the first ``rotary_dim`` dims of every head: for ``j < half = rotary_dim/2``
the pair ``(x[j], x[j + half])`` is rotated by ``angle = pos * inv_freq[j]``; dims ``>=
rotary_dim`` are untouched. ``inv_freq[j] = 1 / fl32(theta ** fl32(2j / rotary_dim))`` (HF's
fp32 chain, the power taken in double and rounded once), the angle is an fp32 product, cos/sin
are exact functions of that fp32 angle and the rotation is done in floating point and rounded
once to bf16 (HF rounds cos/sin to bf16 first; see :func:`hf_style_reference`).

The position of frequency ``j`` comes from stream ``s(j)`` of the metadata (0 = T
``positions``, 1 = H ``positions_h``, 2 = W ``positions_w``), see :func:`axis_map`:

- mode 0 (:data:`MROPE_OFF`): always T;
- mode 1 (:data:`MROPE_CHUNKED`, Qwen2-VL ``[16, 24, 24]``): T for ``j < s0``, H for
  ``j < s0 + s1``, else W;
- mode 2 (:data:`MROPE_INTERLEAVED`, Qwen3-VL ``[24, 20, 20]``, Qwen3.5 ``[11, 11, 10]``): H if
  ``j % 3 == 1 and j < 3 * s1``, W if ``j % 3 == 2 and j < 3 * s2``, else T.

Entry::

    q12_rope(Q12Meta m, bf16* q, bf16* k, int num_q_heads, int num_kv_heads, int head_dim,
             int rotary_dim, float theta, int mrope_mode, int sec_t, int sec_h, int sec_w, RopeTable table)

Scaled rotary embeddings (linear, dynamic NTK, YaRN, llama3, longrope, ...) come as a :class:`RopeScaling`: the
inverse frequencies and the factor cos and sin are multiplied by, passed by value in the launch
(:class:`RopeTableC`); :meth:`RopeScaling.from_transformers` takes them from a transformers config with
transformers' own functions.

The kernel walks ``m.total_tokens`` tokens with a grid stride (any grid covers the work);
:func:`geometry` sizes a persistent grid. The numbers that geometry relies on are the kernel's
(``rope_config()`` in ``rope.cu``): :data:`CONTRACTS` passes them to every build, which
``static_assert`` s them.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.bf16 import from_bf16_bits, to_bf16_bits
from .grid import check_1d_launch, persistent_geometry
from .meta import Q12MetaC
from . import registry

__all__ = [
    "SOURCE",
    "ENTRIES",
    "THREADS",
    "CONTRACTS",
    "TABLE_FREQS",
    "RopeTableC",
    "RopeScaling",
    "MROPE_OFF",
    "MROPE_CHUNKED",
    "MROPE_INTERLEAVED",
    "MAX_ROTARY_DIM",
    "MAX_THREADS",
    "check_params",
    "geometry",
    "tokens_per_warp",
    "floor_bytes",
    "inv_freq",
    "axis_map",
    "reference",
    "hf_style_reference",
    "emulate_rope",
    "EMULATORS",
]

SOURCE = "rope.cu"
ENTRIES = ("q12_rope",)

#: Threads per CTA of the launch :func:`geometry` returns.
THREADS = 256
#: ``mrope_mode`` values: plain RoPE at the token's position; MRoPE with the T/H/W sections in chunks (Qwen2-VL);
#: MRoPE with the sections interleaved (Qwen3-VL, Qwen3.5). Exported as ``q12drv.MROPE_*``.
MROPE_OFF = 0
MROPE_CHUNKED = 1
MROPE_INTERLEAVED = 2
#: Largest block the kernel launches with (``__launch_bounds__(512, 1)``): it uses 112 registers a
#: thread on sm_90, so 1024 threads would exceed the SM's 65,536.
MAX_THREADS = 512
#: Largest rotary_dim the kernel takes (its tables hold 512 frequencies).
MAX_ROTARY_DIM = 1024
_SMEM_ANGLES = 4096  # cos (and sin) floats per CTA, split among its warps
_UNITS_PER_LANE = 3  # units a lane loads at once
_VEC_PAIRS = 8  # pairs in a unit of the 16-byte path
#: Resident CTAs of :data:`THREADS` per SM: the launch bounds guarantee 2 x 256 threads their registers,
#: so the grid is capped at one full wave and no CTA waits for another (grid-stride loop inside).
_CTAS_PER_SM = 2
#: Frequencies a caller-given table holds at most (``rotary_dim <= 2 * TABLE_FREQS`` with a :class:`RopeScaling`).
TABLE_FREQS = 256


class RopeTableC(ctypes.Structure):
    """ctypes mirror of ``struct RopeTable`` (``rope.cu``): a frequency table passed by value in the launch."""

    _fields_ = [("inv_freq", ctypes.c_float * TABLE_FREQS), ("attention_factor", ctypes.c_float),
                ("size", ctypes.c_int32)]


#: The launch's table when there is none (``size`` 0: inverse frequencies from theta, factor 1).
NO_TABLE = RopeTableC()


@dataclass(frozen=True)
class RopeScaling:
    """Scaled rotary embeddings: the inverse frequencies the kernel uses instead of ``theta``'s, and the factor
    cos and sin are multiplied by (transformers' ``attention_scaling``; YaRN and longrope have one).

    Parameters
    ----------
    inv_freq : sequence of float
        ``rotary_dim // 2`` positive finite values (float32), at most :data:`TABLE_FREQS`.
    attention_factor : float
        Positive finite.

    Examples
    --------
    >>> s = RopeScaling(inv_freq=inv_freq(64, 1e7) / 4)        # linear scaling by 4  # doctest: +SKIP
    >>> s = RopeScaling.from_transformers(config)               # whatever rope_type the config names  # doctest: +SKIP
    """

    inv_freq: tuple
    attention_factor: float = 1.0
    _table: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            values = np.asarray(self.inv_freq, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise TypeError(f"inv_freq must be a sequence of numbers, got {type(self.inv_freq).__name__}") from None
        if not 1 <= values.size <= TABLE_FREQS:
            raise ValueError(f"inv_freq has {values.size} frequencies; a table holds 1..{TABLE_FREQS} "
                             f"(rotary_dim // 2)")
        if not (np.all(np.isfinite(values)) and np.all(values > 0)):
            raise ValueError("inv_freq must be positive and finite")
        af = self.attention_factor
        if isinstance(af, bool) or not isinstance(af, (int, float, np.floating)) or not (math.isfinite(af) and af > 0):
            raise ValueError(f"attention_factor must be a positive finite number, got {af!r}")
        f32 = values.astype(np.float32)
        object.__setattr__(self, "inv_freq", tuple(float(x) for x in f32))
        object.__setattr__(self, "attention_factor", float(np.float32(af)))
        table = RopeTableC()
        table.inv_freq[:f32.size] = [float(x) for x in f32]
        table.attention_factor = self.attention_factor
        table.size = f32.size
        object.__setattr__(self, "_table", table)

    @property
    def half(self) -> int:
        """Frequencies: ``rotary_dim // 2``."""
        return len(self.inv_freq)

    def table(self) -> RopeTableC:
        """The launch's by-value table (built once)."""
        return self._table

    @classmethod
    def from_transformers(cls, config: Any, seq_len: int | None = None, layer_type: str | None = None) -> "RopeScaling":
        """The table transformers itself computes for ``config`` (``ROPE_INIT_FUNCTIONS[rope_type]``: default,
        linear, dynamic, yarn, longrope, llama3, ...).

        Parameters
        ----------
        config : transformers.PreTrainedConfig
            A model config carrying ``rope_parameters`` (or the older ``rope_scaling``).
        seq_len : int, optional
            The sequence length the dynamic and longrope types depend on (the longest position of the pass + 1):
            their table changes with it, so a runtime makes one per pass where it does.
        layer_type : str, optional
            For configs with per-layer-type rope parameters.

        Raises
        ------
        ImportError
            transformers (and torch) are not installed.
        """
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # an optional dependency

        config.standardize_rope_params()
        params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
        rope_type = params.get("rope_type", "default")
        init = _default_inv_freq if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
        kw = {} if layer_type is None else {"layer_type": layer_type}
        inv, factor = init(config, "cpu", seq_len, **kw) if seq_len is not None else init(config, "cpu", **kw)
        return cls(tuple(float(x) for x in inv.float().reshape(-1).tolist()), float(factor))


def _default_inv_freq(config, device, seq_len=None, layer_type=None):
    """transformers' default rotary frequencies (``theta ** (2j / dim)``, float32), factor 1."""
    import torch

    params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
    base = params["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
    return inv, 1.0


#: The host/device contract: the numbers :func:`geometry`, :func:`tokens_per_warp` and :func:`check_params`
#: rely on, passed as ``-D`` to every build of ``rope.cu`` and checked there against ``rope_config()``.
CONTRACTS = {
    "Q12_ROPE_THREADS": THREADS,
    "Q12_ROPE_CTAS_PER_SM": _CTAS_PER_SM,
    "Q12_ROPE_MAX_THREADS": MAX_THREADS,
    "Q12_ROPE_MAX_ROTARY_DIM": MAX_ROTARY_DIM,
    "Q12_ROPE_SMEM_ANGLES": _SMEM_ANGLES,
    "Q12_ROPE_UNITS_PER_LANE": _UNITS_PER_LANE,
    "Q12_ROPE_VEC_PAIRS": _VEC_PAIRS,
    "Q12_ROPE_TABLE_FREQS": TABLE_FREQS,
    "Q12_ROPE_TABLE_BYTES": ctypes.sizeof(RopeTableC),
}


def check_params(
    head_dim: int,
    rotary_dim: int,
    mrope_mode: int = MROPE_OFF,
    sections: tuple[int, int, int] = (0, 0, 0),
    num_q_heads: int = 1,
    num_kv_heads: int = 1,
) -> None:
    """Validate a RoPE configuration the way the host must before launching.

    Parameters
    ----------
    head_dim, rotary_dim : int
        ``D`` and the rotated prefix; ``rotary_dim`` even, ``0 <= rotary_dim <= min(D, 1024)``.
    mrope_mode : int
        0 plain, 1 chunked, 2 interleaved.
    sections : tuple of int
        ``(sec_t, sec_h, sec_w)``; non-negative, summing to ``rotary_dim // 2`` when
        ``mrope_mode != 0``.
    num_q_heads, num_kv_heads : int
        Head counts, non-negative.

    Raises
    ------
    ValueError
        On any violation.
    """
    if num_q_heads < 0 or num_kv_heads < 0:
        raise ValueError(f"head counts must be >= 0, got {num_q_heads}, {num_kv_heads}")
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim or rotary_dim > MAX_ROTARY_DIM:
        raise ValueError(f"rotary_dim must be even and in [0, min(head_dim, {MAX_ROTARY_DIM})], got {rotary_dim}")
    if mrope_mode not in (MROPE_OFF, MROPE_CHUNKED, MROPE_INTERLEAVED):
        raise ValueError(f"mrope_mode must be 0, 1 or 2, got {mrope_mode}")
    if mrope_mode != MROPE_OFF:
        if len(sections) != 3 or min(sections) < 0 or sum(sections) != rotary_dim // 2:
            raise ValueError(f"MRoPE sections {sections} must be 3 non-negative ints summing to {rotary_dim // 2}")


def tokens_per_warp(num_q_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                    threads: int = THREADS) -> int:
    """Tokens a warp takes per iteration in ``q12_rope`` (G): as many whole tokens as fit in
    ``32 * units_per_lane`` units (at least 1), capped by the warp's share of the angle buffer. A unit
    is one head's 8 pairs (1 pair when the layout forbids 16-byte accesses)."""
    half = max(rotary_dim // 2, 1)
    vec = rotary_dim % (2 * _VEC_PAIRS) == 0 and head_dim % _VEC_PAIRS == 0
    units = max(num_q_heads + num_kv_heads, 1) * (half // _VEC_PAIRS if vec else half)
    cap = _SMEM_ANGLES // max(threads // 32, 1)
    if half > cap:
        return 1  # the kernel's direct path: one token per warp, sincosf per unit
    return max(1, min(32 * _UNITS_PER_LANE // max(units, 1), cap // half))


def geometry(
    total_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    *,
    num_sms: int = 132,
    threads: int = THREADS,
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """Launch geometry of ``q12_rope``.

    Every warp takes :func:`tokens_per_warp` tokens per iteration and walks the tokens with a
    grid stride over warps; this sizes the grid to cover T once, capped at one resident wave
    (2 CTAs of 256 threads per SM).

    Parameters
    ----------
    total_tokens : int
        T (host-known; the kernel reads ``m.total_tokens``).
    num_q_heads, num_kv_heads, head_dim, rotary_dim : int
        The shapes.
    num_sms : int
        SMs of the device (132 on the H200).
    threads : int
        Threads per CTA, a multiple of 32, at most :data:`MAX_THREADS` (the grid stays capped at 2
        CTAs per SM).

    Returns
    -------
    tuple
        ``(grid, block, dynamic_smem_bytes)``; shared memory is static (about 35 KB).

    Raises
    ------
    ValueError
        ``threads`` not a multiple of 32 in ``[32, MAX_THREADS]``.
    """
    per_cta = threads // 32 * tokens_per_warp(num_q_heads, num_kv_heads, head_dim, rotary_dim, threads)
    return persistent_geometry("q12_rope", total_tokens, per_cta, threads, max_threads=MAX_THREADS,
                               num_sms=num_sms, ctas_per_sm=_CTAS_PER_SM)


def floor_bytes(total_tokens: int, num_q_heads: int, num_kv_heads: int, rotary_dim: int,
                mrope_mode: int = MROPE_OFF) -> int:
    """Bytes ``q12_rope`` must move at least: the rotary dims of every head read and written
    (``T * (Hq + Hkv) * rotary_dim * 2 B``, twice) plus the u32 positions (1 stream, 3 under MRoPE)."""
    streams = 1 if mrope_mode == MROPE_OFF else 3
    return 2 * total_tokens * (num_q_heads + num_kv_heads) * rotary_dim * 2 + 4 * streams * total_tokens


def inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """``inv_freq[j] = 1 / fl32(theta ** fl32(2j / rotary_dim))`` as float32, as the kernel computes it.

    Parameters
    ----------
    rotary_dim : int
        Rotated dims (even).
    theta : float
        RoPE base; taken as float32 (the kernel parameter is ``float``).

    Returns
    -------
    numpy.ndarray
        float32 ``[rotary_dim // 2]``.
    """
    half = rotary_dim // 2
    e = (np.arange(half, dtype=np.float32) * np.float32(2)) / np.float32(rotary_dim)
    p = np.power(np.float64(np.float32(theta)), e.astype(np.float64)).astype(np.float32)
    return (np.float32(1) / p).astype(np.float32)


def axis_map(half: int, mrope_mode: int, sections: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """Position stream ``s(j)`` (0 = T, 1 = H, 2 = W) of each frequency ``j < half``.

    Parameters
    ----------
    half : int
        ``rotary_dim // 2``.
    mrope_mode : int
        0 plain, 1 chunked, 2 interleaved.
    sections : tuple of int
        ``(sec_t, sec_h, sec_w)``.

    Returns
    -------
    numpy.ndarray
        int64 ``[half]``.
    """
    j = np.arange(half)
    s_t, s_h, s_w = (int(x) for x in sections)
    if mrope_mode == MROPE_OFF:
        return np.zeros(half, dtype=np.int64)
    if mrope_mode == MROPE_CHUNKED:
        return np.where(j < s_t, 0, np.where(j < s_t + s_h, 1, 2)).astype(np.int64)
    if mrope_mode == MROPE_INTERLEAVED:
        ax = np.zeros(half, dtype=np.int64)
        ax[(j % 3 == 1) & (j < 3 * s_h)] = 1
        ax[(j % 3 == 2) & (j < 3 * s_w)] = 2
        return ax
    raise ValueError(f"mrope_mode must be 0, 1 or 2, got {mrope_mode}")


def _frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The float32 inverse frequencies the kernel uses: the table's, or ``theta``'s."""
    if scaling is None:
        return inv_freq(rotary_dim, theta)
    if scaling.half != rotary_dim // 2:
        raise ValueError(f"the RopeScaling table has {scaling.half} frequencies but rotary_dim {rotary_dim} needs "
                         f"{rotary_dim // 2}")
    return np.array(scaling.inv_freq, np.float32)


def _angles(positions3: np.ndarray, rotary_dim: int, theta: float, mrope_mode: int, sections,
            scaling: RopeScaling | None = None) -> np.ndarray:
    """fp32 angles ``[T, half]`` from positions ``[3, T]`` (uint32)."""
    half = rotary_dim // 2
    ax = axis_map(half, mrope_mode, sections)
    pos = np.asarray(positions3, dtype=np.uint32).astype(np.float32)  # RN, as __uint2float_rn
    per_j = pos[ax, :].T  # [T, half]
    return (per_j * _frequencies(rotary_dim, theta, scaling)[None, :]).astype(np.float32)


def _positions3(positions, positions_h, positions_w) -> np.ndarray:
    p_t = np.asarray(positions, dtype=np.uint32).reshape(-1)
    p_h = p_t if positions_h is None else np.asarray(positions_h, dtype=np.uint32).reshape(-1)
    p_w = p_t if positions_w is None else np.asarray(positions_w, dtype=np.uint32).reshape(-1)
    if not (p_t.shape == p_h.shape == p_w.shape):
        raise ValueError(f"position streams differ in length: {p_t.shape}, {p_h.shape}, {p_w.shape}")
    return np.stack([p_t, p_h, p_w])


def _rotate(x_bits: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Rotate the rotary prefix of ``x_bits`` ``[T, H, D]`` (uint16) in float64; one bf16 rounding."""
    half = rotary_dim // 2
    out = np.array(x_bits, dtype=np.uint16, copy=True)
    if half == 0 or out.size == 0:
        return out
    x = from_bf16_bits(out[..., :rotary_dim]).astype(np.float64)
    x1, x2 = x[..., :half], x[..., half:]
    c = cos[:, None, :]
    s = sin[:, None, :]
    out[..., :half] = to_bf16_bits(x1 * c - x2 * s)
    out[..., half:rotary_dim] = to_bf16_bits(x2 * c + x1 * s)
    return out


def reference(
    q: np.ndarray,
    k: np.ndarray,
    positions: np.ndarray,
    rotary_dim: int,
    theta: float,
    mrope_mode: int = MROPE_OFF,
    sections: tuple[int, int, int] = (0, 0, 0),
    positions_h: np.ndarray | None = None,
    positions_w: np.ndarray | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel computes (returns new arrays; the kernel works in place).

    Parameters
    ----------
    q, k : numpy.ndarray
        uint16 bf16 bits, ``[T, Hq, D]`` and ``[T, Hkv, D]``.
    positions : numpy.ndarray
        uint32 ``[T]``, the T stream.
    rotary_dim : int
        Rotated prefix of each head (even, <= D).
    theta : float
        RoPE base (used as float32).
    mrope_mode : int
        0 plain, 1 chunked, 2 interleaved.
    sections : tuple of int
        ``(sec_t, sec_h, sec_w)`` for MRoPE.
    positions_h, positions_w : numpy.ndarray, optional
        uint32 ``[T]`` H and W streams (default: the T stream).
    scaling : RopeScaling, optional
        A frequency table and attention factor instead of ``theta``'s frequencies (factor 1).

    Returns
    -------
    tuple of numpy.ndarray
        ``(q_out, k_out)`` uint16 bf16 bits.

    Notes
    -----
    inv_freq and the angle are bit-for-bit the kernel's fp32 values; cos/sin are taken in
    float64 of that angle and the rotation in float64 with one rounding to bf16. The kernel uses
    ``sincosf`` (within 2 ulp) and fp32 FMAs, so the two can differ by one bf16 ulp in rare
    elements.
    """
    q = np.asarray(q)
    k = np.asarray(k)
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape} must be [T, H, D] with equal T and D")
    check_params(q.shape[2], rotary_dim, mrope_mode, tuple(sections), q.shape[1], k.shape[1])
    pos3 = _positions3(positions, positions_h, positions_w)
    if pos3.shape[1] != q.shape[0]:
        raise ValueError(f"{pos3.shape[1]} positions for {q.shape[0]} tokens")
    ang = _angles(pos3, rotary_dim, theta, mrope_mode, sections, scaling).astype(np.float64)
    af = 1.0 if scaling is None else scaling.attention_factor
    cos, sin = np.cos(ang) * af, np.sin(ang) * af
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


def hf_style_reference(
    x: np.ndarray,
    positions: np.ndarray,
    rotary_dim: int,
    theta: float,
    mrope_mode: int = MROPE_OFF,
    sections: tuple[int, int, int] = (0, 0, 0),
    positions_h: np.ndarray | None = None,
    positions_w: np.ndarray | None = None,
    scaling: RopeScaling | None = None,
) -> np.ndarray:
    """HF's bf16 formula (``x * cos + rotate_half(x) * sin`` with cos/sin rounded to bf16 and every
    bf16 op rounded) on ``x`` ``[T, H, D]`` uint16 bits; for tolerance comparisons only.

    Parameters
    ----------
    x : numpy.ndarray
        uint16 bf16 bits ``[T, H, D]``.
    positions, positions_h, positions_w : numpy.ndarray
        uint32 ``[T]`` position streams (H and W default to T).
    rotary_dim, theta, mrope_mode, sections, scaling
        As in :func:`reference`.

    Returns
    -------
    numpy.ndarray
        uint16 bf16 bits.
    """
    half = rotary_dim // 2
    pos3 = _positions3(positions, positions_h, positions_w)
    ang = _angles(pos3, rotary_dim, theta, mrope_mode, sections, scaling)
    af = np.float32(1.0 if scaling is None else scaling.attention_factor)
    cos_b = from_bf16_bits(to_bf16_bits(np.cos(ang.astype(np.float64)).astype(np.float32) * af))[:, None, :]
    sin_b = from_bf16_bits(to_bf16_bits(np.sin(ang.astype(np.float64)).astype(np.float32) * af))[:, None, :]
    out = np.array(x, dtype=np.uint16, copy=True)
    xf = from_bf16_bits(out[..., :rotary_dim])
    x1, x2 = xf[..., :half], xf[..., half:]

    def r(a):
        return from_bf16_bits(to_bf16_bits(a))

    out[..., :half] = to_bf16_bits(r(x1 * cos_b) + r(-x2 * sin_b))
    out[..., half:rotary_dim] = to_bf16_bits(r(x2 * cos_b) + r(x1 * sin_b))
    return out


def emulate_rope(args: dict, mem, grid, block) -> None:
    """Emulated-driver stand-in for ``q12_rope``: reads metadata and tensors through ``mem``.

    Parameters
    ----------
    args : dict
        Kernel parameters by name (``m`` a :class:`Q12MetaC`, pointers and ints as ``int``,
        ``theta`` as float).
    mem : object
        Emulated device memory; ``mem.array(ptr, dtype, shape)`` is a writable view.
    grid, block : tuple of int
        The launch geometry.

    Raises
    ------
    ValueError
        On a launch shape the kernel does not handle (1-D grid and block of whole warps needed;
        the grid-stride loop covers any grid size), on parameters the kernel would trap on, and
        on MRoPE sections that do not sum to ``rotary_dim // 2`` (the kernel does not check
        them; the host must).
    """
    check_1d_launch("q12_rope", grid, block, MAX_THREADS)
    m: Q12MetaC = args["m"]
    hq, hkv = int(args["num_q_heads"]), int(args["num_kv_heads"])
    d, rd = int(args["head_dim"]), int(args["rotary_dim"])
    mode = int(args["mrope_mode"])
    sections = (int(args["sec_t"]), int(args["sec_h"]), int(args["sec_w"]))
    if rd <= 0 or hq + hkv <= 0:
        return  # the kernel returns before anything else
    # The kernel traps on these.
    if rd % 2 or rd > d or rd // 2 > MAX_ROTARY_DIM // 2 or mode not in (0, 1, 2) or hq < 0 or hkv < 0:
        raise ValueError(f"q12_rope would trap: head_dim={d} rotary_dim={rd} mode={mode} heads={hq},{hkv}")
    t = int(m.total_tokens)
    if t == 0:
        return
    p_t = np.array(mem.array(m.positions, np.uint32, (t,)))
    if mode == MROPE_OFF:
        p_h = p_w = None
    else:
        p_h = np.array(mem.array(m.positions_h, np.uint32, (t,)))
        p_w = np.array(mem.array(m.positions_w, np.uint32, (t,)))
    q = mem.array(args["q"], np.uint16, (t, hq, d)) if hq else np.zeros((t, 0, d), np.uint16)
    k = mem.array(args["k"], np.uint16, (t, hkv, d)) if hkv else np.zeros((t, 0, d), np.uint16)
    theta = float(np.float32(args["theta"]))
    table = args["table"]
    scaling = None
    if table.size:
        if table.size != rd // 2:
            raise ValueError(f"q12_rope would trap: a table of {table.size} frequencies for rotary_dim {rd}")
        scaling = RopeScaling(tuple(table.inv_freq[:table.size]), table.attention_factor)
    q_out, k_out = reference(q, k, p_t, rd, theta, mode, sections, p_h, p_w, scaling)
    if hq:
        q[...] = q_out
    if hkv:
        k[...] = k_out


EMULATORS = {"q12_rope": emulate_rope}

registry.register(SOURCE, ENTRIES, EMULATORS, defines=CONTRACTS, structs={"RopeTable": RopeTableC})
