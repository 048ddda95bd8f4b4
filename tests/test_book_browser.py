"""Open every page of the built book in a real browser and check what a reader would see.

For each page listed in ``_toc.yml``: it is served with HTTP 200, has an ``<h1>``, every
image has loaded (``naturalWidth > 0``), no cell output is a traceback or an error, the
browser logs no console errors or uncaught exceptions, no request fails or answers with an
HTTP error, nothing is fetched from outside the local server (the book must work offline),
and no line of code, in a cell or in a cell's text output, is wider than its box at the
widest content column (a 1600-pixel window, about 89 characters of code). A full-page
screenshot of each page is written to ``artifacts/screenshots/``.

Exercises: every solution starts closed and opens on a click. The bibliography page lists
at least ten references.

The book is built by ``make book`` (``make test`` builds it first). If ``_build/html`` is
missing these tests are skipped, with that reason.
"""
from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "artifacts" / "screenshots"

# Selectors for MyST-NB / nbconvert outputs that show an error rather than a result.
ERROR_OUTPUT_SELECTORS = [
    ".output.traceback",
    ".output.error",
    "div.cell_output .error",
    "div.cell_output .traceback",
    "div.cell_output .ansi-red-intense-fg",
]
STDERR_SELECTOR = ".output.stderr, div.cell_output .stderr"

# At 1600 px the book's content column is as wide as it gets; at 1366 px (a common laptop)
# it is narrower, and _static/pagedkv.css sets code in 13 px so that 88 columns still fit.
# Code is checked at both widths: input cells and plain-text outputs.
# Source listings from `pagedkv.display.source` follow the package's own line length, and
# are not checked.
WIDE_VIEWPORT = {"width": 1600, "height": 1000}
LAPTOP_VIEWPORT = {"width": 1366, "height": 900}    # a common laptop screen
CODE_BOXES = ("div.cell_input pre, div.cell_output .output.stream pre, "
              "div.cell_output .output.text_plain pre")
MIN_BIBLIOGRAPHY_ENTRIES = 10


def toc_pages(toc_path: Path = ROOT / "_toc.yml") -> list[str]:
    """Every document in the table of contents, in reading order, without its extension."""
    toc = yaml.safe_load(toc_path.read_text())
    pages: list[str] = []

    def add(entry):
        if isinstance(entry, dict):
            if "file" in entry:
                pages.append(str(Path(entry["file"]).with_suffix("")))
            for key in ("parts", "chapters", "sections"):
                for child in entry.get(key, []) or []:
                    add(child)

    pages.append(str(Path(toc["root"]).with_suffix("")))
    for key in ("parts", "chapters", "sections"):
        for child in toc.get(key, []) or []:
            add(child)
    return pages


PAGES = toc_pages()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # keep pytest output readable
        pass


@pytest.fixture(scope="module")
def site():
    """Serve _build/html on 127.0.0.1 (a free port) for the duration of the module."""
    if not (HTML / "index.html").exists():
        pytest.skip(f"{HTML.relative_to(ROOT)} does not exist: build the book first "
                    "(`make book`; `make test` does it for you)")
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_toc_lists_pages():
    assert PAGES, "_toc.yml lists no pages"
    assert len(set(PAGES)) == len(PAGES), f"a page is listed twice in _toc.yml: {PAGES}"
    for page in PAGES:
        sources = [ROOT / f"{page}{ext}" for ext in (".md", ".ipynb")]
        assert any(p.exists() for p in sources), f"_toc.yml lists {page}, which has no source"


def test_index_redirects_to_root(site, page):
    page.goto(f"{site}/index.html")
    # index.html is a meta refresh to the root page of _toc.yml.
    page.wait_for_url(f"{site}/{PAGES[0]}.html", timeout=10_000)


@pytest.mark.parametrize("docname", PAGES)
def test_page_renders(site, page, docname):
    local_host = urlsplit(site).netloc
    console_errors: list[str] = []
    page_errors: list[str] = []
    failed: list[str] = []
    external: list[str] = []

    def block_external(route):
        url = route.request.url
        if url.startswith(("data:", "blob:")) or urlsplit(url).netloc == local_host:
            route.continue_()
        else:
            external.append(url)
            route.abort()

    page.route("**/*", block_external)
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    page.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})"))
    page.on("response", lambda r: failed.append(f"{r.url} (HTTP {r.status})")
            if r.status >= 400 else None)

    response = page.goto(f"{site}/{docname}.html", wait_until="load")
    assert response is not None and response.status == 200, (
        f"{docname}.html: HTTP {response.status if response else 'no response'}")
    page.wait_for_load_state("networkidle")
    # Pages with math: wait until MathJax (served from _static/) has typeset them.
    if page.locator(".math").count():
        page.wait_for_function(
            "() => window.MathJax && MathJax.startup && MathJax.startup.promise"
            " && (MathJax.startup.promise.then(() => { window.__mj_done = true; }),"
            " window.__mj_done === true)", timeout=15_000)

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{Path(docname).name}.png"), full_page=True)

    h1 = page.locator("main h1, article h1, h1")
    assert h1.count() >= 1, f"{docname}: no <h1>"
    assert h1.first.inner_text().strip(), f"{docname}: the <h1> is empty"

    assert page.locator("link[rel=stylesheet]").count() > 0, f"{docname}: no stylesheet"
    # The theme's CSS took effect: the sidebar is laid out, not an unstyled list.
    assert page.evaluate(
        "() => getComputedStyle(document.body).fontFamily !== ''"
        " && document.querySelector('.bd-sidebar-primary') !== null"), (
        f"{docname}: the theme's layout is missing")

    broken = page.evaluate(
        "() => Array.from(document.images)"
        "  .filter(img => !(img.complete && img.naturalWidth > 0))"
        "  .map(img => img.currentSrc || img.src)")
    assert not broken, f"{docname}: images that did not load: {broken}"

    for selector in ERROR_OUTPUT_SELECTORS:
        n = page.locator(selector).count()
        assert n == 0, f"{docname}: {n} error output(s) matching {selector!r}"
    stderr_texts = page.locator(STDERR_SELECTOR).all_inner_texts()
    tracebacks = [t for t in stderr_texts if "Traceback" in t or "Error" in t]
    assert not tracebacks, f"{docname}: error text in stderr output: {tracebacks}"
    body = page.locator("article").first.inner_text() if page.locator("article").count() \
        else page.inner_text("body")
    assert "Traceback (most recent call last)" not in body, f"{docname}: a traceback on the page"

    if page.locator(".math").count():
        unrendered = page.evaluate(
            "() => Array.from(document.querySelectorAll('.math'))"
            "  .filter(el => !el.querySelector('mjx-container')).length")
        assert unrendered == 0, f"{docname}: {unrendered} math element(s) not typeset by MathJax"

    for viewport in (WIDE_VIEWPORT, LAPTOP_VIEWPORT):
        page.set_viewport_size(viewport)
        too_wide = page.evaluate(
            "sel => Array.from(document.querySelectorAll(sel))"
            "  .filter(pre => pre.scrollWidth > pre.clientWidth + 1)"
            "  .map(pre => pre.innerText.split('\\n')"
            "    .reduce((a, b) => (b.length > a.length ? b : a), ''))", CODE_BOXES)
        assert not too_wide, (
            f"{docname}: code wider than its box at {viewport['width']} px; "
            f"longest lines: {too_wide}")

    assert not external, f"{docname}: requests to outside the local server: {external}"
    assert not failed, f"{docname}: failed requests: {failed}"
    assert not console_errors, f"{docname}: console errors: {console_errors}"
    assert not page_errors, f"{docname}: uncaught JavaScript errors: {page_errors}"


