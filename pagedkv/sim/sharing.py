"""Sharing: forked sequences that share blocks copy-on-write (beam search, parallel
sampling), and how much memory that saves.

Both run on a :class:`~pagedkv.sim.kvdata.CheckedKV`, so every token of every beam is
written and, when the beam is freed, read back through its own page table and checked.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..beams import follow
from ..checks import cdiv, positive_int
from ..errors import AuditError, ConfigError
from .kvdata import SIM_SPEC, CheckedKV
from .workloads import make_workload

__all__ = ["beam_search", "parallel_sampling", "sharing_savings", "beam_children"]


def beam_children(rng, scores, width, alpha, vocab):
    """One beam-search step over random next-token distributions: every beam proposes
    its ``width`` likeliest tokens (probabilities from a Dirichlet(alpha) draw over
    ``vocab`` tokens), and the ``width`` best candidates by total log-probability
    survive. Returns the surviving candidates' parent indices and scores."""
    probs = rng.dirichlet(np.full(vocab, alpha), size=len(scores))
    top = -np.sort(-probs, axis=1)[:, :width]
    cand = scores[:, None] + np.log(np.maximum(top, 1e-300))
    best = np.argsort(-cand, axis=None, kind="stable")[:width]
    return best // width, cand.ravel()[best]


def beam_search(kv: CheckedKV, first_id: int, prompt: int, output: int, width: int, rng,
                *, alpha: float = 0.3, vocab: int = 64, on_step=None) -> tuple[int, int]:
    """One beam-search request on ``kv``: prefill the prompt, then every step fork the
    beams with several surviving children, free (prune) those with none, and step all
    the beams. Every beam is verified when it is freed. Sequence ids are ``first_id``,
    ``first_id + 1``, ...

    Returns (sum over steps of blocks in use, the same without sharing). ``on_step(kv)``
    is called after every step (to record pictures)."""
    positive_int(width, "beam width"), positive_int(prompt, "prompt")
    positive_int(output, "output")
    ids = itertools.count(first_id + 1)

    def fork(parent, j):                # a second child of a beam: a new sequence
        child = next(ids)
        kv.fork(parent, child)
        return child

    kv.add(first_id, prompt)
    beams, scores = [first_id], np.zeros(1)
    used_sum = unshared_sum = 0
    for _ in range(output):
        parents, scores = beam_children(rng, scores, width, alpha, vocab)
        # a beam's first child continues it, others fork; the pruned are freed (verified)
        beams = follow(beams, parents.tolist(), fork, kv.free)
        kv.step(beams)
        used, unshared = kv.used_and_unshared()
        used_sum, unshared_sum = used_sum + used, unshared_sum + unshared
        if on_step is not None:
            on_step(kv)
    for b in beams:
        kv.free(b)
    return used_sum, unshared_sum


def parallel_sampling(kv: CheckedKV, first_id: int, prompt: int, output: int, n: int, *,
                      on_step=None) -> tuple[int, int]:
    """``n`` samples of one prompt: prefill once, fork ``n - 1`` times, then every
    sample writes its own ``output`` tokens. Returns sums over steps as
    :func:`beam_search` does."""
    positive_int(n, "n")
    ids = list(range(first_id, first_id + n))
    kv.add(ids[0], prompt)
    if n > 1:
        kv.fork(ids[0], *ids[1:])
    used_sum = unshared_sum = 0
    for _ in range(output):
        kv.step(ids)
        used, unshared = kv.used_and_unshared()
        used_sum, unshared_sum = used_sum + used, unshared_sum + unshared
        if on_step is not None:
            on_step(kv)
    for s in ids:
        kv.free(s)
    return used_sum, unshared_sum


def sharing_savings(mode: str, widths=(2, 4, 6), *, preset: str = "alpaca",
                    n: int = 200, seed: int = 0, block_size: int = 16, write: bool = True,
                    alpha: float = 0.3, bookkeeping: str = "teaching") -> dict:
    """Memory saved by sharing, for beam search (``mode="beam"``) or parallel sampling
    (``"parallel"``), over ``n`` requests of ``preset`` served one after another.

    Saving = 1 - (blocks in use) / (blocks the same sequences would hold unshared), both
    summed over every decode step of every request (a time average, weighted by memory).
    Returns ``{width: {"saving", "copies", "verified", "corrupted"}}``.
    """
    if mode not in ("beam", "parallel"):
        raise ConfigError(f"mode must be 'beam' or 'parallel', got {mode!r}")
    widths = [positive_int(w, "width") for w in widths]
    wl = make_workload(preset, n=n, seed=seed)
    out = {}
    for w in widths:
        blocks = (2 * w + 2) * cdiv(wl.longest, block_size)   # room for every live beam
        kv = CheckedKV(blocks * SIM_SPEC.block_bytes(block_size), block_size, write=write,
                     bookkeeping=bookkeeping, max_seqs=2 * w, max_len=wl.longest)
        rng = np.random.default_rng([seed, w])
        used = unshared = next_id = 0
        for r in wl.requests:
            if mode == "beam":
                u, s = beam_search(kv, next_id, r.prompt, r.output, w, rng, alpha=alpha)
                next_id += 1 + w * r.output    # enough fresh ids for every fork
            else:
                u, s = parallel_sampling(kv, next_id, r.prompt, r.output, w)
                next_id += w
            used, unshared = used + u, unshared + s
        kv.manager.audit()
        if kv.allocator.num_used:
            raise AuditError("blocks still in use after every request finished")
        out[w] = dict(saving=1 - used / unshared, copies=kv.copies,
                      verified=kv.verified, corrupted=kv.corrupted)
    return out
