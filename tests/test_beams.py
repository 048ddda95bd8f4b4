"""The one beam-search step (pagedkv.beams.follow) against a trivially correct model: for
random parent lists (fixed, printed seed), the first child of each parent is the parent,
every further child is a fork of it in order, and exactly the beams without a child are
freed, after every fork."""
import random

from pagedkv.beams import follow


def test_follow_against_a_by_hand_model():
    seed = 7
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(500):
        beams = [f"b{i}" for i in range(rng.randint(1, 6))]
        parents = [rng.randrange(len(beams)) for _ in range(rng.randint(1, 8))]
        events = []

        def fork(parent, j):
            events.append(("fork", parent, j))
            return f"{parent}/{j}"

        def free(beam):
            events.append(("free", beam))

        got = follow(beams, parents, fork, free)
        seen, want, forks = set(), [], []
        for j, i in enumerate(parents):
            if i in seen:
                want.append(f"{beams[i]}/{j}")
                forks.append(("fork", beams[i], j))
            else:
                seen.add(i)
                want.append(beams[i])
        frees = [("free", b) for i, b in enumerate(beams) if i not in seen]
        assert got == want
        assert events == forks + frees        # every fork before any free


def test_a_parent_with_no_children_is_freed_and_nothing_else():
    freed = []
    got = follow(["a", "b", "c"], [2, 2, 0], lambda p, j: p + "'", freed.append)
    assert got == ["c", "c'", "a"] and freed == ["b"]
