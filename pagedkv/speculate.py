"""Speculative decoding's pure parts: guess the next tokens, keep what the model agrees with.

A decode step computes one token a sequence. At small batch the step is bound by reading the
weights (or by its launches), not by its arithmetic, so a pass over ``k + 1`` query tokens of a
row costs about what a pass over one does. Speculation spends that: a cheap *drafter* guesses
``k`` tokens, one pass of the target model computes its distribution at each of the ``k + 1``
positions (after the last sampled token, and after each guess), and an *acceptance rule* keeps
the guesses the target agrees with, plus one token of the target's own, so a step yields
between 1 and ``k + 1`` tokens. The K/V written for rejected guesses is taken back by the
cache (``truncate``; the prefix-caching managers reserve the guesses' slots with
``reserve_slots`` and name a block only once its ids are committed).

Three pure functions, no engine, no model:

* :func:`propose` — prompt lookup (n-gram) drafting: the tokens that followed the most recent
  earlier occurrence of the sequence's last n tokens, for ``n`` from ``max_ngram`` down to
  ``min_ngram``. It costs no model and guesses well where the output repeats the input
  (summaries, code edits, extraction, quoting), and not at all on text that never repeats.
* :func:`accept_greedy` — for greedy requests: the longest prefix of the guesses that equals
  the target's argmax at each position, then the target's argmax after it. The output is
  token for token the output without speculation.
* :func:`accept_sampled` — for sampled requests, the rejection-sampling rule that keeps the
  target distribution (Leviathan et al., 2023; Chen et al., 2023). The drafter is
  deterministic, so its distribution is a point mass on its guess ``d``: accept ``d`` with
  probability ``p(d)``, else sample from ``p`` with ``d`` removed and renormalised. The
  uniforms come from the caller, so the rule is deterministic and testable.
"""
from __future__ import annotations

import numpy as np

from .checks import count, positive_int, token_ids
from .errors import ConfigError

__all__ = ["propose", "Lookup", "accept_greedy", "accept_sampled", "accept_drawn",
           "DEFAULT_K", "DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM"]

#: Guesses a row: verifying ``k + 1`` tokens costs about one decode at small batch.
DEFAULT_K = 4
#: The longest match tried first (a 3-gram is specific in a vocabulary of tens of thousands)
#: and the shortest one accepted (one repeated token still predicts quoted text).
DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM = 3, 1


def _ids(tokens) -> np.ndarray:
    """Token ids as an int64 array, by :func:`pagedkv.checks.token_ids`' rule (a 1-D
    integer array is checked at once, without a Python loop)."""
    if isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        if not tokens.size or (tokens.min() >= 0 and tokens.max() < 2**63):
            return tokens.astype(np.int64)
    return np.array(token_ids(tokens), dtype=np.int64)


