"""One step of beam search, as the memory sees it: which beams continue, fork or go.

Beam search keeps ``width`` hypotheses. At each step every beam proposes candidates, the
best ``width`` survive, and each survivor names its parent beam. A parent's first surviving
candidate continues the beam itself; every further one is a **fork** (a new sequence that
shares the parent's blocks, copy-on-write); a beam that no survivor descends from is
**pruned**. The simulation (:func:`pagedkv.sim.beam_search`) and the model engine
(:class:`pagedkv.model.engine.Engine`) both take that step through :func:`follow`.
"""
from __future__ import annotations

__all__ = ["follow"]


def follow(beams: list, parents, fork, free) -> list:
    """The beams after one step whose survivors descend from ``parents`` (indices into
    ``beams``, one per survivor, in order): a parent's first survivor is the parent itself,
    each further one is ``fork(parent, j)`` (``j``: the survivor's place in ``parents``),
    and every beam no survivor descends from is given to ``free``, after the forks.
    Returns the new beams, one per survivor."""
    new, taken = [], set()
    for j, i in enumerate(parents):
        if i in taken:
            new.append(fork(beams[i], j))
        else:
            taken.add(i)
            new.append(beams[i])
    for i, beam in enumerate(beams):
        if i not in taken:
            free(beam)
    return new
