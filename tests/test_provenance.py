"""The lists of where the book's numbers come from are made from the files, so they cannot
fall behind: pagedkv.provenance finds the results files each chapter names, the intro's list
(book/_results.md, written by scripts/provenance.py) is what the files say now, every file
on it is described, and the status page names no notebook the book does not have."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from pagedkv import provenance

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("provenance_script",
                                              ROOT / "scripts" / "provenance.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def notebook(path: Path, *cells) -> Path:
    """A notebook of ("code" | "markdown", source) cells."""
    nb = {"cells": [{"cell_type": kind, "metadata": {}, "source": src,
                     **({"outputs": [], "execution_count": None} if kind == "code" else {})}
                    for kind, src in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    for name in ("model-h200-2026-12-04.json", "model-h200-2026-12-04-pdl.json",
                 "serve-b256-h100-2026-12-07-x.json", "serve-b512-h100-2026-12-07-x.json",
                 "prefix-hit-2026-11-30.json", "prefix-hit-2026-12-01.json"):
        (d / name).write_text(json.dumps({"date": name[-15:-5]}))
    (d / "h200-2026-12-03-nbval.log").write_text("513 passed in 61.83s\n")
    return d


# ---- what a chapter reads ----

def test_code_names_literals_paths_and_fstrings():
    src = ('%matplotlib inline\n'
           'a = json.loads((RESULTS / "model-h200-2026-12-01.json").read_text())\n'
           'b = glob.glob("../perf/results/prefix-hit-*.json")\n'
           'c = [f"model-h200-2026-12-04{s}.json" for s in ("", "-pdl")]\n'
           'd = {b: f"serve-b{b}-h100-{tag}.json" for n, tag in ((1, "x"), (2, "y"))\n'
           '     for b in (256, 512)}\n'
           'e = f"http-{way}.json"\n'
           'f = "not a file.json is prose", "x.txt"\n')
    assert provenance.code_names(src) == {
        "model-h200-2026-12-01.json", "../perf/results/prefix-hit-*.json",
        "model-h200-2026-12-04.json",
        "model-h200-2026-12-04-pdl.json", "serve-b256-h100-x.json", "serve-b256-h100-y.json",
        "serve-b512-h100-x.json", "serve-b512-h100-y.json", "http-*.json"}


def test_a_chapter_reads_code_and_prose(tmp_path, results):
    nb = notebook(tmp_path / "09_x.ipynb",
                  ("markdown", "From `perf/results/serve-b{256,512}-h100-2026-12-07-x.json`"
                               " and `…-two.json`, not `gone-2026-01-01.json`."),
                  ("code", 'r = [f"serve-b{b}-h100-2026-12-07-x.json" for b in (256, 512)]'),
                  ("code", 'm = "model-h200-2026-12-04.json"'))
    reads = provenance.chapter_reads(nb, results)
    # the code's two literal names are left to the prose's {a,b} name that covers them
    assert list(reads) == ["serve-b{256,512}-h100-2026-12-07-x.json",
                           "model-h200-2026-12-04.json"]
    assert [p.name for p in reads["serve-b{256,512}-h100-2026-12-07-x.json"]] == [
        "serve-b256-h100-2026-12-07-x.json", "serve-b512-h100-2026-12-07-x.json"]


def test_code_that_reads_a_file_not_committed_is_an_error(tmp_path, results):
    nb = notebook(tmp_path / "09_x.ipynb", ("code", 'out = "serve.json"  # written here'),
                  ("code", 'x = "../perf/results/model-h999-2027-01-01.json"'))
    with pytest.raises(FileNotFoundError, match="cell 1, reads .*model-h999-2027-01-01.json"):
        provenance.chapter_reads(nb, results)
    nb = notebook(tmp_path / "09_x.ipynb", ("code", 'out = "serve.json"  # written here'))
    assert provenance.chapter_reads(nb, results) == {}


def test_card_and_date_from_the_file_or_its_name(tmp_path):
    gpu = tmp_path / "serve-h200-2026-12-02.json"
    gpu.write_text(json.dumps({"date": "2026-12-02T02:10:40",
                               "machine": {"device": "NVIDIA H200"}}))
    cpu = tmp_path / "bookkeeping-2026-11-30.json"
    cpu.write_text(json.dumps({"date": "2026-11-30 13:42 UTC", "machine": "x86_64"}))
    log = tmp_path / "h100-2026-12-07-nbval.log"
    log.write_text("1 passed in 1.0s\n")
    assert provenance.card_and_date(gpu) == ("H200", "2026-12-02")
    assert provenance.card_and_date(cpu) == ("CPU", "2026-11-30")
    assert provenance.card_and_date(log) == ("H100", "2026-12-07")


# ---- the book's own lists ----

def test_every_file_a_chapter_names_is_on_the_intro_list():
    """An oracle that shares no code with pagedkv.provenance: every committed file whose
    exact name appears in a chapter's cells must be on the intro's list under that
    chapter's heading."""
    committed = {p.name for p in provenance.RESULTS.iterdir()}
    listed = (ROOT / "book" / "_results.md").read_text()
    sections = dict(re.findall(r"^- \{doc\}`[^<`]*<([^>]+)>`:\n((?:  - .*\n)*)",
                               listed, re.M))
    missing = []
    for nb in sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb")):
        text = "".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"])
        for name in sorted(set(re.findall(r"[\w.-]+\.(?:json|log)", text)) & committed):
            entries = re.findall(r"^  - `([^`]+)`", sections.get(nb.stem, ""), re.M)
            if not any(name in provenance.expand(e) or (
                    "*" in e and Path(name).match(e)) for e in entries):
                missing.append(f"{nb.stem}: {name}")
    assert not missing, "on no list: " + ", ".join(missing)