def propose(tokens, k: int = DEFAULT_K, *, max_ngram: int = DEFAULT_MAX_NGRAM,
            min_ngram: int = DEFAULT_MIN_NGRAM) -> list[int]:
    """Up to ``k`` guessed next tokens of a sequence whose ids so far (prompt and generated)
    are ``tokens``. For ``n`` from ``max_ngram`` down to ``min_ngram``: if the last ``n``
    tokens occurred earlier, the guesses are the (at most ``k``) tokens that followed
    their most recent earlier occurrence; fewer than ``k`` when it ends within ``k``
    tokens of the end. No match of any size: no guesses (``[]``), the row decodes as
    usual."""
    ids = _ids(tokens)
    k = count(k, "k (tokens to guess)")
    max_ngram = positive_int(max_ngram, "max_ngram")
    min_ngram = positive_int(min_ngram, "min_ngram")
    if min_ngram > max_ngram:
        raise ConfigError(f"min_ngram must be at most max_ngram, got min_ngram={min_ngram} "
                          f"and max_ngram={max_ngram}")
    length = len(ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        starts = length - n                   # an earlier occurrence starts before this
        match = np.ones(starts, dtype=bool)   # match[i]: ids[i:i + n] is the last n ids
        for j in range(n):
            match &= ids[j:starts + j] == ids[starts + j]
        found = np.flatnonzero(match)
        if len(found):
            after = int(found[-1]) + n        # the most recent occurrence's next token
            return ids[after:after + k].tolist()
    return []


class Lookup:
    """:func:`propose` for one growing sequence, at O(``max_ngram``) work a token instead
    of a pass over the whole sequence at every step: an index from each n-gram (``n``
    from ``min_ngram`` to ``max_ngram``) to where its latest occurrence ended, the
    sequence's own last n-grams left out (they are what is looked up). The engine keeps
    one per sequence that guesses; ``propose(tokens, k)`` gives what :func:`propose`
    gives, for a list of ids that only grows between calls (the sequence's own).

    It also scores itself: ``rate`` is a moving average (over about ``1 / RATE_WEIGHT``
    guesses) of how often its first guess was the token that came next, checked at the
    next call, whether or not the guess was used. It starts at ``RATE_START``."""

    RATE_WEIGHT, RATE_START = 1 / 8, 0.5

    def __init__(self, *, max_ngram: int = DEFAULT_MAX_NGRAM,
                 min_ngram: int = DEFAULT_MIN_NGRAM):
        self.max_ngram = positive_int(max_ngram, "max_ngram")
        self.min_ngram = positive_int(min_ngram, "min_ngram")
        if min_ngram > max_ngram:
            raise ConfigError(f"min_ngram must be at most max_ngram, got min_ngram="
                              f"{min_ngram} and max_ngram={max_ngram}")
        self.ends: dict = {}      # n-gram (a tuple) -> the end of its latest occurrence
        self.indexed = 0          # the n-grams ending at or before this are in ``ends``
        self.rate = self.RATE_START
        self.last = None          # (position, token): its last first guess, to score

    def propose(self, tokens: list, k: int) -> list[int]:
        """Up to ``k`` guesses after ``tokens``, as :func:`propose` makes them."""
        length = len(tokens)
        if self.last is not None and self.last[0] < length:       # score the last guess
            at, guess = self.last
            self.rate += ((tokens[at] == guess) - self.rate) * self.RATE_WEIGHT
            self.last = None
        lo, hi = self.min_ngram, self.max_ngram
        for end in range(self.indexed + 1, length):       # every n-gram but the last ones
            for n in range(lo, min(hi, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(hi, length - 1), lo - 1, -1):
            end = self.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                if k:
                    self.last = (length, tokens[end])
                return tokens[end:end + k]
        return []


def accept_greedy(draft, target) -> list[int]:
    """The tokens a greedy row keeps: ``draft`` holds the ``k`` guesses, ``target`` the
    target's argmax at each of the ``k + 1`` positions (``target[i]`` follows the
    sequence and ``draft[:i]``). Returns the longest prefix of ``draft`` that agrees with
    ``target``, then the target's token after it: between 1 and ``k + 1`` tokens, the
    first ``len(result) - 1`` of them accepted guesses."""
    draft, target = token_ids(draft), token_ids(target)
    if len(target) != len(draft) + 1:
        raise ConfigError(f"accept_greedy: the target gives one token more than the draft "
                          f"(k + 1 for k guesses); got {len(draft)} guesses and "
                          f"{len(target)} target tokens")
    agree = 0
    while agree < len(draft) and draft[agree] == target[agree]:
        agree += 1
    return draft[:agree] + [target[agree]]


def _uniform(u, what: str) -> float:
    if isinstance(u, (bool, np.bool_)) or not isinstance(u, (int, float, np.integer,
                                                              np.floating)):
        raise ConfigError(f"{what} must be a number in [0, 1), got {u!r}")
    if not 0 <= u < 1:
        raise ConfigError(f"{what} must be in [0, 1), got {u!r}")
    return float(u)


def _sample(p: np.ndarray, u: float) -> int:
    """The token at ``u`` (in [0, 1)) of distribution ``p`` by its cumulative sum: the
    first whose cumulative probability exceeds ``u`` times the total (never a token of
    probability 0)."""
    cumulative = np.cumsum(p)
    return int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))


