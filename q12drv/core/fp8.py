"""FP8 e4m3 (``float8_e4m3fn``: 4 exponent bits of bias 7, 3 mantissa bits, no infinities, 0x7f / 0xff NaN) on the
host: what the FP8 KV write stores and attention reads, for the emulator and the references.

:func:`to_e4m3_bits` rounds as the kernels' ``cvt.rn.satfinite.e4m3x2.f32`` does: to nearest, ties to even, finite
values past the largest (448) saturate to +-448, NaN stays NaN. Numbers below 2**-6 are subnormal (steps of 2**-9).
"""

from __future__ import annotations

import numpy as np

__all__ = ["E4M3_MAX", "to_e4m3_bits", "from_e4m3_bits"]

#: The largest finite e4m3 value.
E4M3_MAX = 448.0
_MIN_NORMAL_EXP = -6
_MANTISSA_BITS = 3


def _decode_table() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = (bits & 0x7).astype(np.float64)
    value = np.where(exp == 0, man * 2.0 ** (_MIN_NORMAL_EXP - _MANTISSA_BITS),
                     (1.0 + man / 8.0) * np.exp2(exp.astype(np.float64) - 7))
    value = sign * value
    value[(bits & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


_DECODE = _decode_table()


def from_e4m3_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of e4m3 bytes (uint8)."""
    return _DECODE[np.asarray(bits, dtype=np.uint8)]


def to_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """e4m3 bytes (uint8) of float32 ``x``: round to nearest even, saturating to +-448; NaN to 0x7f (sign kept)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    # the spacing of the grid at |x|: 2**(e - 3) for normal numbers, 2**-9 below 2**-6
    e = np.floor(np.log2(np.maximum(a, 2.0 ** _MIN_NORMAL_EXP)))
    quantum = np.exp2(e - _MANTISSA_BITS)
    r = np.minimum(np.round(a / quantum) * quantum, E4M3_MAX)  # np.round: ties to even; exact in float64
    exp = np.floor(np.log2(np.maximum(r, 2.0 ** _MIN_NORMAL_EXP)))
    normal = r >= 2.0 ** _MIN_NORMAL_EXP
    man = np.where(normal, r / np.exp2(exp) * 8 - 8, r / 2.0 ** (_MIN_NORMAL_EXP - _MANTISSA_BITS))
    field = np.where(normal, (exp + 7).astype(np.int64) << 3, 0) + np.rint(man).astype(np.int64)
    out = field.astype(np.uint8) | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(nan, out | 0x7F, out).astype(np.uint8)
