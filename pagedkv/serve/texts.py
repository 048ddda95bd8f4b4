"""The text half: a request's token ids into what its client reads.

A :class:`Job` is one HTTP request's work; the engine's client (:mod:`.client`) hands it
events, a list at a time (everything one step brought it, so that the HTTP layer wakes
once for them):

* :class:`Accepted` / :class:`Rejected` (``status``, ``message``, ``param``): the answer to
  a submit;
* :class:`Delta`: new text of one choice (a job that does not stream gets one per choice,
  when it ends; a stream gets one every ``stream_interval`` tokens, and its first text at
  once);
* :class:`PoolMap`: the block map seen from the job (at most every ``pool_interval``
  seconds while it runs);
* :class:`Failed` (``status``, ``message``): the request failed;
* :class:`Done` (``usage``, ``timings``): every choice has ended.

:class:`Texts` makes the deltas: it decodes one token at a time (never the whole answer
again), cuts an answer at a stop string, and holds back what might be the start of one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Job", "Choice", "Texts", "Accepted", "Rejected", "Delta", "PoolMap", "Failed",
           "Done", "timings"]


@dataclass(frozen=True, slots=True)
class Accepted:
    pool: str | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    status: int
    message: str
    param: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    index: int
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class PoolMap:
    pool: str


@dataclass(frozen=True, slots=True)
class Failed:
    status: int                # 500: the engine failed on it; 503: the engine stalled, died
    message: str


@dataclass(frozen=True, slots=True)
class Done:
    usage: dict
    timings: dict


@dataclass
class Choice:
    """One sequence's answer as the client sees it."""
    index: int
    decoder: object            # the tokenizer's incremental decoder
    text: str = ""             # the text decoded so far (cut at a stop string)
    sent: int = 0              # characters of it already sent
    tokens: int = 0            # tokens this choice generated (its usage)
    flushed: int = 0           # tokens it had when text was last sent
    finish_reason: str | None = None


@dataclass(eq=False)        # a job is itself: hashable, compared by identity
class Job:
    """One HTTP request's work: what to run and where its events go."""
    prompt: list
    params: object             # a SamplingParams
    emit: object               # called with a list of events (from the client's thread)
    stop: tuple = ()           # stop strings
    want_pool: bool = False    # send block maps (the chat page asks for them)
    stream: bool = True        # deltas as they come (else one per choice, at its end)
    arrived: float = field(default_factory=time.monotonic)   # when its request came
    key: int | None = None     # its name in the engine's client, once submitted
    accepted: bool = False     # the engine has taken it
    admitted: float | None = None   # when the engine admitted it (time.monotonic())
    first: float | None = None      # when its first token reached the client
    last: float | None = None       # when its last one did
    choices: dict = field(default_factory=dict)   # sequence id -> Choice


class Texts:
    """Token ids into text for one server's jobs: ``tokenizer`` decodes (one token at a
    time), ``stop_ids`` are the end tokens; a stream gets text every ``stream_interval``
    tokens of a choice (and its first text, and its end, at once)."""

    def __init__(self, tokenizer, stop_ids, stream_interval: int = 1):
        self.tokenizer, self.stop_ids = tokenizer, frozenset(stop_ids)
        self.interval = stream_interval

    def advance(self, job: Job, updates, out: list) -> bool:
        """Decode what is new in each of the job's sequences, its deltas into ``out``;
        True once every choice has ended (one cut by a stop string ends before its
        sequence)."""
        choices, ended_now = job.choices, False
        for seq_id, tokens, ended in updates:
            ch = choices.get(seq_id)
            if ch is None:
                ch = choices[seq_id] = Choice(len(choices), self.tokenizer.decoder())
            if ch.finish_reason:
                continue              # cut by a stop string: the rest is not read
            ch.tokens += len(tokens)
            eos = ended and bool(tokens) and tokens[-1] in self.stop_ids and \
                not job.params.ignore_eos
            if self._extend(ch, tokens[:-1] if eos else tokens, job.stop):
                ch.finish_reason = "stop"
            elif ended:
                ch.finish_reason = "stop" if eos else "length"
            ended_now = ended_now or bool(ch.finish_reason)
            self._send_text(job, ch, out)
        # (a job can only become complete in a call that ended one of its choices)
        return ended_now and len(choices) == job.params.n and \
            all(c.finish_reason for c in choices.values())

    @staticmethod
    def _extend(ch: Choice, tokens, stops) -> bool:
        """Append the text of ``tokens``; True if a stop string now appears (the text is
        then cut before it). Only the end that could hold a new match is searched."""
        before = len(ch.text)
        step = ch.decoder.step
        ch.text += step(tokens[0]) if len(tokens) == 1 else "".join(map(step, tokens))
        if not stops:
            return False
        cuts = [i for i in (ch.text.find(s, max(0, before - len(s) + 1)) for s in stops)
                if i >= 0]
        if cuts:
            ch.text = ch.text[:min(cuts)]
        return bool(cuts)

    def _send_text(self, job: Job, ch: Choice, out: list) -> None:
        """A delta of what is new and safe to send: while the choice runs, the last
        characters that might begin a stop string are held back, and a stream that has
        sent text waits for ``interval`` tokens more."""
        if ch.finish_reason:
            end = len(ch.text)
        elif not job.stream or (ch.sent and ch.tokens - ch.flushed < self.interval):
            return
        elif job.stop:
            end = max(ch.sent, len(ch.text) - max(map(len, job.stop)) + 1)
        else:
            end = len(ch.text)
        delta, ch.sent = ch.text[ch.sent:end], max(ch.sent, end)
        if delta or ch.finish_reason:
            ch.flushed = ch.tokens
            out.append(Delta(ch.index, delta, ch.finish_reason))

    @staticmethod
    def usage(job: Job) -> dict:
        gen = sum(c.tokens for c in job.choices.values())
        n = len(job.prompt)
        return dict(prompt_tokens=n, completion_tokens=gen, total_tokens=n + gen)


def timings(job: Job, now: float | None = None) -> dict:
    """Where a request's time went, in ms from when its request came: waiting (to be
    read, checked, and admitted by the engine), its prefill (to its first token), its
    decode (to its last), and the decode's tokens a second (each choice's first token
    is the prefill's)."""
    now = time.monotonic() if now is None else now
    first = job.first or now
    admitted = min(job.admitted or first, first)
    last = job.last or first
    tokens = sum(c.tokens for c in job.choices.values())
    decode = last - first
    rate = (tokens - len(job.choices)) / decode if decode > 0 else None
    ms = lambda s: round(1e3 * s, 3)  # noqa: E731
    return dict(queued_ms=ms(admitted - job.arrived), prefill_ms=ms(first - admitted),
                decode_ms=ms(decode), total_ms=ms(now - job.arrived),
                prompt_tokens=len(job.prompt), completion_tokens=tokens,
                decode_tokens_per_s=None if rate is None else round(rate, 2))
