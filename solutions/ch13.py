"""Chapter 13 (scheduling under load): how many steps a long prompt takes to its first token
under a token budget, and the budget that brings it there in a given number of steps; the
prefill kernel's tile loop in NumPy; a scheduler that runs prefills first, measured against
the one that runs decodes first on a long prompt's arrival."""
from __future__ import annotations

import itertools
import math

import numpy as np

from pagedkv import sim
from pagedkv.kernels.reference import paged_prefill_attention_ref
from pagedkv.scheduler import Scheduler

from ._seeds import names_its_seed

__all__ = ["steps_to_first_token", "budget_for", "prefill_tiles", "PrefillFirst"]


def steps_to_first_token(prompt: int, running: int, budget: int) -> int:
    """Steps a ``prompt``-token request needs to finish its prefill, admitted into a step
    where ``running`` requests decode one token each under a token ``budget``. Each step
    leaves ``budget - running`` tokens for its chunk; the last chunk must fit with the
    request's own first decode token, so the prompt and that token take
    ``ceil((prompt + 1) / (budget - running))`` steps."""
    room = budget - running
    if room < 2:
        raise ValueError(f"a budget of {budget} beside {running} decodes leaves no room "
                         f"for a chunk and its decode token")
    return math.ceil((prompt + 1) / room)


def budget_for(prompt: int, running: int, steps: int) -> int:
    """The smallest budget with which a ``prompt``-token request, beside ``running``
    decodes, finishes its prefill within ``steps`` steps: ``running`` for the decodes plus
    ``ceil((prompt + 1) / steps)`` for the chunks."""
    return running + max(2, math.ceil((prompt + 1) / steps))


