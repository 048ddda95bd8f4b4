"""A decode step in two halves: its slots now, its token ids later.

A prefix-caching manager's :meth:`step` takes, for each sequence, the token whose K/V the new
slot will hold, because a block that this token fills is named (hashed, cached) by its ids.
An engine that plans step n + 1 while the GPU still computes step n does not know those
tokens yet: step n is choosing them. :class:`Reserving` splits the step for it:

* :meth:`~Reserving.reserve` maps every sequence's next slot (a new block where the last one
  is full), as ``step`` does, and returns the same plan; the slot is *pending*;
* :meth:`~Reserving.commit` gives the oldest pending slot of each sequence its token id once
  it is known, and names the blocks it fills. A sequence freed in between (it ended at step
  n, so its step n + 1 is thrown away) is skipped: its pending slots went back with its
  blocks.

A sequence may hold several pending slots (a prompt's first token and the one after it can
both be on their way); their ids come in the order the slots were reserved. A block is named
only at commit, when its ids are known. Its K/V may be written before that (the GPU runs
ahead of the host), but nobody can find it in the cache before it is named.
"""
from __future__ import annotations

from .errors import ConfigError

__all__ = ["Reserving"]


class Reserving:
    """``reserve`` and ``commit`` for a prefix-caching manager (a mixin: it uses the
    manager's ``pages``, ``_tail``, ``_cache_full_blocks`` and ``block_size``). A sequence
    with pending slots must take no ids by ``step`` or ``append`` until they are committed
    (its ids would be named out of order)."""

    def _pending_counts(self) -> dict:
        """Sequence id -> its pending slots. A sequence freed with slots pending keeps its
        entry until a commit meets it or the dict outgrows the live sequences (then every
        freed one is dropped at once: amortised, no pass over it at every step)."""
        counts = self.__dict__.setdefault("_pending", {})
        if len(counts) > 2 * len(self._tail) + 64:
            for seq_id in [i for i in counts if i not in self._tail]:
                del counts[seq_id]
        return counts

    def pending(self) -> dict:
        """The sequences that have reserved slots without token ids, and how many each."""
        return {i: n for i, n in self._pending_counts().items() if i in self._tail}

    def reserve(self, seq_ids):
        """One decode step's slots for ``seq_ids`` (the plan ``step`` returns), their
        token ids to come by :meth:`commit`."""
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"reserve: a sequence is named twice in {ids}")
        plan = self.pages.step(ids)               # unknown ids and a full pool: refused here
        counts = self._pending_counts()
        for seq_id in ids:
            counts[seq_id] = counts.get(seq_id, 0) + 1
        return plan

    def commit(self, seq_ids, tokens) -> None:
        """The token ids of the oldest slots :meth:`reserve` gave ``seq_ids``; a full block
        is named now. A sequence freed since its reservation is skipped."""
        ids, tokens = list(seq_ids), [int(t) for t in tokens]
        if len(ids) != len(tokens):
            raise ConfigError(f"commit: one token per sequence, got {len(tokens)} for "
                              f"{len(ids)}")
        for seq_id, token in zip(ids, tokens):
            if not self._commit_one(seq_id, token) and seq_id in self._tail:
                raise ConfigError(f"commit: sequence {seq_id!r} has no reserved slot")

    def commit_landed(self, seq_ids, tokens) -> None:
        """Tokens as they land, each its sequence's newest: those whose slot is reserved
        and pending are committed (in order); the others are not the manager's yet (their
        slot will be reserved with the id known) and are passed over."""
        for seq_id, token in zip(seq_ids, tokens):
            self._commit_one(seq_id, int(token))

    def _commit_one(self, seq_id, token: int) -> bool:
        """Give the oldest pending slot of ``seq_id`` its token (naming a block it fills);
        False if the sequence has none (a freed one's entry is dropped)."""
        counts = self.__dict__.setdefault("_pending", {})
        n = counts.get(seq_id)
        if not n:
            return False
        tail = self._tail.get(seq_id)
        if tail is None:                           # freed since: nothing left to name
            del counts[seq_id]
            return False
        if n == 1:
            del counts[seq_id]
        else:
            counts[seq_id] = n - 1
        tail.append(token)
        if len(tail) == self.block_size:
            self._cache_full_blocks(seq_id)
        return True

    def _committed(self, seq_id) -> int:
        """Tokens of the sequence whose ids the manager knows (pending slots excluded)."""
        return self.num_tokens(seq_id) - self.__dict__.get("_pending", {}).get(seq_id, 0)