def test_status_page_lists_every_notebook(site, page):
    """The status page's execution table has one successful row per notebook in _toc.yml."""
    status = [p for p in PAGES if Path(p).name == "status"]
    if not status:
        pytest.skip("_toc.yml has no status page")
    notebooks = [p for p in PAGES if (ROOT / f"{p}.ipynb").exists()]
    page.goto(f"{site}/{status[0]}.html", wait_until="load")
    table = page.locator("table", has=page.locator("th", has_text="Run Time"))
    assert table.count() == 1, "the status page has no execution table"
    rows = {}
    for row in table.locator("tbody tr").all():
        cells = [c.strip() for c in row.locator("td").all_inner_texts()]
        rows[cells[0]] = cells
    assert sorted(rows) == sorted(notebooks), (
        f"executed notebooks {sorted(rows)} != notebooks in _toc.yml {sorted(notebooks)}")
    for doc, cells in rows.items():
        # "inline" for chapters whose prose quotes numbers with {eval} (executed in the
        # Sphinx process), "force" for the others; "cache" or "off" would be stale outputs.
        assert cells[2] in ("force", "inline"), f"{doc} was not executed for this build: {cells}"
        assert float(cells[3]) >= 0, f"{doc}: no run time: {cells}"
        assert cells[4] == "✅", f"{doc} did not run cleanly: {cells}"


@pytest.mark.parametrize("docname", PAGES)
def test_solutions_start_closed_and_open_on_click(site, page, docname):
    """Each exercise's solution is in a dropdown: hidden until its button is clicked."""
    page.goto(f"{site}/{docname}.html", wait_until="load")
    page.wait_for_load_state("networkidle")
    exercises = page.locator("div.exercise").count()
    solutions = page.locator("div.solution")
    if exercises == 0 and solutions.count() == 0:
        pytest.skip(f"{docname} has no exercises")
    assert solutions.count() == exercises, (
        f"{docname}: {exercises} exercises but {solutions.count()} solutions")
    for k in range(solutions.count()):
        solution = solutions.nth(k)
        body = solution.locator(":scope > :not(.admonition-title)")
        assert body.count() >= 1, f"{docname}: solution {k + 1} is empty"
        assert not body.first.is_visible(), f"{docname}: solution {k + 1} is open on load"
        solution.locator("button.toggle-button").click()
        body.first.wait_for(state="visible", timeout=5_000)
        assert body.first.inner_text().strip(), f"{docname}: solution {k + 1} opened empty"


def test_bibliography_lists_references(site, page):
    bib = [p for p in PAGES if Path(p).name == "bibliography"]
    if not bib:
        pytest.skip("_toc.yml has no bibliography page")
    page.goto(f"{site}/{bib[0]}.html", wait_until="load")
    entries = page.locator("div.citation, dl.citation > dt")
    assert entries.count() >= MIN_BIBLIOGRAPHY_ENTRIES, (
        f"the bibliography lists {entries.count()} entries, fewer than "
        f"{MIN_BIBLIOGRAPHY_ENTRIES}")
    texts = entries.all_inner_texts()
    assert all(t.strip() for t in texts), "an empty bibliography entry"
    ids = set(page.evaluate("() => Array.from(document.querySelectorAll('[id]'), e => e.id)"))
    # Every citation in the chapters links to an entry of this page.
    cited = 0
    for docname in PAGES:
        page.goto(f"{site}/{docname}.html", wait_until="load")
        hrefs = page.evaluate(
            "() => Array.from(document.querySelectorAll('a[href*=\"bibliography.html#\"]'),"
            " a => a.getAttribute('href'))")
        for href in hrefs:
            assert href.split("#", 1)[1] in ids, f"{docname}: citation {href} has no entry"
        cited += len(hrefs)
    assert cited > 0, "no page cites the bibliography"
