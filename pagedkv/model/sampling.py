"""Choosing tokens: greedy, sampling (temperature, top-p, a seeded generator) and beam search.

The functions work on a batch of logits: :func:`sample` draws one token per row,
:func:`log_softmax_topk` gives each row's most likely tokens for beam search, and
:func:`beam_select` and :func:`best_beams` rank the beams' candidates and hypotheses.
:class:`Choosing` is the part of :class:`~pagedkv.model.engine.Engine` that applies them to
a request's sequences after a pass: ``n`` parallel samples fork the prompt once its first
logits are in; beams fork when a beam has several good continuations and are freed when it
has none (:func:`pagedkv.beams.follow`).

Where the logits are on a GPU, every sampled row of a step is chosen in one call of the
batch sampler (:func:`pagedkv.kernels.sampling.sample_rows`: one kernel, one download of the
tokens), each sequence drawing from its own counter-based stream; on NumPy each request
calls :func:`sample` with its own generator, as the chapters show.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import backend
from ..beams import follow
from ..kernels.sampling import derive_seed, pack_rows, sample_packed

if TYPE_CHECKING:
    from .requests import Request, SamplingParams, Sequence

__all__ = ["sample", "log_softmax_topk", "best_beams", "beam_select", "Choosing"]


def sample(logits, temperature: float, top_p: float, u, top_k: int = 0) -> np.ndarray:
    """One token per row of ``logits`` [B, vocab] (on the device). ``u`` [B] are uniform
    numbers from the request's generator (host): the token is where ``u`` falls in the
    cumulative distribution, tokens sorted most likely first, cut to the first ``top_k``
    (0: all), then at ``top_p``."""
    xp = backend.xp if not isinstance(logits, np.ndarray) else np
    if temperature == 0:
        return backend.to_numpy(xp.argmax(logits, axis=1)).astype(np.int64)
    z = logits / np.float32(temperature)
    p = xp.exp(z - z.max(axis=1, keepdims=True))
    order = xp.argsort(-p, axis=1)                     # most likely first
    ps = xp.take_along_axis(p, order, axis=1)
    if 0 < top_k < ps.shape[1]:
        ps[:, top_k:] = 0
    cum = xp.cumsum(ps, axis=1)
    ps = xp.where(cum - ps < top_p * cum[:, -1:], ps, 0)  # the nucleus (the first always stays)
    cum = xp.cumsum(ps, axis=1)
    target = xp.asarray(np.asarray(u, dtype=np.float32))[:, None] * cum[:, -1:]
    idx = xp.minimum((cum <= target).sum(axis=1), logits.shape[1] - 1)
    return backend.to_numpy(order[xp.arange(len(idx)), idx]).astype(np.int64)


def log_softmax_topk(logits, k: int):
    """The ``k`` most likely tokens of each row and their log-probabilities (host arrays)."""
    xp = backend.xp if not isinstance(logits, np.ndarray) else np
    z = logits - logits.max(axis=1, keepdims=True)
    lp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
    ids = xp.argsort(-lp, axis=1)[:, :k]
    return backend.to_numpy(xp.take_along_axis(lp, ids, axis=1)), backend.to_numpy(ids)


def best_beams(seqs, width: int) -> list:
    """The ``width`` best hypotheses, by log-probability per generated token."""
    key = lambda s: (-s.score / max(1, len(s.generated)), s.generated)  # noqa: E731
    return sorted(seqs, key=key)[:width]


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


class Choosing:
    """Each request's next tokens, from its rows of a pass's logits (a mixin of
    :class:`~pagedkv.model.engine.Engine`; it uses ``self.manager``, ``self.stop_ids`` and
    ``self._new_seq``)."""

    #: Sample a step's rows in one batch call: ``None`` where the logits are on a GPU (the
    #: server's engine, :func:`pagedkv.serve.start.served_engine`), ``True`` always (the
    #: same code on NumPy, for tests), ``False`` never: the default, the per-request
    #: sampler the chapters show, whose samples are the same on a CPU and a GPU.
    batch_sampling: bool | None = False

    def _batched(self, logits) -> bool:
        if self.batch_sampling is None:
            return not isinstance(logits, np.ndarray)
        return self.batch_sampling

    def _first_tokens(self, req: Request, logits) -> None:
        """The prompt is in the cache: choose the first token(s) from its last logits."""
        p, seq = req.params, req.live[0]
        if p.beam_width > 1:
            self._beam_step(req, logits)
            return
        if p.n > 1:                                    # parallel sampling: fork the prompt
            children = [self._new_seq(seq.tokens, seq.prompt_len, parent=seq.seq_id)
                        for _ in range(p.n - 1)]
            self.manager.fork(seq.seq_id, *(c.seq_id for c in children))
            req.live.extend(children)
            logits = logits[[0] * p.n]
        self._sample_step(req, logits)

    def _decoded(self, reqs, logits, greedy) -> None:
        """Each request takes its rows' tokens (``greedy``: the runner's greedy choices, or
        None): the greedy fast path, a beam step or a sampling step."""
        start, batch = 0, []
        for req in reqs:
            end = start + len(req.live)
            p = req.params
            if greedy is not None and end == start + 1 and p.temperature == 0 \
                    and p.beam_width == 1 and not self._masked(req, greedy[start:end]):
                seq = req.live[0]                    # the common case, without a call
                seq.tokens.append(greedy[start])
                if self._ends(p, seq):
                    self._retire(req, seq)
            elif p.beam_width > 1:
                self._beam_step(req, logits[start:end])
            elif self._batched(logits):
                batch.append((req, start))
            else:
                self._sample_step(req, logits[start:end],
                                  None if greedy is None else greedy[start:end])
            start = end
        if batch:
            self._sample_batch(batch, logits)

    def _sample_step(self, req: Request, logits, greedy=None) -> None:
        """Greedy or sampled: each live sequence takes one token from its row (``greedy``:
        the rows' greedy tokens, when the runner chose them already)."""
        p = req.params
        if p.temperature == 0 and greedy is not None and not self._masked(req, greedy):
            tokens = greedy
        elif self._batched(logits):
            self._sample_batch([(req, 0)], logits)
            return
        else:
            u = req.rng.random(len(req.live)) if p.temperature > 0 else None
            tokens = sample(self._mask(req, logits), p.temperature, p.top_p, u,
                            p.top_k).tolist()
        self._take(req, tokens)

    def _take(self, req: Request, tokens) -> None:
        """Each live sequence appends its token; the ones that ended retire."""
        for seq, t in zip(req.live, tokens):
            seq.tokens.append(int(t))
        for seq in list(req.live):
            if self._ends(req.params, seq):
                self._retire(req, seq)

    def _sample_batch(self, batch, logits) -> None:
        """One call of the batch sampler for every live sequence of the ``(request, first
        row)`` pairs, one download of the tokens. A sequence draws from its own stream: its
        seed (:meth:`_stream`) and the number of tokens it has generated."""
        rows, banned, values = [], [], []
        for req, start in batch:
            p = req.params
            if p.min_tokens:
                banned += [len(rows) + i for i in self._early(req)]
            for i, seq in enumerate(req.live):
                rows.append(start + i)
                values.append((p.temperature, p.top_p, p.top_k, self._stream(req, seq),
                               len(seq.tokens) - seq.prompt_len))
        xp = np if isinstance(logits, np.ndarray) else backend.xp
        if banned or rows != list(range(len(logits))):
            logits = logits[xp.asarray(rows)]                # a copy: masking is safe
        if banned:
            stop = xp.asarray(sorted(self.stop_ids))
            logits[xp.asarray(banned)[:, None], stop[None, :]] = -np.inf
        tokens = backend.to_numpy(sample_packed(logits, pack_rows(*zip(*values)))).tolist()
        at = 0
        for req, _ in batch:
            n = len(req.live)
            self._take(req, tokens[at:at + n])
            at += n

    @staticmethod
    def _stream(req: Request, seq: Sequence) -> int:
        """The seed of ``seq``'s stream, fixed at its first draw: sample ``i`` of the request
        (its place among the live sequences then) takes ``derive_seed(base, i)``, ``base``
        the request's seed, or a number from its generator when it has none."""
        seed = getattr(seq, "stream_seed", None)
        if seed is None:
            base = getattr(req, "stream_base", None)
            if base is None:
                base = req.params.seed if req.params.seed is not None else \
                    int(req.rng.integers(2**63))
                req.stream_base = base
            seed = seq.stream_seed = derive_seed(base, req.live.index(seq))
        return seed

    def _ends(self, p: SamplingParams, seq: Sequence) -> bool:
        """Does the token just chosen end the sequence: its limit, or an end token?"""
        return seq.num_generated >= p.max_new_tokens or \
            (seq.tokens[-1] in self.stop_ids and not p.ignore_eos)

    def _early(self, req: Request) -> list:
        """Rows whose next token may not be an end token yet (``min_tokens``)."""
        if not req.params.min_tokens or not self.stop_ids:
            return []
        return [i for i, s in enumerate(req.live) if s.num_generated < req.params.min_tokens]

    def _masked(self, req: Request, tokens) -> bool:
        """Did a row choose an end token that ``min_tokens`` forbids?"""
        return any(tokens[i] in self.stop_ids for i in self._early(req))

    def _mask(self, req: Request, logits):
        """The logits with the end tokens taken out of the rows ``min_tokens`` holds."""
        rows = self._early(req)
        if not rows:
            return logits
        logits = logits.copy()
        for i in rows:
            logits[i, sorted(self.stop_ids)] = -np.inf
        return logits

    def _beam_step(self, req: Request, logits) -> None:
        """Beam search: rank every (beam, next token); fork the beams chosen more than once,
        free the ones not chosen, keep the finished hypotheses."""
        k = req.params.beam_width
        top_lp, top_ids = log_softmax_topk(logits, 2 * k)
        beams = req.live
        continuing, ended = beam_select([b.score for b in beams], top_lp, top_ids, k,
                                        self.stop_ids)
        for b, t, score in ended:                      # finished: no cache needed
            req.finished.append(self._new_seq(beams[b].tokens + [t], beams[b].prompt_len,
                                              score, parent=beams[b].seq_id))
        def fork(parent, j):                           # a second child: share the blocks
            _, t, score = continuing[j]
            child = self._new_seq(parent.tokens + [t], parent.prompt_len, score,
                                  parent=parent.seq_id)
            self.manager.fork(parent.seq_id, child.seq_id)
            return child

        req.live = follow(beams, [b for b, _, _ in continuing], fork,
                          lambda beam: self.manager.free(beam.seq_id))
        for beam, (b, t, score) in zip(req.live, continuing):
            if beam is beams[b]:                       # the first child continues the beam
                beam.tokens.append(t)
                beam.score = score
        full = req.live and len(req.live[0].generated) >= req.params.max_new_tokens
        if len(req.finished) >= k or full or not req.live:
            for seq in list(req.live):
                self._retire(req, seq)

    def _retire(self, req: Request, seq: Sequence) -> None:
        """A sequence is complete: free its blocks, keep its tokens."""
        self.manager.free(seq.seq_id)
        req.live.remove(seq)
        req.finished.append(seq)
