"""Argument checks and integer arithmetic shared by every module (one copy of each)."""
from __future__ import annotations

import reprlib

import numpy as np

from .errors import ConfigError

__all__ = ["positive_int", "count", "cdiv", "is_int", "token_ids", "bad_token_ids"]


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


def bad_token_ids(tokens) -> ConfigError:
    """The error for token ids that break :func:`token_ids`' rule."""
    return ConfigError(f"token ids must be integers in [0, 2**63), given as a list, a "
                       f"tuple or a 1-D integer array; got {reprlib.repr(tokens)}")


def token_ids(tokens) -> list:
    """Token ids as a list of Python ints. The rule, the same for every call that takes
    token ids on both paths: a list, a tuple or a 1-D integer array of Python or NumPy
    integers in [0, 2**63) (an engine further bounds them by its vocabulary). Bools,
    floats, ``None``, strings and values out of range are a :class:`ConfigError`."""
    if isinstance(tokens, np.ndarray):
        ok = tokens.ndim == 1 and tokens.dtype.kind in "iu"
        items = tokens.tolist() if ok else [None]
    elif isinstance(tokens, (list, tuple)):
        items = tokens
    else:
        items = [None]
    if not all(is_int(t) and 0 <= t < 2**63 for t in items):
        raise bad_token_ids(tokens)
    return [int(t) for t in items]
