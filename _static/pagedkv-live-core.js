/* pagedkv's teaching core, in JavaScript, for the book's live figures.
 *
 * Each class below follows one module of the Python package, rule for rule and message for
 * message, so that a figure in the page behaves as the package does:
 *
 *   BlockAllocator        pagedkv/allocator.py      (chapter 3)
 *   PageTable             pagedkv/page_table.py     (chapter 4)
 *   KVCacheManager        pagedkv/manager.py        (chapters 5 and 7)
 *   FirstFit              pagedkv/contiguous.py     (chapter 1)
 *   serve                 pagedkv/sim/serving.py with sim/policies.py (chapter 6)
 *   CachedBlocks,
 *   PrefixCachingManager  pagedkv/prefix_cache.py   (chapter 11)
 *
 * Nothing here touches the page. tests/test_live_figures.py drives the figures built on it in
 * Chromium and compares what they show with what the Python package gives for the same
 * operations, so a change of rule on either side fails a test.
 */
(function () {
  "use strict";
  const P = (window.pagedkv = window.pagedkv || {});

  // ------------------------------------------------------------------ Python's values
  /** A float typed by the reader ("2.0"): kept apart from integers, as Python does. */
  class PyFloat {
    constructor(value) { this.value = value; }
  }

  /** What Python's repr() prints for a value of the figures (ids, counts, tuples). */
  function pyRepr(v) {
    if (v === null || v === undefined) return "None";
    if (v === true) return "True";
    if (v === false) return "False";
    if (v instanceof PyFloat) {
      const x = v.value;
      if (Number.isInteger(x) && Math.abs(x) < 1e16) return x.toFixed(1);
      return String(x);
    }
    if (typeof v === "number") return String(v);
    if (Array.isArray(v)) {
      const items = v.map(pyRepr);
      return "(" + items.join(", ") + (items.length === 1 ? ",)" : ")");
    }
    const s = String(v);
    if (s.includes("'") && !s.includes('"')) return '"' + s + '"';
    return "'" + s.replace(/\\/g, "\\\\").replace(/'/g, "\\'") + "'";
  }

  /** A reader's typed text as the Python value it would be: an int, a float, True, False,
   * None, or else the text itself (a string). */
  function pyValue(text) {
    const t = String(text).trim();
    if (/^[-+]?\d+$/.test(t)) return parseInt(t, 10);
    if (t === "True") return true;
    if (t === "False") return false;
    if (t === "None") return null;
    if (t !== "" && /^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i.test(t)) return new PyFloat(Number(t));
    return t;
  }

  const isInt = (v) => typeof v === "number" && Number.isInteger(v);
  const cdiv = (a, b) => Math.floor((a + b - 1) / b);

  // ------------------------------------------------------------------ errors (errors.py)
  class PagedKVError extends Error {
    constructor(type, message) {
      super(message);
      this.type = type;
    }
    /** As the chapters print an error: ``f"{type(err).__name__}: {err}"``. */
    toString() { return this.type + ": " + this.message; }
  }
  const err = (type) => (message) => new PagedKVError(type, message);
  const ConfigError = err("ConfigError");
  const InvalidBlock = err("InvalidBlock");
  const DoubleFree = err("DoubleFree");
  const UnknownSequence = err("UnknownSequence");
  const SequenceExists = err("SequenceExists");
  const DuplicateSequence = err("DuplicateSequence");
  const TokenIndexError = err("TokenIndexError");
  const AuditError = err("AuditError");
  function OutOfBlocks(needed, free, what) {
    const e = new PagedKVError("OutOfBlocks", (what ? what + ": " : "") +
      `needs ${needed} free block(s), only ${free} free`);
    e.needed = needed;
    e.free = free;
    return e;
  }

  // ------------------------------------------------------------------ checks.py
  function positiveInt(value, what) {
    if (!isInt(value) || value < 1)
      throw ConfigError(`${what} must be a positive integer, got ${pyRepr(value)}`);
    return value;
  }
  function count(value, what) {
    if (!isInt(value) || value < 0)
      throw ConfigError(`${what} must be a non-negative integer, got ${pyRepr(value)}`);
    return value;
  }

  // ------------------------------------------------------------------ allocator.py
  class BlockAllocator {
    constructor(numBlocks) {
      this.numBlocks = positiveInt(numBlocks, "num_blocks");
      this._free = [];                     // lowest id on top: 0, 1, 2, ... handed out first
      for (let b = this.numBlocks - 1; b >= 0; b--) this._free.push(b);
      this._refcount = new Array(this.numBlocks).fill(0);
      this.numShared = 0;
    }
    allocate() {
      if (!this._free.length) throw OutOfBlocks(1, 0, "allocate");
      const block = this._free.pop();
      this._refcount[block] = 1;
      return block;
    }
    free(block) {
      const b = this._checkId(block);
      if (this._refcount[b] === 0) throw DoubleFree(`block ${b} is already free`);
      this._refcount[b] -= 1;
      if (this._refcount[b] === 0) this._free.push(b);
      else if (this._refcount[b] === 1) this.numShared -= 1;
    }
    share(block) { this.shareN([block]); }
    allocateN(n) {
      n = count(n, "n");
      if (n > this.numFree) throw OutOfBlocks(n, this.numFree, "allocate_n");
      const out = [];
      for (let i = 0; i < n; i++) out.push(this.allocate());
      return out;
    }
    freeN(blocks) {
      const ids = blocks.map((b) => this._checkId(b));
      const drops = new Map();
      for (const b of ids) drops.set(b, (drops.get(b) || 0) + 1);
      for (const [b, d] of drops)
        if (d > this._refcount[b])
          throw DoubleFree(`block ${b} has ${this._refcount[b]} owner(s), cannot drop ${d}`);
      for (const b of ids) this.free(b);
    }
    shareN(blocks, times = 1) {
      times = positiveInt(times, "times");
      const ids = blocks.map((b) => this._checkId(b));
      for (const b of ids)
        if (this._refcount[b] === 0) throw InvalidBlock(`cannot share block ${b}: it is free`);
      for (const b of ids) {
        if (this._refcount[b] === 1) this.numShared += 1;
        this._refcount[b] += times;
      }
    }
    _checkId(block) {
      if (!isInt(block)) throw InvalidBlock(`a block id must be an integer, got ${pyRepr(block)}`);
      if (!(block >= 0 && block < this.numBlocks))
        throw InvalidBlock(`block id ${block} is outside the pool [0, ${this.numBlocks})`);
      return block;
    }
    refcount(block) { return this._refcount[this._checkId(block)]; }
    refcounts() { return this._refcount.slice(); }
    freeBlocks() { return this._free.slice(); }       // bottom first; the top is the last
    get numFree() { return this._free.length; }
    get numUsed() { return this.numBlocks - this._free.length; }
  }

  // ------------------------------------------------------------------ page_table.py
  class PageTable {
    constructor(blockSize, blocks = [], numTokens = 0) {
      this.blockSize = positiveInt(blockSize, "block_size");
      this.blocks = blocks.slice();
      this.numTokens = numTokens;
    }
    get numBlocks() { return this.blocks.length; }
    get capacity() { return this.blocks.length * this.blockSize; }
    appendBlock(block) { this.blocks.push(block); }
    appendToken() {
      if (this.numTokens >= this.capacity)
        throw TokenIndexError(`no room for token ${this.numTokens}: the page table maps ` +
          `${this.numBlocks} block(s) = ${this.capacity} tokens`);
      this.numTokens += 1;
      return this.slot(this.numTokens - 1);
    }
    locate(token) {
      if (!isInt(token) || !(token >= 0 && token < this.numTokens))
        throw TokenIndexError(`token index ${pyRepr(token)} is outside the sequence ` +
          `[0, ${this.numTokens})`);
      return [this.blocks[Math.floor(token / this.blockSize)], token % this.blockSize];
    }
    slot(token) {
      const [block, offset] = this.locate(token);
      return block * this.blockSize + offset;
    }
  }

  // ------------------------------------------------------------------ manager.py
  class KVCacheManager {
    /** ``allocator`` is a BlockAllocator (or, for chapter 11, a CachedBlocks). */
    constructor(allocator, blockSize) {
      this.blockSize = positiveInt(blockSize, "block_size");
      this.allocator = allocator;
      this._tables = new Map();             // sequence id -> PageTable, in the order added
    }
    _table(seqId) {
      const t = this._tables.get(seqId);
      if (t === undefined) throw UnknownSequence(`unknown sequence ${pyRepr(seqId)}`);
      return t;
    }
    _checkNew(seqId, what) {
      if (this._tables.has(seqId))
        throw SequenceExists(`${what} ${pyRepr(seqId)}: that sequence already exists`);
    }
    has(seqId) { return this._tables.has(seqId); }
    get size() { return this._tables.size; }
    get seqIds() { return Array.from(this._tables.keys()); }
    numTokens(seqId) { return this._table(seqId).numTokens; }
    blockTable(seqId) { return this._table(seqId).blocks.slice(); }
    slots(seqId) {
      const t = this._table(seqId), out = [];
      for (let i = 0; i < t.numTokens; i++) out.push(t.slot(i));
      return out;
    }
    _mustCopy(table) {
      return table.numTokens % this.blockSize !== 0 &&
        this.allocator.refcount(table.blocks[table.blocks.length - 1]) > 1;
    }
    blocksNeeded(seqId, n = 1) {
      const table = this._table(seqId);
      const tokens = table.numTokens + positiveInt(n, "the number of tokens");
      return cdiv(tokens, this.blockSize) - table.numBlocks + (this._mustCopy(table) ? 1 : 0);
    }
    _grow(table, n) {
      const copies = [];
      if (this._mustCopy(table)) {               // copy-on-write: a private copy first
        const src = table.blocks[table.blocks.length - 1], dst = this.allocator.allocate();
        this.allocator.free(src);
        table.blocks[table.blocks.length - 1] = dst;
        copies.push([src, dst]);
      }
      const slots = [];
      for (let i = 0; i < n; i++) {
        if (table.numTokens === table.capacity) table.appendBlock(this.allocator.allocate());
        slots.push(table.appendToken());
      }
      return { slots, copies };
    }
    add(seqId, numTokens = 0) {
      this._checkNew(seqId, "sequence");
      numTokens = count(numTokens, "the number of tokens");
      const need = cdiv(numTokens, this.blockSize);
      if (need > this.allocator.numFree)
        throw OutOfBlocks(need, this.allocator.numFree, `add ${pyRepr(seqId)}`);
      const table = new PageTable(this.blockSize);
      this._tables.set(seqId, table);
      return this._grow(table, numTokens);
    }
    append(seqId, n = 1) {
      const need = this.blocksNeeded(seqId, n);
      if (need > this.allocator.numFree)
        throw OutOfBlocks(need, this.allocator.numFree, `append ${n} to ${pyRepr(seqId)}`);
      return this._grow(this._table(seqId), n);
    }
    /** A decode step; ``withTables`` builds the plan's block tables (a figure shows them;
     * the simulation does not need them). */
    step(seqIds = null, withTables = true) {
      const ids = seqIds === null ? this.seqIds : seqIds.slice();
      const tables = ids.map((s) => this._table(s));
      if (new Set(tables).size !== tables.length)
        throw DuplicateSequence("a sequence appears more than once in one step");
      const need = this._neededByStep(tables);
      if (need > this.allocator.numFree)
        throw OutOfBlocks(need, this.allocator.numFree, `step of ${ids.length} sequences`);
      const slotMapping = [], copies = [];
      for (const table of tables) {
        const plan = this._grow(table, 1);
        slotMapping.push(plan.slots[0]);
        copies.push(...plan.copies);
      }
      const plan = { seqIds: ids, slotMapping, copies,
                     seqLens: tables.map((t) => t.numTokens) };
      if (withTables) {
        const width = Math.max(0, ...tables.map((t) => t.numBlocks));
        plan.blockTables = tables.map((t) =>
          t.blocks.concat(new Array(width - t.numBlocks).fill(-1)));
      }
      return plan;
    }
    _neededByStep(tables) {
      let need = 0;
      const ownersLeft = new Map();
      for (const table of tables) {
        if (table.numTokens % this.blockSize === 0) { need += 1; continue; }
        const last = table.blocks[table.blocks.length - 1];
        const owners = ownersLeft.has(last) ? ownersLeft.get(last)
          : this.allocator.refcount(last);
        if (owners > 1) { need += 1; ownersLeft.set(last, owners - 1); }
      }
      return need;
    }
    fork(parent, ...children) {
      const table = this._table(parent);
      if (!children.length) throw ConfigError("fork needs at least one child id");
      for (const child of children) this._checkNew(child, "cannot fork onto");
      if (new Set(children).size !== children.length)
        throw DuplicateSequence(`a child id appears more than once in ${pyRepr(children)}`);
      this.allocator.shareN(table.blocks, children.length);
      for (const child of children)
        this._tables.set(child, new PageTable(this.blockSize, table.blocks, table.numTokens));
    }
    free(seqId) {
      this.allocator.freeN(this._table(seqId).blocks);
      this._tables.delete(seqId);
    }
    /** What stats() reports that the figures show. */
    stats() {
      const a = this.allocator, bs = this.blockSize;
      const fill = new Map();
      let tokens = 0;
      for (const t of this._tables.values()) {
        tokens += t.numTokens;
        t.blocks.forEach((b, j) => fill.set(b, Math.min(bs, t.numTokens - j * bs)));
      }
      let stored = 0;
      for (const v of fill.values()) stored += v;
      const used = a.numUsed;
      return { total_blocks: a.numBlocks, free_blocks: a.numFree, used_blocks: used,
               utilization: used / a.numBlocks, sequences: this._tables.size, tokens,
               stored_tokens: stored,
               internal_fragmentation: used ? (used * bs - stored) / (used * bs) : 0,
               shared_blocks: a.refcounts().filter((r) => r > 1).length };
    }
  }

  // ------------------------------------------------------------------ contiguous.py
  class FirstFit {
    constructor(size) {
      this.size = positiveInt(size, "size");
      this.starts = [0];
      this.lengths = [this.size];
      this.freeTotal = this.size;
    }
    alloc(n) {
      n = positiveInt(n, "n");
      for (let i = 0; i < this.lengths.length; i++) {
        const length = this.lengths[i];
        if (length >= n) {
          const start = this.starts[i];
          if (length === n) { this.starts.splice(i, 1); this.lengths.splice(i, 1); }
          else { this.starts[i] += n; this.lengths[i] -= n; }
          this.freeTotal -= n;
          return start;
        }
      }
      return null;
    }
    free(start, n) {
      start = count(start, "start");
      n = positiveInt(n, "n");
      if (start + n > this.size)
        throw InvalidBlock(`range [${start}, ${start + n}) ends past the memory's ` +
          `${this.size} slots`);
      let i = 0;                                   // bisect: holes before i start at or before
      while (i < this.starts.length && this.starts[i] <= start) i++;
      if ((i && this.starts[i - 1] + this.lengths[i - 1] > start) ||
          (i < this.starts.length && start + n > this.starts[i]))
        throw DoubleFree(`range [${start}, ${start + n}) overlaps a free hole`);
      this.freeTotal += n;
      if (i < this.starts.length && start + n === this.starts[i]) {
        n += this.lengths[i];
        this.starts.splice(i, 1);
        this.lengths.splice(i, 1);
      }
      if (i && this.starts[i - 1] + this.lengths[i - 1] === start) this.lengths[i - 1] += n;
      else { this.starts.splice(i, 0, start); this.lengths.splice(i, 0, n); }
    }
    holes() { return this.starts.map((s, i) => [s, this.lengths[i]]); }
    largest() { return this.lengths.length ? Math.max(...this.lengths) : 0; }
  }

  // ------------------------------------------------ the simulation (sim/serving.py)
  const SIM_TOKEN_BYTES = 512;           // sim.SIM_SPEC: one layer, one head of 64, float32
  const TOKEN_BUDGET = 2048;

  /** A paged policy (sim.PagedPolicy) over a teaching manager: admission keeps a watermark
   * of the pool's blocks free; a step is all or nothing. */
  class PagedPolicy {
    constructor(poolBytes, blockSize, watermark = 0.01) {
      const numBlocks = Math.floor(poolBytes / (blockSize * SIM_TOKEN_BYTES));
      if (numBlocks < 1)
        throw ConfigError(`a pool of ${poolBytes} bytes is smaller than one block ` +
          `(${blockSize} tokens x ${SIM_TOKEN_BYTES} B)`);
      this.blockSize = blockSize;
      this.manager = new KVCacheManager(new BlockAllocator(numBlocks), blockSize);
      this.poolSlots = numBlocks * blockSize;
      this.watermark = watermark;
      this.watermarkBlocks = Math.floor(watermark * numBlocks);
      this.name = `paged, block ${blockSize}`;
    }
    check(requests) {
      const blocks = this.manager.allocator.numBlocks, wm = this.watermarkBlocks;
      const limit = (blocks - wm) * this.blockSize;
      for (const r of requests)
        if (r.prompt + r.output > limit)
          throw ConfigError(`request ${r.rid} grows to ${r.prompt + r.output} tokens, but ` +
            `this pool holds at most ${limit} tokens for one request: ${blocks} blocks of ` +
            `${this.blockSize} tokens (pool bytes // block bytes), ${wm} of them kept free ` +
            `by the ${Math.round(this.watermark * 100)}% watermark`);
    }
    /** How many blocks admission asks for, and whether they are free. */
    admission(length) {
      const need = cdiv(length + 1, this.blockSize);
      return { need, watermark: this.watermarkBlocks,
               free: this.manager.allocator.numFree,
               ok: need + this.watermarkBlocks <= this.manager.allocator.numFree };
    }
    admit(rid, length) {
      if (!this.admission(length).ok) return false;
      this.manager.add(rid, length);
      return true;
    }
    /** The free blocks a step of ``ids`` needs, and how many are free. */
    stepNeed(ids) {
      const m = this.manager;
      return { need: m._neededByStep(ids.map((s) => m._table(s))), free: m.allocator.numFree };
    }
    step(ids) {
      try { this.manager.step(ids, false); }
      catch (e) { if (e.type === "OutOfBlocks") return false; throw e; }
      return true;
    }
    release(rid) { this.manager.free(rid); }
    held(len) { return cdiv(len, this.blockSize) * this.blockSize; }
  }

  /** Max-length reservation (sim.make_policy("max-length")): one contiguous range of
   * ``maxLen`` slots per request, placed first fit, held until it finishes. */
  class MaxLengthPolicy {
    constructor(poolBytes, maxLen) {
      this.poolSlots = Math.floor(poolBytes / SIM_TOKEN_BYTES);
      this.maxLen = maxLen;
      this.space = new FirstFit(this.poolSlots);
      this.ranges = new Map();
      this.blockSize = null;
      this.name = "max-length";
    }
    check(requests) {
      for (const r of requests)
        if (this.maxLen > this.poolSlots)
          throw ConfigError(`request ${r.rid} reserves ${this.maxLen} token slots ` +
            `(max-length); the pool has ${this.poolSlots}`);
    }
    admission() { return { ok: this.space.largest() >= this.maxLen }; }
    admit(rid) {
      const start = this.space.alloc(this.maxLen);
      if (start === null) return false;
      this.ranges.set(rid, [start, this.maxLen]);
      return true;
    }
    step() { return true; }
    release(rid) { const [s, n] = this.ranges.get(rid); this.ranges.delete(rid); this.space.free(s, n); }
    held() { return this.maxLen; }
  }

  /** sim.serve for one policy, without chunked prefill: first come, first served; the head
   * of the queue is admitted while fewer than ``maxSeqs`` run, its prefill and first token
   * fit in the step's token budget, and the policy places it; every running request then
   * gains a token, the newest preempted (recompute) while the pool runs out; finished
   * requests leave after the step. ``requests``: [{rid, arrival, prompt, output}].
   * Returns per-step series (after each step, before finished requests leave), the
   * events of each step and the totals; ``onStep(step, state)`` sees each step. */
  function serve(requests, policy, opts = {}) {
    const maxSeqs = positiveInt(opts.maxSeqs === undefined ? 256 : opts.maxSeqs, "max_seqs");
    const budget0 = positiveInt(opts.tokenBudget === undefined ? TOKEN_BUDGET : opts.tokenBudget,
                                "token_budget");
    const longest = Math.max(0, ...requests.map((r) => r.prompt + r.output));
    if (longest > budget0)
      throw ConfigError(`token_budget=${budget0} cannot prefill the longest request ` +
        `(${longest} tokens) after a preemption`);
    policy.check(requests);
    const maxSteps = opts.maxSteps || 1e6;
    const pending = requests.slice().sort((a, b) => a.arrival - b.arrival || a.rid - b.rid);
    let next = 0;                                   // pending[next:] have not arrived
    const waiting = [], running = [];               // running: {req, len, final}
    const starts = new Map();                       // waiting rid -> tokens it starts with
    const preemptedRids = new Set();
    const series = { step: [], running: [], tokens: [], held: [], waiting: [], finished: [] };
    const events = [];
    const totals = { steps: 0, preemptions: 0, prefillTokens: 0, recomputedTokens: 0,
                     completions: 0, tokensGenerated: 0 };
    let step = 0;
    while (next < pending.length || waiting.length || running.length) {
      if (step > maxSteps) throw AuditError(`no end after ${maxSteps} steps`);
      while (next < pending.length && pending[next].arrival <= step) {
        const req = pending[next++];
        waiting.push(req);
        starts.set(req.rid, req.prompt);
      }
      const ev = { step: step + 1, admitted: [], admitInfo: [], preempted: [], shortfalls: [],
                   left: [], refused: null };
      // admission: the head first, while it fits
      let budget = budget0 - running.length;
      let live = running.length;
      while (waiting.length) {
        const req = waiting[0];
        if (live + 1 > maxSeqs) break;
        const left = starts.get(req.rid);
        if (left + 1 > budget) { ev.refused = { rid: req.rid, why: "budget", left, budget }; break; }
        const info = policy.admission(left);
        if (!policy.admit(req.rid, left)) {
          ev.refused = { rid: req.rid, why: "memory", left, info };
          break;
        }
        waiting.shift();
        starts.delete(req.rid);
        running.push({ req, len: left, final: req.prompt + req.output });
        totals.prefillTokens += left;
        if (preemptedRids.has(req.rid)) {
          preemptedRids.delete(req.rid);
          totals.recomputedTokens += left;
        }
        ev.admitted.push([req.rid, left]);
        ev.admitInfo.push(info);
        live += 1;
        budget -= left + 1;
      }
      if (!running.length) {                        // nothing runs: the next arrival
        if (next >= pending.length) throw ConfigError("a waiting request can never be admitted");
        step = Math.max(step + 1, pending[next].arrival);
        continue;
      }
      // decode: every running request gains a token, all or nothing
      for (;;) {
        const ids = running.map((r) => r.req.rid);
        const short = policy.stepNeed ? policy.stepNeed(ids) : null;
        if (policy.step(ids)) break;
        ev.shortfalls.push(short);
        if (running.length === 1) throw AuditError("a request alone cannot take its next step");
        const victim = running.pop();               // the newest
        policy.release(victim.req.rid);
        waiting.unshift(victim.req);
        starts.set(victim.req.rid, victim.len);
        preemptedRids.add(victim.req.rid);
        totals.preemptions += 1;
        ev.preempted.push([victim.req.rid, victim.len]);
      }
      for (const r of running) r.len += 1;
      step += 1;
      let tokens = 0, held = 0, done = totals.completions;
      for (const r of running) {
        tokens += r.len;
        held += policy.held(r.len);
        if (r.len >= r.final) done += 1;
      }
      series.step.push(step);
      series.running.push(running.length);
      series.tokens.push(tokens);
      series.held.push(held);
      series.waiting.push(waiting.length);
      series.finished.push(done);
      totals.tokensGenerated += running.length;
      totals.steps = step;
      if (opts.onStep) opts.onStep(step, { running, waiting, policy });
      for (let i = 0; i < running.length;) {        // finished requests leave
        const r = running[i];
        if (r.len >= r.final) {
          running.splice(i, 1);
          policy.release(r.req.rid);
          totals.completions += 1;
          ev.left.push(r.req.rid);
        } else i++;
      }
      events.push(ev);
    }
    return { series, events, totals, poolSlots: policy.poolSlots };
  }

  // ------------------------------------------------------------------ prefix_cache.py
  /** A full block's name: its tokens chained after its parent's name. The package hashes
   * the same chain with xxh3_64; an exact name here never collides, which is what the
   * package's exact check makes of a hash. */
  const blockHash = (parent, tokens) => (parent ? parent + " | " : "") + tokens.join(" ");

  class CachedBlocks {
    constructor(allocator) {
      this.allocator = allocator;
      this.numBlocks = allocator.numBlocks;
      this._blockOf = new Map();          // name -> block
      this._entry = new Map();            // block -> {hash, tokens, serial, parent, parentHash}
      this._idle = new Map();             // idle blocks, least recently used first
      this._serial = 0;
      this.hits = 0;
      this.evictions = 0;
    }
    get numFree() { return this.allocator.numFree + this._idle.size; }
    get numUsed() { return this.numBlocks - this.numFree; }
    get numIdle() { return this._idle.size; }
    refcount(block) { return this.allocator.refcount(block) - (this._idle.has(block) ? 1 : 0); }
    refcounts() {
      const c = this.allocator.refcounts();
      for (const b of this._idle.keys()) c[b] -= 1;
      return c;
    }
    idleBlocks() { return Array.from(this._idle.keys()); }
    allocate() {
      if (this.allocator.numFree || !this._idle.size) return this.allocator.allocate();
      const block = this._idle.keys().next().value;   // evict the least recently used
      this._idle.delete(block);
      this._blockOf.delete(this._entry.get(block).hash);
      this._entry.delete(block);
      this.evictions += 1;
      return block;
    }
    free(block) {
      const owners = this.refcount(block);
      if (owners === 0) throw DoubleFree(`block ${block} is already free`);
      if (owners === 1 && this._entry.has(block)) this._idle.set(block, null);
      else this.allocator.free(block);
    }
    freeN(blocks) {
      const drops = new Map();
      for (const b of blocks) drops.set(b, (drops.get(b) || 0) + 1);
      for (const [b, d] of drops)
        if (d > this.refcount(b))
          throw DoubleFree(`block ${b} has ${this.refcount(b)} owner(s), cannot drop ${d}`);
      for (const b of blocks) this.free(b);
    }
    shareN(blocks, times = 1) { this.allocator.shareN(blocks, times); }
    lookup(hash, tokens, parent) {
      const block = this._blockOf.get(hash);
      if (block === undefined) return null;
      const e = this._entry.get(block);
      if (e.tokens.join(" ") !== tokens.join(" ") || e.parent !== parent) return null;
      return [block, e.serial];
    }
    isIdle(block) { return this._idle.has(block); }
    take(block) {
      if (this._idle.has(block)) this._idle.delete(block);
      else this.allocator.shareN([block]);
      this.hits += 1;
    }
    serial(hash) {
      const block = this._blockOf.get(hash);
      return block === undefined ? null : this._entry.get(block).serial;
    }
    insert(block, hash, tokens, parent, parentHash) {
      if (parent === null || (parent && this.serial(parentHash) !== parent)) return null;
      if (!this._blockOf.has(hash) && !this._entry.has(block)) {
        const serial = ++this._serial;
        this._blockOf.set(hash, block);
        this._entry.set(block, { hash, tokens: tokens.slice(), serial, parent, parentHash });
        return serial;
      }
      const twin = this.lookup(hash, tokens, parent);
      return twin === null ? null : twin[1];
    }
    /** The tokens a cached block holds, or null. */
    cachedTokens(block) {
      const e = this._entry.get(block);
      return e === undefined ? null : e.tokens;
    }
  }

  class PrefixCachingManager {
    constructor(allocator, blockSize) {
      this.pages = new KVCacheManager(allocator, blockSize);
      this.cache = this.pages.allocator = new CachedBlocks(allocator);
      this.allocator = this.cache;
      this.blockSize = this.pages.blockSize;
      this._tail = new Map();
      this._hashes = new Map();
      this._serials = new Map();
    }
    get seqIds() { return this.pages.seqIds; }
    has(s) { return this.pages.has(s); }
    numTokens(s) { return this.pages.numTokens(s); }
    blockTable(s) { return this.pages.blockTable(s); }
    _hashesOf(tokens) {
      const bs = this.blockSize, hashes = [];
      for (let j = 0; j < Math.floor(tokens.length / bs); j++)
        hashes.push(blockHash(j ? hashes[j - 1] : "", tokens.slice(j * bs, (j + 1) * bs)));
      return hashes;
    }
    _findPrefix(tokens, hashes) {
      const bs = this.blockSize, blocks = [], serials = [];
      for (let j = 0; j < Math.floor((tokens.length - 1) / bs); j++) {
        const own = tokens.slice(j * bs, (j + 1) * bs);
        const hit = this.cache.lookup(hashes[j], own, j ? serials[serials.length - 1] : 0);
        if (hit === null) break;
        blocks.push(hit[0]);
        serials.push(hit[1]);
      }
      return [blocks, serials];
    }
    cachedPrefix(tokens) {
      return this._findPrefix(tokens, this._hashesOf(tokens))[0].length * this.blockSize;
    }
    /** Admit a prompt (token ids): its leading full blocks from the cache where they are,
     * fresh blocks for the rest. All or nothing. */
    add(seqId, tokens) {
      this.pages._checkNew(seqId, "sequence");
      if (!tokens.length)
        throw ConfigError("add needs at least one token (the last one's logits choose the next)");
      const hashes = this._hashesOf(tokens);
      const [hits, serials] = this._findPrefix(tokens, hashes);
      const fresh = cdiv(tokens.length, this.blockSize) - hits.length;
      const need = fresh + new Set(hits.filter((b) => this.cache.isIdle(b))).size;
      if (need > this.cache.numFree)
        throw OutOfBlocks(need, this.cache.numFree, `add ${pyRepr(seqId)}`);
      for (const b of hits) this.cache.take(b);
      const found = hits.length * this.blockSize;
      const table = new PageTable(this.blockSize, hits, found);
      this.pages._tables.set(seqId, table);
      this._tail.set(seqId, tokens.slice(found));
      this._hashes.set(seqId, hashes.slice());
      this._serials.set(seqId, serials);
      const plan = this.pages._grow(table, tokens.length - found);
      this._cacheFullBlocks(seqId);
      return { slots: plan.slots, copies: plan.copies, cachedTokens: found };
    }
    append(seqId, tokens) {
      this.pages._table(seqId);
      if (!tokens.length) throw ConfigError("append needs at least one token");
      const plan = this.pages.append(seqId, tokens.length);
      this._tail.get(seqId).push(...tokens);
      this._cacheFullBlocks(seqId);
      return plan;
    }
    _cacheFullBlocks(seqId) {
      const bs = this.blockSize, tail = this._tail.get(seqId);
      const full = Math.floor(tail.length / bs) * bs;
      const hashes = this._hashes.get(seqId), serials = this._serials.get(seqId);
      const blocks = this.pages._table(seqId).blocks;
      for (let start = 0; start < full; start += bs) {
        const j = serials.length, tokens = tail.slice(start, start + bs);
        const parentHash = j ? hashes[j - 1] : "";
        if (j === hashes.length) hashes.push(blockHash(parentHash, tokens));
        serials.push(this.cache.insert(blocks[j], hashes[j], tokens,
                                       j ? serials[j - 1] : 0, parentHash));
      }
      tail.splice(0, full);
    }
    fork(parent, ...children) {
      this.pages.fork(parent, ...children);
      for (const c of children) {
        this._tail.set(c, this._tail.get(parent).slice());
        this._hashes.set(c, this._hashes.get(parent).slice());
        this._serials.set(c, this._serials.get(parent).slice());
      }
    }
    free(seqId) {
      this.pages._table(seqId).blocks.reverse();     // the last block first
      this.pages.free(seqId);
      this._tail.delete(seqId);
      this._hashes.delete(seqId);
      this._serials.delete(seqId);
    }
  }

  P.core = { PyFloat, pyRepr, pyValue, isInt, cdiv, PagedKVError, positiveInt, count,
             BlockAllocator, PageTable, KVCacheManager, FirstFit, PagedPolicy,
             MaxLengthPolicy, serve, TOKEN_BUDGET, SIM_TOKEN_BYTES, blockHash,
             CachedBlocks, PrefixCachingManager };
})();
