"""Beam search's side of choosing tokens, on the host: each beam row's most likely tokens
(:func:`log_softmax_topk`) and the ranking of every (beam, next token) candidate
(:func:`beam_select`); the finished hypotheses are ranked by
:func:`~pagedkv.model.requests.best_beams`.

Every other token is drawn on the device, by the runner, with the batch sampler of
:mod:`pagedkv.kernels.sampling` (greedy, or temperature, top-p and top-k with each
sequence's own counter-based random stream).
"""
from __future__ import annotations

import numpy as np

from .. import backend
from .requests import best_beams

__all__ = ["log_softmax_topk", "best_beams", "beam_select"]


def log_softmax_topk(logits, k: int):
    """The ``k`` most likely tokens of each row and their log-probabilities (host arrays)."""
    xp = backend.xp if not isinstance(logits, np.ndarray) else np
    z = logits - logits.max(axis=1, keepdims=True)
    lp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
    ids = xp.argsort(-lp, axis=1)[:, :k]
    return backend.to_numpy(xp.take_along_axis(lp, ids, axis=1)), backend.to_numpy(ids)


def beam_select(scores, top_lp, top_ids, width: int, stop_ids):
    """One beam-search step. Candidates are (beam b, token t) with score ``scores[b] +
    top_lp[b, j]``, ranked best first (ties: lower beam, then lower token). Walking down the
    ranks, a candidate that ends the answer becomes a finished hypothesis if its rank is below
    ``width``; the others continue until ``width`` of them are taken. Returns ``(continuing,
    ended)``, lists of ``(beam, token, score)``."""
    cands = sorted(((float(s + lp), b, int(t)) for b, s in enumerate(scores)
                    for lp, t in zip(top_lp[b], top_ids[b])), key=lambda c: (-c[0], c[1], c[2]))
    continuing, ended = [], []
    for rank, (score, b, t) in enumerate(cands):
        if t in stop_ids:
            if rank < width:
                ended.append((b, t, score))
        else:
            continuing.append((b, t, score))
            if len(continuing) == width:
                break
    return continuing, ended
