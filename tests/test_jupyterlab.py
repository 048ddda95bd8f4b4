"""Run every chapter in JupyterLab, in a real browser, as a reader of the notebooks would.

One JupyterLab server (from this venv, on 127.0.0.1, with a random token, no browser of its
own) serves the repository for the whole session. For each notebook listed in ``_toc.yml``,
Debian's Chromium (through Playwright, see ``conftest.py``) opens it, runs all cells, and
checks that:

- no cell has an error output, and every code cell ran;
- every number the prose quotes with MyST's ``{eval}`` role was computed (jupyterlab-myst
  stores each result in the cell's ``user_expressions`` metadata: all of them ``ok``) and is
  shown (no raw ``{eval}`` text and no ``NameError`` in the rendered markdown);
- nothing is fetched from outside the local server, and the page logs no uncaught error.

Then, in the notebooks that have a widget slider, moving the slider must change the image of
the plot it drives (at least one notebook in the book must have one).

The notebooks on disk are never modified: autosave is off (JupyterLab settings in a temporary
folder), nothing is saved, and the test checks the files' bytes before and after. On failure a
screenshot is written to ``artifacts/jupyterlab/``.

Set ``PAGEDKV_JUPYTERLAB_PAGES`` to a comma-separated list of names (``01_why_paging,...``) to
run only those notebooks.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from test_book_browser import ROOT, toc_pages

ARTIFACTS = ROOT / "artifacts" / "jupyterlab"
RUN_TIMEOUT_S = 300          # one notebook's Run All, cells included (each well under a minute)
START_TIMEOUT_S = 120        # the server, and a notebook's kernel, coming up

NOTEBOOKS = [p for p in toc_pages() if (ROOT / f"{p}.ipynb").exists()]
if os.environ.get("PAGEDKV_JUPYTERLAB_PAGES"):
    wanted = {n.strip() for n in os.environ["PAGEDKV_JUPYTERLAB_PAGES"].split(",")}
    NOTEBOOKS = [p for p in NOTEBOOKS if Path(p).name in wanted]

# JupyterLab settings for the test's server: no autosave (the notebooks in the repository must
# not change), every cell rendered (JupyterLab 4 otherwise renders only the cells in view), no
# news or update checks (the network is closed).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 for the whole session: (base URL, token)."""
    jupyter = Path(sys.executable).parent / "jupyter"
    if not jupyter.exists():
        pytest.fail(f"{jupyter} is missing: run `bash scripts/setup.sh`")
    home = tmp_path_factory.mktemp("jupyterlab")
    settings = home / "settings"
    for name, value in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "PYTHONUNBUFFERED": "1"}
    log = (home / "lab.log").open("w")
    server = subprocess.Popen(
        [str(jupyter), "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
         "--expose-app-in-browser", "--LabApp.news_url=None",
         "--LabApp.extension_manager=readonly"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start; its log:\n{(home / 'lab.log').read_text()}")
            time.sleep(0.5)
    try:
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="session")
def lab_results():
    """What each notebook's run left for the widget test: {docname: has a slider}."""
    return {}


def _screenshot(page, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    except Exception:  # the page may be gone; the failure itself is what matters
        pass


def _guard(page, base):
    """Route every request: local ones go through, outside ones are refused and recorded."""
    local = urlsplit(base).netloc
    external, errors = [], []

    def route(r):
        url = r.request.url
        if url.startswith(("data:", "blob:")) or urlsplit(url).netloc == local:
            r.continue_()
        else:
            external.append(url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return external, errors


def _open(page, base, token, docname):
    page.goto(f"{base}/lab/tree/{docname}.ipynb?token={token}&reset",
              timeout=START_TIMEOUT_S * 1000)
    page.wait_for_function(
        "path => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return w && w.context && w.context.isReady && w.context.path === path"
        "  && w.sessionContext.session && w.sessionContext.session.kernel"
        "  && w.sessionContext.session.kernel.status === 'idle'; }",
        arg=f"{docname}.ipynb", timeout=START_TIMEOUT_S * 1000)


def _run_all(page):
    """Run All, and wait until it has finished (it stops at the first cell that raises)."""
    page.evaluate(
        "() => { window.__runDone = null;"
        " window.jupyterapp.commands.execute('notebook:run-all-cells').then("
        "  ok => { window.__runDone = {ok: ok}; },"
        "  err => { window.__runDone = {error: String(err)}; }); }")
    page.wait_for_function("() => window.__runDone !== null", timeout=RUN_TIMEOUT_S * 1000,
                           polling=500)
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
        " === 'idle'", timeout=RUN_TIMEOUT_S * 1000, polling=500)
    return page.evaluate("() => window.__runDone")


def _close(page):
    """Close the notebook without saving and shut its kernel down."""
    page.evaluate(
        "async () => { const w = window.jupyterapp.shell.currentWidget;"
        " await w.sessionContext.shutdown(); w.context.model.dirty = false; w.dispose(); }")


def test_notebooks_are_listed():
    assert NOTEBOOKS, "_toc.yml lists no notebook (or PAGEDKV_JUPYTERLAB_PAGES matched none)"


@pytest.mark.parametrize("docname", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(lab, page, lab_results, docname):
    base, token = lab
    path = ROOT / f"{docname}.ipynb"
    before = _digest(path)
    external, errors = _guard(page, base)
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    try:
        _open(page, base, token, docname)
        run = _run_all(page)
        page.wait_for_timeout(500)            # let the last markdown cells render
        report = page.evaluate(
            "() => { const w = window.jupyterapp.shell.currentWidget; const out = [];"
            " for (const [i, c] of w.content.widgets.entries()) {"
            "  const m = c.model; const r = {index: i, type: m.type, source: m.sharedModel.getSource()};"
            "  if (m.type === 'code') { r.outputs = m.outputs.toJSON(); r.count = m.executionCount; }"
            "  if (m.type === 'markdown') { r.expressions = m.getMetadata('user_expressions') || [];"
            "   const node = c.node.querySelector('.myst, .jp-RenderedMarkdown');"
            "   r.rendered = node ? node.innerText : null; }"
            "  out.push(r); }"
            " return out; }")
        sliders = page.locator(".jp-OutputArea .widget-slider").count()
        lab_results[docname] = sliders > 0
    except Exception:
        _screenshot(page, Path(docname).name)
        raise
    problems = [] if run.get("ok") else [f"Run All did not complete: {run}"]
    not_run = []
    for cell in report:
        where = f"cell {cell['index']}"
        if cell["type"] == "code":
            for out in cell["outputs"]:
                if out.get("output_type") == "error":
                    problems.append(f"{where}: {out.get('ename')}: {out.get('evalue')}")
                text = "".join(out.get("text", "")) if out.get("name") == "stderr" else ""
                if "Traceback" in text:
                    problems.append(f"{where}: a traceback on stderr")
            if cell["count"] is None and cell["source"].strip():
                not_run.append(cell["index"])
        elif cell["type"] == "markdown":
            roles = len(re.findall(r"\{eval\}`", cell["source"]))
            results = cell["expressions"]
            if roles and len(results) != roles:
                problems.append(f"{where}: {roles} {{eval}} roles, {len(results)} evaluated")
            for e in results:
                status = (e.get("result") or {}).get("status")
                if status != "ok":
                    problems.append(f"{where}: {{eval}}`{e.get('expression')}` gave {status}: "
                                    f"{(e.get('result') or {}).get('ename')}")
            shown = cell["rendered"] or ""
            if roles and cell["rendered"] is None:
                problems.append(f"{where}: the markdown was not rendered")
            if "{eval}" in shown or "NameError" in shown:
                problems.append(f"{where}: an {{eval}} value is not shown: {shown[:200]!r}")
    if not_run:
        problems.append(f"{len(not_run)} code cells did not run, from cell {not_run[0]} on")
    if problems:
        _screenshot(page, Path(docname).name)
    _close(page)
    assert not problems, f"{docname} in JupyterLab:\n" + "\n".join(problems)
    assert not external, f"{docname}: requests to outside the local server: {external}"
    assert not errors, f"{docname}: uncaught JavaScript errors: {errors}"
    assert _digest(path) == before, f"{docname}.ipynb was modified by the JupyterLab run"


def _image(page, output):
    img = output.locator("img").first
    return img.get_attribute("src") if img.count() else None


def test_a_slider_redraws_its_plot(lab, page, lab_results):
    """In the first notebook whose widgets have a slider, moving it changes the plot's image."""
    ran = [d for d in NOTEBOOKS if d in lab_results]
    if not ran:
        pytest.skip("no notebook ran in this session")
    with_slider = [d for d in ran if lab_results[d]]
    assert with_slider, f"none of the notebooks that ran has a widget slider: {ran}"
    docname = with_slider[0]
    base, token = lab
    external, errors = _guard(page, base)
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    try:
        _open(page, base, token, docname)
        _run_all(page)
        output = page.locator(".jp-OutputArea-output", has=page.locator(".widget-slider")).first
        output.scroll_into_view_if_needed()
        output.locator("img").first.wait_for(state="visible")
        first = _image(page, output)
        handle = output.locator(".widget-slider .noUi-handle, .widget-slider input").first
        handle.focus()
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        page.wait_for_function(
            "([el, src]) => { const img = el.querySelector('img');"
            " return img && img.getAttribute('src') !== src; }",
            arg=[output.element_handle(), first], timeout=60_000)
        second = _image(page, output)
        _close(page)
    except Exception:
        _screenshot(page, f"{Path(docname).name}-slider")
        raise
    assert first and second and first != second, f"{docname}: the plot did not change"
    assert not external and not errors, (external, errors)