def test_the_intro_list_is_what_the_files_say_now():
    assert (ROOT / "book" / "_results.md").read_text() == script.text(), (
        "book/_results.md is out of date: run python scripts/provenance.py")
    assert "{include} _results.md" in (ROOT / "book" / "intro.md").read_text()


def test_every_file_on_the_list_is_described_and_nothing_else():
    sources = provenance.sources()
    names = {s.name for s in sources}
    assert not [s.name for s in sources if not s.what], "add them to perf/results/about.json"
    stale = set(provenance.about()) - names
    assert not stale, f"perf/results/about.json describes files nothing reads: {stale}"


def stale_notebooks(text: str, book: Path = ROOT / "book") -> list[str]:
    """Notebook names in ``text`` (``NN_name.ipynb``, or a {doc} target) that book/ lacks."""
    names = set(re.findall(r"\b(\d\d_[a-z0-9_]+)\.ipynb\b", text))
    names |= set(re.findall(r"\{doc\}`[^`<]*<(\d\d_[a-z0-9_]+)>`", text))
    return sorted(n for n in names if not (book / f"{n}.ipynb").exists())


def test_the_check_finds_a_notebook_that_is_gone():
    assert stale_notebooks("ran 13_scheduling.ipynb and 15_scheduling.ipynb, and "
                           "{doc}`chapter 9 <09_attention_kernels>`") == ["15_scheduling"]


def test_the_status_page_names_only_notebooks_that_exist():
    cells = json.loads((ROOT / "book" / "status.ipynb").read_text())["cells"]
    text = "".join("".join(c["source"]) + "".join(
        "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
        for o in c.get("outputs", [])) for c in cells)
    text += (ROOT / "book" / "_results.md").read_text()
    assert not stale_notebooks(text)


# ---- the GPU runs of every notebook ----

