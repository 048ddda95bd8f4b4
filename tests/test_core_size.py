"""The teaching core stays as short as its chapters say: a reader holds it in their head.

Chapters 3 and 5 each open by stating the size of the module they show ("about N lines with
its documentation"), and the README repeats both numbers. A module that grows past its
promise fails here, with the chapter to update if the growth is worth it.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMISES = [("pagedkv/allocator.py", "book/03_allocator.ipynb"),   # module, its chapter
            ("pagedkv/manager.py", "book/05_manager.ipynb")]


def promised_lines(chapter: str) -> int:
    """The N of "about N lines" in the chapter's first cell, which says it exactly once."""
    intro = "".join(json.loads((ROOT / chapter).read_text())["cells"][0]["source"])
    found = re.findall(r"about (\d+) lines", " ".join(intro.split()))
    assert len(found) == 1, f"{chapter} should say once: 'about N lines'"
    return int(found[0])


@pytest.mark.parametrize("module, chapter", PROMISES)
def test_module_is_no_longer_than_its_chapter_promises(module, chapter):
    promise = promised_lines(chapter)
    lines = len((ROOT / module).read_text().splitlines())
    print(f"{module}: {lines} lines, {chapter} promises about {promise}")
    assert lines <= promise, (f"{module} is {lines} lines, but {chapter} promises about "
                              f"{promise} (and README.md repeats it): tighten the module, "
                              f"or change the promise in both places")


def test_readme_promises_what_the_chapters_do():
    readme = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(r"chapters show whole \((\d+) and (\d+) lines\)", readme)
    assert found, "README.md no longer states the teaching core's size"
    chapters = [promised_lines(chapter) for _, chapter in PROMISES]
    readme_says = [int(n) for n in found.groups()]
    assert readme_says == chapters, f"README.md says {readme_says}, the chapters {chapters}"
