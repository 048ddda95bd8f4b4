"""Turn plain "chapter N" mentions in the book's prose into links.

    python scripts/link_chapters.py [--check] [NOTEBOOK ...]

In the markdown cells of the given notebooks (default: every numbered chapter in
``_toc.yml``), a plain "chapter 9" or "Chapter 9" becomes
{doc}`chapter 9 <09_attention_kernels>`, and in "chapters 3 to 5", "chapters 3, 4 and 5" or
"chapters 3–5" each number becomes a link of its own. The number-to-file map comes from
``_toc.yml``: chapters are numbered in toc order across the numbered parts (the book sets
use_multitoc_numbering), and a numbered chapter's file name must start with its number,
which is checked.

Only a cell's first mention of each chapter is linked (``--every``: all of them), and none
where the cell links that chapter already. Left alone: mentions inside a role or a link,
inside code (spans and fenced blocks), in headings, on a directive's opening line (an
exercise's title) and its option lines, numbers that are no chapter of the book, and a
chapter's mentions of itself. A line that a link pushes past 96 columns is re-broken (the
paragraph's following lines flow on from it). Running it twice changes nothing the second
time. With ``--check`` nothing is written; the exit status is 1 if a file would change (each
mention that would be linked is listed), 0 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]

# a fenced block: ``` or ~~~ (three or more), or a MyST colon fence :::
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}|:{3,})\s*(\{([^}]*)\})?")
# directives whose body is code or data, not prose
CODE_DIRECTIVES = {"code", "code-block", "code-cell", "sourcecode", "literalinclude", "math",
                   "raw", "eval", "eval:figure", "csv-table", "mermaid", "glue", "glue:figure"}
# what a mention must not be inside: a code span (with the role before it, if any), a
# markdown link or image, an autolink or HTML tag, inline math
PROTECTED = re.compile(
    r"(?:\{[^{}\s`]+\})?(`+)(?:.|\n)*?(?<!`)\1(?!`)"     # {role}`...` or `code`
    r"|!?\[[^\]\n]*\]\([^)\n]*\)"                        # [text](target), ![alt](src)
    r"|!?\[[^\]\n]*\]\[[^\]\n]*\]"                       # [text][ref]
    r"|<[^<>\n]+>"                                       # <https://...>, <span ...>
    r"|\$[^$\n]+\$")                                     # $math$
# "chapter 9"; "chapters 3 to 5", "chapters 3, 4 and 5", "chapters 3–5" (a list only after
# the plural: in "chapter 3 and 4 blocks" the 4 is no chapter)
NUMBER_LIST = r"\d{1,2}(?:(?:\s*,\s*|\s+and\s+|\s+or\s+|\s+to\s+|\s*[–-]\s*)\d{1,2})*"
MENTION = re.compile(r"(?<![\w{`<])(?:([Cc]hapter)(\s+)(\d{1,2})|([Cc]hapters)(\s+)("
                     + NUMBER_LIST + r"))(?![\w.]\d|\d)")
NUMBER = re.compile(r"\d{1,2}")


def chapter_map(toc_path: pathlib.Path = ROOT / "_toc.yml") -> dict[int, pathlib.Path]:
    """Chapter number -> notebook path (relative to the repository root), in toc order."""
    toc = yaml.safe_load(toc_path.read_text())
    out, n = {}, 0
    for part in toc.get("parts", []):
        if not part.get("numbered"):
            continue
        for entry in part.get("chapters", []):
            n += 1
            file = pathlib.Path(entry["file"])
            prefix = re.match(r"(\d+)_", file.name)
            if prefix is None:                    # an appendix page: numbered, not a chapter
                continue
            if int(prefix.group(1)) != n:
                raise SystemExit(f"_toc.yml: {file} is chapter {n} in toc order, but its "
                                 f"name says {int(prefix.group(1))}")
            out[n] = file
    return out


def prose_ranges(text: str) -> list[tuple[int, int]]:
    """(start, end) character ranges of a markdown cell that hold prose: everything but
    fenced code, headings, directive opening lines and their option lines."""
    ranges, pos, fence, code = [], 0, None, False
    fence_stack, in_options = [], False
    for line in text.splitlines(keepends=True):
        start, pos = pos, pos + len(line)
        stripped = line.strip()
        m = FENCE.match(line)
        if fence is not None:
            # a closing fence: the same character, at least as long, and nothing after it
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and stripped == m.group(1):
                fence_stack.pop()
                fence, code = fence_stack[-1] if fence_stack else (None, False)
                in_options = False
                continue
            if code:
                continue
            if m:                                 # a fence nested in a prose directive
                directive = m.group(3).strip() if m.group(2) else None
                fence_stack.append((m.group(1),
                                    directive is None or directive in CODE_DIRECTIVES))
                fence, code = fence_stack[-1]
                in_options = True
                continue
            if in_options and (stripped.startswith(":") or stripped == ""):
                in_options = stripped != ""
                continue
            in_options = False
        elif m:
            directive = m.group(3).strip() if m.group(2) else None
            fence_stack = [(m.group(1), directive is None or directive in CODE_DIRECTIVES)]
            fence, code = fence_stack[0]
            in_options = True
            continue
        if re.match(r" {0,3}#{1,6}(\s|$)", line):   # a heading
            continue
        ranges.append((start, pos))
    # merge neighbouring lines, so that a code span across two lines is seen whole
    merged = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


DOC_TARGET = re.compile(r"\{doc\}`(?:[^`<]*<([^>`]+)>|([^`<]+))`")


def link_text(text: str, chapters: dict[int, str], self_number: int | None,
              every: bool = False) -> tuple[str, list]:
    """``text`` with its plain chapter mentions linked, and the mentions that were. Only
    the first mention of a chapter in ``text`` (a cell) is linked, unless ``every``; one
    that ``text`` links already is not linked again."""
    out, last, found = [], 0, []
    linked = {(a or b).strip() for a, b in DOC_TARGET.findall(text)} if not every else None
    for a, b in prose_ranges(text):
        segment = text[a:b]
        gaps, p = [], 0
        for m in PROTECTED.finditer(segment):
            gaps.append((p, m.start()))
            p = m.end()
        gaps.append((p, len(segment)))
        pieces, q = [], 0
        for ga, gb in gaps:
            pieces.append(segment[q:ga])
            pieces.append(_link_gap(segment[ga:gb], chapters, self_number, found, linked))
            q = gb
        pieces.append(segment[q:])
        out.append(text[last:a])
        out.append("".join(pieces))
        last = b
    out.append(text[last:])
    return "".join(out), found


def _link_gap(gap: str, chapters: dict[int, str], self_number, found: list,
              linked: set | None) -> str:
    def one(m: re.Match) -> str:
        word, space, numbers = (m.group(1, 2, 3) if m.group(1) else m.group(4, 5, 6))
        values = [int(x) for x in NUMBER.findall(numbers)]
        if any(v not in chapters or v == self_number for v in values):
            return m.group(0)                     # not all of them chapters, or this one
        new = [v for v in values if linked is None or chapters[v] not in linked]
        if not new:
            return m.group(0)                     # linked already in this cell
        if linked is not None:
            linked.update(chapters[v] for v in new)
        found.append(m.group(0).replace("\n", " "))
        if len(values) == 1:                      # the word goes inside the link
            return f"{{doc}}`{word}{space}{values[0]} <{chapters[values[0]]}>`"
        return word + space + NUMBER.sub(
            lambda n: (f"{{doc}}`{n.group(0)} <{chapters[int(n.group(0))]}>`"
                       if int(n.group(0)) in new else n.group(0)), numbers)
    return MENTION.sub(one, gap)


BLOCK_START = re.compile(r"\s*(?:[-*+]\s|\d+[.)]\s|#|>|\||`{3}|~{3}|:|=+\s*$|-+\s*$)")
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+[.)])\s+")


def rewrap(old: str, new: str, width: int = 96) -> str:
    """Re-break the lines of ``new`` that linking pushed past ``width`` (lines that were
    longer before are left as they were): the words past the width move to the start of
    the paragraph's next line, which is broken in turn, or to a line of their own at the
    paragraph's end. A line is never broken so that the next one would start a new block
    (a list item, a heading, a table row, a fence), and table rows are left whole."""
    old_lines, lines = old.split("\n"), new.split("\n")
    if len(old_lines) != len(lines):
        return new
    for i in reversed(range(len(lines))):
        if lines[i] == old_lines[i] or len(lines[i]) <= width or len(old_lines[i]) > width \
                or lines[i].lstrip().startswith("|"):
            continue
        j, line = i, lines[i]
        while len(line) > width:
            cut = _break_at(line, width)
            if cut is None:
                break
            lines[j], tail = line[:cut].rstrip(), line[cut:].strip()
            nxt = lines[j + 1] if j + 1 < len(lines) else ""
            if nxt.strip() and not BLOCK_START.match(nxt):
                j += 1                                    # the paragraph goes on: join it
                line = nxt[:len(nxt) - len(nxt.lstrip())] + tail + " " + nxt.lstrip()
            else:                                         # its last line: a new one
                item = LIST_ITEM.match(lines[j])
                indent = " " * item.end() if item else lines[j][:len(lines[j])
                                                                - len(lines[j].lstrip())]
                lines.insert(j + 1, indent + tail)
                j, line = j + 1, indent + tail
        lines[j] = line
    return "\n".join(lines)


def _break_at(line: str, width: int):
    """Where to break ``line``: the last space within ``width``, outside roles and code
    spans, after which no new block would start, past the line's indentation and list
    marker; None if there is none."""
    item = LIST_ITEM.match(line)
    start = item.end() if item else len(line) - len(line.lstrip())
    inside = [m.span() for m in PROTECTED.finditer(line)]      # no break inside a role
    for k in range(min(width, len(line) - 1), start, -1):
        if line[k] == " " and line[k - 1] != " " and not BLOCK_START.match(line[k + 1:]) \
                and not any(a < k < b for a, b in inside):
            return k
    return None


def process(path: pathlib.Path, chapters: dict[int, pathlib.Path], write: bool,
            every: bool = False) -> list:
    """Link the mentions in one notebook's markdown cells; returns what was (or would be)
    linked, as (cell index, mention)."""
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    here = path.resolve().parent
    targets = {n: os.path.relpath(ROOT / f, here).replace(os.sep, "/")
               for n, f in chapters.items()}
    self_number = next((n for n, f in chapters.items()
                        if (ROOT / f).with_suffix("") == path.resolve().with_suffix("")), None)
    changes = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        src = cell["source"]
        text = "".join(src) if isinstance(src, list) else src
        new, found = link_text(text, targets, self_number, every)
        if new != text:
            new = rewrap(text, new)
            cell["source"] = new.splitlines(keepends=True) if isinstance(src, list) else new
            changes += [(i, f) for f in found]
    if changes and write:
        indent = 1 if raw.startswith("{\n \"") else 2
        path.write_text(json.dumps(nb, indent=indent, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    return changes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=pathlib.Path)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if any notebook would change")
    ap.add_argument("--every", action="store_true",
                    help="link every mention, not only a cell's first of each chapter")
    args = ap.parse_args(argv)
    chapters = chapter_map()
    paths = args.notebooks or [(ROOT / f).with_suffix(".ipynb") for f in chapters.values()]
    changed = 0
    for path in paths:
        changes = process(path, chapters, write=not args.check, every=args.every)
        if changes:
            changed += 1
            verb = "would link" if args.check else "linked"
            print(f"{path}: {verb} {len(changes)}")
            for i, mention in changes:
                print(f"  cell {i}: {mention}")
    if args.check:
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
