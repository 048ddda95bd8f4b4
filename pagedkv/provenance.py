"""Where the book's measured numbers come from: the files in ``perf/results/`` the chapters read.

A number the build machine cannot measure (a GPU's time, a peer that is not installed here)
is read from a committed file. This module answers, from the files themselves, what the
intro's list and the status page show, so that neither can fall behind:

* :func:`chapter_reads`: the results files a notebook names, in its code (string literals,
  and f-strings whose fields run over a literal tuple in the same cell; a call of
  :func:`newest_gpu_run` reads the newest all-notebook GPU log and its tests' log) or in
  its prose (a name that matches a committed file, ``{a,b}`` choices allowed);
* :func:`sources`: every such file or pattern, the chapters that name it, its card, its
  date and what it holds (``perf/results/about.json``, one line a file or pattern), and
  the files the scoreboard page reads (:func:`scoreboard_files`: the newest result of
  each kind, whatever its name);
* :func:`gpu_runs` and :func:`newest_gpu_run`: the logs of nbval over every notebook on a
  GPU, parsed (cells passed, failed, in error; the notebooks not passed; each notebook's
  cells, where the log lists them).

An all-notebook GPU log is named ``<card>-<date>-nbval.log`` or
``<card>-<date>-nbval-all<anything>.log`` (``scripts/gpu_check.sh`` writes ``nbval.log``;
a partial rerun gets another suffix, ``-rerun``, ``-15``). Its package tests' log, if
committed, has ``pytest`` where it has ``nbval``.
"""
from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
RESULTS = ROOT / "perf" / "results"
ABOUT = RESULTS / "about.json"

# a results file's name as a chapter writes it: word characters, dots, dashes, a * for
# "any", and {a,b} for a choice (expand() turns it into the names it stands for)
NAME = r"(?:[\w.*-]|\{[\w.,-]*\})+\.(?:json|log)"
NAME_RE = re.compile(rf"(?<![\w.*{{}},-])({NAME})(?![\w.])")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
CARD = re.compile(r"(?:^|-)([a-z]\d{2,3})(?=-)")
NBVAL_LOG = re.compile(r"^(?P<card>[a-z]\d{2,3})-(?P<date>\d{4}-\d{2}-\d{2})(?:-(?P<tag>\w+))?"
                       r"-nbval(?P<suffix>-[\w.-]+)?\.log$")


def expand(name: str) -> list[str]:
    """A name with ``{a,b,...}`` choices in it: one name for each combination."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [n for x in m.group(1).split(",")
            for n in expand(name[:m.start()] + x + name[m.end():])]


def matching(name: str, results: Path = RESULTS) -> list[Path]:
    """The committed files a name stands for (a ``*`` matches any run of characters)."""
    return sorted({p for n in expand(name) for p in results.glob(n)})


def _values(cell_tree) -> dict[str, list]:
    """Names bound by a ``for`` over a literal tuple or list in the cell: their values."""
    found: dict[str, list] = {}

    def bind(target, value):
        if isinstance(target, ast.Name):
            found.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (tuple, list)) \
                and len(value) == len(target.elts):
            for t, v in zip(target.elts, value):
                bind(t, v)

    for node in ast.walk(cell_tree):
        if isinstance(node, (ast.For, ast.comprehension)):
            try:
                values = ast.literal_eval(node.iter)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(values, (tuple, list)):
                for v in values:
                    bind(node.target, v)
    return found


def _fstring_names(node: ast.JoinedStr, values: dict) -> list[str]:
    """The strings an f-string can make: a field over a known loop takes each of its
    values; any other field becomes ``*``."""
    parts = []
    for v in node.values:
        if isinstance(v, ast.Constant):
            parts.append([str(v.value)])
        elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) \
                and v.value.id in values and v.format_spec is None and v.conversion == -1:
            parts.append(sorted({str(x) for x in values[v.value.id]}))
        else:
            parts.append(["*"])
    return ["".join(p) for p in itertools.product(*parts)]


def code_names(source: str) -> set[str]:
    """The file names (``.json``, ``.log``) a code cell's strings hold: the last part of a
    path, or the whole string if it names ``results/``."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return set()
    values = _values(tree)
    inside = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in n.values}
    strings = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in inside:
            strings.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            strings += _fstring_names(node, values)
    return {s if "results/" in s else s.rsplit("/", 1)[-1] for s in strings
            if re.fullmatch(NAME, s.rsplit("/", 1)[-1])}


