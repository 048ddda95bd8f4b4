"""Requests and what they ask for: :class:`SamplingParams` (how a request is decoded,
checked when it is made), :class:`Sequence` (one answer's tokens) and :class:`Request` (a
prompt, its sequences and its random generator), the types :class:`~pagedkv.model.engine.Engine`
takes in and gives back.

Every sequence's list of tokens ends with its *pending* token: sampled, but its K/V not yet in the
cache. The manager counts only the tokens whose K/V are in the cache. The sequence is its tokens'
one owner: the manager keeps only the ids of a partly filled block (a full one it names by their
hash), and a swapped-out sequence's come back from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checks import is_int, positive_int
from ..errors import ConfigError
from .sampling import best_beams

__all__ = ["SamplingParams", "Sequence", "Request"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` is greedy; ``beam_width > 1`` is beam
    search (greedy, ``n == 1``); ``n > 1`` needs a temperature (else the samples are equal)."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0             # keep the k most likely tokens (ties at the k-th: all); 0: off
    n: int = 1
    beam_width: int = 1
    seed: int | None = None
    ignore_eos: bool = False   # an end token does not end the answer (benchmarks' lengths)
    min_tokens: int = 0        # no end token among the first min_tokens (it is masked)

    def __post_init__(self):
        positive_int(self.max_new_tokens, "max_new_tokens")
        positive_int(self.n, "n")
        positive_int(self.beam_width, "beam_width")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ConfigError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(f"n = {self.n} samples need a temperature > 0 "
                              "(greedy decoding would give n equal answers)")
        if self.beam_width > 1 and (self.n > 1 or self.temperature > 0):
            raise ConfigError("beam search is greedy: give beam_width alone, without n or "
                              "temperature")
        if self.seed is not None and not (is_int(self.seed) and self.seed >= 0):
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not (is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_new_tokens):
            raise ConfigError(f"min_tokens must be an integer in [0, max_new_tokens = "
                              f"{self.max_new_tokens}], got {self.min_tokens!r}")
        if self.beam_width > 1 and (self.ignore_eos or self.min_tokens):
            raise ConfigError("beam search ends its hypotheses at the end token: give "
                              "ignore_eos and min_tokens without beam_width")

    @property
    def width(self) -> int:
        """How many sequences the request runs at once."""
        return max(self.n, self.beam_width)


@dataclass
class Sequence:
    seq_id: int
    tokens: list          # prompt + generated; the last one is pending (not yet in the cache)
    prompt_len: int
    score: float = 0.0    # sum of the log-probabilities of the generated tokens (beam search)
    parent: int | None = None  # the sequence this one was forked from
    prefill: object = field(default=None, repr=False)  # its tokens to prefill, hashed once

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(eq=False)                   # compared and hashed by identity: the scheduler's keys
class Request:
    request_id: int
    prompt: list
    params: SamplingParams
    rng: np.random.Generator
    live: list = field(default_factory=list)      # sequences still decoding
    finished: list = field(default_factory=list)  # completed samples or beam hypotheses
    hashed: object = field(default=None, repr=False)  # the prompt, checked and hashed
    prefilled: bool = False   # its K/V are in the cache: it decodes

    @property
    def done(self) -> bool:
        return bool(self.finished) and not self.live

    def outputs(self) -> list:
        """The answers, best first for beam search (by score per generated token)."""
        if self.params.beam_width == 1:
            return list(self.finished)
        return best_beams(self.finished, self.params.beam_width)
