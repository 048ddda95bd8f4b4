"""A randomized check names its seed when it fails, and prints nothing when it passes."""
from __future__ import annotations

import functools
import inspect

__all__ = ["names_its_seed"]


def names_its_seed(check):
    """Decorate a ``check_*`` function that takes a ``seed``: an ``AssertionError`` it raises
    ends with ``(seed=N)``, the seed it ran with, so that the failing run can be repeated
    exactly (``check(impl, seed=N)``); a check that passes leaves nothing on the page."""
    signature = inspect.signature(check)

    @functools.wraps(check)
    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        try:
            return check(*args, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (seed={bound.arguments['seed']})") from exc

    return run
