"""A decode step in two halves: its slots now, its token ids later.

A prefix-caching manager's :meth:`step` takes, for each sequence, the token whose K/V the new
slot will hold, because a block that this token fills is named (hashed, cached) by its ids.
An engine that plans step n + 1 while the GPU still computes step n does not know those
tokens yet: step n is choosing them. :class:`Reserving` splits the step for it:

* :meth:`~Reserving.reserve` maps every sequence's next slot (a new block where the last one
  is full), as ``step`` does, and returns the same plan; the slot is *pending*;
* :meth:`~Reserving.commit` gives the pending slots their token ids once they are known, and
  names the blocks they fill. A sequence freed in between (it ended at step n, so its step
  n + 1 is thrown away) is skipped: its pending slot went back with its blocks.

A block is named only at commit, when its ids are known. Its K/V may be written before that
(the GPU runs ahead of the host), but nobody can find it in the cache before it is named.
"""
from __future__ import annotations

from .errors import ConfigError

__all__ = ["Reserving"]


class Reserving:
    """``reserve`` and ``commit`` for a prefix-caching manager (a mixin: it uses the
    manager's ``pages``, ``_tail``, ``_cache_full_blocks`` and ``block_size``). At most one
    slot of a sequence is pending at a time."""

    def pending(self) -> frozenset:
        """The sequences whose last slot is reserved and has no token id yet."""
        return frozenset(self.__dict__.get("_pending", ()))

    def reserve(self, seq_ids):
        """One decode step's slots for ``seq_ids`` (the plan ``step`` returns), their
        token ids to come by :meth:`commit`."""
        ids = list(seq_ids)
        pending = self.__dict__.setdefault("_pending", set())
        twice = [i for i in ids if i in pending]
        if twice or len(set(ids)) != len(ids):
            raise ConfigError(f"reserve: sequences {twice or ids} would have two pending "
                              f"slots (commit the first)")
        plan = self.pages.step(ids)               # unknown ids and a full pool: refused here
        pending.update(ids)
        return plan

    def commit(self, seq_ids, tokens) -> None:
        """The token ids of the slots :meth:`reserve` gave ``seq_ids``; a full block is
        named now. A sequence freed since its reservation is skipped."""
        ids, tokens = list(seq_ids), [int(t) for t in tokens]
        if len(ids) != len(tokens):
            raise ConfigError(f"commit: one token per sequence, got {len(tokens)} for "
                              f"{len(ids)}")
        pending = self.__dict__.setdefault("_pending", set())
        for seq_id, token in zip(ids, tokens):
            if seq_id not in pending:
                raise ConfigError(f"commit: sequence {seq_id!r} has no reserved slot")
            pending.discard(seq_id)
            if seq_id not in self._tail:          # freed since: nothing left to name
                continue
            tail = self._tail[seq_id]
            tail.append(token)
            if len(tail) == self.block_size:
                self._cache_full_blocks(seq_id)

    def _committed(self, seq_id) -> int:
        """Tokens of the sequence whose ids the manager knows (a pending slot excluded)."""
        return self.num_tokens(seq_id) - (seq_id in self.__dict__.get("_pending", ()))