OLD_LOG = """bringing up nodes...
........F..                                                     [100%]
FAILED book/03_allocator.ipynb::Cell 2
ERROR book/15_scheduling.ipynb::Cell 0 - Failed: Timeout
1 failed, 444 passed, 24 errors in 72.80s (0:01:12)
"""
NEW_LOG = """# date: 2026-12-07T09:30:00Z
# gpu: NVIDIA H100 80GB HBM3, 550.90.07, 81559 MiB
# backend: {'backend': 'cupy'}
# commit: unknown
....                                                            [100%]
==== short test summary info ====
PASSED book/01_why_paging.ipynb::Cell 0
PASSED book/01_why_paging.ipynb::Cell 1
PASSED book/02_setup.ipynb::Cell 0
FAILED book/13_scheduling.ipynb::Cell 5 - nbval differs
3 passed, 1 failed in 40.10s
"""


def test_an_old_log_names_its_failures_only(tmp_path):
    log = tmp_path / "h200-2026-12-02-nbval.log"
    log.write_text(OLD_LOG)
    (tmp_path / "h200-2026-12-02-pytest.log").write_text("1 passed in 1s\n")
    run = provenance.parse_nbval_log(log)
    assert (run.card, run.date, run.passed, run.failed, run.errors, run.total) == (
        "H200", "2026-12-02", 444, 1, 24, 469)
    assert run.not_passed == ["03_allocator.ipynb", "15_scheduling.ipynb"]
    assert run.cells is None and run.seconds == 72.8
    assert run.tests_log.name == "h200-2026-12-02-pytest.log"


def test_a_new_log_says_where_when_and_every_cell(tmp_path):
    log = tmp_path / "h100-2026-12-07-nbval.log"
    log.write_text(NEW_LOG)
    run = provenance.parse_nbval_log(log)
    assert (run.card, run.date, run.passed, run.failed) == ("H100", "2026-12-07", 3, 1)
    assert run.cells == {"01_why_paging.ipynb": 2, "02_setup.ipynb": 1,
                         "13_scheduling.ipynb": 1}
    assert run.not_passed == ["13_scheduling.ipynb"] and run.tests_log is None


def test_the_newest_run_of_every_notebook(tmp_path):
    for name, text in (("h200-2026-12-03-nbval.log", "3 failed, 471 passed in 43.8s\n"),
                       ("h200-2026-12-03-nbval-all.log", "513 passed in 61.8s\n"),
                       ("h200-2026-12-04-nbval-rerun.log", "42 passed in 22.6s\n"),
                       ("h200-2026-12-02-nbval.log", OLD_LOG)):
        (tmp_path / name).write_text(text)
    runs = provenance.gpu_runs(tmp_path)
    assert [r.log.name for r in runs] == ["h200-2026-12-02-nbval.log",
                                          "h200-2026-12-03-nbval.log",
                                          "h200-2026-12-03-nbval-all.log"]
    (tmp_path / "h100-2026-12-07-nbval.log").write_text(NEW_LOG)
    assert provenance.newest_gpu_run(tmp_path).card == "H100"


def test_what_a_run_says_of_one_notebook(tmp_path):
    old = tmp_path / "h200-2026-12-02-nbval.log"
    old.write_text(OLD_LOG)
    (tmp_path / "h200-2026-12-02-pytest.log").write_text(
        "SKIPPED [1] tests/test_backend.py:32: a GPU is usable here, so cupy can be had\n")
    run = provenance.parse_nbval_log(old)
    assert run.outcome("03_allocator") == "1 of its cells did not pass"
    assert run.outcome("02_setup.ipynb").startswith("none of its cells failed")
    assert run.on_cupy is True
    new = tmp_path / "h100-2026-12-07-nbval.log"
    new.write_text(NEW_LOG.replace("'cupy'", "'numpy'"))
    run = provenance.parse_nbval_log(new)
    assert run.outcome("01_why_paging") == "all 2 of its cells passed"
    assert run.outcome("13_scheduling") == "1 of its 1 cells did not pass"
    assert run.outcome("09_attention_kernels") == "it was not in the run"
    assert run.on_cupy is False
