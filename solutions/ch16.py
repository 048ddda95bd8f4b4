"""Chapter 16 (from pagedkv to vLLM and SGLang): a free list in the order vLLM's
prefix-caching test expects, orphaned cache blocks, the blocks a sliding window keeps, and a
radix tree with pages.

The first part holds what the chapter itself runs and shows, written for the chapter and kept
out of the package: a manager that frees head first (the order pagedkv and vLLM avoid), the
eviction experiment, a radix tree small enough to read, the chat trace and its replay. The
exercises reuse them.
"""
from __future__ import annotations

import random
from collections import deque

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.checks import cdiv, positive_int
from pagedkv.errors import OutOfBlocks
from pagedkv.prefix_cache import PrefixCachingManager

from ._seeds import names_its_seed

__all__ = ["QueueAllocator", "orphans", "window_blocks", "PagedRadixTree"]


# ------------------------------------------------------------- what the chapter runs and shows
class HeadFirst(PrefixCachingManager):
    """Frees a finished sequence's blocks first block first: the natural order, which pagedkv
    and vLLM both avoid (kept here to measure what it costs)."""

    def free(self, seq_id):
        self._table(seq_id).blocks.reverse()   # dropped next: only the order changes
        super().free(seq_id)                   # (which frees the last block first)


def cache_then_take(manager_class, taken: int, bs: int = 4, full_blocks: int = 8):
    """Cache a prompt of `full_blocks` full blocks and one more token, free it,
    then let an unrelated request take `taken` of its blocks and leave. Returns
    (manager, prompt)."""
    m = manager_class(BlockAllocator(full_blocks + 1, bs * 4), bs)
    prompt = list(range(full_blocks * bs + 1))
    m.add("a", prompt)
    m.free("a")
    m.add("b", [10_000 + t for t in range((taken + 1) * bs)])  # 1 fresh + `taken`
    m.free("b")
    return m, prompt


def found_again(manager_class, taken: int, bs: int = 4, full_blocks: int = 8) -> int:
    """The experiment of `cache_then_take`, then the prompt admitted again: the
    number of its tokens found in the cache."""
    m, prompt = cache_then_take(manager_class, taken, bs, full_blocks)
    found = m.add("a again", prompt).cached_tokens
    m.audit()
    return found


class RadixNode:
    """The run of tokens on the edge into this node; children by their first token."""
    __slots__ = ("tokens", "children")

    def __init__(self, tokens=()):
        self.tokens, self.children = tuple(tokens), {}


