"""Every exercise solution in ``solutions/`` passes its check, and every check rejects the
wrong answers listed beside it (the convention is in ``solutions/__init__.py``).

Modules are found on disk (``solutions/ch*.py``), so a new chapter's solutions are collected
without editing this file.
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import solutions

MODULES = sorted(p.stem for p in Path(solutions.__file__).parent.glob("ch*.py"))


def _module(name):
    return importlib.import_module(f"solutions.{name}")


def _checks():
    for name in MODULES:
        mod = _module(name)
        for attr, fn in inspect.getmembers(mod, inspect.isfunction):
            if attr.startswith("check_") and fn.__module__ == mod.__name__:
                yield pytest.param(fn, id=f"{name}.{attr}")


def _wrong_answers():
    for name in MODULES:
        mod = _module(name)
        for target, wrongs in getattr(mod, "WRONG", {}).items():
            for k, wrong in enumerate(wrongs):
                yield pytest.param(getattr(mod, f"check_{target}"), wrong,
                                   id=f"{name}.{target}.wrong{k}")


def test_there_are_solutions():
    assert MODULES, "solutions/ has no chNN.py module"


@pytest.mark.parametrize("name", MODULES)
def test_every_solution_has_a_check(name):
    mod = _module(name)
    assert getattr(mod, "__all__", None), f"solutions/{name}.py has no __all__"
    missing = [s for s in mod.__all__ if not callable(getattr(mod, f"check_{s}", None))]
    assert not missing, f"solutions/{name}.py: no check_<name> for {missing}"
    unknown = sorted(set(getattr(mod, "WRONG", {})) - set(mod.__all__))
    assert not unknown, f"solutions/{name}.py: WRONG names what is not a solution: {unknown}"


@pytest.mark.parametrize("check", list(_checks()))
def test_solution_passes_its_check(check):
    check()


@pytest.mark.parametrize("check, wrong", list(_wrong_answers()))
def test_check_rejects_a_wrong_answer(check, wrong):
    with pytest.raises(AssertionError):
        check(wrong)