def prose_names(text: str, results: Path = RESULTS) -> set[str]:
    """The names in a markdown cell that stand for committed files."""
    return {m.group(1) for m in NAME_RE.finditer(text) if matching(m.group(1), results)}


def chapter_reads(path: Path, results: Path = RESULTS) -> dict[str, list[Path]]:
    """Each results name a notebook's code or prose holds -> the committed files it stands
    for. A path into ``results/`` in code that matches no file raises
    :class:`FileNotFoundError`; other names that match none are not results."""
    cells = json.loads(Path(path).read_text())["cells"]
    names: dict[str, list[Path]] = {}
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] == "code":
            if "newest_gpu_run(" in text:              # the newest all-notebook GPU log
                run = newest_gpu_run(results)
                for log in filter(None, (run.log, run.tests_log)):
                    names[log.name] = [log]
            for string in sorted(code_names(text)):
                name = string.rsplit("/", 1)[-1]
                files = matching(name, results)
                if files:
                    names[name] = files
                elif "results/" in string:           # other files (a --json output) pass
                    raise FileNotFoundError(f"{Path(path).name}, cell {i}, reads "
                                            f"perf/results/{name}, which is not committed")
        elif cell["cell_type"] == "markdown":
            for name in sorted(prose_names(text, results)):
                names[name] = matching(name, results)
    # a name that one of the chapter's {a,b} names covers is left to it (the code reads
    # serve-spike-b256-...json, the prose names serve-spike-b{256,512,2048}-...json)
    choices = [set(files) for name, files in names.items() if "{" in name]
    return {name: files for name, files in names.items()
            if "{" in name or not any(set(files) <= c for c in choices)}


def card_and_date(path: Path) -> tuple[str, str]:
    """The card a file was measured on ("H200", "CPU") and its date (YYYY-MM-DD): from
    what the file records, else from its name."""
    card = date = None
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            places = [data, data.get("meta"), data.get("machine"), data.get("backend")]
            for place in places:
                if isinstance(place, dict):
                    device = place.get("device")
                    if isinstance(device, str) and device:
                        card = card or device.removeprefix("NVIDIA ").split()[0]
                    for key in ("date", "started"):
                        m = DATE.search(str(place.get(key, "")))
                        date = date or (m.group(0) if m else None)
            if card is None and (isinstance(data.get("machine"), str) or "cpu" in data):
                card = "CPU"
    m = CARD.search(path.name)
    card = card or (m.group(1).upper() if m else "CPU")
    m = DATE.search(path.name)
    return card, date or (m.group(0) if m else "undated")


@dataclasses.dataclass
class Source:
    name: str                 # as the chapters write it: a file, a pattern, {a,b} choices
    files: list[Path]         # the committed files it stands for
    chapters: list[str]       # the notebooks that name it (their stems)
    what: str | None          # from perf/results/about.json (None: not described)
    card: str
    date: str                 # of the newest file it stands for

    @property
    def newest(self) -> Path:
        return self.files[-1]


def about(path: Path = ABOUT) -> dict[str, str]:
    """perf/results/about.json: file name or pattern -> what it holds, in a line."""
    return json.loads(path.read_text()) if path.exists() else {}


def describe(name: str, described: dict[str, str]) -> str | None:
    """What a results file holds: its line in about.json; a GPU run's logs say it by
    their names (``<card>-<date>-nbval.log`` and its ``pytest`` twin)."""
    if name in described:
        return described[name]
    if NBVAL_LOG.match(name):
        return "every notebook under nbval on the GPU"
    if NBVAL_LOG.match(name.replace("-pytest", "-nbval")):
        return "the package's tests in the same GPU run"
    return None


def chapters(book: Path = BOOK) -> list[Path]:
    """The numbered chapters' notebooks, in order."""
    return sorted(p for p in book.glob("[0-9][0-9]_*.ipynb"))


