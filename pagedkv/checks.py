"""Argument checks and integer arithmetic shared by every module (one copy of each)."""
from __future__ import annotations

import numpy as np

from .errors import ConfigError

__all__ = ["positive_int", "count", "cdiv", "is_int"]


def is_int(value) -> bool:
    """A Python or NumPy integer, and not a bool (``True`` is an ``int`` in Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(value, what: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 1, else :class:`ConfigError`."""
    if not is_int(value) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def count(value, what: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 0, else :class:`ConfigError`."""
    if not is_int(value) or value < 0:
        raise ConfigError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def cdiv(a, b):
    """Ceiling division, ``ceil(a / b)`` for integers (works on NumPy arrays too)."""
    return -(-a // b)
