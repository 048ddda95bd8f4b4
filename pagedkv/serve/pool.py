"""The pool as the server shows it: a map of one character a block, and its counts.

A stream that asks for it (the chat page's ``"pool": true``) gets maps seen from its own
request; ``GET /pool`` gets the whole pool's, with the queues and, with ``--audit``, the
manager's audit. Both are made where the engine runs, between steps.
"""
from __future__ import annotations

__all__ = ["pool_map", "pool_counts", "pool_report", "FREE", "CACHED", "MINE", "SHARED",
           "OTHERS", "USED"]

# one character a block
FREE, CACHED, MINE, SHARED, OTHERS, USED = ".", "c", "m", "s", "o", "u"


def pool_map(manager, owners: dict, me=None) -> str:
    """The pool as a string, one character a block: free, cached idle (the prefix cache
    keeps it, nobody maps it), and for a block somebody maps: with ``me``, mine alone,
    shared (mine and another sequence's) or others'; without, used or shared. ``owners``
    maps a block to the set of requests whose sequences map it. O(blocks)."""
    alloc = manager.allocator
    refs = alloc.refcounts().tolist()
    idle = alloc.is_idle
    out = []
    for b, r in enumerate(refs):
        if r == 0:
            out.append(CACHED if idle(b) else FREE)
        elif me is None:
            out.append(SHARED if r > 1 else USED)
        elif me in owners.get(b, ()):
            out.append(SHARED if r > 1 else MINE)
        else:
            out.append(OTHERS)
    return "".join(out)


def pool_counts(manager) -> dict:
    """Blocks in use, free and cached idle, from the allocator's counters (O(1); cached
    idle blocks count as free to the allocator: they are handed out when the free list is
    empty)."""
    alloc = manager.allocator
    total, free, cached = alloc.num_blocks, alloc.num_free, alloc.num_idle
    return {"total": total, "used": total - free, "free": free - cached, "cached": cached}


def pool_report(engine, audit: bool) -> dict:
    """What ``GET /pool`` shows: the map, the counts, the cache's dtype and a block's bytes,
    the queues, and the manager's audit
    if ``audit`` (O(blocks) either way: ask rarely)."""
    m = engine.memory.manager
    answer = "not run (start the server with --audit)"
    if audit:
        try:
            m.audit()
            answer = "ok"
        except Exception as exc:  # noqa: BLE001 (reported, not raised)
            answer = f"{type(exc).__name__}: {exc}"
    return dict(blocks=pool_map(m, {}), audit=answer, **pool_counts(m),
                block_size=engine.config.block_size, kv_dtype=engine.runner.kv.spec.dtype,
                block_bytes=m.allocator.block_bytes, running=len(engine.scheduler.running),
                waiting=len(engine.scheduler.waiting), sequences=len(m.seq_ids))
