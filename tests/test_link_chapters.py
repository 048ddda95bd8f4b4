"""scripts/link_chapters.py links plain "chapter N" mentions in prose and nothing else: not
code, headings, exercise titles, existing links, numbers that are no chapter, a chapter's
mentions of itself; a second run changes nothing; --check fails while a mention is plain."""
from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("link_chapters",
                                              ROOT / "scripts" / "link_chapters.py")
lc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lc)

CHAPTERS = lc.chapter_map()
TARGETS = {n: f.stem for n, f in CHAPTERS.items()}


def link(text, self_number=8, every=False):
    return lc.link_text(text, TARGETS, self_number, every)[0]


def test_the_toc_numbers_the_chapter_files():
    assert sorted(CHAPTERS) == list(range(1, 18))
    assert all(f.name.startswith(f"{n:02d}_") for n, f in CHAPTERS.items())


def test_single_mentions_and_lists():
    assert link("Chapter 1 showed it; chapter 9's kernels.") == (
        "{doc}`Chapter 1 <01_why_paging>` showed it; "
        "{doc}`chapter 9 <09_attention_kernels>`'s kernels.")
    assert link("chapters 3 to 5, chapters 6–7") == (
        "chapters {doc}`3 <03_allocator>` to {doc}`5 <05_manager>`, "
        "chapters {doc}`6 <06_simulation>`–{doc}`7 <07_copy_on_write>`")
    assert link("chapters 3, 4 and\n5") == (
        "chapters {doc}`3 <03_allocator>`, {doc}`4 <04_page_table>` and\n"
        "{doc}`5 <05_manager>`")


def test_what_is_left_alone():
    text = ("# Chapter 3 in a heading\n"
            "`chapter 3` in code, {doc}`chapter 11\n<11_prefix_caching>` linked,\n"
            "[chapter 4](04_page_table.ipynb), chapter 8 itself, chapter 18, chapter 9.2,\n"
            "chapters 3 and 40\n"
            "```{exercise} Sharing, as in chapter 7\n:label: ex-x\n\nsee chapter 7\n```\n"
            "```python\n# chapter 5\n```\n")
    assert link(text) == text.replace("see chapter 7",
                                      "see {doc}`chapter 7 <07_copy_on_write>`")


def test_first_mention_per_cell_and_idempotent():
    text = "chapter 5 and chapter 5 again, and {doc}`chapter 6 <06_simulation>`; chapter 6"
    once = link(text)
    assert once == ("{doc}`chapter 5 <05_manager>` and chapter 5 again, and "
                    "{doc}`chapter 6 <06_simulation>`; chapter 6")
    assert link(once) == once
    assert link(text, every=True).count("{doc}`chapter 5") == 2


def test_check_mode_on_a_notebook(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["See chapter 9.\n"]},
                    {"cell_type": "code", "metadata": {}, "execution_count": None,
                     "outputs": [], "source": ["# chapter 9\n"]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "book" / "x.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps(nb, indent=1) + "\n")
    assert lc.main(["--check", str(path)]) == 1
    assert json.loads(path.read_text()) == nb            # --check writes nothing
    assert lc.main([str(path)]) == 0
    cells = json.loads(path.read_text())["cells"]
    target = lc.os.path.relpath(ROOT / "book" / "09_attention_kernels", path.parent)
    assert cells[0]["source"] == [f"See {{doc}}`chapter 9 <{target}>`.\n"]
    assert cells[1]["source"] == ["# chapter 9\n"]       # code cells are not touched
    assert lc.main(["--check", str(path)]) == 0


def test_a_lengthened_line_is_rebroken_and_the_paragraph_flows_on():
    old = ("We have a pool of blocks (chapter 3) and page tables that map a sequence's tokens "
           "into them\n(chapter 4). A serving engine runs many sequences at once.\n"
           "- a list item stays one\n")
    new = lc.rewrap(old, link(old))
    lines = new.split("\n")
    assert max(map(len, lines)) <= 96, lines
    assert lines[-2] == "- a list item stays one"
    words = lambda t: t.split()
    assert words(new) == words(old.replace("(chapter 3)", "({doc}`chapter 3 <03_allocator>`)")
                               .replace("(chapter 4)", "({doc}`chapter 4 <04_page_table>`)"))
    assert all("{doc}`chapter" not in line or line.count("`") % 2 == 0 for line in lines)
    item = "1. **Counts.** Remember how many owners each block has, since chapter 7 lets several\n"
    out = lc.rewrap(item, link(item)).split("\n")
    assert out[1].startswith("   ") and not out[1].startswith("    ")   # inside the item
