"""The live figures of the rendered book follow the package, operation for operation.

Each chapter's figures (``pagedkv/plots/live.py`` places them; ``_static/pagedkv-live*.js``
draws them) are driven in Chromium through their own buttons, fields and sliders, along a
recorded sequence of operations: the same sequence runs through the Python package, and after
every operation what the figure shows (page tables, free stacks, reference counts, plans,
the package's error messages, the simulation's numbers) must be what the package gives. So a
figure cannot drift from the code it draws. The figures are also checked for what every
reader needs: a title naming what they model, text alternatives, keyboard use, no overflow at
the book's widths.

The tests read the built book (``_build/html``, ``make book``) with one browser page for the
whole module; they are skipped when the book is not built. Oracles are the package's own
classes, called here directly.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from pagedkv import sim
from pagedkv.allocator import BlockAllocator
from pagedkv.contiguous import FirstFit
from pagedkv.errors import OutOfBlocks, PagedKVError
from pagedkv.manager import KVCacheManager
from pagedkv.page_table import PageTable
from pagedkv.plots import life
from pagedkv.plots import memory as mem
from pagedkv.prefix_cache import PrefixCachingManager
from test_book_browser import HTML, site  # noqa: F401  (site: the built book, served)

# The figures each chapter must show, in page order.
FIGURES = {
    "01_why_paging": ["fragmentation"],
    "03_allocator": ["allocator"],
    "04_page_table": ["page_table"],
    "05_manager": ["manager", "fill_pool"],
    "06_simulation": ["admission", "simulation"],
    "07_copy_on_write": ["manager", "beam"],
    "11_prefix_caching": ["prefix_cache"],
}

READ = """el => {
  const out = {};
  for (const r of el.querySelectorAll('[data-read]')) out[r.dataset.read] = r.textContent.trim();
  for (const l of el.querySelectorAll('[data-list]'))
    out[l.dataset.list] = Array.from(l.querySelectorAll(':scope > .pkv-item'),
                                     i => i.textContent.trim());
  return out;
}"""


@pytest.fixture(scope="module")
def tab(browser, site):  # noqa: F811
    """One page for the whole module; ``tab.open(chapter)`` loads a chapter once."""
    page = browser.new_page(viewport={"width": 1366, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # (a fresh page asks the server for /favicon.ico, which the book does not have)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error"
            and not m.location.get("url", "").endswith("/favicon.ico") else None)
    page.on("response", lambda r: errors.append(f"{r.url}: HTTP {r.status}")
            if r.status >= 400 else None)

    class Tab:
        def open(self, chapter):
            url = f"{site}/book/{chapter}.html"
            if page.url != url:
                page.goto(url, wait_until="load")
                page.wait_for_selector(".pkv-live.pkv-ready")
            return page

        def figure(self, chapter, kind, nth=0):
            fig = self.open(chapter).locator(f'.pkv-live[data-figure="{kind}"]').nth(nth)
            fig.scroll_into_view_if_needed()
            return fig

    yield Tab()
    page.close()
    assert not errors, f"JavaScript errors: {errors}"


def set_arg(fig, name, value):
    el = fig.locator(f'[data-arg="{name}"]')
    kind = el.evaluate("e => e.tagName === 'SELECT' ? 'select' : e.type")
    if kind == "select":
        el.select_option(str(value))
    elif kind == "range":
        el.evaluate("(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }", str(value))
    else:
        el.fill(str(value))


def do(fig, op, **args):
    """Fill the figure's fields, then press its button ``op``; return what it shows."""
    for name, value in args.items():
        set_arg(fig, name, value)
    fig.locator(f'[data-op="{op}"]').click()
    return fig.evaluate(READ)


def show(fig, **args):
    for name, value in args.items():
        set_arg(fig, name, value)
    return fig.evaluate(READ)


def py_value(text: str):
    """A typed field as the Python value it stands for (the figures' pyValue)."""
    t = text.strip()
    if re.fullmatch(r"[-+]?\d+", t):
        return int(t)
    if t in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[t]
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", t, re.I):
        return float(t)
    return t


def raised(fn) -> str:
    """Run ``fn``; the package's error as the figures print it, or ''."""
    try:
        fn()
    except PagedKVError as e:
        return f"{type(e).__name__}: {e}"
    return ""


