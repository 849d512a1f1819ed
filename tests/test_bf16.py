"""q12drv.core.bf16: round to nearest even (as ``__float2bfloat16_rn``), the same bits as ml_dtypes where it is
installed, exact widening."""

import numpy as np
import pytest

from q12drv.core.bf16 import from_bf16_bits, round_to_bf16, to_bf16_bits


def every_kind_of_float32() -> np.ndarray:
    """A sweep of float32 bit patterns (every exponent, both signs) plus the exact ties and the specials."""
    sweep = np.arange(0, 1 << 32, 65_537, dtype=np.uint64).astype(np.uint32)
    mant = np.arange(1 << 16, dtype=np.uint32)  # every low half under one high half: ties at 0x8000
    ties = np.concatenate([(np.uint32(0x3F80) << 16) | mant, (np.uint32(0x3F81) << 16) | mant,
                           (np.uint32(0x7F7F) << 16) | mant])  # 1.0, 1.0078125 and the largest finite
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF], np.uint32)
    return np.concatenate([sweep, ties, specials]).view(np.float32)


def test_round_to_nearest_even_by_hand():
    one = np.float32(1.0)
    step = np.float32(2 ** -7)  # one bf16 ulp at 1.0
    x = np.array([one + step / 2, one + step + step / 2, one + step / 4, one + 3 * step / 4], np.float32)
    # a tie goes to the even neighbour (1.0, then 1 + 2 ulp); below and above the tie round plainly
    assert from_bf16_bits(to_bf16_bits(x)).tolist() == [1.0, 1.0 + 2 * 2 ** -7, 1.0, 1.0 + 2 ** -7]
    assert to_bf16_bits(np.array([3.4e38], np.float32))[0] == 0x7F80  # rounds up past the largest: inf


def test_nan_stays_a_quiet_nan_and_widening_is_exact():
    nan = np.array([0x7F800001, 0xFFC12345], np.uint32).view(np.float32)
    bits = to_bf16_bits(nan)
    assert np.isnan(from_bf16_bits(bits)).all() and (bits & 0x40).all()
    b = np.arange(1 << 16, dtype=np.uint16)
    back = from_bf16_bits(b)
    finite = ~np.isnan(back)
    assert np.array_equal(to_bf16_bits(back)[finite], b[finite])  # bf16 -> f32 -> bf16 is the identity
    with pytest.raises(TypeError, match="must be uint16"):
        from_bf16_bits(np.zeros(4, np.int16))
    assert round_to_bf16(np.float64(1 / 3)).dtype == np.float32


def test_the_same_bits_as_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = every_kind_of_float32()
    finite = ~np.isnan(x)
    with np.errstate(invalid="ignore"):
        theirs = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(to_bf16_bits(x)[finite], theirs.view(np.uint16)[finite])
    # their arrays are taken as they are, both ways
    assert np.array_equal(to_bf16_bits(theirs), theirs.view(np.uint16))
    assert np.array_equal(from_bf16_bits(theirs)[finite], theirs.astype(np.float32)[finite])