def sources(book: Path = BOOK, results: Path = RESULTS) -> list[Source]:
    """Every results file or pattern a chapter names, in the order the chapters first do."""
    described = about(results / "about.json")
    found: dict[str, Source] = {}
    for nb in chapters(book):
        for name, files in chapter_reads(nb, results).items():
            if name not in found:
                card, _ = card_and_date(files[-1])
                date = max(card_and_date(f)[1] for f in files)
                found[name] = Source(name, files, [], describe(name, described), card, date)
            found[name].chapters.append(nb.stem)
    for path, _ in scoreboard_files(results).values():      # the scoreboard's newest
        if path.name not in found:
            card, date = card_and_date(path)
            found[path.name] = Source(path.name, [path], [],
                                      describe(path.name, described), card, date)
        found[path.name].chapters.append("scoreboard")
    return list(found.values())


@dataclasses.dataclass
class GpuRun:
    """One run of nbval over the notebooks on a GPU, as its log tells it."""
    log: Path
    card: str
    date: str
    passed: int
    failed: int
    errors: int
    seconds: float
    not_passed: list[str]           # notebooks (file names then) with a failed cell
    cells: dict[str, int] | None    # notebook -> cells run, if the log lists each cell
    header: dict[str, str]          # the "# key: value" lines scripts/gpu_check.sh writes
    tests_log: Path | None          # the package tests of the same run, if committed

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors

    @property
    def on_cupy(self) -> bool | None:
        """Whether the notebooks ran on CuPy: the log's own header says, else its package
        tests' log (a GPU usable, "so cupy can be had"); None if neither tells."""
        if "backend" in self.header:
            return "'backend': 'cupy'" in self.header["backend"]
        if self.tests_log is not None:
            return "a GPU is usable here, so cupy can be had" in self.tests_log.read_text()
        return None

    def outcome(self, notebook: str) -> str:
        """What the run says of one notebook (a file name or stem), in words."""
        name = notebook if notebook.endswith(".ipynb") else f"{notebook}.ipynb"
        bad = self.not_passed.count(name) and self._bad_cells(name)
        if self.cells is None:
            return (f"{bad} of its cells did not pass" if bad else
                    "none of its cells failed (the log names failures only)")
        if name not in self.cells:
            return "it was not in the run"
        n = self.cells[name]
        return f"{bad} of its {n} cells did not pass" if bad else f"all {n} of its cells passed"

    def _bad_cells(self, name: str) -> int:
        text = self.log.read_text()
        return len(set(re.findall(rf"^(?:FAILED|ERROR) book/{re.escape(name)}::(Cell \d+)",
                                  text, re.M)))


def parse_nbval_log(path: Path) -> GpuRun:
    """A log of ``pytest --nbval-lax ... book/``: its summary line and what it names."""
    text = path.read_text()
    header = dict(re.findall(r"^# ([\w ]+): (.*)$", text, re.M))
    summary = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)\b", ln)
               and re.search(r" in [\d.]+s", ln)][-1]
    count = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?)", summary)}
    not_passed = sorted(set(re.findall(r"^(?:FAILED|ERROR) book/(\S+?\.ipynb)::", text, re.M)))
    listed = re.findall(r"^(?:PASSED|FAILED|ERROR) book/(\S+?\.ipynb)::", text, re.M)
    every = re.search(r"^PASSED book/", text, re.M)       # the log lists every cell
    cells = {nb: listed.count(nb) for nb in sorted(set(listed))} if every else None
    m = NBVAL_LOG.match(path.name)
    card = header.get("gpu", "").removeprefix("NVIDIA ").split(",")[0].split(" ")[0] or \
        (m.group("card").upper() if m else card_and_date(path)[0])
    date = (DATE.search(header.get("date", "")) or DATE.search(path.name)).group(0)
    tests = path.with_name(path.name.replace("-nbval", "-pytest"))
    return GpuRun(path, card, date, count.get("passed", 0), count.get("failed", 0),
                  count.get("errors", 0) + count.get("error", 0),
                  float(re.search(r" in ([\d.]+)s", summary).group(1)), not_passed, cells,
                  header, tests if tests.exists() else None)


