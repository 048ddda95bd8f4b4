"""Checks of the notebooks' source, before anything runs.

* A name that a markdown cell shows with {eval} keeps its value for the rest of the notebook.
  JupyterLab (jupyterlab-myst) may evaluate a markdown cell's expressions again after later
  cells ran, so a later code cell that binds the same name at the top level changes, or
  breaks, what the prose shows; the browser test caught `replay` rebound this way in
  chapter 12. Every name an {eval} expression reads must not be bound again at the top level
  of a code cell after that markdown cell.
* A line of code, or of what the code printed, fits its box on the rendered page (the
  browser test measures the boxes; at 1,366 px a box holds about 92 characters).
"""
from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
EVAL = re.compile(r"\{eval\}`([^`]+)`")


def _read(expr):
    """The global names an expression reads (not those its comprehensions bind)."""
    tree = ast.parse(expr, mode="eval")
    bound = {n.id for n in ast.walk(tree)
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _bound_at_top(source):
    """Names a code cell binds at its top level (assignments, loops, imports, defs)."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    tree = ast.parse("\n".join(lines))
    names = set()

    def targets(t):
        if isinstance(t, ast.Name):
            names.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)
        elif isinstance(t, ast.Starred):
            targets(t.value)

    def visit(body):
        for node in body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets(node.target)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                targets(node.target)
                visit(node.body + node.orelse)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        targets(item.optional_vars)
                visit(node.body)
            elif isinstance(node, (ast.If, ast.While)):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody
                      + [s for h in node.handlers for s in h.body])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names.add((a.asname or a.name).split(".")[0])
        return names

    return visit(tree.body)


def rebound(cells):
    """(markdown cell, name, later code cell) for each name an {eval} shows and a later cell
    binds again."""
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        shown = set()
        for expr in EVAL.findall("".join(cell["source"])):
            shown |= _read(expr)
        for j in range(i + 1, len(cells)):
            if cells[j]["cell_type"] == "code":
                for name in sorted(shown & _bound_at_top("".join(cells[j]["source"]))):
                    found.append((i, name, j))
    return found


def test_the_check_finds_a_rebound_name():
    cells = [{"cell_type": "code", "source": "replay = {'1': 2}"},
             {"cell_type": "markdown", "source": "{eval}`replay['1'] + n` and "
                                                 "{eval}`[k for k in ks]`"},
             {"cell_type": "code", "source": "for n in range(3):\n    pass\nk = 1"},
             {"cell_type": "code", "source": "if True:\n    replay = {}"}]
    assert rebound(cells) == [(1, "n", 2), (1, "replay", 3)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_eval_names_are_not_rebound_later(path):
    cells = json.loads(path.read_text())["cells"]
    problems = [f"cell {i} shows {name!r}, which cell {j} binds again"
                for i, name, j in rebound(cells)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_page_that_quotes_with_eval_runs_inline(path):
    """myst-nb evaluates an {eval} role only in a notebook it executes inline (the
    notebook's metadata: "mystnb": {"execution_mode": "inline"}); elsewhere the build
    warns "This document does not have a running kernel" and fails."""
    nb = json.loads(path.read_text())
    quotes = any("{eval}`" in "".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "markdown")
    mode = nb["metadata"].get("mystnb", {}).get("execution_mode")
    assert not quotes or mode == "inline", \
        f"{path.name} quotes with {{eval}} but its mystnb execution_mode is {mode!r}"


MAX_CODE_LINE = 92


def _printed(cell):
    """What a code cell printed (its stream outputs: the page shows them in a box too)."""
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_code_lines_fit_their_box(path):
    cells = json.loads(path.read_text())["cells"]
    wide = [f"cell {i} {what}: {line!r} ({len(line)} characters)"
            for i, cell in enumerate(cells) if cell["cell_type"] == "code"
            for what, text in (("source", "".join(cell["source"])),
                               ("output", _printed(cell)))
            for line in text.splitlines() if len(line) > MAX_CODE_LINE]
    assert not wide, "\n".join(wide)
