"""Requests and their answers: :class:`Sequence` (one answer's tokens) and :class:`Request` (a
prompt, its sequences, how it is decoded), the types :class:`~pagedkv.model.engine.Engine`
takes in and gives back. How a request is decoded is a
:class:`~pagedkv.config.SamplingParams`.

Every sequence's list of tokens ends with its *pending* token: chosen, but its K/V not yet in
the cache. The manager counts only the tokens whose K/V are in the cache. The sequence is its
tokens' one owner: the manager keeps only the ids of a partly filled block (a full one it
names by their hash), and a swapped-out sequence's come back from here.

While the device runs ahead of the host, a sequence's newest tokens may still be on their way:
``planned`` counts the tokens the engine has asked for (drawn in a step that has not landed
yet included), ``num_generated`` the ones it has.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import SamplingParams

__all__ = ["SamplingParams", "Sequence", "Request", "best_beams"]


@dataclass(eq=False)                   # a sequence is itself (the engine's rows name it)
class Sequence:
    seq_id: int
    tokens: list          # prompt + generated; the last one is pending (not yet in the cache)
    prompt_len: int
    score: float = 0.0    # sum of the log-probabilities of the generated tokens (beam search)
    parent: int | None = None  # the sequence this one was forked from
    prefill: object = field(default=None, repr=False)  # its tokens to prefill, hashed once
    planned: int = -1     # tokens generated or on their way (-1: as many as generated)
    stream_seed: int | None = field(default=None, repr=False)  # its sampler's stream
    lookup: object = field(default=None, repr=False)  # its n-gram index, while it guesses
    ended: bool = False   # it left its request's live sequences (finished or cancelled)

    def __post_init__(self):
        if self.planned < 0:
            self.planned = self.num_generated

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def on_its_way(self) -> int:
        """Tokens drawn for it in steps that have not landed yet."""
        return self.planned - self.num_generated


@dataclass(eq=False)                   # compared and hashed by identity: the scheduler's keys
class Request:
    request_id: int
    prompt: list
    params: SamplingParams
    seed: int                 # its sequences' random streams start here (params.seed, or drawn)
    live: list = field(default_factory=list)      # sequences still decoding
    finished: list = field(default_factory=list)  # completed samples or beam hypotheses
    hashed: object = field(default=None, repr=False)  # the prompt, checked and hashed
    prefilled: bool = False   # its K/V are in the cache (or will be, in a planned step)

    @property
    def done(self) -> bool:
        return bool(self.finished) and not self.live

    def outputs(self) -> list:
        """The answers, best first for beam search (by score per generated token)."""
        if self.params.beam_width == 1:
            return list(self.finished)
        return best_beams(self.finished, self.params.beam_width)


def best_beams(seqs, width: int) -> list:
    """The ``width`` best hypotheses, by log-probability per generated token."""
    key = lambda s: (-s.score / max(1, len(s.generated)), s.generated)  # noqa: E731
    return sorted(seqs, key=key)[:width]