strs = lambda xs: [str(int(x)) for x in xs]  # noqa: E731


# ------------------------------------------------------------------ chapter 3
ALLOCATOR_OPS = [
    ("allocate", {}), ("allocate", {}), ("allocate_n", {"n": "3"}), ("free", {"block": "1"}),
    ("free", {"block": "1"}), ("free", {"block": "-5"}), ("free", {"block": "16"}),
    ("free", {"block": "2.0"}), ("free", {"block": "True"}), ("share", {"block": "0"}),
    ("share", {"block": "0"}), ("share", {"block": "7"}), ("free_n", {"blocks": "0, 0, 0, 0"}),
    ("free_n", {"blocks": "2, 0, 4"}), ("allocate_n", {"n": "20"}), ("allocate_n", {"n": "-1"}),
    ("allocate", {}), ("free_n", {"blocks": "0, 1, x"}), ("allocate_n", {"n": "12"}),
    ("allocate", {}), ("allocate", {}), ("free", {"block": "5"}), ("allocate", {}),
]


def test_allocator_follows_the_package(tab):
    fig = tab.figure("03_allocator", "allocator")
    do(fig, "reset")
    alloc = BlockAllocator(16, 8, xp=np)
    calls = {
        "allocate": lambda a: alloc.allocate(),
        "allocate_n": lambda a: alloc.allocate_n(py_value(a["n"])),
        "free": lambda a: alloc.free(py_value(a["block"])),
        "share": lambda a: alloc.share(py_value(a["block"])),
        "free_n": lambda a: alloc.free_n([py_value(t) for t in a["blocks"].split(",")]),
    }
    errors = 0
    for op, args in ALLOCATOR_OPS:
        want_error = raised(lambda: calls[op](args))
        got = do(fig, op, **args)
        where = f"after {op}({args})"
        assert got["error"] == want_error, where
        assert got["refcounts"] == strs(alloc.refcounts()), where
        assert got["stack"] == strs(alloc.free_blocks()), where
        assert (got["free"], got["used"], got["shared"]) == (
            str(alloc.num_free), str(alloc.num_used), str(alloc.num_shared)), where
        errors += bool(want_error)
    assert errors >= 8, "the recorded operations must exercise the package's errors"


# ------------------------------------------------------------------ chapter 4
def test_page_tables_follow_the_package(tab):
    fig = tab.figure("04_page_table", "page_table")
    do(fig, "reset")
    state = {}

    def reset(bs):
        alloc = BlockAllocator(12, 8, xp=np)
        held = alloc.allocate_n(8)
        for b in held[1::2]:
            alloc.free(b)
        state.update(alloc=alloc, bs=bs, tables={"A": PageTable(bs), "B": PageTable(bs)},
                     located="")

    def append(seq, k):
        t, alloc = state["tables"][seq], state["alloc"]
        for _ in range(k):                  # the chapter's loop: a block when the last is full
            if t.num_tokens == t.capacity:
                t.append_block(alloc.allocate())
            t.append_token()

    def locate(seq, token):
        t = state["tables"][seq]
        block, offset = t.locate(token)
        state["located"] = (f"token {token} of {seq}: logical block {token // state['bs']}, "
                            f"offset {offset} -> physical block {block}, slot {t.slot(token)}")

    def free(seq):
        for b in state["tables"][seq].blocks:
            state["alloc"].free(b)
        state["tables"][seq] = PageTable(state["bs"])

    reset(4)
    ops = [("append", "A", 5), ("append", "B", 3), ("locate", "A", 4), ("locate", "A", 5),
           ("locate", "B", -1), ("append", "A", 10), ("append", "B", 20), ("locate", "B", 13),
           ("free", "A", 0), ("append", "B", 9), ("locate", "B", 30), ("append", "A", 1),
           ("block_size", None, 2), ("append", "A", 7), ("append", "B", 2), ("locate", "A", 6),
           ("block_size", None, 8), ("append", "B", 17), ("locate", "B", 16)]
    for op, seq, k in ops:
        if op == "block_size":
            reset(k)
            got = show(fig, block_size=k)
            want_error = ""
        else:
            fn = {"append": lambda: append(seq, k), "locate": lambda: locate(seq, k),
                  "free": lambda: free(seq)}[op]
            want_error = raised(fn)
            args = {"seq": seq, "k": k} if op == "append" else {"seq": seq, "token": k}
            got = do(fig, op, **(args if op != "free" else {"seq": seq}))
        where = f"after {op} {seq} {k}"
        assert got["error"] == want_error, where
        for name, t in state["tables"].items():
            assert got[f"table:{name}"] == repr(t), where
        assert got["stack"] == strs(state["alloc"].free_blocks()), where
        if op == "locate" and not want_error:
            assert got["located"] == state["located"], where


