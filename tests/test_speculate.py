"""The pure parts of speculative decoding (pagedkv.speculate): the prompt-lookup drafter and
the two acceptance rules, on hand-made cases, against brute-force oracles that share no code
with them, and the sampled rule's output distribution against the target's (exactly, on a grid
of uniforms, and by a chi-square test with a fixed seed). Seeds are printed."""
import itertools
import math
import random
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.speculate import (DEFAULT_K, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, Lookup,
                               accept_greedy, accept_sampled, propose)

SEED = 40


# ---------------------------------------------------------------------- the drafter
def lookup_oracle(tokens, k, max_ngram, min_ngram):
    """Brute force, from the definition: for each n (longest first), every earlier
    position where the last n tokens occur, compared as tuples; the latest one wins."""
    tokens = list(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(tokens):
            continue
        last = tuple(tokens[len(tokens) - n:])
        where = [i for i in range(len(tokens) - n) if tuple(tokens[i:i + n]) == last]
        if where:
            follow = where[-1] + n
            return tokens[follow:follow + k]
    return []


WORDS = "the cat sat on the mat . the cat".split()


@pytest.mark.parametrize("tokens, kwargs, guesses", [
    # "the cat" occurred at the start: what followed it
    ([WORDS.index(w) for w in WORDS], dict(k=3, max_ngram=2), [2, 3, 0]),
    ([1, 2, 3, 1, 2, 4, 1, 2], dict(k=3, max_ngram=2), [4, 1, 2]),   # the most recent one
    ([1, 2, 3, 1, 2, 4, 1, 2], dict(k=3, max_ngram=2, min_ngram=2), [4, 1, 2]),
    ([5, 6, 7, 9, 6, 7], dict(k=3), [9, 6, 7]),          # no 3-gram match: the 2-gram's
    ([5, 6, 7, 9, 6, 7], dict(k=3, min_ngram=3), []),    # ... unless 3 is the shortest
    ([4, 8, 4], dict(k=5), [8, 4]),                      # fewer than k follow it
    ([1, 1], dict(k=4), [1]),
    ([3, 1, 4, 1], dict(max_ngram=2, min_ngram=2), []),
    ([1, 2, 3], dict(), []),                             # nothing repeats
    ([7], dict(), []),
    ([], dict(), []),
    ([1, 2, 1, 2], dict(k=0), []),
    ([2, 9, 9, 9, 2, 9, 9], dict(k=2), [9, 2]),          # the 3-gram 2 9 9 at 0
])
def test_propose_on_hand_made_cases(tokens, kwargs, guesses):
    assert propose(tokens, **kwargs) == guesses
    assert propose(np.array(tokens, dtype=np.int32), **kwargs) == guesses
    assert lookup_oracle(tokens, kwargs.get("k", DEFAULT_K),
                         kwargs.get("max_ngram", DEFAULT_MAX_NGRAM),
                         kwargs.get("min_ngram", DEFAULT_MIN_NGRAM)) == guesses


def test_propose_agrees_with_the_oracle_on_random_sequences():
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    found = 0
    for case in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.3 and tokens:              # a quoted stretch
            i = rng.randrange(len(tokens))
            tokens += tokens[i:i + rng.randrange(1, 8)]
        k = rng.randrange(0, 7)
        max_ngram = rng.randrange(1, 6)
        min_ngram = rng.randrange(1, max_ngram + 1)
        got = propose(tokens, k, max_ngram=max_ngram, min_ngram=min_ngram)
        want = lookup_oracle(tokens, k, max_ngram, min_ngram)
        assert got == want, (case, tokens, k, max_ngram, min_ngram)
        found += bool(got)
    assert 0.2 < found / 3000 < 0.95                   # both outcomes met, often


@pytest.mark.parametrize("args, kwargs, words", [
    (([1, 2], -1), {}, "non-negative"),
    (([1, 2], 1.5), {}, "non-negative"),
    (([1, 2],), dict(max_ngram=0), "max_ngram must be a positive"),
    (([1, 2],), dict(min_ngram=0), "min_ngram must be a positive"),
    (([1, 2],), dict(min_ngram=3, max_ngram=2), "at most max_ngram"),
    (([1, -2],), {}, "token ids"),
    (([1, 2.0],), {}, "token ids"),
    (([1, True],), {}, "token ids"),
    (("12",), {}, "token ids"),
    ((None,), {}, "token ids"),
    ((np.array([1.0, 2.0]),), {}, "token ids"),
    ((np.array([[1, 2]]),), {}, "token ids"),
])
def test_propose_refuses_bad_input(args, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        propose(*args, **kwargs)


def test_the_incremental_lookup_agrees_with_the_oracle_as_a_sequence_grows():
    """The engine's Lookup, asked after every few tokens of a growing sequence, guesses
    what the brute-force oracle guesses from the whole sequence."""
    rng = random.Random(SEED + 1)
    print(f"seed {SEED + 1}")
    for case in range(1500):
        vocab = rng.choice([2, 3, 5, 50])
        max_ngram = rng.randrange(1, 6)
        min_ngram = rng.randrange(1, max_ngram + 1)
        look, tokens = Lookup(max_ngram=max_ngram, min_ngram=min_ngram), []
        for _ in range(rng.randrange(1, 8)):
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
            k = rng.randrange(0, 6)
            assert look.propose(tokens, k) == lookup_oracle(tokens, k, max_ngram,
                                                            min_ngram), (case, tokens)
    with pytest.raises(ConfigError, match="at most max_ngram"):
        Lookup(max_ngram=2, min_ngram=3)


def test_the_lookup_scores_its_first_guess_against_the_token_that_came():
    look = Lookup(max_ngram=2, min_ngram=1)
    assert look.rate == Lookup.RATE_START
    tokens = [1, 2, 3, 1]
    assert look.propose(tokens, 2) == [2, 3]           # first guess: 2 at position 4
    tokens.append(2)                                   # right
    assert look.propose(tokens, 2) == [3, 1]
    assert look.rate == 0.5 + 0.5 / 8
    tokens.append(9)                                   # wrong (3 was guessed)
    assert look.propose(tokens, 2) == []               # nothing to guess: nothing scored
    rate = look.rate
    assert rate == (0.5 + 0.5 / 8) * 7 / 8
    tokens += [5, 6]
    assert look.propose(tokens, 0) == [] and look.rate == rate


# ---------------------------------------------------------------------- greedy acceptance
def greedy_oracle(draft, target):
    """The longest a for which the first a guesses are the target's, tried longest first."""
    for a in range(len(draft), -1, -1):
        if list(draft[:a]) == list(target[:a]):
            return list(draft[:a]) + [target[a]]


def test_accept_greedy_on_hand_made_cases():
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]   # all kept, and a bonus
    assert accept_greedy([1, 2, 3], [1, 5, 3, 4]) == [1, 5]         # stops at the first miss
    assert accept_greedy([1, 2, 3], [9, 2, 3, 4]) == [9]            # nothing kept: as decode
    assert accept_greedy([], [7]) == [7]                            # no guesses: a decode
    assert accept_greedy(np.array([4, 4]), np.array([4, 4, 0])) == [4, 4, 0]


def test_accept_greedy_agrees_with_the_oracle():
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    kept = Counter()
    for _ in range(3000):
        k = rng.randrange(0, 8)
        target = [rng.randrange(3) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.7 else rng.randrange(3) for t in target[:k]]
        got = accept_greedy(draft, target)
        assert got == greedy_oracle(draft, target), (draft, target)
        kept[len(got) - 1 == k] += 1
    assert kept[True] and kept[False]


def test_accept_greedy_refuses_bad_input():
    for draft, target in [([1, 2], [1, 2]), ([1], [1, 2, 3]), ([1, 2], []), ([1.5], [1, 2]),
                          ([1], [1, -1])]:
        with pytest.raises(ConfigError):
            accept_greedy(draft, target)


# ---------------------------------------------------------------------- sampled acceptance
def target_law(draft, probs):
    """What sampling the target one token at a time gives, as the outputs the rule can
    return: (t,) with t != draft[0], (draft[0], t) with t != draft[1], ..., and all k guesses
    then any t; each with the chain rule's probability (exact when probs are Fractions)."""
    law, before = {}, 1
    for i in range(len(draft) + 1):
        for t, pt in enumerate(probs[i]):
            if i < len(draft) and t == draft[i]:
                continue
            if before * pt:
                law[tuple(draft[:i]) + (t,)] = before * pt
        if i < len(draft):
            before *= probs[i][draft[i]]
    return law


def fraction_rows(rng, rows, vocab, denom):
    """Rows of [vocab] non-negative multiples of 1/denom summing to 1."""
    out = []
    for _ in range(rows):
        cuts = sorted(rng.randrange(denom + 1) for _ in range(vocab - 1))
        parts = [b - a for a, b in zip([0] + cuts, cuts + [denom])]
        out.append([Fraction(x, denom) for x in parts])
    return out


def test_the_sampled_rule_gives_the_target_distribution_exactly():
    """Probabilities in multiples of 1/D, uniforms on grids of midpoints: D per acceptance
    test (an acceptance probability a/D is then exactly a of them) and lcm(1..D) for the
    one sample (the residual's probabilities c/b, b <= D, are then exact too, and no grid
    point falls on a boundary). Every grid point is one call; the counts must equal the
    target's chain-rule probabilities exactly, for guesses that are likely, unlikely,
    certain and impossible."""
    rng = random.Random(SEED)
    print(f"seed {SEED}")
    for case in range(6):
        k, vocab, denom = (1, 4, 8) if case < 3 else (2, 3, 4)
        accept_grid = [(j + 0.5) / denom for j in range(denom)]
        points = math.lcm(*range(1, denom + 1))
        sample_grid = [(j + 0.5) / points for j in range(points)]
        probs = fraction_rows(rng, k + 1, vocab, denom)
        draft = [rng.randrange(vocab) for _ in range(k)]
        if case == 1:
            probs[0], draft[0] = [Fraction(1), 0, 0, 0], 0  # a certain guess
        if case == 2:                                       # an impossible one
            d, e = draft[0], (draft[0] + 1) % vocab
            probs[0][d], probs[0][e] = 0, probs[0][d] + probs[0][e]
        floats = np.array([[float(x) for x in row] for row in probs])
        counts = Counter()
        for us in itertools.product(accept_grid, repeat=k):
            for v in sample_grid:
                counts[tuple(accept_sampled(draft, floats, us, v))] += 1
        total = denom ** k * points
        got = {out: Fraction(n, total) for out, n in counts.items()}
        assert got == target_law(draft, probs), (case, draft, probs)


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square value exceeded with probability about 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_the_sampled_rule_passes_a_chi_square_test_against_the_target():
    """Random (Dirichlet) distributions over 6 tokens, 3 guesses each drawn from the
    target itself or uniformly; 20,000 rows with NumPy's uniforms at a fixed seed. The
    outputs' counts against the chain rule's expectation, cells of expectation < 5
    pooled."""
    rng = np.random.default_rng(SEED)
    print(f"seed {SEED}")
    vocab, k, rows = 6, 3, 20_000
    for trial in range(3):
        probs = rng.dirichlet(np.full(vocab, 0.7), size=k + 1)
        draft = [int(rng.choice(vocab, p=probs[i])) if trial != 1 else
                 int(rng.integers(vocab)) for i in range(k)]
        us = rng.random((rows, k + 1))
        counts = Counter(tuple(accept_sampled(draft, probs, u[:k], u[k])) for u in us)
        law = target_law(draft, probs)
        assert set(counts) <= set(law)
        expected = {out: p * rows for out, p in law.items()}
        big = [out for out, e in expected.items() if e >= 5]
        small_e = sum(e for out, e in expected.items() if e < 5)
        small_n = sum(n for out, n in counts.items() if expected[out] < 5)
        chi2 = sum((counts[out] - expected[out]) ** 2 / expected[out] for out in big)
        cells = len(big)
        if small_e:
            chi2 += (small_n - small_e) ** 2 / small_e
            cells += 1
        print(f"trial {trial}: draft {draft}, chi2 {chi2:.1f} over {cells - 1} df "
              f"(critical {chi2_critical(cells - 1):.1f})")
        assert chi2 < chi2_critical(cells - 1)


def test_accept_and_reject_at_the_boundary():
    p = np.array([[0.25, 0.75], [0.5, 0.5]])
    assert accept_sampled([1], p, [0.7499], 0.0) == [1, 0]     # u < p(d): kept
    assert accept_sampled([1], p, [0.75], 0.9) == [0]          # u = p(d): rejected
    assert accept_sampled([0], p, [0.3], 0.999) == [1]         # only token 1 is left
    assert accept_sampled([], p[:1], [], 0.2) == [0]           # no guesses: a sample


def test_one_hot_targets_make_the_sampled_rule_greedy():
    rng = random.Random(SEED)
    for _ in range(500):
        k = rng.randrange(0, 5)
        target = [rng.randrange(4) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.6 else rng.randrange(4) for t in target[:k]]
        probs = np.eye(4)[target]
        us = [rng.random() for _ in range(k)]
        assert accept_sampled(draft, probs, us, rng.random()) == accept_greedy(draft, target)


@pytest.mark.parametrize("args, words", [
    (([0], [[1.0, 0.0]], [0.5], 0.5), r"\[k \+ 1, vocab\]"),
    (([0], [[1.0], [1.0]], [0.5], 0.5), None),                     # fine: a vocab of 1
    (([0], np.ones((2, 2, 2)), [0.5], 0.5), r"\[k \+ 1, vocab\]"),
    (([0], [[0.5, 0.4], [0.5, 0.5]], [0.5], 0.5), "row 0 sums to 0.9"),
    (([0], [[2.0, -1.0], [0.5, 0.5]], [0.5], 0.5), "non-negative"),
    (([0], [[np.nan, 1.0], [0.5, 0.5]], [0.5], 0.5), "finite"),
    (([3], [[0.5, 0.5], [0.5, 0.5]], [0.5], 0.5), "outside the vocabulary"),
    (([0], [[0.5, 0.5], [0.5, 0.5]], [], 0.5), "one acceptance uniform a guess"),
    (([0], [[0.5, 0.5], [0.5, 0.5]], [1.0], 0.5), r"in \[0, 1\)"),
    (([0], [[0.5, 0.5], [0.5, 0.5]], [0.5], -0.1), r"in \[0, 1\)"),
    (([0], [[0.5, 0.5], [0.5, 0.5]], [0.5], True), "a number"),
    (([0], [[0.5, 0.5], [0.5, 0.5]], ["a"], 0.5), "a number"),
    (([0.5], [[0.5, 0.5], [0.5, 0.5]], [0.5], 0.5), "token ids"),
])
def test_accept_sampled_refuses_bad_input(args, words):
    if words is None:
        assert accept_sampled(*args) == [0, 0]
        return
    with pytest.raises(ConfigError, match=words):
        accept_sampled(*args)
