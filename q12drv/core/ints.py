"""The scalar checks every layer uses: an exact ``int`` (or numpy integer, never a bool) in a range, and a real
``bool`` (never a string, a number or NaN taken for its truth value).

The error names the argument, the value and the bound, so a caller sees what to fix.
"""

from __future__ import annotations

import numpy as np

__all__ = ["checked_int", "checked_bool"]


def checked_int(name: str, value, lo: int = 0, hi: int | None = None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (``hi`` None: no upper bound).

    Raises
    ------
    TypeError
        Not an int or numpy integer (bools, floats and strings included).
    ValueError
        Out of range; the message gives the bound and the value.
    """
    if type(value) is int and lo <= value and (hi is None or value <= hi):  # the common case
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.60}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}, got {v}")
    return v


def checked_bool(name: str, value) -> bool:
    """``value`` as a Python bool: only ``True``/``False`` (or a numpy bool) are flags.

    ``"False"``, ``"no"``, ``1`` or NaN would otherwise be taken for their truth value (``bool("False")`` is
    True), silently turning a setting on.

    Raises
    ------
    TypeError
        Anything but a bool, naming ``name`` and the value.
    """
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r:.60}")
