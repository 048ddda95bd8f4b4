"""Chapter 7 (copy-on-write): predict the copies a beam search makes, and the blocks parallel
sampling holds, without running the manager."""
from __future__ import annotations

import itertools
import random

import numpy as np

from pagedkv import sim
from pagedkv.allocator import BlockAllocator
from pagedkv.beams import follow
from pagedkv.checks import cdiv
from pagedkv.manager import KVCacheManager

from ._seeds import names_its_seed

__all__ = ["count_copies", "parallel_blocks"]


def count_copies(prompt: int, block_size: int, schedule) -> int:
    """The copy-on-write copies of a beam search whose step ``s`` keeps the beams
    ``schedule[s]``: for each beam after the step, the index of its parent among
    the beams before it (a parent's first child continues it, the others fork).

    After any step every beam has a last block of its own (it copied, took a new
    block, or was the last sharer and wrote in place), so a step's sharers are the
    children of one parent: k children of a partly filled block make k - 1 copies."""
    copies, length = 0, prompt
    for parents in schedule:
        if length % block_size:                     # the last block is partly filled
            copies += len(parents) - len(set(parents))
        length += 1
    return copies


def parallel_blocks(prompt: int, output: int, n: int, block_size: int):
    """(blocks in use, blocks without sharing), each summed over the ``output``
    steps, for ``n`` samples of one prompt: what ``sim.parallel_sampling`` measures.
    The prompt's full blocks stay shared; a partly filled last prompt block is
    copied at the first step, so every sample owns the rest of its blocks."""
    shared = prompt // block_size
    used = unshared = 0
    for length in range(prompt + 1, prompt + output + 1):
        blocks = cdiv(length, block_size)
        used += shared + n * (blocks - shared)
        unshared += n * blocks
    return used, unshared


def beam_schedule(seed: int, steps: int, width: int, *, alpha: float = 0.3, vocab: int = 64):
    """The schedule of ``sim.beam_search`` run with ``np.random.default_rng(seed)``: its
    parents at every step, from the same random draws (the choice does not depend on blocks)."""
    rng, scores, schedule = np.random.default_rng(seed), np.zeros(1), []
    for _ in range(steps):
        parents, scores = sim.beam_children(rng, scores, width, alpha, vocab)
        schedule.append(parents.tolist())
    return schedule


# ------------------------------------------------------------------------------------ checks
def _run_schedule(prompt, block_size, schedule):
    """Beam search driven by ``schedule`` on a real manager, as ``sim.beam_search`` runs it:
    fork repeated parents, free the pruned, step every beam. Returns the copies planned."""
    m = KVCacheManager(BlockAllocator(512, block_size * 4, xp=np), block_size)
    m.add(0, prompt)
    ids = itertools.count(1)

    def fork(parent, j):
        child = next(ids)
        m.fork(parent, child)
        return child

    beams, copies = [0], 0
    for parents in schedule:
        beams = follow(beams, parents, fork, m.free)
        copies += len(m.step(beams).copies)
    m.audit()
    return copies


def _random_schedule(rng, steps, width):
    beams, schedule = 1, []
    for _ in range(steps):
        parents = [rng.randrange(beams) for _ in range(width)]
        schedule.append(parents)
        beams = width
    return schedule


@names_its_seed
def check_count_copies(impl=count_copies, seed=6, trials=200):
    """Against a real manager driven by random schedules, and against the chapter's beam
    search itself (its parents replayed from the same random draws)."""
    rng = random.Random(seed)
    for _ in range(trials):
        prompt, bs = rng.randrange(1, 40), rng.choice([1, 2, 4, 16])
        schedule = _random_schedule(rng, rng.randrange(1, 30), rng.randrange(1, 7))
        want = _run_schedule(prompt, bs, schedule)
        assert impl(prompt, bs, schedule) == want, (prompt, bs, schedule)
    for n, prompt in [(4, 10), (4, 12), (1, 5)]:          # parallel sampling: n - 1 copies
        schedule = [[0] * n] + [list(range(n))] * 9      # once, if the prompt's block is partial
        assert impl(prompt, 4, schedule) == (n - 1) * (prompt % 4 != 0)
    kv = sim.CheckedKV(96 * sim.SIM_SPEC.block_bytes(4), 4, write=False)
    sim.beam_search(kv, 0, 10, 30, 4, np.random.default_rng(0))
    schedule = beam_schedule(0, 30, 4)
    assert impl(10, 4, schedule) == kv.copies, (impl(10, 4, schedule), kv.copies)
    return {"schedules": trials, "copies in the chapter's search": kv.copies}


@names_its_seed
def check_parallel_blocks(impl=parallel_blocks, seed=8, trials=300):
    """Against ``sim.parallel_sampling`` on a real manager."""
    rng = random.Random(seed)
    for _ in range(trials):
        prompt, output = rng.randrange(1, 60), rng.randrange(1, 60)
        n, bs = rng.randrange(1, 7), rng.choice([1, 2, 4, 16])
        kv = sim.CheckedKV(4096 * sim.SIM_SPEC.block_bytes(bs), bs, write=False)
        want = sim.parallel_sampling(kv, 0, prompt, output, n)
        assert tuple(impl(prompt, output, n, bs)) == want, (prompt, output, n, bs, want)
    return {"trials": trials}


# ---------------------------------------------------- wrong answers the checks must reject
def _copies_even_into_full_blocks(prompt, block_size, schedule):
    return sum(len(p) - len(set(p)) for p in schedule)


def _copies_for_every_sharer(prompt, block_size, schedule):
    copies, length = 0, prompt
    for parents in schedule:
        if length % block_size:
            copies += sum(parents.count(p) for p in set(parents) if parents.count(p) > 1)
        length += 1
    return copies


def _copies_length_after_the_step(prompt, block_size, schedule):
    return sum(len(p) - len(set(p)) for s, p in enumerate(schedule)
               if (prompt + s + 1) % block_size)


def _prompt_block_shared_forever(prompt, output, n, block_size):
    shared = cdiv(prompt, block_size)
    used = unshared = 0
    for length in range(prompt + 1, prompt + output + 1):
        blocks = cdiv(length, block_size)
        used += shared + n * (blocks - shared)
        unshared += n * blocks
    return used, unshared


def _counted_before_each_step(prompt, output, n, block_size):
    return parallel_blocks(prompt - 1, output, n, block_size) if prompt > 1 else \
        parallel_blocks(prompt, output, n, block_size)


WRONG = {
    "count_copies": [_copies_even_into_full_blocks, _copies_for_every_sharer,
                     _copies_length_after_the_step],
    "parallel_blocks": [_prompt_block_shared_forever, _counted_before_each_step],
}