# ------------------------------------------------------------------ chapters 5 and 7
def check_manager(fig, m, ops):
    """Run ``ops`` ([op, seq, n-or-child]) through the figure and through ``m``."""
    errors = 0
    for op, seq, arg in ops:
        plan = {}

        def call():
            if op == "add":
                plan["p"] = m.add(seq, py_value(arg))
            elif op == "append":
                plan["p"] = m.append(seq, py_value(arg))
            elif op == "step":
                plan["p"] = m.step()
            elif op == "fork":
                m.fork(seq, arg)
            elif op == "free":
                m.free(seq)

        want_error = raised(call)
        args = {"seq": seq} if seq is not None else {}
        if op in ("add", "append"):
            args["n"] = arg
        elif op == "fork":
            args["child"] = arg
        got = do(fig, op, **args)
        where = f"after {op}({seq}, {arg})"
        assert got["error"] == want_error, where
        errors += bool(want_error)
        assert got["refcounts"] == strs(m.allocator.refcounts()), where
        assert got["free"] == str(m.allocator.num_free), where
        tables = {k[6:]: v for k, v in got.items() if k.startswith("table:")}
        assert tables == {s: strs(m.block_table(s)) for s in m.seq_ids}, where
        for s in m.seq_ids:
            assert got[f"tokens:{s}"] == str(m.num_tokens(s)), where
        if "p" in plan:
            p = plan["p"]
            slots = p.slot_mapping if hasattr(p, "slot_mapping") else p.slots
            assert got["slots"] == strs(slots), where
            assert got["copies"] == [f"{a}->{b}" for a, b in p.copies.tolist()], where
        m.audit()
    return errors


def test_manager_follows_the_package(tab):
    fig = tab.figure("05_manager", "manager")
    do(fig, "reset")
    m = KVCacheManager(BlockAllocator(24, 16, xp=np), 4)
    ops = [("add", "a", "7"), ("add", "b", "10"), ("append", "a", "5"), ("step", None, None),
           ("add", "huge", "100"), ("append", "zz", "1"), ("add", "a", "1"),
           ("append", "a", "0"), ("append", "b", "2.5"), ("step", None, None),
           ("free", "b", None), ("free", "b", None), ("add", "c", "0"), ("step", None, None),
           ("append", "c", "60"), ("add", "d", "33"), ("step", None, None),
           ("append", "a", "13"), ("step", None, None), ("step", None, None)]
    assert check_manager(fig, m, ops) >= 7


def test_fork_and_copy_follow_the_package(tab):
    fig = tab.figure("07_copy_on_write", "manager")
    do(fig, "reset")
    m = KVCacheManager(BlockAllocator(8, 16, xp=np), 4)
    script = [("add", "a", "6"), ("fork", "a", "b"), ("append", "b", "1"), ("append", "a", "1")]
    for op, seq, arg in script:             # the chapter's example, by its own button
        {"add": lambda: m.add(seq, int(arg)), "fork": lambda: m.fork(seq, arg),
         "append": lambda: m.append(seq, int(arg))}[op]()
        got = do(fig, "script")
        assert got["refcounts"] == strs(m.allocator.refcounts()), op
        assert {s: got[f"table:{s}"] for s in m.seq_ids} == {
            s: strs(m.block_table(s)) for s in m.seq_ids}, op
    assert got["error"] == "" and m.block_table("b").tolist() == [0, 2]
    ops = [("fork", "b", "c"), ("fork", "b", "d"), ("step", None, None), ("fork", "a", "a"),
           ("fork", "zz", "q"), ("fork", "c", "b"), ("append", "c", "3"), ("free", "a", None),
           ("fork", "c", "e"), ("step", None, None), ("step", None, None), ("add", "f", "9"),
           ("step", None, None), ("free", "e", None), ("step", None, None)]
    assert check_manager(fig, m, ops) >= 3


