"""bfloat16 on the host: numpy has no bf16 dtype, so bf16 tensors are held as uint16 bit patterns.

These two conversions are the only place q12drv turns bf16 bits into numbers and back; the
numpy kernel references and the tests use them so that host and device round the same way
(round to nearest, ties to even, as ``__float2bfloat16_rn``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["to_bf16_bits", "from_bf16_bits", "round_to_bf16"]


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float values to bfloat16 (nearest, ties to even); return the uint16 bit patterns.

    Parameters
    ----------
    x : array_like
        Values to round; converted to float32 first. NaN stays NaN (quiet).

    Returns
    -------
    numpy.ndarray
        uint16 array of the same shape holding bfloat16 bits.
    """
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(f)
    if nan.any():
        rounded = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly.

    Parameters
    ----------
    bits : numpy.ndarray
        uint16 array of bfloat16 bits.

    Returns
    -------
    numpy.ndarray
        float32 array of the same shape.
    """
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float values to the nearest bfloat16 and return them as float32."""
    return from_bf16_bits(to_bf16_bits(x))