def prefill_tiles(q, cache, table, start: int, *, scale=None, q_tile=16, kv_tile=16):
    """Causal attention of one sequence's chunk over its paged K/V, tile by tile, as
    ``paged_prefill.cu`` does it. ``q`` ``[n, q_heads, d]``: the new tokens, at positions
    ``start .. start + n - 1``, their K/V already in ``cache`` ``[num_blocks, 2,
    block_size, kv_heads, d]``; ``table``: the sequence's block table. A row is (new token,
    query head of a group), token-major; a tile of ``q_tile`` rows walks the K/V tiles
    from position 0 to its last row's, no further, with an online softmax, and masks only
    the tiles that the diagonal cuts. Returns float64 ``[n, q_heads, d]``."""
    n, q_heads, d = q.shape
    bs, kv_heads = cache.shape[2], cache.shape[3]
    group = q_heads // kv_heads
    scale = 1 / math.sqrt(d) if scale is None else scale
    rows = q.astype(np.float64).reshape(n, kv_heads, group, d).transpose(1, 0, 2, 3)
    rows = rows.reshape(kv_heads, n * group, d) * scale       # row r: token r // group
    pos = start + np.arange(n * group) // group
    out = np.empty_like(rows)
    for h, r0 in itertools.product(range(kv_heads), range(0, n * group, q_tile)):
        qt, p = rows[h, r0:r0 + q_tile], pos[r0:r0 + q_tile]
        m, l, acc = np.full(len(p), -np.inf), np.zeros(len(p)), np.zeros((len(p), d))
        for t0 in range(0, p[-1] + 1, kv_tile):           # up to the last row's position
            t = np.arange(t0, min(t0 + kv_tile, p[-1] + 1))
            blocks, offsets = table[t // bs], t % bs        # through the block table
            k = cache[blocks, 0, offsets, h].astype(np.float64)
            v = cache[blocks, 1, offsets, h].astype(np.float64)
            s = qt @ k.T
            if t[-1] > p[0]:                              # the diagonal cuts this tile
                s = np.where(t[None, :] <= p[:, None], s, -np.inf)
            new_m = np.maximum(m, s.max(axis=1))          # finite: key 0 is in every past
            corr, w = np.exp(m - new_m), np.exp(s - new_m[:, None])
            l = l * corr + w.sum(axis=1)
            acc = acc * corr[:, None] + w @ v
            m = new_m
        out[h, r0:r0 + q_tile] = acc / l[:, None]
    return out.reshape(kv_heads, n, group, d).transpose(1, 0, 2, 3).reshape(n, q_heads, d)


class PrefillFirst(Scheduler):
    """Prefills first: a step that has prefill work gives it the whole token budget and
    decodes only the requests whose prefill it finishes (their first token); a step with
    nothing to prefill decodes everyone. (The order of vLLM's first scheduler and of
    nano-vllm; :class:`~pagedkv.scheduler.Scheduler` decodes first.)"""

    _sharing = False             # True while prefill() shares the budget out

    def decoding(self) -> list:
        return [] if self._sharing else super().decoding()

    def prefill(self) -> list:
        self._sharing = True     # the decodes are not charged ...
        try:
            self._chunks = super().prefill()
        finally:
            self._sharing = False
        return self._chunks

    def decode(self, who=None) -> list:
        if not self._chunks:     # nothing to prefill: everyone decodes
            return super().decode(who)
        return super().decode(   # ... nor run, but those whose prefill ends now
            lambda: [c.req for c in self._chunks if c.last and c.req in self.running])


class _Clock(sim.Observer):
    """Every output token's step and time, a step taking as long as the tokens it
    computes (its prefill chunks and decodes): ``times[s]`` is the time after ``s``
    steps, ``outputs[rid]`` the steps at which request ``rid`` got its tokens."""

    def __init__(self, workload):
        self.prompt = {r.rid: r.prompt for r in workload.requests}
        self.lens, self.times, self.outputs = {}, [0], {}
        self.steps = []          # per step: (tokens computed, any prefill, decoders grown)

    def stepped(self, step, batch, queue, refused):
        tokens, prefilled, decoders_grew = 0, False, 0
        for rid, n in zip(batch.ids, batch.lens.tolist()):
            before = self.lens.get(rid, 0)
            tokens += n - before
            prefilled |= before < self.prompt[rid] and n > before
            decoders_grew += before > self.prompt[rid] and n > before
            got = max(0, n - max(before, self.prompt[rid]))
            self.outputs.setdefault(rid, []).extend([step] * got)
            self.lens[rid] = n
        now = self.times[-1]
        self.times.extend([now] * (step - len(self.times)) + [now + tokens])
        self.steps.append((tokens, prefilled, decoders_grew))


def spike_in_sim(scheduler=Scheduler, *, prompt=4096, running=64, budget=512, at=40,
                 short=128, output=512):
    """The H200 spike in the simulation: ``running`` requests of ``short`` prompt tokens
    decode ``output`` tokens each; at step ``at`` a prompt of ``prompt`` tokens arrives (16
    output tokens). Served by ``scheduler`` under a token ``budget``, chunked. Returns
    the running requests' worst gap between tokens while the long prompt is prefilled,
    their median gap, and the long prompt's TTFT, each in steps and in tokens computed
    (a step as long as its tokens), with the clock (:class:`_Clock`) for checks."""
    reqs = [sim.Request(i, 0, short, output) for i in range(running)]
    reqs.append(sim.Request(running, at, prompt, 16))
    wl = sim.Workload("spike", tuple(reqs), max(r.total for r in reqs), 0)
    clock = _Clock(wl)
    policy = sim.make_policy("paged:16", 64 * sim.MiB, wl.max_len)
    run = sim.serve(wl, policy, max_seqs=running + 1, token_budget=budget,
                    chunked_prefill=True, observers=[clock], scheduler=scheduler)
    assert run.completions == len(reqs)
    first = clock.outputs[running][0]                   # the long prompt's first token
    out = {}
    for unit, t in (("steps", list(range(len(clock.times)))), ("tokens", clock.times)):
        gaps = [(t[a], t[b]) for rid in range(running)
                for a, b in zip(clock.outputs[rid], clock.outputs[rid][1:])]
        during = [b - a for a, b in gaps if b >= t[at] and a <= t[first]]
        out[unit] = {"worst_gap": max(during), "median_gap": float(np.median(
            [b - a for a, b in gaps])), "ttft": t[first] - t[at]}
    return out, clock


# ------------------------------------------------------------------------------------ checks
def _served(prompt: int, running: int, budget: int) -> int:
    """The steps, counted by the simulation (the shared scheduler, chunked prefill), from
    the long request's admission to its first decode: ``running`` requests are decoding
    when it arrives, and the pool is large enough for everyone."""
    reqs = [sim.Request(i, 0, 1, 400) for i in range(running)]
    reqs.append(sim.Request(running, 5, prompt, 2))     # (after they all started)
    wl = sim.Workload("exercise", tuple(reqs), max(r.total for r in reqs), 0)
    grew = []

    class Watch(sim.Observer):
        def stepped(self, step, batch, queue, refused):
            if running in batch.ids:
                grew.append(int(batch.lens[batch.ids.index(running)]))
    policy = sim.make_policy("paged:16", 64 * sim.MiB, wl.max_len)
    sim.serve(wl, policy, max_seqs=running + 1, token_budget=budget, chunked_prefill=True,
              observers=[Watch()])
    return next(i for i, n in enumerate(grew) if n > prompt) + 1


def check_steps_to_first_token(impl=steps_to_first_token):
    """Against the simulation for a grid of prompts, decodes and budgets."""
    for prompt, running, budget in itertools.product((1, 30, 64, 100), (0, 3, 8),
                                                     (12, 33, 64)):
        want = _served(prompt, running, budget)
        got = impl(prompt, running, budget)
        assert got == want, (prompt, running, budget, got, want)
    return {"cases": 36}


def check_budget_for(impl=budget_for):
    """The budget it gives reaches the first token within the steps (by the simulation),
    and one token less does not."""
    for prompt, running, steps in itertools.product((10, 63, 100), (0, 4), (1, 2, 5)):
        b = impl(prompt, running, steps)
        assert _served(prompt, running, b) <= steps, (prompt, running, steps, b)
        if b - running > 2:
            assert _served(prompt, running, b - 1) > steps, (prompt, running, steps, b)
    return {"cases": 18}


@names_its_seed
def check_prefill_tiles(impl=prefill_tiles, seed=21, trials=60):
    """Against the float64 reference (``paged_prefill_attention_ref``) on random chunks:
    scattered block tables, chunks starting mid-block, grouped heads, tiles that do not
    line up with blocks, and a pool that holds NaN wherever no token was written."""
    rng = np.random.default_rng(seed)
    for _ in range(trials):
        bs, kv_heads, group = (int(rng.choice(c)) for c in ((8, 16, 32), (1, 2), (1, 3)))
        start, n, d = int(rng.integers(0, 40)), int(rng.integers(1, 50)), 64
        length = start + n
        used = -(-length // bs)
        pool = used + int(rng.integers(0, 4))
        cache = np.full((pool, 2, bs, kv_heads, d), np.nan, np.float32)
        table = rng.permutation(pool)[:used].astype(np.int32)
        t = np.arange(length)
        cache[table[t // bs], :, t % bs] = rng.standard_normal((length, 2, kv_heads, d))
        q = rng.standard_normal((n, kv_heads * group, d)).astype(np.float32)
        q_tile, kv_tile = int(rng.choice((4, 8, 16))), int(rng.choice((4, 8, 16, 32)))
        want = paged_prefill_attention_ref(q, cache, table[None],
                                           np.array([0, n], np.int32),
                                           np.array([length], np.int32))
        got = impl(q, cache, table, start, q_tile=q_tile, kv_tile=kv_tile)
        assert got.shape == q.shape and np.allclose(got, want, rtol=1e-5, atol=1e-6), \
            (bs, kv_heads, group, start, n, q_tile, kv_tile)
    return {"cases": trials}


@names_its_seed
def check_PrefillFirst(impl=PrefillFirst, seed=22):
    """A long prompt arriving into running decodes, in the simulation: with prefills
    first, its prefill takes ``ceil((prompt + 1) / budget)`` steps (the whole budget, its
    first token included) and the running requests wait one step more than that; no step
    computes more than the budget, and no step that prefills also decodes a request that
    was already decoding (also on a trace of random arrivals)."""
    cases = 0
    for prompt, budget in itertools.product((63, 300), (32, 64, 100)):
        out, clock = spike_in_sim(impl, prompt=prompt, running=8, budget=budget, at=30,
                                  short=16, output=200)
        k = math.ceil((prompt + 1) / budget)
        assert out["steps"]["ttft"] == k, (prompt, budget, out)
        assert out["steps"]["worst_gap"] == k + 1, (prompt, budget, out)
        _check_steps(clock, budget)
        cases += 1
    trace = sim.make_workload("chat", n=60, seed=seed, rate=0.5)
    clock = _Clock(trace)
    policy = sim.make_policy("paged:16", 64 * sim.MiB, trace.max_len)
    run = sim.serve(trace, policy, token_budget=256, chunked_prefill=True,
                    observers=[clock], scheduler=impl)
    assert run.completions == len(trace) and run.preemptions == 0   # (lengths only grow)
    _check_steps(clock, 256)
    return {"cases": cases + 1}


def _check_steps(clock, budget):
    for step, (tokens, prefilled, decoders_grew) in enumerate(clock.steps, 1):
        assert tokens <= budget, (step, tokens, budget)
        assert not (prefilled and decoders_grew), (step, "a prefill step decoded")


# ---------------------------------------------------- wrong answers the checks must reject
def _without_the_decode_token(prompt, running, budget):
    return math.ceil(prompt / (budget - running))


def _decodes_not_charged(prompt, running, budget):
    return math.ceil((prompt + 1) / budget)


def _budget_without_decodes(prompt, running, steps):
    return max(2, math.ceil((prompt + 1) / steps))


def _budget_one_short(prompt, running, steps):
    return running + max(2, math.ceil(prompt / steps))


def _tiles_ignoring_the_table(q, cache, table, start, **kw):
    return prefill_tiles(q, cache, np.arange(len(table)), start, **kw)


def _tiles_from_position_zero(q, cache, table, start, **kw):
    return prefill_tiles(q, cache, table, 0, **kw)


def _tiles_unmasked(q, cache, table, start, *, scale=None, q_tile=16, kv_tile=16):
    """Tiles above a tile's last row skipped, but the keys past each row not masked."""
    n, q_heads, d = q.shape
    bs, kv_heads = cache.shape[2], cache.shape[3]
    group = q_heads // kv_heads
    scale = 1 / math.sqrt(d) if scale is None else scale
    rows = q.astype(np.float64).reshape(n, kv_heads, group, d).transpose(1, 0, 2, 3)
    rows = rows.reshape(kv_heads, n * group, d) * scale
    pos = start + np.arange(n * group) // group
    out = np.empty_like(rows)
    for h, r0 in itertools.product(range(kv_heads), range(0, n * group, q_tile)):
        qt, last = rows[h, r0:r0 + q_tile], pos[min(r0 + q_tile, n * group) - 1]
        t = np.arange(last + 1)
        k = cache[table[t // bs], 0, t % bs, h].astype(np.float64)
        v = cache[table[t // bs], 1, t % bs, h].astype(np.float64)
        s = qt @ k.T
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[h, r0:r0 + q_tile] = (w @ v) / w.sum(axis=1, keepdims=True)
    return out.reshape(kv_heads, n, group, d).transpose(1, 0, 2, 3).reshape(n, q_heads, d)


class _HeldButCharged(PrefillFirst):
    """Decodes held back in a prefill step, but their tokens still taken off its budget."""

    def prefill(self) -> list:
        self._chunks = Scheduler.prefill(self)
        return self._chunks


class _ChargedNothing(PrefillFirst):
    """Decodes not charged, but run in the prefill step all the same."""

    def decode(self, who=None):
        return Scheduler.decode(self, who)


WRONG = {
    "steps_to_first_token": [_without_the_decode_token, _decodes_not_charged],
    "budget_for": [_budget_without_decodes, _budget_one_short],
    "prefill_tiles": [_tiles_ignoring_the_table, _tiles_from_position_zero,
                      _tiles_unmasked],
    "PrefillFirst": [Scheduler, _HeldButCharged, _ChargedNothing],
}