def accept_sampled(draft, probs, accept_u, sample_u) -> list[int]:
    """The tokens a sampled row keeps, distributed as sampling the target one token at a
    time. ``draft``: the ``k`` guesses of a deterministic drafter. ``probs``: ``[k + 1,
    vocab]``, the target's distribution at each position (after temperature, top-k or
    top-p: whatever the request samples from; each row sums to 1). ``accept_u``: ``k``
    uniforms in [0, 1); guess ``i`` is accepted if ``accept_u[i] < probs[i, draft[i]]``.
    ``sample_u``: one uniform in [0, 1) for the one token the target samples: at the first
    rejected position ``i``, from ``probs[i]`` with ``draft[i]`` removed and
    renormalised; after ``k`` accepted guesses, from ``probs[k]``. Returns the accepted
    guesses, then that token."""
    draft = token_ids(draft)
    k = len(draft)
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != k + 1 or p.shape[1] == 0:
        raise ConfigError(f"accept_sampled: probs must be [k + 1, vocab] = [{k + 1}, vocab] "
                          f"for {k} guesses, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ConfigError("accept_sampled: probs must be finite and non-negative")
    sums = p.sum(axis=1)
    if (abs(sums - 1) > 1e-3).any():
        row = int(np.flatnonzero(abs(sums - 1) > 1e-3)[0])
        raise ConfigError(f"accept_sampled: each row of probs must sum to 1 (a distribution, "
                          f"not logits); row {row} sums to {sums[row]:.6g}")
    if any(d >= p.shape[1] for d in draft):
        raise ConfigError(f"accept_sampled: a guess outside the vocabulary of "
                          f"{p.shape[1]}: {max(draft)}")
    accept_u = list(accept_u)
    if len(accept_u) != k:
        raise ConfigError(f"accept_sampled: one acceptance uniform a guess, got "
                          f"{len(accept_u)} for {k}")
    accept_u = [_uniform(u, "an acceptance uniform") for u in accept_u]
    sample_u = _uniform(sample_u, "sample_u")
    p = p / sums[:, None]
    for i, (d, u) in enumerate(zip(draft, accept_u)):
        rest = p[i].copy()
        rest[d] = 0.0
        if u >= p[i, d] and rest.any():          # rejected: the target's token instead
            return draft[:i] + [_sample(rest, sample_u)]
    return draft + [_sample(p[k], sample_u)]


def accept_drawn(guess, drawn) -> np.ndarray:
    """Which of a step's drawn tokens a speculating engine keeps. The draws come in row
    order, each sequence's rows together: its own row (``guess[i]`` -1), then a row for
    each of its guesses, whose input was ``guess[i]``. Every row drew a token from the
    target: greedy, its argmax; sampled, a sample with the sequence's stream at that
    token's place in the answer. A draw is kept if its row is a sequence's own, or if the
    draw before it was kept and drew exactly the guess this row took as input.

    For greedy rows this is :func:`accept_greedy`. For sampled rows it is the rejection
    rule of :func:`accept_sampled` with one uniform doing both jobs: the guess ``d`` is
    kept when the target's sample is ``d`` (probability ``p(d)``), and otherwise that
    sample, which is not ``d``, is distributed as ``p`` with ``d`` removed and
    renormalised. Since the uniform is the one the sequence would have used without
    speculation, it draws the very tokens it would have drawn without it. Returns a bool
    array."""
    guess = np.asarray(guess, dtype=np.int64)
    drawn = np.asarray(drawn, dtype=np.int64)
    if guess.shape != drawn.shape or guess.ndim != 1:
        raise ConfigError(f"accept_drawn: one guess (or -1) per drawn token, got shapes "
                          f"{guess.shape} and {drawn.shape}")
    if len(guess) and guess[0] >= 0:
        raise ConfigError("accept_drawn: the first row is a sequence's own (guess -1)")
    keep = np.ones(len(drawn), dtype=bool)
    for i in np.flatnonzero(guess >= 0).tolist():
        keep[i] = keep[i - 1] and drawn[i - 1] == guess[i]
    return keep
