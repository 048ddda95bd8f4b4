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
both be on their way; a speculative row's last sampled token and its guesses, reserved at once
by :meth:`~Reserving.reserve_slots`); their ids come in the order the slots were reserved. A
block is named only at commit, when its ids are known. Its K/V may be written before that (the
GPU runs ahead of the host), but nobody can find it in the cache before it is named.

:meth:`~Reserving.truncate` takes tokens back (a rewind): the guesses a verification
rejected, whose slots are still pending, or committed tokens once none is pending. Blocks
wholly past the kept tokens are released as ``free`` releases them (a cached one stays
cached, idle: it still holds every token it is named by); the block the cut leaves partly
filled stays mapped (shared, if it was: its next write copies it), and if it was cached it
is forgotten, since it no longer holds the tokens its hash names and its next write
overwrites them.
"""
from __future__ import annotations

from collections import Counter

from .checks import count, token_ids
from .errors import ConfigError, TokenIndexError

__all__ = ["Reserving"]


class Reserving:
    """``reserve``, ``reserve_slots``, ``commit`` and ``truncate`` for a prefix-caching
    manager (a mixin: it uses the manager's ``pages``, ``cache``, ``_tail``, ``_hashes``,
    ``_serials``, ``_cache_full_blocks`` and ``block_size``). A sequence with pending
    slots must take no ids by ``step`` or ``append`` until they are committed (its ids
    would be named out of order)."""

    def _reservations(self) -> dict:
        """Sequence id -> [its list of tail ids, its pending slots]. Slots belong to the
        sequence they were reserved for, known by its list of tail ids (each ``add`` makes
        a new one; nothing else replaces it): a sequence freed since, even one added again
        under the same id, has none. Every reader checks that; the stale entries are
        dropped all at once when they could outnumber the live sequences (amortised: no
        pass over the dict at every step)."""
        held = self.__dict__.setdefault("_pending", {})
        if len(held) > 2 * len(self._tail) + 64:
            for seq_id in [i for i, (tail, _) in held.items() if self._tail.get(i) is not tail]:
                del held[seq_id]
        return held

    def _pending_of(self, seq_id) -> int:
        """The sequence's pending slots (0 for an unknown one, or one freed since)."""
        entry = self.__dict__.get("_pending", {}).get(seq_id)
        return entry[1] if entry is not None and entry[0] is self._tail.get(seq_id) else 0

    def _reserved(self, seq_ids, n: int) -> None:
        """Count ``n`` more pending slots for each of ``seq_ids``."""
        held = self._reservations()
        for seq_id in seq_ids:
            tail = self._tail[seq_id]
            entry = held.get(seq_id)
            if entry is None or entry[0] is not tail:   # none, or a freed namesake's
                entry = held[seq_id] = [tail, 0]
            entry[1] += n

    def pending(self) -> dict:
        """The sequences that have reserved slots without token ids, and how many each."""
        return {seq_id: n for seq_id, (tail, n) in self._reservations().items()
                if self._tail.get(seq_id) is tail}

    def reserve(self, seq_ids):
        """One decode step's slots for ``seq_ids`` (the plan ``step`` returns), their
        token ids to come by :meth:`commit`."""
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"reserve: a sequence is named twice in {ids}")
        plan = self.pages.step(ids)               # unknown ids and a full pool: refused here
        self._reserved(ids, 1)
        return plan

    def reserve_slots(self, seq_id, n: int):
        """``n`` slots for one sequence (the plan ``append`` returns for ``n`` tokens),
        their token ids to come by :meth:`commit`: a speculative row, the last sampled
        token and its guesses, verified in one pass. Guesses the pass rejects are taken
        back by :meth:`truncate`."""
        plan = self.pages.append(seq_id, n)       # unknown ids, bad n, a full pool: refused
        self._reserved([seq_id], n)
        return plan

    def commit(self, seq_ids, tokens) -> None:
        """The token ids of the oldest slots :meth:`reserve` gave ``seq_ids``; a full block
        is named now. A sequence named ``k`` times gives its ``k`` oldest slots their ids,
        in order. A sequence freed since its reservation is skipped. All or nothing: ids
        for more slots than a sequence has pending are refused before any is taken."""
        ids, tokens = list(seq_ids), token_ids(tokens)
        if len(ids) != len(tokens):
            raise ConfigError(f"commit: one token per sequence, got {len(tokens)} for "
                              f"{len(ids)}")
        live = [(seq_id, t) for seq_id, t in zip(ids, tokens) if seq_id in self._tail]
        for seq_id, k in Counter(seq_id for seq_id, _ in live).items():
            if k > self._pending_of(seq_id):
                raise ConfigError(f"commit: sequence {seq_id!r} has no reserved slot for "
                                  f"its id(s): {k} given, {self._pending_of(seq_id)} pending")
        for seq_id, token in live:
            self._commit_one(seq_id, token)

    def commit_landed(self, seq_ids, tokens) -> None:
        """Tokens as they land, each its sequence's newest: those whose slot is reserved
        and pending are committed (in order); the others are not the manager's yet (their
        slot will be reserved with the id known) and are passed over."""
        held, tails = self.__dict__.get("_pending"), self._tail
        if not held:
            return
        for seq_id, token in zip(seq_ids, tokens):
            entry = held.get(seq_id)
            if entry is not None and entry[1] and entry[0] is tails.get(seq_id):
                self._commit_one(seq_id, int(token))

    def _commit_one(self, seq_id, token: int) -> None:
        """Give the oldest pending slot of ``seq_id`` (it has one) its token id, naming a
        block it fills."""
        held = self.__dict__["_pending"]
        entry = held[seq_id]
        entry[1] -= 1
        if not entry[1]:
            del held[seq_id]
        tail = entry[0]
        tail.append(token)
        if len(tail) == self.block_size:
            self._cache_full_blocks(seq_id)

    def _committed(self, seq_id) -> int:
        """Tokens of the sequence whose ids the manager knows (pending slots excluded)."""
        return self.num_tokens(seq_id) - self._pending_of(seq_id)

    def truncate(self, seq_id, n: int, tokens=None) -> None:
        """Keep the sequence's first ``n`` tokens (a rewind; see the module's docstring).
        At least one token stays (as ``add`` takes at least one; ``free`` takes them all).
        With pending slots, only they can go (the newest first): ``n`` must be at least the
        count of committed tokens, since cutting those would leave the pending slots'
        step computed on tokens that are gone. ``tokens`` (the sequence's first ``n`` ids)
        is needed only when the cut falls inside a block the sequence had filled, whose
        ids the manager keeps only as its hash; where it keeps the ids they must agree.
        All or nothing: bad input raises and changes nothing."""
        length = self.num_tokens(seq_id)          # an unknown id is reported first
        n = count(n, "the number of tokens to keep")
        pending = self._pending_of(seq_id)
        known, bs, tail = length - pending, self.block_size, self._tail[seq_id]
        if n > length:
            raise TokenIndexError(f"cannot keep {n} tokens: the sequence has {length}")
        if n == 0:
            raise ConfigError(f"truncate {seq_id!r} to 0 tokens: a sequence here keeps at "
                              f"least one, as add does (its last token's logits choose the "
                              f"next); free it instead")
        if pending and n < known:
            raise ConfigError(f"truncate {seq_id!r} to {n} tokens: it has {pending} pending "
                              f"slot(s) after {known} committed tokens; drop only pending "
                              f"slots (n >= {known}), or commit them first")
        start, held = n // bs * bs, known // bs * bs   # the ids held: tokens held..known
        deep = start < held and start < n     # the cut leaves a block it had filled partly
        ids = None if tokens is None else token_ids(tokens)
        if ids is not None and len(ids) != n:
            raise ConfigError(f"truncate {seq_id!r} to {n} tokens: tokens are the sequence's "
                              f"first {n} ids, got {len(ids)}")
        upto = min(n, known)                      # the committed tokens that stay
        if ids is not None and ids[held:upto] != tail[:max(upto - held, 0)]:
            raise ConfigError(f"truncate {seq_id!r}: tokens disagree with the ids the manager "
                              f"holds for tokens {held} to {upto - 1}")
        if deep and ids is None:
            raise ConfigError(f"truncate {seq_id!r} to {n} tokens cuts into block {n // bs}, "
                              f"whose ids live on only in its hash: pass the sequence's first "
                              f"{n} ids as tokens")
        # --- from here on nothing can fail
        if deep:                                  # no longer the tokens its hash names
            self.cache.forget(int(self.block_table(seq_id)[n // bs]))
        self.pages.truncate(seq_id, n)
        if n < known:                   # (in place: a reservation knows the list)
            tail[:] = ids[start:n] if deep else tail[:max(n - held, 0)]
            del self._hashes[seq_id][n // bs:], self._serials[seq_id][n // bs:]
        elif n == known and pending:
            del self._reservations()[seq_id]
        elif pending:
            self._reservations()[seq_id][1] = n - known
