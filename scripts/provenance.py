"""Write the intro's list of the committed results the book reads: ``book/_results.md``.

    python scripts/provenance.py           write it (scripts/build_book.sh does, each build)
    python scripts/provenance.py --check   exit 1 if the committed file is not what the
                                           files say now (tests/test_provenance.py)

The list is made from the files, not by hand: for each chapter (and the scoreboard), every
results file its code or prose names (``pagedkv.provenance.sources``), with the card and
date the file records and what ``perf/results/about.json`` says it holds; then the newest
run of every notebook on a GPU. ``book/intro.md`` includes it.
"""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv import provenance  # noqa: E402

OUT = ROOT / "book" / "_results.md"


def _page(stem: str) -> str:
    m = re.match(r"(\d+)_", stem)
    return f"{{doc}}`Chapter {int(m.group(1))} <{stem}>`" if m else \
        f"{{doc}}`The {stem} <{stem}>`"


def _file(source: provenance.Source) -> str:
    name = f"`{source.name}`"
    if "*" in source.name:
        name += f" (the newest: `{source.newest.name}`)"
    what = source.what or "NOT DESCRIBED in perf/results/about.json"
    return f"{name}, {source.card}, {source.date}: {what}"


def text(book=provenance.BOOK, results=provenance.RESULTS) -> str:
    """The list, as MyST markdown."""
    sources = provenance.sources(book, results)
    pages = sorted({c for s in sources for c in s.chapters},
                   key=lambda c: (not c[:2].isdigit(), c))
    lines = ["<!-- Written by scripts/provenance.py from perf/results/: do not edit. -->", ""]
    for page in pages:
        lines.append(f"- {_page(page)}:")
        lines += [f"  - {_file(s)}" for s in sources if page in s.chapters]
    run = provenance.newest_gpu_run(results)
    lines += ["", f"The newest run of every notebook on a GPU committed here is "
              f"`{run.log.name}` ({run.card}, {run.date}): {run.passed} cells passed, "
              f"{run.failed} failed, {run.errors} in error; the {{doc}}`status page "
              f"<status>` says what it covered.", ""]
    return "\n".join(lines)


def main(argv) -> int:
    new = text()
    if "--check" in argv:
        old = OUT.read_text() if OUT.exists() else ""
        if old != new:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/provenance.py")
            return 1
        return 0
    OUT.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