def gpu_runs(results: Path = RESULTS) -> list[GpuRun]:
    """The committed all-notebook GPU runs, oldest first (by date, then a log's own time,
    then a ``-all`` log after the plain one of the same day)."""
    logs = [p for p in results.glob("*-nbval*.log")
            if (m := NBVAL_LOG.match(p.name)) and (m.group("suffix") or "-all").startswith(
                "-all")]
    runs = [parse_nbval_log(p) for p in logs]
    return sorted(runs, key=lambda r: (r.date, r.header.get("date", ""),
                                       "-nbval-all" in r.log.name, r.log.name))


def newest_gpu_run(results: Path = RESULTS) -> GpuRun:
    return gpu_runs(results)[-1]


def code_cells(book: Path = BOOK) -> dict[str, int]:
    """Each notebook of the book -> its number of code cells now."""
    return {p.name: sum(c["cell_type"] == "code" for c in json.loads(p.read_text())["cells"])
            for p in sorted(book.glob("*.ipynb"))}


# ---- the scoreboard's files: the newest result of each kind, by the time it records ----

def recorded_time(data: dict, path: Path) -> str:
    """When a result was measured, as a sortable string: its own date (and time, if it
    records one), else the date in its name."""
    for place in (data, data.get("meta") if isinstance(data, dict) else None):
        if isinstance(place, dict):
            m = re.search(r"(\d{4}-\d{2}-\d{2})(?:[T ](\d{2}:\d{2}(?::\d{2})?))?",
                          str(place.get("date", "")))
            if m:
                hms = ((m.group(2) or "00:00") + ":00")[:8]
                return f"{m.group(1)}T{hms}"
    m = DATE.search(path.name)
    return f"{m.group(0)}T00:00:00" if m else ""


def _engines(data: dict, key: str) -> dict:
    """The engines a result measured: its top-level dicts that hold ``key``."""
    return {k: v for k, v in data.items() if isinstance(v, dict) and key in v}


def is_step(data: dict) -> bool:
    """A decode-step result of ``python -m pagedkv.bench.model``: the graph runner's step
    at each batch size, with compiled transformers beside it."""
    return isinstance(data, dict) and all(
        isinstance(data.get(k), dict) for k in ("pagedkv_graph", "transformers_compiled"))


def _default_workload(data: dict) -> bool:
    w = data.get("workload") if isinstance(data, dict) else None
    return isinstance(w, dict) and not w.get("spike") and w.get("rate") is None


def is_serve(data: dict) -> bool:
    """An in-process serving result of ``python -m pagedkv.bench.serve`` on the default
    workload (every request at once, no spike) with the default float16 cache."""
    engine = data.get("pagedkv", {})
    return (_default_workload(data) and "output_tokens_per_s" in engine
            and engine.get("kv_dtype", "float16") == "float16")


def is_http(data: dict) -> bool:
    """A result of ``python -m pagedkv.bench.http`` on the default workload."""
    return _default_workload(data) and "output_tokens_per_s" in data.get("http", {})


def is_serve_with_peer(data: dict) -> bool:
    """An in-process serving result with a peer measured beside pagedkv in the same run."""
    return is_serve(data) and len(_engines(data, "ttft_ms")) > 1      # not the floor


SCOREBOARD = {"step": ("model-*.json", is_step), "serve": ("serve-*.json", is_serve),
              "serve_peer": ("serve-*.json", is_serve_with_peer),
              "http": ("http-*.json", is_http)}


def newest(pattern: str, keep, results: Path = RESULTS) -> tuple[Path, dict]:
    """Of the committed JSON files matching ``pattern`` whose data ``keep`` accepts, the one
    measured last, and its data."""
    found = []
    for path in matching(pattern, results):
        data = json.loads(path.read_text())
        if keep(data):
            found.append((recorded_time(data, path), path.name, path, data))
    if not found:
        raise FileNotFoundError(f"no perf/results/{pattern} holds such a result")
    return max(found)[2:]


def scoreboard_files(results: Path = RESULTS) -> dict[str, tuple[Path, dict]]:
    """The scoreboard's results: the newest decode step, in-process serving run (and the
    newest with a peer beside pagedkv, which may be the same file) and HTTP run."""
    return {kind: newest(pattern, keep, results)
            for kind, (pattern, keep) in SCOREBOARD.items()}
