"""The cheat sheet (book/cheatsheet.md) runs: its Python snippets, executed top to bottom in one
namespace as a reader would paste them, raise nothing (their asserts are the page's claims),
fit the page's 88 columns, and name only what the package exports."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "book" / "cheatsheet.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_has_snippets():
    assert len(SNIPPETS) >= 5, f"{PAGE.name}: only {len(SNIPPETS)} python blocks"


def test_snippets_fit_the_page():
    wide = [(k, line) for k, s in enumerate(SNIPPETS) for line in s.splitlines()
            if len(line) > 88]
    assert not wide, wide


def test_snippets_run_in_order():
    namespace: dict = {}
    for k, snippet in enumerate(SNIPPETS):
        try:
            exec(compile(snippet, f"{PAGE.name}, snippet {k}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"snippet {k} of {PAGE.name} raised {exc!r}:\n{snippet}")


def test_a_wrong_claim_would_fail():
    # the check can fail: a snippet whose assert is false is reported
    namespace: dict = {}
    exec(compile(SNIPPETS[0], "first", "exec"), namespace)
    with pytest.raises(AssertionError):
        exec("assert alloc.refcount(alloc.allocate()) == 2", namespace)
