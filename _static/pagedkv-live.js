/* The book's live figures: small interactive pictures of pagedkv, drawn in the page.
 *
 * A chapter places one with a cell whose output is
 *   <div class="pkv-live" data-figure="KIND" data-params='{...}'> (a text alternative) </div>
 * (pagedkv/plots/live.py writes it), and this script replaces the text with the figure once
 * the page has loaded. The rules every figure follows are pagedkv-live-core.js's, a port of
 * the package's teaching core; tests/test_live_figures.py replays recorded operations through
 * each figure's buttons in Chromium and compares what the figure shows with the package.
 *
 * Conventions a test reads: a control has data-op (a button) or data-arg (an input or a
 * select); what a figure shows is readable as [data-read=NAME] (one value) and
 * [data-list=NAME] (the texts of its .pkv-item children, in order).
 */
(function () {
  "use strict";
  const P = (window.pagedkv = window.pagedkv || {});
  const figures = (P.figures = P.figures || {});

  // The package's colours (pagedkv/plots/memory.py): Okabe-Ito, free pale grey.
  const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"];
  const FREE = "#EEEEEE", SHARED = "#777777", IDLE = "#F0E442", EDGE = "#555555";
  const DARK_TEXT = new Set(["#F0E442", "#E69F00", "#56B4E9", FREE]);
  const SVGNS = "http://www.w3.org/2000/svg";
  let serial = 0;

  // ------------------------------------------------------------------ building the DOM
  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    set(el, attrs);
    for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false)
      el.append(k instanceof Node ? k : String(k));
    return el;
  }
  function s(tag, attrs, ...kids) {
    const el = document.createElementNS(SVGNS, tag);
    set(el, attrs);
    for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false)
      el.append(k instanceof Node ? k : String(k));
    return el;
  }
  function set(el, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "on") for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
      else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
      else el.setAttribute(k, v === true ? "" : v);
    }
  }
  const textColor = (fill) => (DARK_TEXT.has(fill) ? "#000" : "#fff");
  const list = (name, items, cls) =>
    h("span", { "data-list": name, class: "pkv-list " + (cls || "") },
      items.map((x) => h("span", { class: "pkv-item" }, x)));
  const fmtList = (xs) => "[" + xs.join(", ") + "]";
  /** ``x`` with ``digits`` decimals as Python's format() writes it: a tie rounds to even
   * (JavaScript's toFixed rounds it up). */
  function fixed(x, digits) {
    const scale = 10 ** digits, v = x * scale, low = Math.floor(v);
    if (v - low === 0.5) return ((low % 2 === 0 ? low : low + 1) / scale).toFixed(digits);
    return x.toFixed(digits);
  }
  const pct = (x, digits = 0) => fixed(100 * x, digits) + "%";

  /** The frame every figure shares: a caption saying what the figure is a model of and
   * where the Python it follows lives, its controls, its view, a line for what the last
   * action did, one for its error (the package's own message), and a text alternative. */
  function frame(root, { title, mirrors, help }) {
    const id = "pkv-fig-" + ++serial;
    root.textContent = "";
    root.classList.add("pkv-ready");
    root.setAttribute("role", "group");
    root.setAttribute("aria-labelledby", id + "-title");
    const parts = {
      title: h("p", { class: "pkv-title", id: id + "-title" }, title),
      mirrors: h("p", { class: "pkv-mirrors" }, mirrors,
                 " Its rules are the package's, ported to JavaScript; the book's tests " +
                 "replay recorded operations through it and compare what it shows with " +
                 "the Python."),
      controls: h("div", { class: "pkv-controls" }),
      view: h("div", { class: "pkv-view" }),
      status: h("p", { class: "pkv-status", role: "status", "aria-live": "polite",
                       "data-read": "status" }),
      error: h("p", { class: "pkv-error", role: "alert", "data-read": "error" }),
      alt: h("p", { class: "pkv-alt", "data-read": "summary" }),
    };
    if (help) parts.help = h("p", { class: "pkv-help" }, help);
    root.append(parts.title, parts.mirrors, parts.help || "", parts.controls, parts.error,
                parts.status, parts.view, parts.alt);
    return parts;
  }

  /** Run ``fn``; a PagedKVError is shown as the package prints it, anything else is a bug. */
  function attempt(parts, fn) {
    parts.error.textContent = "";
    try {
      const said = fn();
      if (said !== undefined) parts.status.textContent = said;
      return true;
    } catch (e) {
      if (!(e instanceof P.core.PagedKVError)) throw e;
      parts.error.textContent = e.toString();
      parts.status.textContent = "Nothing changed: the operation raised.";
      return false;
    }
  }

  function field(label, arg, value, attrs) {
    const input = h("input", Object.assign({ type: "text", "data-arg": arg, value,
                                             size: String(Math.max(3, String(value).length + 1)),
                                             autocomplete: "off", spellcheck: "false" },
                                           attrs || {}));
    return [h("label", { class: "pkv-field" }, label, input), input];
  }
  function select(label, arg, options, value) {
    const el = h("select", { "data-arg": arg },
                 options.map((o) => h("option", { value: String(o), selected: o === value }, o)));
    return [h("label", { class: "pkv-field" }, label, el), el];
  }
  function slider(label, arg, min, max, value, step) {
    const out = h("output", { class: "pkv-out" }, value);
    const el = h("input", { type: "range", "data-arg": arg, min, max, value, step: step || 1,
                            "aria-valuetext": String(value) });
    el.addEventListener("input", () => {
      out.textContent = el.value;
      el.setAttribute("aria-valuetext", el.value);
    });
    return [h("label", { class: "pkv-field" }, label, el, out), el];
  }
  const button = (text, op, onclick, attrs) =>
    h("button", Object.assign({ type: "button", "data-op": op, on: { click: onclick } },
                              attrs || {}), text);
  const group = (...kids) => h("span", { class: "pkv-group" }, kids);
  const value = (input) => P.core.pyValue(input.value);

  /** Colours for owners, in order of first appearance (owner_colors in plots/memory.py). */
  function colorsFor(owners) {
    const out = new Map();
    for (const o of owners) if (o !== null && !out.has(o)) out.set(o, PALETTE[out.size % PALETTE.length]);
    return out;
  }

  /** A pool of blocks as a wrapping grid: ``cells[b]`` = {fill, label, sub, read, fillBar}. */
  function poolGrid(cells, caption) {
    return h("div", { class: "pkv-pool", role: "img", "aria-label": caption },
      cells.map((c, b) => {
        const bar = c.fillBar === undefined ? null :
          h("span", { class: "pkv-bar", style: { width: pct(c.fillBar) } });
        return h("span", { class: "pkv-block", "data-block": b,
                           style: { background: c.fill, color: textColor(c.fill),
                                    borderStyle: c.dashed ? "dashed" : "solid" } },
                 h("span", { class: "pkv-id" }, b),
                 h("span", { class: "pkv-sub", "data-read": c.read || null }, c.sub || ""),
                 bar);
      }));
  }

  // ======================================================= chapter 3: the block allocator
  figures.allocator = function (root, p) {
    const C = P.core, n = p.blocks || 16;
    const parts = frame(root, {
      title: `A pool of ${n} blocks: allocate, free and share them`,
      mirrors: "A model of pagedkv.allocator.BlockAllocator (the free stack and the " +
               "reference counts of this chapter).",
      help: "Type a block id (or several, for free_n) and press a button. Try freeing a " +
            "block twice, or an id outside the pool.",
    });
    let alloc;
    const [fN, nIn] = field("n", "n", "3");
    const [fB, bIn] = field("block", "block", "0");
    const [fL, lIn] = field("blocks", "blocks", "1, 2");
    const act = (fn) => { attempt(parts, fn); draw(); };
    const blocksOf = (text) => text.split(",").filter((t) => t.trim() !== "").map(C.pyValue);
    parts.controls.append(
      group(button("allocate()", "allocate", () => act(() => `allocate() returned block ${alloc.allocate()}`))),
      group(fN, button("allocate_n(n)", "allocate_n", () => act(() =>
        `allocate_n(${C.pyRepr(value(nIn))}) returned ${fmtList(alloc.allocateN(value(nIn)))}`))),
      group(fB, button("free(block)", "free", () => act(() => {
        const b = value(bIn);
        alloc.free(b);
        return `free(${C.pyRepr(b)}): block ${b} has ${alloc.refcount(b)} owner(s) left`;
      })), button("share(block)", "share", () => act(() => {
        const b = value(bIn);
        alloc.share(b);
        return `share(${C.pyRepr(b)}): block ${b} has ${alloc.refcount(b)} owners`;
      }))),
      group(fL, button("free_n(blocks)", "free_n", () => act(() => {
        const bs = blocksOf(lIn.value);
        alloc.freeN(bs);
        return `free_n([${bs.map(C.pyRepr).join(", ")}]): done`;
      }))),
      group(button("reset", "reset", () => { reset(); parts.status.textContent = "A fresh pool."; })));

    function reset() { alloc = new C.BlockAllocator(n); parts.error.textContent = ""; draw(); }
    function draw() {
      const stack = alloc.freeBlocks(), refs = alloc.refcounts();
      const place = new Map(stack.map((b, i) => [b, stack.length - i]));
      const cells = refs.map((r, b) => ({
        fill: r === 0 ? FREE : r === 1 ? PALETTE[0] : SHARED,
        sub: r === 0 ? `#${place.get(b)}` : r === 1 ? "1 owner" : `${r} owners`,
      }));
      const used = refs.map((r, b) => [r, b]).filter(([r]) => r).map(([, b]) => b);
      parts.view.replaceChildren(
        poolGrid(cells, `the pool: ${used.length} blocks in use`),
        h("p", { class: "pkv-line" }, "reference counts: ", list("refcounts", refs)),
        h("p", { class: "pkv-line" }, "free stack, bottom first (the top, last, is what " +
          "allocate() returns next): ", list("stack", stack)),
        h("p", { class: "pkv-line" }, "free ", h("b", { "data-read": "free" }, alloc.numFree),
          " · used ", h("b", { "data-read": "used" }, alloc.numUsed),
          " · shared ", h("b", { "data-read": "shared" }, alloc.numShared)));
      parts.alt.textContent = `${n} blocks: ${used.length} in use` +
        (used.length ? ` (${used.join(", ")})` : "") + `, ${alloc.numFree} free` +
        (stack.length ? `; the next allocate() returns block ${stack[stack.length - 1]}.` : ".") +
        (alloc.numShared ? ` ${alloc.numShared} shared.` : "");
    }
    reset();
    parts.status.textContent = "A fresh pool: allocate() hands out 0, 1, 2, ... in order.";
  };

  // ========================================================= chapter 4: the page table
  figures.page_table = function (root, p) {
    const C = P.core, n = p.blocks || 12;
    const parts = frame(root, {
      title: "Two page tables over one pool",
      mirrors: "A model of pagedkv.page_table.PageTable over a pagedkv.allocator.BlockAllocator, " +
               "grown the way this chapter grows one: a block is taken when the last is full.",
      help: "Append tokens to A or B and watch each new block come off the free stack; " +
            "look a token up to see its block, offset and slot.",
    });
    let alloc, tables, others, bs = p.block_size || 4;
    const [fBs, bsIn] = select("block size", "block_size", [1, 2, 4, 8], bs);
    const [fSeq, seqIn] = select("sequence", "seq", ["A", "B"], "A");
    const [fTok, tokIn] = field("token", "token", "0");
    const [fK, kIn] = field("tokens", "k", "1");
    const act = (fn) => { attempt(parts, fn); draw(); };
    bsIn.addEventListener("change", () => { bs = parseInt(bsIn.value, 10); reset(); });
    function appendOne(name) {
      const t = tables[name];
      let note = "";
      if (t.numTokens === t.capacity) {         // full: map one more block first
        const block = alloc.allocate();
        t.appendBlock(block);
        note = ` (new block: logical ${t.numBlocks - 1} -> physical ${block})`;
      }
      const slot = t.appendToken();
      return `${name}: token ${t.numTokens - 1} -> slot ${slot}${note}`;
    }
    parts.controls.append(
      group(fBs),
      group(fSeq, fK, button("append tokens", "append", () => act(() => {
        const k = C.positiveInt(value(kIn), "the number of tokens"), said = [];
        for (let i = 0; i < k; i++) said.push(appendOne(seqIn.value));
        return said.join("; ");
      }))),
      group(fTok, button("locate(token)", "locate", () => act(() => {
        const t = tables[seqIn.value], tok = value(tokIn);
        const [block, offset] = t.locate(tok);
        const line = `token ${tok} of ${seqIn.value}: logical block ${Math.floor(tok / bs)}, ` +
          `offset ${offset} -> physical block ${block}, slot ${t.slot(tok)}`;
        located = line;
        return line;
      }))),
      group(button("free the sequence's blocks", "free", () => act(() => {
        const name = seqIn.value, t = tables[name];
        for (const b of t.blocks) alloc.free(b);
        tables[name] = new C.PageTable(bs);
        return `${name}'s blocks went back to the free stack`;
      })), button("reset", "reset", () => reset())));
    let located = "";
    function reset() {
      alloc = new C.BlockAllocator(n);
      const held = alloc.allocateN(p.others_allocate || 0);    // someone else's blocks
      for (const b of p.others_free || []) alloc.free(b);
      others = held.filter((b) => alloc.refcount(b));
      tables = { A: new C.PageTable(bs), B: new C.PageTable(bs) };
      located = "";
      parts.error.textContent = "";
      parts.status.textContent = `Blocks ${others.join(", ")} are held by someone else; ` +
        "the free stack is scattered.";
      draw();
    }
    function draw() {
      const W = 46, top = 30, rowH = 62, names = ["A", "B"];
      const width = Math.max(n, ...names.map((k) => tables[k].numBlocks));
      const height = top + rowH * names.length + 70;
      const owner = new Array(n).fill(null);
      names.forEach((k) => tables[k].blocks.forEach((b) => { owner[b] = k; }));
      const color = { A: PALETTE[0], B: PALETTE[1] };
      const g = s("svg", { viewBox: `0 0 ${80 + W * width} ${height}`, class: "pkv-svg",
                           role: "img", "aria-label": "page tables A and B, arrows to the pool" });
      g.append(s("defs", {}, s("pattern", { id: "pkv-hatch", width: 6, height: 6,
        patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
        s("rect", { width: 6, height: 6, fill: FREE }),
        s("line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#999", "stroke-width": 2 }))));
      const poolY = top + rowH * names.length + 20;
      for (let b = 0; b < n; b++) {
        const fill = owner[b] ? color[owner[b]] : others.includes(b) ? "url(#pkv-hatch)" : FREE;
        g.append(s("rect", { x: 80 + W * b + 3, y: poolY, width: W - 6, height: 34, fill,
                             stroke: EDGE, "data-block": b, "data-owner": owner[b] || "" }),
                 s("text", { x: 80 + W * b + W / 2, y: poolY + 22, "text-anchor": "middle",
                             fill: owner[b] ? "#fff" : "#000", class: "pkv-svgtext" }, b));
      }
      g.append(s("text", { x: 74, y: poolY + 22, "text-anchor": "end", class: "pkv-svgtext" }, "pool"));
      names.forEach((k, r) => {
        const y = top + rowH * r, t = tables[k];
        g.append(s("text", { x: 74, y: y + 22, "text-anchor": "end", class: "pkv-svgtext" },
                   `${k}, logical`));
        t.blocks.forEach((b, j) => {
          g.append(s("rect", { x: 80 + W * j + 3, y, width: W - 6, height: 34, fill: "#fff",
                               stroke: color[k], "stroke-width": 2.5 }),
                   s("text", { x: 80 + W * j + W / 2, y: y + 22, "text-anchor": "middle",
                               class: "pkv-svgtext" }, j),
                   s("line", { x1: 80 + W * j + W / 2, y1: y + 34, x2: 80 + W * b + W / 2,
                               y2: poolY - 2, stroke: color[k], "stroke-width": 1.5,
                               "marker-end": "url(#pkv-arrow-" + k + ")" }));
        });
        g.querySelector("defs").append(s("marker", { id: "pkv-arrow-" + k, viewBox: "0 0 10 10",
          refX: 9, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" },
          s("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: color[k] })));
      });
      const repr = (t) => `PageTable(${t.numTokens} tokens, blocks=${fmtList(t.blocks)})`;
      parts.view.replaceChildren(g,
        ...names.map((k) => h("p", { class: "pkv-line" }, `${k}: `,
          h("code", { "data-read": "table:" + k }, repr(tables[k])))),
        h("p", { class: "pkv-line" }, "free stack, bottom first: ", list("stack", alloc.freeBlocks())),
        h("p", { class: "pkv-line", "data-read": "located" }, located));
      parts.alt.textContent = names.map((k) => `${k} has ${tables[k].numTokens} tokens in ` +
        `blocks ${fmtList(tables[k].blocks)}`).join("; ") +
        `; blocks ${others.join(", ")} are someone else's; ${alloc.numFree} blocks are free.`;
    }
    reset();
  };

  // =============================================== chapters 5 and 7: the KV-cache manager
  figures.manager = function (root, p) {
    const C = P.core, n = p.blocks || 24, bs = p.block_size || 4, forks = !!p.fork;
    const parts = frame(root, {
      title: forks ? `Fork, write, copy: a pool of ${n} blocks of ${bs} tokens`
                   : `The manager over a pool of ${n} blocks of ${bs} tokens`,
      mirrors: "A model of pagedkv.manager.KVCacheManager (add, append, step, " +
               (forks ? "fork, free; copy-on-write in _grow)." : "free) over a BlockAllocator."),
      help: forks ? "Fork a sequence, then append to the child: the first write into the " +
                    "shared, partly filled last block copies it. The plan lists the copy."
                  : "Add sequences with a prompt, append tokens, step every sequence by one " +
                    "token, free them. Try a prompt larger than the free blocks.",
    });
    let m, lastPlan = null, scriptAt = 0;
    const [fSeq, seqIn] = field("seq", "seq", "a");
    const [fN, nIn] = field("n", "n", forks ? "6" : "7");
    const [fChild, childIn] = field("child", "child", "b");
    const act = (fn) => { attempt(parts, fn); draw(); };
    const seq = () => seqIn.value.trim();        // sequence ids are strings here
    const ops = {
      add: () => { const s_ = seq(), k = value(nIn); lastPlan = m.add(s_, k);
                   return `add(${C.pyRepr(s_)}, ${C.pyRepr(k)})`; },
      append: () => { const s_ = seq(), k = value(nIn); lastPlan = m.append(s_, k);
                      return `append(${C.pyRepr(s_)}, ${C.pyRepr(k)})`; },
      step: () => { lastPlan = m.step(); return "step()"; },
      fork: () => { const s_ = seq(), c = childIn.value.trim(); m.fork(s_, c); lastPlan = null;
                    return `fork(${C.pyRepr(s_)}, ${C.pyRepr(c)}): no bytes move`; },
      free: () => { const s_ = seq(); m.free(s_); lastPlan = null;
                    return `free(${C.pyRepr(s_)})`; },
    };
    const run = (op) => act(ops[op]);
    parts.controls.append(
      group(fSeq, fN, button("add(seq, n)", "add", () => run("add")),
            button("append(seq, n)", "append", () => run("append"))),
      forks ? group(fChild, button("fork(seq, child)", "fork", () => run("fork"))) : "",
      group(button("step()", "step", () => run("step")),
            button("free(seq)", "free", () => run("free")),
            button("reset", "reset", () => reset())),
      p.script ? group(button("next step of the example", "script", () => {
        if (scriptAt >= p.script.length) reset();
        const [op, a, b] = p.script[scriptAt++];
        seqIn.value = a === undefined ? seqIn.value : a;
        if (op === "fork") childIn.value = b; else if (b !== undefined) nIn.value = b;
        run(op);
      })) : "");
    function reset() {
      m = new C.KVCacheManager(new C.BlockAllocator(n), bs);
      lastPlan = null;
      scriptAt = 0;
      parts.error.textContent = "";
      parts.status.textContent = "An empty manager.";
      draw();
    }
    function draw() {
      const a = m.allocator, refs = a.refcounts(), owner = new Array(n).fill(null);
      const fill = new Array(n).fill(0);
      for (const sid of m.seqIds) {
        const t = m._table(sid);
        t.blocks.forEach((b, j) => {
          owner[b] = owner[b] === null ? sid : "shared";
          fill[b] = Math.min(bs, t.numTokens - j * bs);
        });
      }
      const colors = colorsFor(m.seqIds);
      const cells = refs.map((r, b) => ({
        fill: r === 0 ? FREE : r > 1 ? SHARED : colors.get(owner[b]),
        sub: r === 0 ? "" : r > 1 ? `${owner[b] === "shared" ? "x" + r : r}` : String(owner[b]),
        fillBar: r ? fill[b] / bs : undefined,
      }));
      const st = m.stats();
      const tables = m.seqIds.map((sid) => {
        const t = m._table(sid);
        return h("li", {}, h("span", { class: "pkv-swatch", style: { background: colors.get(sid) } }),
          `${C.pyRepr(sid)}: `, h("b", { "data-read": "tokens:" + sid }, t.numTokens),
          " tokens, blocks ", list("table:" + sid, t.blocks));
      });
      const plan = [];
      if (lastPlan && lastPlan.seqIds) {
        plan.push(h("li", {}, "batch ", fmtList(lastPlan.seqIds.map(C.pyRepr))),
                  h("li", {}, "slot_mapping ", list("slots", lastPlan.slotMapping)),
                  h("li", {}, "seq_lens ", fmtList(lastPlan.seqLens)),
                  h("li", {}, "block_tables ", lastPlan.blockTables.map(fmtList).join(" ")));
      } else if (lastPlan) {
        plan.push(h("li", {}, "slots ", list("slots", lastPlan.slots)));
      }
      if (lastPlan) plan.push(h("li", {}, "copies (src -> dst), made before the writes: ",
        list("copies", lastPlan.copies.map(([x, y]) => `${x}->${y}`))));
      parts.view.replaceChildren(
        poolGrid(cells, `the pool: ${a.numUsed} of ${n} blocks in use`),
        h("p", { class: "pkv-line" }, "reference counts: ", list("refcounts", refs)),
        h("p", { class: "pkv-line" }, "free ", h("b", { "data-read": "free" }, a.numFree),
          " · used ", h("b", { "data-read": "used" }, a.numUsed),
          " · shared ", h("b", { "data-read": "shared" }, st.shared_blocks),
          " · internal fragmentation ", h("b", { "data-read": "ifrag" }, pct(st.internal_fragmentation, 1))),
        h("div", { class: "pkv-cols" },
          h("div", {}, h("p", { class: "pkv-sub-title" }, "page tables"),
            tables.length ? h("ul", { class: "pkv-ul" }, tables) : h("p", {}, "(no sequence)")),
          h("div", {}, h("p", { class: "pkv-sub-title" }, "the last plan"),
            plan.length ? h("ul", { class: "pkv-ul" }, plan) : h("p", {}, "(none)"))));
      parts.alt.textContent = `${m.size} sequence(s); ` + m.seqIds.map((sid) =>
        `${sid}: ${m.numTokens(sid)} tokens in blocks ${fmtList(m.blockTable(sid))}`).join("; ") +
        `; ${a.numFree} of ${n} blocks free` +
        (st.shared_blocks ? `, ${st.shared_blocks} shared.` : ".");
    }
    reset();
  };

  // ===================================== chapter 5: the block size, one pool, one set of prompts
  figures.fill_pool = function (root, p) {
    const C = P.core, slots = p.pool_slots || 96;
    const parts = frame(root, {
      title: `One pool of ${slots} token slots, cut into blocks of different sizes`,
      mirrors: "The same manager (pagedkv.manager.KVCacheManager) admitting the chapter's " +
               "random sequences until one does not fit, as fill_pool above does.",
      help: "Change the block size or the number of sequences.",
    });
    const [fBs, bsIn] = select("block size", "block_size", [1, 2, 4, 8, 16], p.block_size || 4);
    const [fK, kIn] = slider("sequences", "sequences", 1, Object.keys(p.lengths).length,
                             p.sequences || 6);
    parts.controls.append(group(fBs), group(fK));
    bsIn.addEventListener("change", draw);
    kIn.addEventListener("input", draw);
    function draw() {
      const bs = parseInt(bsIn.value, 10), k = parseInt(kIn.value, 10);
      const lengths = p.lengths[String(k)];
      const m = new C.KVCacheManager(new C.BlockAllocator(Math.floor(slots / bs)), bs);
      let admitted = 0;
      for (let i = 0; i < lengths.length; i++) {
        try { m.add(i, lengths[i]); } catch (e) { if (e.type === "OutOfBlocks") break; throw e; }
        admitted += 1;
      }
      const st = m.stats(), nb = m.allocator.numBlocks, owner = new Array(nb).fill(null);
      const fill = new Array(nb).fill(0);
      for (const sid of m.seqIds) m.blockTable(sid).forEach((b, j) => {
        owner[b] = sid;
        fill[b] = Math.min(bs, m.numTokens(sid) - j * bs);
      });
      const colors = colorsFor(m.seqIds);
      const title = `block size ${bs}: ${admitted} of ${k} sequences admitted, ${st.tokens} ` +
        `tokens, internal fragmentation ${pct(st.internal_fragmentation)}`;
      parts.status.textContent = "";
      parts.view.replaceChildren(
        h("p", { class: "pkv-line", "data-read": "title" }, title),
        h("p", { class: "pkv-line" }, "lengths drawn: ", list("lengths", lengths)),
        poolGrid(owner.map((o, b) => ({ fill: o === null ? FREE : colors.get(o),
                                        sub: o === null ? "" : `seq ${o}`,
                                        fillBar: o === null ? undefined : fill[b] / bs })),
                 title),
        h("p", { class: "pkv-line" }, "owners: ", list("owners", owner.map((o) => (o === null ? "-" : o)))));
      parts.alt.textContent = title + ".";
    }
    draw();
  };

  P.h = h;
  P.s = s;
  P.ui = { h, s, fixed, frame, attempt, field, select, slider, button, group, list, poolGrid, colorsFor,
           fmtList, pct, value, PALETTE, FREE, SHARED, IDLE, EDGE, textColor };

  /** Build every figure on the page (once each). */
  function init() {
    for (const el of document.querySelectorAll(".pkv-live[data-figure]")) {
      if (el.dataset.built) continue;
      const make = figures[el.dataset.figure];
      if (!make || !P.core) continue;
      el.dataset.built = "1";
      try {
        make(el, JSON.parse(el.dataset.params || "{}"));
      } catch (e) {                         // one broken figure leaves the others working
        console.error(`pagedkv live figure ${el.dataset.figure}: ${e}`);
      }
    }
  }
  P.init = init;
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else setTimeout(init, 0);
})();
