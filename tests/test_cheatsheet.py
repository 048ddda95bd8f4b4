"""The cheat sheet (book/cheatsheet.md) runs: its Python snippets, executed top to bottom in one
namespace as a reader would paste them, raise nothing (their asserts are the page's claims),
fit the page's 88 columns, and import only names the package has (its public ones, where a
module lists them in ``__all__``); every ``python -m pagedkv...`` command in its shell blocks
names a module that answers ``--help`` and options that the module's help lists; and the page
walks the chapters in the book's order, through chapter 16.

The snippets that serve (chapter 15) start the server on the small random model
(``--model tiny``) on a free port, with a start-up timeout, and stop it: bounded, no model
file."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "cheatsheet.md"
TEXT = PAGE.read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", TEXT, re.S)
SHELL = re.findall(r"```bash\n(.*?)```", TEXT, re.S)


def test_the_page_has_snippets():
    assert len(SNIPPETS) >= 16, f"{PAGE.name}: only {len(SNIPPETS)} python blocks"


def test_the_sections_follow_the_chapters():
    chapters = [int(n) for n in re.findall(r"^## .*\(chapters? (\d+)", TEXT, re.M)]
    assert chapters == list(range(1, 17)), chapters


def test_snippets_fit_the_page():
    blocks = SNIPPETS + SHELL
    wide = [(k, line) for k, s in enumerate(blocks) for line in s.splitlines()
            if len(line) > 88]
    assert not wide, wide


def _imports(snippet: str):
    """(module, name) for every ``from pagedkv... import name`` of a snippet."""
    for node in ast.walk(ast.parse(snippet)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedkv"):
            for alias in node.names:
                yield node.module, alias.name


def test_snippets_import_what_the_package_has():
    wrong = []
    for k, snippet in enumerate(SNIPPETS):
        for module, name in _imports(snippet):
            mod = importlib.import_module(module)
            public = getattr(mod, "__all__", None)
            is_module = importlib.util.find_spec(f"{module}.{name}") is not None \
                if hasattr(mod, "__path__") else False
            if not (hasattr(mod, name) or is_module):
                wrong.append((k, module, name, "missing"))
            elif public is not None and name not in public and not is_module:
                wrong.append((k, module, name, "not in __all__"))
    assert not wrong, wrong


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
        exec("assert space.alloc(71) is not None", namespace)


def _commands():
    """(module, [options]) of every ``python -m pagedkv...`` line of the shell blocks."""
    for block in SHELL:
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0]:            # VAR=value before the command
                words.pop(0)
            if words[:2] != ["python", "-m"] or not words[2].startswith("pagedkv"):
                continue
            yield words[2], [w.split("=")[0] for w in words[3:] if w.startswith("--")]


COMMANDS = list(_commands())


def test_the_page_has_commands():
    assert len(COMMANDS) >= 4, COMMANDS


@pytest.mark.parametrize("module", sorted({m for m, _ in COMMANDS}))
def test_commands_name_real_options(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    options = set(re.findall(r"--[a-z][a-z0-9-]*", r.stdout))
    used = {o for m, opts in COMMANDS if m == module for o in opts}
    assert used <= options, (module, sorted(used - options))
