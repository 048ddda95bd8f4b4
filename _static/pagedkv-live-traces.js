/* The book's live figures that replay a trace: chapter 1's three ways to hand out memory,
 * chapter 6's simulation (its admission rule step by step, and the whole run), chapter 7's
 * beam search over the pool, and chapter 11's prefix cache with the life of a block.
 * They use the frame and helpers of pagedkv-live.js and the rules of pagedkv-live-core.js
 * (both looked up when a figure is built, so the files may load in any order).
 */
(function () {
  "use strict";
  const P = (window.pagedkv = window.pagedkv || {});
  const figures = (P.figures = P.figures || {});
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

  // ================================================ chapter 1: three ways to hand out memory
  figures.fragmentation = function (root, p) {
    const C = P.core, U = P.ui, h = P.h, s = P.s;
    const cap = p.capacity, maxLen = p.max_len, finished = p.finished;
    const seeds = Object.keys(p.lengths).map(Number);
    const events = [];
    for (let i = 0; i < 6; i++) events.push(["arrive", i]);
    for (const i of finished) events.push(["end", i]);
    events.push(["arrive", 6]);
    const said = (e) => (e ? (e[0] === "arrive" ? `request ${e[1]} arrives` : `request ${e[1]} ends`)
                           : "nothing yet");
    const parts = U.frame(root, {
      title: `${cap} token slots, three ways to hand them out`,
      mirrors: "A model of this chapter's three strategies: (a) and (b) place ranges with " +
               "pagedkv.contiguous.FirstFit, (c) is a pagedkv.manager.KVCacheManager.",
      help: "Draw other request lengths (the seed), change the block size of (c), or replay " +
            "the requests one event at a time.",
    });
    const [fSeed, seedIn] = U.slider("seed", "seed", Math.min(...seeds), Math.max(...seeds),
                                     p.seed);
    const [fBs, bsIn] = U.select("block size of (c)", "block_size", [1, 2, 4, 8, 16], p.block_size);
    const [fEv, evIn] = U.slider("events", "events", 0, events.length, events.length);
    parts.controls.append(U.group(fSeed), U.group(fBs), U.group(fEv));
    for (const el of [seedIn, bsIn, evIn]) el.addEventListener("input", draw);
    bsIn.addEventListener("change", draw);

    function replay(seed, bs, upto) {
      const lens = p.lengths[String(seed)];            // requests 0-5, then request 6
      const lenOf = (i) => lens[i];
      const ffA = new C.FirstFit(cap), ffB = new C.FirstFit(cap);
      const a = new Map(), b = new Map(), refused = { a: [], b: [], c: [] };
      const m = new C.KVCacheManager(new C.BlockAllocator(cap / bs), bs);
      for (const [kind, i] of events.slice(0, upto)) {
        if (kind === "arrive") {
          const sa = ffA.alloc(maxLen), sb = ffB.alloc(lenOf(i));
          if (sa === null) refused.a.push(i); else a.set(i, sa);
          if (sb === null) refused.b.push(i); else b.set(i, sb);
          try { m.add(i, lenOf(i)); } catch (e) { if (e.type !== "OutOfBlocks") throw e; refused.c.push(i); }
        } else {
          if (a.has(i)) { ffA.free(a.get(i), maxLen); a.delete(i); }
          if (b.has(i)) { ffB.free(b.get(i), lenOf(i)); b.delete(i); }
          if (m.has(i)) m.free(i);
        }
      }
      const regions = {
        a: [...a].map(([i, st]) => [st, maxLen, i, lenOf(i)]),
        b: [...b].map(([i, st]) => [st, lenOf(i), i, lenOf(i)]),
        c: [],
      };
      for (const sid of m.seqIds) m.blockTable(sid).forEach((blk, j) =>
        regions.c.push([blk * bs, bs, sid, Math.min(bs, m.numTokens(sid) - j * bs)]));
      return { lens, regions, refused, placed: { a: a.size, b: b.size, c: m.size } };
    }
    function summary(regions) {           // plots/memory.py's layout_summary
      const rs = regions.slice().sort((x, y) => x[0] - y[0]);
      let stored = 0, reserved = 0, largest = 0, end = 0;
      for (const [st, size, , used] of rs) {
        largest = Math.max(largest, st - end);
        end = st + size;
        stored += used;
        reserved += size;
      }
      largest = Math.max(largest, cap - end);
      return { stored, empty: reserved - stored, free: cap - reserved, hole: largest };
    }
    function strip(label, regions, bs) {
      const W = 12, x0 = 150, owner = new Array(cap).fill(null), used = new Array(cap).fill(null);
      for (const [st, size, o, u] of regions)
        for (let k = 0; k < size; k++) { owner[st + k] = o; used[st + k] = k < u; }
      const g = s("g", {});
      g.append(s("text", { x: x0 - 8, y: 17, "text-anchor": "end", class: "pkv-svgtext" }, label));
      for (let k = 0; k < cap; k++) {
        const o = owner[k];
        const fill = o === null ? U.FREE : used[k] ? U.PALETTE[o % 7] : "url(#pkv-empty)";
        g.append(s("rect", { x: x0 + W * k, y: 2, width: W, height: 22, fill,
                             stroke: o === null ? "#ccc" : "none", "stroke-width": 0.5,
                             "data-owner": o === null ? "" : o,
                             "data-used": o === null ? "" : used[k] ? "1" : "0" }));
      }
      for (const [st, size, o] of regions) {
        g.append(s("rect", { x: x0 + W * st, y: 2, width: W * size, height: 22, fill: "none",
                             stroke: U.PALETTE[o % 7], "stroke-width": 1.5 }));
        if (size * W >= 14)
          g.append(s("text", { x: x0 + W * st + 3, y: 17, class: "pkv-svgsmall",
                               fill: U.textColor(U.PALETTE[o % 7]) }, o));
      }
      if (bs) for (let k = bs; k < cap; k += bs)
        g.append(s("line", { x1: x0 + W * k, y1: 2, x2: x0 + W * k, y2: 24, stroke: "#fff",
                             "stroke-width": 1.5 }));
      return g;
    }
    function draw() {
      const seed = parseInt(seedIn.value, 10), bs = parseInt(bsIn.value, 10);
      const upto = parseInt(evIn.value, 10);
      const r = replay(seed, bs, upto);
      const svg = s("svg", { viewBox: `0 0 ${150 + 12 * cap + 4} ${3 * 34 + 4}`,
                             class: "pkv-svg", role: "img",
                             "aria-label": "three strips of memory, one per strategy" },
        s("defs", {}, s("pattern", { id: "pkv-empty", width: 5, height: 5,
          patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)" },
          s("rect", { width: 5, height: 5, fill: "#fff" }),
          s("line", { x1: 0, y1: 0, x2: 0, y2: 5, stroke: "#888", "stroke-width": 1.5 }))));
      const rows = [["a", "(a) maximum"], ["b", "(b) exact"], ["c", `(c) blocks of ${bs}`]];
      rows.forEach(([k, label], i) => {
        const g = strip(label, r.regions[k], k === "c" ? bs : 0);
        g.setAttribute("transform", `translate(0, ${i * 34})`);
        g.setAttribute("data-strip", k);
        svg.append(g);
      });
      const last = upto === events.length;
      const head = ["strategy", "holding", "refused", "stored", "reserved empty", "free",
                    "largest hole", "request 6 fits"];
      const body = rows.map(([k, label]) => {
        const sm = summary(r.regions[k]);
        const fits = last ? (r.refused[k].includes(6) ? "no" : "yes") : "-";
        return U.h("tr", {}, U.h("th", { scope: "row" }, label),
          ...[["holding", r.placed[k]], ["refused", U.fmtList(r.refused[k])],
              ["stored", sm.stored], ["empty", sm.empty], ["free", sm.free], ["hole", sm.hole],
              ["fits", fits]].map(([name, v]) => U.h("td", { "data-read": `${name}:${k}` }, v)));
      });
      parts.view.replaceChildren(
        h("p", { class: "pkv-line" }, `requests 0-5: `, U.list("lengths", r.lens.slice(0, 6)),
          ` · request 6: ${r.lens[6]} · after: `, h("b", { "data-read": "event" }, said(events[upto - 1]))),
        svg,
        h("div", { class: "pkv-scroll" }, h("table", { class: "pkv-table" },
          h("thead", {}, h("tr", {}, head.map((x) => h("th", { scope: "col" }, x)))),
          h("tbody", {}, body))));
      parts.alt.textContent = rows.map(([k, label]) => {
        const sm = summary(r.regions[k]);
        return `${label}: ${r.placed[k]} requests hold memory, ${sm.stored} slots store ` +
          `tokens, ${sm.empty} are reserved but empty, the largest hole is ${sm.hole}`;
      }).join("; ") + ".";
    }
    draw();
  };

  // ================================================ chapter 6: the admission rule, step by step
  function serveFrames(C, p, blockSize, maxSeqs) {
    const policy = new C.PagedPolicy(p.pool_bytes, blockSize, p.watermark);
    const reqs = p.requests.map(([rid, arrival, prompt, output]) => ({ rid, arrival, prompt, output }));
    const frames = [{ step: 0, running: [], waiting: reqs.filter((r) => r.arrival === 0).map((r) => r.rid),
                      free: policy.manager.allocator.numFree }];
    const run = C.serve(reqs, policy, {
      maxSeqs,
      onStep: (step, st) => frames.push({
        step,
        running: st.running.map((r) => ({ rid: r.req.rid, len: r.len, final: r.final,
                                          blocks: st.policy.manager.blockTable(r.req.rid) })),
        waiting: st.waiting.map((q) => q.rid),
        free: st.policy.manager.allocator.numFree,
      }),
    });
    return { policy, frames, run, reqs };
  }

  figures.admission = function (root, p) {
    const C = P.core, U = P.ui, h = P.h;
    const parts = U.frame(root, {
      title: `The simulation's admission rule, step by step: ${p.requests.length} requests, ` +
             `a pool of ${Math.floor(p.pool_bytes / (p.block_size * C.SIM_TOKEN_BYTES))} ` +
             `blocks of ${p.block_size} tokens, at most ${p.max_seqs} running`,
      mirrors: "A model of pagedkv.sim.serve with a sim.PagedPolicy (first come, first served; " +
               "a watermark; the newest preempted when a step runs out), over the teaching " +
               "manager.",
      help: "Step through the run: each step admits from the head of the queue while the " +
            "request fits, then every running request gains a token.",
    });
    const { frames, run, reqs, policy } = serveFrames(C, p, p.block_size, p.max_seqs);
    const [fStep, stepIn] = U.slider("step", "step", 0, frames.length - 1, 0);
    const go = (d) => { stepIn.value = String(Math.min(frames.length - 1,
                          Math.max(0, parseInt(stepIn.value, 10) + d)));
                        stepIn.dispatchEvent(new Event("input")); };
    parts.controls.append(U.group(U.button("previous step", "back", () => go(-1)),
                                  U.button("next step", "next", () => go(1))), U.group(fStep));
    stepIn.addEventListener("input", draw);
    const nb = policy.manager.allocator.numBlocks;
    function decisions(ev) {
      if (!ev) return ["Before the first step: nothing runs, the pool is empty."];
      const out = [];
      ev.admitted.forEach(([rid, len], i) => {
        const inf = ev.admitInfo[i];
        out.push(`admit ${rid}: ${len} tokens need ceil((${len} + 1) / ${p.block_size}) = ` +
                 `${inf.need} blocks, + ${inf.watermark} watermark <= ${inf.free} free`);
      });
      if (ev.refused && ev.refused.why === "memory") {
        const inf = ev.refused.info;
        out.push(`refuse ${ev.refused.rid} (the head of the queue): ${ev.refused.left} tokens ` +
                 `need ${inf.need} blocks, + ${inf.watermark} watermark > ${inf.free} free; ` +
                 "it and everyone behind it wait");
      } else if (ev.refused) {
        out.push(`refuse ${ev.refused.rid}: its ${ev.refused.left} tokens and its first ` +
                 `decode token do not fit the ${ev.refused.budget} tokens left of the budget`);
      }
      ev.preempted.forEach(([rid, len], i) => {
        const sf = ev.shortfalls[i];
        out.push(`the step needs ${sf.need} new blocks, ${sf.free} are free: preempt ${rid}, ` +
                 `the newest (its ${len} tokens go back to the head of the queue)`);
      });
      out.push(`every running request gains a token`);
      if (ev.left.length) out.push(`finished, leave after the step: ${ev.left.join(", ")}`);
      return out;
    }
    function draw() {
      const k = parseInt(stepIn.value, 10), f = frames[k], ev = run.events[k - 1];
      const owner = new Array(nb).fill(null), fill = new Array(nb).fill(0);
      for (const r of f.running) r.blocks.forEach((b, j) => {
        owner[b] = r.rid;
        fill[b] = Math.min(p.block_size, r.len - j * p.block_size);
      });
      const colors = new Map(reqs.map((r, i) => [r.rid, U.PALETTE[i % 7]]));
      parts.status.textContent = "";
      parts.view.replaceChildren(
        h("p", { class: "pkv-line" }, "step ", h("b", { "data-read": "step" }, f.step),
          ` of ${frames.length - 1} · free blocks `, h("b", { "data-read": "free" }, f.free),
          ` of ${nb} · preempted so far `,
          h("b", { "data-read": "preempted" },
            run.events.slice(0, k).reduce((n, e) => n + e.preempted.length, 0))),
        h("ol", { class: "pkv-ul pkv-log", "data-list": "decisions" },
          decisions(ev).map((x) => h("li", { class: "pkv-item" }, x))),
        U.poolGrid(owner.map((o, b) => ({ fill: o === null ? U.FREE : colors.get(o),
                                          sub: o === null ? "" : `req ${o}`,
                                          fillBar: o === null ? undefined : fill[b] / p.block_size })),
                   `the pool after step ${f.step}`),
        h("div", { class: "pkv-cols" },
          h("div", {}, h("p", { class: "pkv-sub-title" }, "running, in admission order"),
            h("ul", { class: "pkv-ul" }, f.running.map((r) => h("li", {},
              h("span", { class: "pkv-swatch", style: { background: colors.get(r.rid) } }),
              `request ${r.rid}: ${r.len} of ${r.final} tokens, blocks `,
              U.list("blocks:" + r.rid, r.blocks))))),
          h("div", {}, h("p", { class: "pkv-sub-title" }, "waiting, the head first"),
            h("p", {}, U.list("waiting", f.waiting.map((rid) => rid))),
            h("p", { class: "pkv-small" }, "not arrived yet: " + (reqs.filter((r) =>
              (k ? r.arrival >= f.step : r.arrival > 0) && !f.running.some((x) => x.rid === r.rid) &&
              !f.waiting.includes(r.rid)).map((r) => `${r.rid} (at step ${r.arrival})`).join(", ")
              || "none")))));
      parts.alt.textContent = `After step ${f.step}: ` + (f.running.length
        ? f.running.map((r) => `request ${r.rid} runs with ${r.len} tokens`).join(", ")
        : "nothing runs") + `; waiting: ${f.waiting.join(", ") || "none"}; ${f.free} blocks free.`;
    }
    draw();
  };

  // ===================================================== chapter 6: the whole run, explored
  figures.simulation = function (root, p) {
    const C = P.core, U = P.ui, h = P.h, s = P.s;
    const parts = U.frame(root, {
      title: `${p.requests.length} ${p.preset} requests through a ${p.pool_mib} MiB pool`,
      mirrors: "A model of pagedkv.sim.serve with a sim.PagedPolicy over the teaching manager " +
               "(and, for reference, max-length reservation with contiguous.FirstFit), as " +
               "simulation_figure draws it above.",
      help: "Change the block size or how many requests may run at once; move the step " +
            "cursor to read the run at one step. The numbers behind the curves are in the " +
            "table under the figure.",
    });
    const reqs = p.requests.map(([rid, arrival, prompt, output]) => ({ rid, arrival, prompt, output }));
    const [fBs, bsIn] = U.select("block size", "block_size", p.block_sizes, p.block_size);
    const [fMs, msIn] = U.slider("max seqs", "max_seqs", 1, p.max_concurrency, p.concurrency);
    const [fAt, atIn] = U.slider("step", "at", 1, 1, 1);
    parts.controls.append(U.group(fBs), U.group(fMs), U.group(fAt));
    let result = null, pending = 0;
    const rerun = () => { cancelAnimationFrame(pending); pending = requestAnimationFrame(run); };
    bsIn.addEventListener("change", rerun);
    msIn.addEventListener("input", rerun);
    atIn.addEventListener("input", () => cursor());
    const details = h("details", { class: "pkv-details" },
                      h("summary", {}, "the numbers, step by step"));
    details.addEventListener("toggle", () => table());

    function run() {
      const bs = parseInt(bsIn.value, 10), ms = parseInt(msIn.value, 10);
      if (!attempt(() => {
        const paged = C.serve(reqs, new C.PagedPolicy(p.pool_bytes, bs, p.watermark), { maxSeqs: ms });
        const naive = C.serve(reqs, new C.MaxLengthPolicy(p.pool_bytes, p.max_len), { maxSeqs: ms });
        result = { bs, ms, paged, naive };
      })) return;
      const steps = result.paged.totals.steps;
      atIn.max = String(steps);
      if (parseInt(atIn.value, 10) > steps) atIn.value = String(steps);
      draw();
    }
    function attempt(fn) { return U.attempt(parts, fn); }
    function chart(xs, lines, ymax, label, fmt) {
      const W = 420, H = 190, L = 44, B = 22, T = 26, xmax = Math.max(1, xs[xs.length - 1] || 1);
      const X = (x) => L + (W - L - 8) * x / xmax, Y = (y) => H - B - (H - B - T) * y / ymax;
      const g = s("svg", { viewBox: `0 0 ${W} ${H}`, class: "pkv-svg pkv-chart", role: "img",
                           "aria-label": label });
      g.append(s("line", { x1: L, y1: H - B, x2: W - 8, y2: H - B, stroke: "#888" }),
               s("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#888" }),
               s("text", { x: L - 4, y: T + 4, "text-anchor": "end", class: "pkv-svgsmall" }, fmt(ymax)),
               s("text", { x: L - 4, y: H - B, "text-anchor": "end", class: "pkv-svgsmall" }, fmt(0)),
               s("text", { x: W - 8, y: H - 6, "text-anchor": "end", class: "pkv-svgsmall" },
                 `decode step ${xmax}`),
               s("text", { x: L, y: H - 6, "text-anchor": "middle", class: "pkv-svgsmall" }, "0"),
               s("text", { x: 4, y: 14, class: "pkv-svgsmall" }, label));
      for (const { ys, color, dash, name } of lines) {
        const pts = [];
        const stride = Math.max(1, Math.floor(xs.length / 700));
        for (let i = 0; i < xs.length; i += stride) pts.push(`${X(xs[i]).toFixed(1)},${Y(ys[i]).toFixed(1)}`);
        g.append(s("polyline", { points: pts.join(" "), fill: "none", stroke: color,
                                 "stroke-width": 1.6, "stroke-dasharray": dash || null,
                                 "data-series": name }));
      }
      g.append(s("line", { class: "pkv-cursor", x1: 0, x2: 0, y1: T, y2: H - B,
                           stroke: "#000", "stroke-width": 1, "stroke-dasharray": "3 2" }));
      g._x = X;
      return g;
    }
    function draw() {
      const { bs, ms, paged, naive } = result, sr = paged.series, pool = paged.poolSlots;
      const title = `${p.requests.length} ${p.preset} requests, ${p.pool_mib} MiB pool, block ` +
        `size ${bs}, at most ${ms} at once: ${paged.totals.steps} steps, ` +
        `${paged.totals.preemptions} preemptions (max-length reservation: ` +
        `${naive.totals.steps} steps)`;
      const left = chart(sr.step, [
        { ys: sr.held.map((v) => v / pool), color: U.PALETTE[0], name: "held" },
        { ys: sr.tokens.map((v) => v / pool), color: U.PALETTE[2], name: "tokens" }],
        1.05, "share of the pool: held in blocks (blue), holding K/V (green)",
        (v) => U.pct(Math.min(v, 1)));
      const top = Math.max(ms, ...sr.running) * 1.15;
      const right = chart(sr.step, [
        { ys: sr.running, color: U.PALETTE[0], name: "running" },
        { ys: sr.step.map(() => ms), color: U.SHARED, dash: "5 3", name: "max seqs" }],
        top, "requests running (dashed: max seqs)", (v) => String(Math.round(v)));
      parts.view.replaceChildren(
        h("p", { class: "pkv-line", "data-read": "title" }, title),
        h("div", { class: "pkv-charts" }, left, right),
        h("p", { class: "pkv-line", "data-read": "at" }), details);
      parts.alt.textContent = title + `. At most ${Math.max(...sr.running)} requests ran at ` +
        `once; the blocks held at most ${U.pct(Math.max(...sr.held) / pool)} of the pool.`;
      cursor();
      if (details.open) table();
    }
    function cursor() {
      if (!result) return;
      const k = parseInt(atIn.value, 10), sr = result.paged.series, i = k - 1;
      const pool = result.paged.poolSlots;
      for (const svg of parts.view.querySelectorAll(".pkv-chart")) {
        const line = svg.querySelector(".pkv-cursor"), x = svg._x(k);
        line.setAttribute("x1", x);
        line.setAttribute("x2", x);
      }
      const at = parts.view.querySelector("[data-read=at]");
      if (at && i < sr.step.length)
        at.textContent = `step ${sr.step[i]}: ${sr.running[i]} running, ${sr.waiting[i]} ` +
          `waiting, ${sr.tokens[i]} tokens in ${sr.held[i]} slots held ` +
          `(${U.pct(sr.held[i] / pool, 1)} of the pool), ${sr.finished[i]} finished`;
    }
    function table() {
      if (!details.open || !result) return;
      const sr = result.paged.series, keys = ["step", "running", "waiting", "tokens", "held", "finished"];
      const old = details.querySelector("table");
      if (old) old.remove();
      const rows = [];
      for (let i = 0; i < sr.step.length; i++)
        rows.push("<tr>" + keys.map((k) => `<td>${sr[k][i]}</td>`).join("") + "</tr>");
      const t = h("table", { class: "pkv-table pkv-numbers", "data-table": "series" },
                  h("thead", {}, h("tr", {}, keys.map((k) => h("th", { scope: "col" }, k)))));
      const body = document.createElement("tbody");
      body.innerHTML = rows.join("");
      t.append(body);
      details.append(h("div", { class: "pkv-scroll pkv-tall" }, t));
    }
    run();
  };

  // ============================================ chapter 7: beam search over the pool
  const SHADES = ["#FDBB84", "#FC8D59", "#EF6548", "#D7301F", "#B30000", "#7F0000", "#4D0000"];
  figures.beam = function (root, p) {
    const C = P.core, U = P.ui, h = P.h, s = P.s;
    const widths = Object.keys(p.schedules).map(Number);
    const parts = U.frame(root, {
      title: `A beam search over a pool of ${p.pool_blocks} blocks of ${p.block_size} tokens`,
      mirrors: "A model of pagedkv.sim.beam_search: every step, pagedkv.beams.follow forks the " +
               "beams with several survivors and frees the pruned ones, then the " +
               "KVCacheManager steps every beam (copy-on-write in _grow). Which beams survive " +
               "each step is the package's own draw (beam_children, seed 0).",
      help: "Change the beam width or the prompt length. One column per step, one row per " +
            "block, coloured by how many beams map it.",
    });
    const [fW, wIn] = U.slider("beam width", "width", Math.min(...widths), Math.max(...widths), p.width);
    const [fP, pIn] = U.slider("prompt", "prompt", 1, p.max_prompt, p.prompt);
    parts.controls.append(U.group(fW), U.group(fP));
    wIn.addEventListener("input", draw);
    pIn.addEventListener("input", draw);
    function search(width, prompt) {
      const bs = p.block_size, m = new C.KVCacheManager(new C.BlockAllocator(p.pool_blocks), bs);
      let nextId = 1, used = 0, unshared = 0, copies = 0;
      const frames = [];
      m.add(0, prompt);
      let beams = [0];
      for (const parents of p.schedules[String(width)].slice(0, p.output)) {
        const fresh = [], taken = new Set();          // pagedkv/beams.py's follow
        parents.forEach((i) => {
          if (taken.has(i)) { const child = nextId++; m.fork(beams[i], child); fresh.push(child); }
          else { taken.add(i); fresh.push(beams[i]); }
        });
        beams.forEach((b, i) => { if (!taken.has(i)) m.free(b); });
        beams = fresh;
        copies += m.step(beams, false).copies.length;
        used += m.allocator.numUsed;
        unshared += m.seqIds.reduce((n, sid) => n + C.cdiv(m.numTokens(sid), bs), 0);
        frames.push(m.allocator.refcounts());
      }
      for (const b of beams) m.free(b);
      return { frames, used, unshared, copies };
    }
    function draw() {
      const width = parseInt(wIn.value, 10), prompt = parseInt(pIn.value, 10);
      const r = search(width, prompt);
      let rows = 1;
      for (const f of r.frames) f.forEach((c, b) => { if (c) rows = Math.max(rows, b + 1); });
      const cw = 14, ch = Math.max(3, Math.min(9, Math.floor(240 / rows))), L = 40;
      const svg = s("svg", { viewBox: `0 0 ${L + cw * r.frames.length + 4} ${ch * rows + 24}`,
                             class: "pkv-svg pkv-heat", role: "img",
                             "aria-label": "the pool during the search: steps across, blocks up" });
      r.frames.forEach((f, k) => {
        const g = s("g", { "data-step": k + 1 });
        for (let b = 0; b < rows; b++) {
          const c = f[b], fill = c === 0 ? U.FREE : c === 1 ? U.PALETTE[4] : SHADES[Math.min(c - 2, 6)];
          g.append(s("rect", { x: L + cw * k, y: (rows - 1 - b) * ch, width: cw - 1,
                               height: ch - 0.5, fill, "data-ref": c }));
        }
        svg.append(g);
      });
      svg.append(s("text", { x: L - 4, y: ch * rows, "text-anchor": "end", class: "pkv-svgsmall" }, "0"),
                 s("text", { x: L - 4, y: 10, "text-anchor": "end", class: "pkv-svgsmall" }, rows - 1),
                 s("text", { x: L, y: ch * rows + 18, class: "pkv-svgsmall" },
                   `decode step 1 to ${r.frames.length} →`));
      const saving = 1 - r.used / r.unshared;
      const title = `beam width ${width}, a prompt of ${prompt} tokens: ${U.pct(saving)} of ` +
        `the block-steps saved, ${r.copies} copies`;
      const most = Math.max(...r.frames.map((f) => Math.max(...f)));
      const legend = [["free", U.FREE], ["1 beam", U.PALETTE[4]]].concat(
        Array.from({ length: Math.max(0, most - 1) }, (_, i) => [`${i + 2} beams`, SHADES[Math.min(i, 6)]]));
      parts.view.replaceChildren(
        h("p", { class: "pkv-line", "data-read": "title" }, title),
        svg,
        h("p", { class: "pkv-line pkv-legend" }, legend.map(([t, c]) =>
          h("span", {}, h("span", { class: "pkv-swatch", style: { background: c } }), t))),
        h("p", { class: "pkv-line" }, "block-steps in use ", h("b", { "data-read": "used" }, r.used),
          ", without sharing ", h("b", { "data-read": "unshared" }, r.unshared)));
      parts.alt.textContent = title + `; the prompt's full blocks are mapped by every beam ` +
        `for the whole search.`;
    }
    draw();
  };

  // ================================ chapter 11: the prefix cache and the life of a block
  figures.prefix_cache = function (root, p) {
    const C = P.core, U = P.ui, h = P.h, s = P.s, n = p.blocks, bs = p.block_size;
    const parts = U.frame(root, {
      title: `A prefix cache over ${n} blocks of ${bs} tokens, and the life of a block`,
      mirrors: "A model of pagedkv.prefix_cache.PrefixCachingManager (CachedBlocks over a " +
               "BlockAllocator): full blocks named by their tokens and everything before " +
               "them, kept idle after their last owner leaves, found again, evicted least " +
               "recently used first.",
      help: "Tokens are words. Add a request with a prompt, append words to it, free it: its " +
            "full blocks stay cached. The diagram counts the blocks in each state and lights " +
            "the moves the last operation made.",
    });
    let m, vocab, moves = new Map();
    const [fSeq, seqIn] = U.field("seq", "seq", "A");
    const [fT, tIn] = U.field("words", "words", p.words || "", { size: "40" });
    const ids = (text) => text.split(/\s+/).filter((w) => w).map((w) => {
      if (!vocab.has(w)) vocab.set(w, vocab.size);
      return vocab.get(w);
    });
    const states = () => {
      const refs = m.cache.refcounts(), out = [];
      for (let b = 0; b < n; b++)
        out.push(m.cache.isIdle(b) ? "idle" : refs[b] ? "used" : "free");
      return out;
    };
    const serials = () => Array.from({ length: n }, (_, b) =>
      (m.cache._entry.get(b) || { serial: null }).serial);
    const act = (fn) => {
      const before = states(), named = serials();
      U.attempt(parts, fn);
      const after = states(), now = serials(), counts = new Map();
      for (let b = 0; b < n; b++) if (before[b] !== after[b]) {
        let key = `${before[b]}>${after[b]}`;
        if (key === "idle>used") key = now[b] === named[b] ? "hit" : "evict";
        counts.set(key, (counts.get(key) || 0) + 1);
      }
      moves = counts;
      draw();
    };
    const ops = {
      add: () => {
        const sid = seqIn.value.trim(), toks = ids(tIn.value);
        const plan = m.add(sid, toks);
        return `add(${C.pyRepr(sid)}, ${toks.length} words): ${plan.cachedTokens} found in ` +
          `the cache, ${plan.slots.length} computed`;
      },
      append: () => {
        const sid = seqIn.value.trim(), toks = ids(tIn.value);
        m.append(sid, toks);
        return `append(${C.pyRepr(sid)}, ${toks.length} words)`;
      },
      free: () => {
        const sid = seqIn.value.trim();
        m.free(sid);
        return `free(${C.pyRepr(sid)}): its blocks go back, the last one first`;
      },
    };
    let scriptAt = 0;
    parts.controls.append(
      U.group(fSeq, fT),
      U.group(U.button("add(seq, words)", "add", () => act(ops.add)),
              U.button("append(seq, words)", "append", () => act(ops.append)),
              U.button("free(seq)", "free", () => act(ops.free)),
              U.button("reset", "reset", () => reset())),
      p.script ? U.group(U.button("next step of the example", "script", () => {
        if (scriptAt >= p.script.length) reset();
        const [op, sid, words] = p.script[scriptAt++];
        seqIn.value = sid;
        if (words !== undefined) tIn.value = words;
        act(ops[op]);
      })) : "");
    function reset() {
      m = new C.PrefixCachingManager(new C.BlockAllocator(n), bs);
      vocab = new Map();
      moves = new Map();
      scriptAt = 0;
      parts.error.textContent = "";
      parts.status.textContent = "An empty cache.";
      draw();
    }
    const node = (x, y, w, label, note, count, color) => s("g", {},
      s("rect", { x, y, width: w, height: 58, rx: 10, fill: color, stroke: U.EDGE }),
      s("text", { x: x + w / 2, y: y + 18, "text-anchor": "middle", class: "pkv-svgtext",
                  "font-weight": "bold" }, label),
      s("text", { x: x + w / 2, y: y + 34, "text-anchor": "middle", class: "pkv-svgsmall" }, note),
      s("text", { x: x + w / 2, y: y + 50, "text-anchor": "middle", class: "pkv-svgtext",
                  "data-read": "count:" + label }, plural(count, "block")));
    function diagram(st) {
      const c = (k) => st.filter((x) => x === k).length;
      const g = s("svg", { viewBox: "0 0 640 200", class: "pkv-svg pkv-diagram", role: "img",
                           "aria-label": "the life of a block: free, in use, cached and idle" },
        s("defs", {}, s("marker", { id: "pkv-life-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
          markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
          s("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "context-stroke" }))));
      g.append(node(10, 71, 150, "free", "on the free stack", c("free"), U.FREE),
               node(245, 71, 150, "in use", "mapped: refcount ≥ 1", c("used"), "#CFE3F1"),
               node(480, 71, 150, "idle", "cached, refcount 0", c("idle"), "#F7F1B0"));
      const arrow = (key, d, label, lx, ly) => {
        const on = moves.has(key);
        g.append(s("path", { d, fill: "none", stroke: on ? U.PALETTE[5] : "#777",
                             "stroke-width": on ? 3 : 1.4, "marker-end": "url(#pkv-life-arrow)" }),
                 s("text", { x: lx, y: ly, "text-anchor": "middle", class: "pkv-svgsmall",
                             "font-weight": on ? "bold" : null, "data-move": key },
                   label + (on ? ` (${moves.get(key)})` : "")));
      };
      arrow("free>used", "M 160 90 C 190 60, 215 60, 245 90", "allocate", 203, 52);
      arrow("used>free", "M 245 112 C 215 142, 190 142, 160 112", "last owner frees (not cached)", 203, 158);
      arrow("used>idle", "M 395 90 C 425 60, 450 60, 480 90", "last owner frees (cached)", 438, 52);
      arrow("hit", "M 480 112 C 450 142, 425 142, 395 112", "found again: take (a hit)", 438, 158);
      arrow("evict", "M 555 123 C 555 195, 320 195, 320 124", "evicted: allocate, stack empty", 438, 194);
      return g;
    }
    function draw() {
      const st = states(), refs = m.cache.refcounts(), idle = m.cache.idleBlocks();
      const owners = new Map();
      for (const sid of m.seqIds) for (const b of m.blockTable(sid)) {
        if (!owners.has(b)) owners.set(b, []);
        owners.get(b).push(sid);
      }
      const colors = U.colorsFor(m.seqIds), words = [...vocab.keys()];
      const cells = st.map((x, b) => {
        const toks = m.cache.cachedTokens(b), star = toks ? "*" : "";
        if (x === "idle") return { fill: U.IDLE, sub: `idle #${idle.indexOf(b) + 1}` };
        if (x === "free") return { fill: U.FREE, sub: "" };
        const who = owners.get(b);
        return { fill: who.length > 1 ? U.SHARED : colors.get(who[0]),
                 sub: (who.length > 1 ? `x${who.length}` : who[0]) + star };
      });
      const named = [];
      for (let b = 0; b < n; b++) {
        const toks = m.cache.cachedTokens(b);
        if (toks) named.push(h("li", {}, `block ${b}: `, h("q", {}, toks.map((t) => words[t]).join(" ")),
                                  st[b] === "idle" ? " (idle)" : ""));
      }
      parts.view.replaceChildren(
        diagram(st),
        U.poolGrid(cells, `the pool: ${st.filter((x) => x === "used").length} blocks in use, ` +
                          `${idle.length} idle`),
        h("p", { class: "pkv-line" }, "free (stack and idle) ", h("b", { "data-read": "free" }, m.cache.numFree),
          " · idle, evicted first to last ", U.list("idle", idle),
          " · hits ", h("b", { "data-read": "hits" }, m.cache.hits),
          " · evictions ", h("b", { "data-read": "evictions" }, m.cache.evictions)),
        h("p", { class: "pkv-line" }, "free stack, bottom first: ", U.list("stack", m.cache.allocator.freeBlocks()),
          " · reference counts: ", U.list("refcounts", refs)),
        h("div", { class: "pkv-cols" },
          h("div", {}, h("p", { class: "pkv-sub-title" }, "page tables"),
            m.seqIds.length ? h("ul", { class: "pkv-ul" }, m.seqIds.map((sid) => h("li", {},
              h("span", { class: "pkv-swatch", style: { background: colors.get(sid) } }),
              `${C.pyRepr(sid)}: `, h("b", { "data-read": "tokens:" + sid }, m.numTokens(sid)),
              " tokens, blocks ", U.list("table:" + sid, m.blockTable(sid)))))
              : h("p", {}, "(no sequence)")),
          h("div", {}, h("p", { class: "pkv-sub-title" }, "cached blocks (* in the pool)"),
            named.length ? h("ul", { class: "pkv-ul" }, named) : h("p", {}, "(none)"))));
      parts.alt.textContent = `${st.filter((x) => x === "used").length} blocks in use, ` +
        `${idle.length} cached and idle (${idle.join(", ") || "none"}), ` +
        `${st.filter((x) => x === "free").length} free on the stack; ` +
        `${plural(m.cache.hits, "hit")}, ${plural(m.cache.evictions, "eviction")}.`;
    }
    reset();
  };
})();