def common_length(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixTree:
    """Every inserted token sequence, each distinct prefix stored once."""

    def __init__(self):
        self.root = RadixNode()

    def match(self, tokens) -> int:
        """How many leading tokens of `tokens` some inserted sequence shares."""
        node, i = self.root, 0
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            k = common_length(child.tokens, tokens[i:])
            i += k
            if k < len(child.tokens):
                break                       # the match ends inside this edge
            node = child
        return i

    def insert(self, tokens) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:               # nothing starts like this: a new leaf
                node.children[tokens[i]] = RadixNode(tokens[i:])
                return
            k = common_length(child.tokens, tokens[i:])
            if k < len(child.tokens):       # split the edge after its first k tokens
                head = RadixNode(child.tokens[:k])
                child.tokens = child.tokens[k:]
                head.children[child.tokens[0]] = child
                node.children[tokens[i]] = child = head
            node, i = child, i + k


def chat_trace(seed: int = 0, conversations: int = 4, turns: int = 2) -> list:
    """Conversations that share a system prompt of 37 tokens, each turn's prompt
    being the whole conversation so far plus a question: a list of (request,
    prompt, answer)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, 37).tolist()
    history, trace = {}, []
    for turn in range(turns):
        for c in range(conversations):
            question = rng.integers(0, 1000, int(rng.integers(6, 20))).tolist()
            answer = rng.integers(0, 1000, int(rng.integers(10, 30))).tolist()
            prompt = history.get(c, system) + question
            trace.append((f"c{c}t{turn}", prompt, answer))
            history[c] = prompt + answer
    return trace


def replay(trace, block_size: int, tree=None) -> list:
    """Per request: (name, prompt length, found by the radix tree, found by us).
    Both leave the prompt's last token to compute: the tree matches all but it."""
    manager = PrefixCachingManager(BlockAllocator(4096, block_size * 4), block_size)
    tree, rows = RadixTree() if tree is None else tree, []
    for name, prompt, answer in trace:
        by_tree = tree.match(prompt[:-1])
        by_blocks = manager.add(name, prompt).cached_tokens
        tree.insert(prompt)
        for token in answer:
            manager.step([name], [token])
        tree.insert(prompt + answer)
        manager.free(name)
        rows.append((name, len(prompt), by_tree, by_blocks))
    manager.audit()
    return rows


def test_prefill_order(allocator_class=BlockAllocator):
    """The scenario of vLLM's ``test_prefill`` (the chapter's cell): three full blocks
    cached, hit by a second request while the first runs and by a third after both
    left, then a request that needs the whole pool. Returns (the tokens each of the
    three found, the blocks the last one takes)."""
    pm = PrefixCachingManager(allocator_class(10, 16 * 4, xp=np), block_size=16)
    common = [i for i in range(3) for _ in range(16)]
    found = [pm.add("0", common + [3] * 7).cached_tokens,
             pm.add("1", common + [3] * 5).cached_tokens]
    pm.free("0")
    pm.free("1")
    found.append(pm.add("2", common + [3] * 6).cached_tokens)
    pm.free("2")
    pm.add("3", [99] * 160)
    pm.audit()
    return found, pm.block_table("3").tolist()


VLLM_TEST_ORDER = [b - 1 for b in [7, 8, 9, 10, 4, 5, 6, 3, 2, 1]]   # asserted by the test


# ------------------------------------------------------------------------------- the solutions
class QueueAllocator(BlockAllocator):
    """A :class:`~pagedkv.allocator.BlockAllocator` whose free list is a queue, as
    nano-vllm's deque and vLLM's free queue at ``717aebb``: a block whose last owner
    leaves goes to the far end, so the block freed longest ago is reused first."""

    def __init__(self, num_blocks: int, block_bytes: int, *, xp=None):
        super().__init__(num_blocks, block_bytes, xp=xp)
        self._free = deque(self._free)           # the next one out still at the right

    def free(self, block: int) -> None:
        super().free(block)                            # (on top, if its last owner left)
        if self._refcount[int(block)] == 0:
            self._free.appendleft(self._free.pop())    # to the bottom: reused last

def orphans(cache) -> list:
    """The idle blocks of a :class:`~pagedkv.prefix_cache.CachedBlocks` that no
    lookup can reach any more: a lookup walks a chain from its first block, so a
    block is lost once any block before it in its chain (followed by parent serial
    numbers) is no longer cached."""
    by_serial = {entry.serial: entry for entry in cache._entry.values()}

    def reachable(entry) -> bool:
        while entry.parent:                      # 0: the first block of its sequence
            entry = by_serial.get(entry.parent)
            if entry is None:
                return False
        return True

    return sorted(b for b in cache._idle if not reachable(cache._entry[b]))


def window_blocks(num_tokens: int, window: int, block_size: int) -> range:
    """The logical blocks a sliding-window layer keeps after `num_tokens` tokens:
    those that hold any of the last `window` tokens, positions max(0, n - window)
    to n - 1."""
    first = max(0, num_tokens - window)
    return range(first // block_size, cdiv(num_tokens, block_size))


class PagedRadixTree(RadixTree):
    """A radix tree whose matches count whole pages of `page_size` tokens only, as
    SGLang's does with pages larger than a token."""

    def __init__(self, page_size: int):
        super().__init__()
        self.page_size = positive_int(page_size, "page_size")

    def match(self, tokens) -> int:
        return super().match(tokens) // self.page_size * self.page_size


# ------------------------------------------------------------------------------------ checks
@names_its_seed
def check_QueueAllocator(impl=QueueAllocator, seed=17, trials=60, ops=80):
    """vLLM's ``test_prefill`` block for block; random allocations, shares and frees
    against a deque (out on the left, back on the right) with the audit after each;
    and random prefix-caching runs over it and over the stack: the same tokens found
    at every admission, the same refusals and evictions (the order changes which block
    a request gets, not what the cache finds)."""
    found, order = test_prefill_order(impl)
    assert found == [0, 48, 48] and order == VLLM_TEST_ORDER, (found, order)
    rng = random.Random(seed)
    for _ in range(trials):
        n = rng.randrange(1, 12)
        alloc, queue, owners = impl(n, 8, xp=np), deque(range(n)), [0] * n
        for _ in range(ops):
            held = [b for b in range(n) if owners[b]]
            op = rng.choice(["allocate", "allocate_n", "free", "free_n", "share"])
            if op == "allocate" and queue:
                want = queue.popleft()
                owners[want] = 1
                assert alloc.allocate() == want, ("allocate", want)
            elif op == "allocate_n" and queue:
                k = rng.randrange(1, len(queue) + 1)
                want = [queue.popleft() for _ in range(k)]
                for b in want:
                    owners[b] = 1
                assert alloc.allocate_n(k) == want, ("allocate_n", want)
            elif op in ("free", "free_n") and held:
                blocks = rng.sample(held, rng.randrange(1, len(held) + 1))
                for b in blocks:
                    owners[b] -= 1
                    if owners[b] == 0:
                        queue.append(b)
                alloc.free(blocks[0]) if op == "free" and len(blocks) == 1 \
                    else alloc.free_n(blocks)
            elif op == "share" and held:
                b = rng.choice(held)
                owners[b] += 1
                alloc.share(b)
            alloc.audit()
            assert alloc.num_free == len(queue) and alloc.refcounts().tolist() == owners
    for _ in range(trials):
        bs = rng.choice([1, 2, 4])
        size = rng.randrange(4, 14)
        ours, theirs = (PrefixCachingManager(cls(size, bs * 4, xp=np), bs)
                        for cls in (BlockAllocator, impl))
        stems = [[rng.randrange(30) for _ in range(12)] for _ in range(3)]
        live = []
        for op in range(ops):
            if live and rng.random() < 0.4:
                seq = live.pop(rng.randrange(len(live)))
                ours.free(seq)
                theirs.free(seq)
                continue
            tokens = rng.choice(stems)[:rng.randrange(1, 13)] + [
                rng.randrange(30) for _ in range(rng.randrange(0, 5))]
            got = []
            for m in (ours, theirs):
                try:
                    got.append(m.add(op, tokens).cached_tokens)
                except OutOfBlocks:
                    got.append(None)
            assert got[0] == got[1], (bs, size, tokens, got)
            if got[0] is not None:
                live.append(op)
            assert ours.cache.evictions == theirs.cache.evictions
        theirs.audit()
    return {"vLLM's order": order == VLLM_TEST_ORDER,
            "allocator runs": trials, "prefix-caching runs": trials}


def _reachable_by_lookup(manager, sequences) -> set:
    """Blocks that a prompt made of one of `sequences` (and one more token) would hit."""
    found = set()
    for tokens in sequences:
        found.update(manager._find_prefix(list(tokens) + [0])[0])
    return found


@names_its_seed
def check_orphans(impl=orphans, seed=14, runs=60, ops=60):
    """The chapter's experiment by hand (head first: every block after the evicted ones is
    lost; tail first, pagedkv's order: none), then random runs of requests with shared
    prefixes in a small pool, freed head first so that orphans arise, against a brute-force
    oracle: every sequence ever cached looked up again."""
    for k in range(9):
        head, _ = cache_then_take(HeadFirst, k)
        tail, _ = cache_then_take(PrefixCachingManager, k)
        assert len(impl(head.cache)) == (8 - k if 0 < k < 8 else 0), ("head first", k)
        assert impl(tail.cache) == [], ("tail first", k)
    rng = random.Random(seed)
    lost = 0
    for _ in range(runs):
        bs = rng.choice([1, 2, 4])
        m = HeadFirst(BlockAllocator(rng.randrange(6, 16), bs * 4), bs)   # orphans arise
        stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
        seen, live = [], []
        for op in range(ops):
            if live and rng.random() < 0.4:
                m.free(live.pop(rng.randrange(len(live))))   # (its tokens: in seen)
            else:
                stem = rng.choice(stems)
                tokens = stem[:rng.randrange(1, 13)] + [rng.randrange(50)
                                                       for _ in range(rng.randrange(0, 6))]
                try:
                    m.add(op, tokens)
                except Exception:                # the pool is full: try something else
                    continue
                live.append(op)
                seen.append(tokens)
            idle = set(m.cache._idle)
            want = sorted(idle - _reachable_by_lookup(m, seen))
            assert list(impl(m.cache)) == want, (bs, want)
            lost += len(want)
        m.audit()
    assert lost > 0, "no run lost a block: the random runs test nothing"
    return {"runs": runs, "orphans seen": lost}


@names_its_seed
def check_window_blocks(impl=window_blocks, seed=15):
    """Against a scan of token positions for every length up to 200, and the bound
    cdiv(window - 1, block_size) + 1."""
    rng = random.Random(seed)
    cases = [(w, bs) for w in (1, 2, 5, 16, 17, 64) for bs in (1, 2, 4, 16)]
    cases += [(rng.randrange(1, 100), rng.randrange(1, 20)) for _ in range(30)]
    for window, bs in cases:
        for n in range(201):
            want = sorted({t // bs for t in range(max(0, n - window), n)})
            got = list(impl(n, window, bs))
            assert got == want, (n, window, bs, got, want)
            assert len(got) <= cdiv(window - 1, bs) + 1
    return {"window and block sizes": len(cases), "lengths each": 201}


@names_its_seed
def check_PagedRadixTree(impl=PagedRadixTree, seed=16, trials=200):
    """Against a brute-force match (the longest common prefix with any inserted sequence,
    rounded down to pages), then request by request against our blocks of the same size on
    chat traces."""
    rng = random.Random(seed)
    for _ in range(trials):
        page = rng.choice([1, 2, 4, 16])
        tree, inserted = impl(page), []
        for _ in range(rng.randrange(1, 8)):
            base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
            seq = base[:rng.randrange(len(base) + 1)] + [rng.randrange(5)
                                                         for _ in range(rng.randrange(1, 30))]
            tree.insert(seq)
            inserted.append(seq)
            query = rng.choice(inserted)[:rng.randrange(40)] + [rng.randrange(5)]
            best = max(common_length(query, s) for s in inserted)
            assert tree.match(query) == best // page * page, (page, query)
    for trace_seed in range(3):
        trace = chat_trace(trace_seed)
        for page in (4, 16):
            for name, _, by_tree, by_blocks in replay(trace, page, impl(page)):
                assert by_tree == by_blocks, (trace_seed, page, name, by_tree, by_blocks)
    return {"trees": trials, "chat traces": 3}


# ---------------------------------------------------- wrong answers the checks must reject
def _orphans_parent_only(cache):
    """Only blocks whose own parent is gone: misses the rest of a broken chain."""
    serials = {entry.serial for entry in cache._entry.values()}
    return sorted(b for b in cache._idle
                  if cache._entry[b].parent and cache._entry[b].parent not in serials)


def _orphans_by_block_id(cache):
    """Follows parents by block id order instead of serial numbers."""
    return sorted(b for b in cache._idle if b - 1 >= 0 and b - 1 not in cache._entry
                  and cache._entry[b].parent)


def _window_from_a_negative_block(num_tokens, window, block_size):
    return range((num_tokens - window) // block_size, cdiv(num_tokens, block_size))


def _window_of_whole_blocks(num_tokens, window, block_size):
    last = cdiv(num_tokens, block_size)
    return range(max(0, last - cdiv(window, block_size)), last)


def _window_one_token_too_many(num_tokens, window, block_size):
    return range(max(0, num_tokens - window - 1) // block_size, cdiv(num_tokens, block_size))


class _TreeRoundingUp(RadixTree):
    def __init__(self, page_size):
        super().__init__()
        self.page_size = page_size

    def match(self, tokens):
        return min(cdiv(super().match(tokens), self.page_size) * self.page_size, len(tokens))


class _TreeUnpaged(RadixTree):
    def __init__(self, page_size):
        super().__init__()


class _QueueUpsideDown(BlockAllocator):
    """A queue, but taken from the other end: a fresh pool hands out its last block
    first."""

    def allocate(self) -> int:
        self._check_open()
        if not self._free:
            raise OutOfBlocks(1, 0, "allocate")
        block = self._free.pop(0)
        self._refcount[block] = 1
        return block


WRONG = {
    "QueueAllocator": [BlockAllocator, _QueueUpsideDown],
    "orphans": [_orphans_parent_only, _orphans_by_block_id],
    "window_blocks": [_window_from_a_negative_block, _window_of_whole_blocks,
                      _window_one_token_too_many],
    "PagedRadixTree": [_TreeRoundingUp, _TreeUnpaged],
}
