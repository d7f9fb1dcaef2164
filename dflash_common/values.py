"""What counts as a whole number and as a real number in a config, for every component's
validation (a bool is neither, although Python counts it as an int)."""

from __future__ import annotations

import math

import numpy as np


def is_int(value: object) -> bool:
    """A whole number: a Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: object, finite: bool = False) -> bool:
    """A number that is not NaN (nor infinite, with `finite`): int or float, not a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(value) if finite else not math.isnan(value)