def fill_pool(bs, lengths, slots=96):
    m = KVCacheManager(BlockAllocator(slots // bs, bs * 4, xp=np), bs)
    admitted = 0
    for i, n in enumerate(lengths):
        try:
            m.add(i, n)
        except OutOfBlocks:
            break
        admitted += 1
    return m, admitted


def test_block_sizes_follow_the_package(tab):
    fig = tab.figure("05_manager", "fill_pool")
    for bs in (1, 2, 4, 8, 16):
        for k in (1, 6, 12):
            lengths = np.random.default_rng(0).integers(1, 17, size=k).tolist()
            m, admitted = fill_pool(bs, lengths)
            s = m.stats()
            got = show(fig, block_size=bs, sequences=k)
            assert got["title"] == (f"block size {bs}: {admitted} of {k} sequences admitted, "
                                    f"{s.tokens} tokens, internal fragmentation "
                                    f"{s.internal_fragmentation:.0%}")
            owners, _ = mem.manager_owners(m)
            assert got["owners"] == ["-" if o is None else str(o) for o in owners]


# ------------------------------------------------------------------ chapter 1
def three_ways(lengths, bs, upto, capacity=64, max_len=16, finished=(3, 1)):
    """The figure's events (requests 0-5 arrive, ``finished`` end, request 6 arrives) under
    the three strategies: (regions, refused) for each."""
    events = [("arrive", i) for i in range(6)] + [("end", i) for i in finished] + [("arrive", 6)]
    ff = {"a": FirstFit(capacity), "b": FirstFit(capacity)}
    size = {"a": lambda i: max_len, "b": lambda i: lengths[i]}
    placed = {"a": {}, "b": {}}
    refused = {"a": [], "b": [], "c": []}
    m = KVCacheManager(BlockAllocator(capacity // bs, bs * 4, xp=np), bs)
    for kind, i in events[:upto]:
        for k in "ab":
            if kind == "arrive":
                start = ff[k].alloc(size[k](i))
                (refused[k].append(i) if start is None else placed[k].__setitem__(i, start))
            elif i in placed[k]:
                ff[k].free(placed[k].pop(i), size[k](i))
        if kind == "arrive":
            try:
                m.add(i, lengths[i])
            except OutOfBlocks:
                refused["c"].append(i)
        elif i in m:
            m.free(i)
    regions = {k: [mem.Region(s, size[k](i), i, lengths[i]) for i, s in placed[k].items()]
               for k in "ab"}
    regions["c"] = mem.paged_layout(m)
    return regions, refused, {"a": len(placed["a"]), "b": len(placed["b"]), "c": len(m)}


STRIPS = """el => Object.fromEntries(Array.from(el.querySelectorAll('[data-strip]'), g =>
  [g.dataset.strip, Array.from(g.querySelectorAll('rect[data-owner]'),
                               r => [r.dataset.owner, r.dataset.used])]))"""


def test_three_strategies_follow_the_package(tab):
    fig = tab.figure("01_why_paging", "fragmentation")
    for seed, bs, upto in [(11, 4, 9), (11, 4, 6), (11, 4, 0), (0, 1, 9), (40, 16, 7),
                           (5, 8, 3), (23, 2, 9), (11, 16, 8)]:
        rng = np.random.default_rng(seed)             # as the chapter draws them
        lengths = rng.integers(3, 17, size=6).tolist() + [int(rng.integers(3, 17))]
        regions, refused, holding = three_ways(lengths, bs, upto)
        got = show(fig, seed=seed, block_size=bs, events=upto)
        strips = fig.evaluate(STRIPS)
        where = f"seed {seed}, block {bs}, {upto} events"
        assert got["lengths"] == strs(lengths[:6]), where
        for k in "abc":
            slots = [["", ""] for _ in range(64)]
            for r in regions[k]:
                for j in range(r.size):
                    slots[r.start + j] = [str(r.owner), "1" if j < r.used else "0"]
            assert strips[k] == slots, f"{where}, strip {k}"
            s = mem.layout_summary(regions[k], 64)
            shown = [got[f"{name}:{k}"] for name in ("holding", "refused", "stored", "empty",
                                                      "free", "hole", "fits")]
            fits = "-" if upto < 9 else ("no" if 6 in refused[k] else "yes")
            assert shown == [str(holding[k]), str(refused[k]), str(s["stored"]),
                             str(s["reserved_empty"]), str(s["free"]), str(s["largest_hole"]),
                             fits], f"{where}, row {k}"


# ------------------------------------------------------------------ chapter 6
class Frames(sim.Observer):
    """What the admission figure shows after each step, from the package's run."""

    def __init__(self, policy, requests):
        self.policy, self.events, self.frames = policy, {}, {}
        self.frames[0] = {"waiting": [r.rid for r in requests if r.arrival == 0]}

    def admitted(self, step, req, length):        # told during step + 1
        self.events.setdefault(step + 1, []).append(f"admit {req.rid}:")

    def preempted(self, step, rid, length):
        self.events.setdefault(step + 1, []).append(f"preempt {rid},")

    def stepped(self, step, batch, queue, refused):
        m = self.policy.manager
        self.frames[step] = {
            "blocks": {r: strs(m.block_table(r)) for r in batch.ids},
            "waiting": [r.rid for r in queue.waiting], "free": m.allocator.num_free}

    def left(self, step, rid):
        self.events.setdefault(step, []).append(f"leave {rid}")


def workload(params, name):
    reqs = tuple(sim.Request(*r) for r in params["requests"])
    return sim.Workload(name, reqs, max(r.total for r in reqs), 0)


def test_admission_rule_follows_the_package(tab):
    fig = tab.figure("06_simulation", "admission")
    p = fig.evaluate("el => JSON.parse(el.dataset.params)")
    wl = workload(p, "tiny")
    policy = sim.PagedPolicy(p["pool_bytes"], p["block_size"], max_len=wl.max_len)
    frames = Frames(policy, wl.requests)
    run = sim.serve(wl, policy, max_seqs=p["max_seqs"], observers=[frames])
    assert run.preemptions > 0, "the figure's trace should show a preemption"
    got = show(fig, step=0)
    assert got["waiting"] == strs(frames.frames[0]["waiting"])
    for step in range(1, run.steps + 1):
        got = do(fig, "next")
        want = frames.frames[step]
        assert got["step"] == str(step)
        assert got["free"] == str(want["free"]), step
        assert got["waiting"] == strs(want["waiting"]), step
        assert {k[7:]: v for k, v in got.items() if k.startswith("blocks:")} == {
            str(r): b for r, b in want["blocks"].items()}, step
        said = []
        for line in got["decisions"]:
            if line.startswith(("admit ", "the step needs")):
                said.append(line.split(":")[0] + ":" if line.startswith("admit") else
                            "preempt " + line.split("preempt ")[1].split(",")[0] + ",")
            elif line.startswith("finished"):
                said += [f"leave {r}" for r in line.split(": ")[1].split(", ")]
        assert said == frames.events.get(step, []), step
    assert do(fig, "next")["step"] == str(run.steps), "the last step is the end"


SIM_SETTINGS = [(16, 32), (4, 64), (256, 8)]


def test_simulation_follows_the_package(tab):
    fig = tab.figure("06_simulation", "simulation")
    p = fig.evaluate("el => JSON.parse(el.dataset.params)")
    wl = workload(p, p["preset"])
    fig.locator("details summary").click()
    naive_steps = {}
    for bs, ms in SIM_SETTINGS:
        paged = sim.serve(wl, sim.make_policy(f"paged:{bs}", p["pool_bytes"], p["max_len"],
                                              max_seqs=ms), max_seqs=ms)
        if ms not in naive_steps:
            naive_steps[ms] = sim.serve(wl, sim.make_policy("max-length", p["pool_bytes"],
                                                            p["max_len"]), max_seqs=ms).steps
        got = show(fig, block_size=bs, max_seqs=ms)
        assert got["title"] == (
            f"{len(wl.requests)} {p['preset']} requests, {p['pool_mib']} MiB pool, block "
            f"size {bs}, at most {ms} at once: {paged.steps} steps, {paged.preemptions} "
            f"preemptions (max-length reservation: {naive_steps[ms]} steps)")
        rows = fig.evaluate("el => Array.from(el.querySelectorAll("
                            "'[data-table=series] tbody tr'), r => Array.from(r.cells,"
                            " c => Number(c.textContent)))")
        keys = ("step", "running", "waiting", "tokens", "held", "finished")
        want = np.stack([paged.series[k] for k in keys], axis=1)
        assert np.array_equal(np.array(rows), want), f"block {bs}, max seqs {ms}"
        got = show(fig, at=paged.steps // 2)
        i = paged.steps // 2 - 1
        assert got["at"].startswith(f"step {paged.series['step'][i]}: "
                                    f"{paged.series['running'][i]} running, ")


# ------------------------------------------------------------------ chapter 7
HEAT = """el => Array.from(el.querySelectorAll('g[data-step]'),
  g => Array.from(g.querySelectorAll('rect[data-ref]'), r => Number(r.dataset.ref)))"""


def test_beam_search_follows_the_package(tab):
    fig = tab.figure("07_copy_on_write", "beam")
    p = fig.evaluate("el => JSON.parse(el.dataset.params)")
    bs = p["block_size"]
    for width, prompt in [(6, 10), (1, 1), (4, 17), (8, 40), (2, 3)]:
        kv = sim.CheckedKV(p["pool_blocks"] * sim.SIM_SPEC.block_bytes(bs), bs, write=False)
        frames = []
        used, unshared = sim.beam_search(kv, 0, prompt, p["output"], width,
                                         np.random.default_rng(0),
                                         on_step=lambda kv: frames.append(
                                             kv.allocator.refcounts().tolist()))
        got = show(fig, width=width, prompt=prompt)
        saving = 1 - used / unshared
        assert got["title"] == (f"beam width {width}, a prompt of {prompt} tokens: "
                                f"{saving:.0%} of the block-steps saved, {kv.copies} copies")
        assert (got["used"], got["unshared"]) == (str(used), str(unshared))
        heat = fig.evaluate(HEAT)
        rows = len(heat[0])
        assert heat == [f[:rows] for f in frames], f"width {width}, prompt {prompt}"
        assert not any(any(f[rows:]) for f in frames), "a block in use is not drawn"


# ------------------------------------------------------------------ chapter 11
def test_prefix_cache_follows_the_package(tab):
    fig = tab.figure("11_prefix_caching", "prefix_cache")
    p = fig.evaluate("el => JSON.parse(el.dataset.params)")
    do(fig, "reset")
    m = PrefixCachingManager(BlockAllocator(p["blocks"], p["block_size"] * 8, xp=np),
                             p["block_size"])
    vocab = {}
    ids = lambda words: [vocab.setdefault(w, len(vocab)) for w in words.split()]  # noqa: E731
    a_words = p["script"][0][2]
    mine = [("add", "D", " ".join(a_words.split()[:8]) + " x y"),   # finds A's start
            ("add", "E", "z z z z " + " ".join(a_words.split()[4:8]) + " q"),  # not A's 2nd
            ("append", "D", "x y x y x y"), ("add", "D", "a"), ("free", "Z", None),
            ("add", "F", ""), ("free", "B", None), ("free", "D", None),
            ("add", "G", a_words), ("free", "E", None), ("free", "G", None),
            ("add", "H", " ".join(f"w{i}" for i in range(40))), ("free", "C", None),
            ("add", "I", a_words + " more words"), ("append", "H", "w40 w41 w42 w43"),
            ("free", "I", None), ("free", "H", None), ("add", "J", "you are")]
    for k, (op, seq, words) in enumerate([tuple(s) + (None,) * (3 - len(s))
                                          for s in p["script"]] + mine):
        last = {}

        def call():
            if op == "add":
                toks = ids(words)
                plan = m.add(seq, toks)
                last["text"] = (f"add({seq!r}, {len(toks)} words): {plan.cached_tokens} found "
                                f"in the cache, {len(plan.slots)} computed")
            elif op == "append":
                m.append(seq, ids(words))
            else:
                m.free(seq)

        want_error = raised(call)
        if k < len(p["script"]):
            got = do(fig, "script")
        else:
            got = do(fig, op, seq=seq, **({"words": words} if words is not None else {}))
        where = f"after {op}({seq}, {words!r})"
        assert got["error"] == want_error, where
        if "text" in last:
            assert got["status"] == last["text"], where
        cache = m.cache
        assert got["refcounts"] == strs(cache.refcounts()), where
        assert got["stack"] == strs(cache.allocator.free_blocks()), where
        assert got["idle"] == strs(cache._idle), where
        assert (got["free"], got["hits"], got["evictions"]) == (
            str(cache.num_free), str(cache.hits), str(cache.evictions)), where
        tables = {k[6:]: v for k, v in got.items() if k.startswith("table:")}
        assert tables == {s: strs(m.block_table(s)) for s in m.seq_ids}, where
        states = life.block_states(m)
        for state in life.STATES:
            n = states.count(state)
            assert got[f"count:{state}"] == f"{n} block{'' if n == 1 else 's'}", where
        m.audit()
    assert m.cache.evictions > 0 and m.cache.hits > 0


# ------------------------------------------------------------------ for every reader
@pytest.mark.parametrize("chapter", sorted(FIGURES))
def test_every_figure_is_there_labelled_and_fits(tab, chapter):
    page = tab.open(chapter)
    figs = page.locator(".pkv-live")
    assert figs.evaluate_all("els => els.map(e => e.dataset.figure)") == FIGURES[chapter]
    for viewport in ({"width": 1600, "height": 1000}, {"width": 1366, "height": 900},
                     {"width": 900, "height": 900}):
        page.set_viewport_size(viewport)
        wide = figs.evaluate_all("els => els.filter(e => e.scrollWidth > e.clientWidth + 1)"
                                 ".map(e => e.dataset.figure)")
        assert not wide, f"{chapter}: wider than the page at {viewport['width']} px: {wide}"
    page.set_viewport_size({"width": 1366, "height": 900})
    for k in range(figs.count()):
        fig = figs.nth(k)
        assert "pkv-ready" in fig.get_attribute("class"), f"{chapter}: figure {k} not built"
        title = fig.evaluate("e => document.getElementById("
                             "e.getAttribute('aria-labelledby')).textContent")
        assert title.strip(), f"{chapter}: figure {k} has no title"
        assert "pagedkv" in fig.locator(".pkv-mirrors").inner_text()
        assert fig.locator(".pkv-alt").inner_text().strip(), "no text alternative"
        unlabelled = fig.evaluate("e => Array.from(e.querySelectorAll('svg, .pkv-pool'))"
                                  ".filter(x => !x.getAttribute('aria-label')).length")
        assert unlabelled == 0, f"{chapter}: a drawing without a text alternative"
        controls = fig.evaluate("e => Array.from(e.querySelectorAll('input, select'))"
                                ".filter(x => !x.closest('label')).length")
        assert controls == 0, f"{chapter}: a control without a label"
    text = page.locator("article").inner_text()
    assert not re.search(r"need[s]? a (running|live) kernel|static page", text), chapter


def test_figures_work_from_the_keyboard(tab):
    fig = tab.figure("03_allocator", "allocator")
    do(fig, "reset")
    fig.locator('[data-op="allocate"]').focus()
    page = tab.open("03_allocator")
    page.keyboard.press("Enter")
    page.keyboard.press("Space")
    assert fig.evaluate(READ)["used"] == "2"
    page.keyboard.press("Tab")                  # to the n field, typed into
    page.keyboard.press("Control+a")
    page.keyboard.type("40")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")                # allocate_n(40): more than is free
    assert fig.evaluate(READ)["error"] == "OutOfBlocks: allocate_n: needs 40 free block(s), " \
                                          "only 14 free"
    strip = tab.figure("01_why_paging", "fragmentation")
    seed = strip.locator('[data-arg="seed"]')
    before = strip.evaluate(READ)["lengths"]
    seed.focus()
    tab.open("01_why_paging").keyboard.press("ArrowRight")
    assert seed.input_value() == "12" and strip.evaluate(READ)["lengths"] != before
