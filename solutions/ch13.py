"""Chapter 13 (scheduling under load): how many steps a long prompt takes to its first token
under a token budget, and the budget that brings it there in a given number of steps."""
from __future__ import annotations

import itertools
import math

from pagedkv import sim

__all__ = ["steps_to_first_token", "budget_for"]


def steps_to_first_token(prompt: int, running: int, budget: int) -> int:
    """Steps a ``prompt``-token request needs to finish its prefill, admitted into a step
    where ``running`` requests decode one token each under a token ``budget``. Each step
    leaves ``budget - running`` tokens for its chunk; the last chunk must fit with the
    request's own first decode token, so the prompt and that token take
    ``ceil((prompt + 1) / (budget - running))`` steps."""
    room = budget - running
    if room < 2:
        raise ValueError(f"a budget of {budget} beside {running} decodes leaves no room "
                         f"for a chunk and its decode token")
    return math.ceil((prompt + 1) / room)


def budget_for(prompt: int, running: int, steps: int) -> int:
    """The smallest budget with which a ``prompt``-token request, beside ``running``
    decodes, finishes its prefill within ``steps`` steps: ``running`` for the decodes plus
    ``ceil((prompt + 1) / steps)`` for the chunks."""
    return running + max(2, math.ceil((prompt + 1) / steps))


# ------------------------------------------------------------------------------------ checks
def _served(prompt: int, running: int, budget: int) -> int:
    """The steps, counted by the simulation (the shared scheduler, chunked prefill), from
    the long request's admission to its first decode: ``running`` requests are decoding
    when it arrives, and the pool is large enough for everyone."""
    reqs = [sim.Request(i, 0, 1, 400) for i in range(running)]
    reqs.append(sim.Request(running, 5, prompt, 2))     # (after they all started)
    wl = sim.Workload("exercise", tuple(reqs), max(r.total for r in reqs), 0)
    grew = []

    class Watch(sim.Observer):
        def stepped(self, step, batch, queue, refused):
            if running in batch.ids:
                grew.append(int(batch.lens[batch.ids.index(running)]))
    policy = sim.make_policy("paged:16", 64 * sim.MiB, wl.max_len)
    sim.serve(wl, policy, max_seqs=running + 1, token_budget=budget, chunked_prefill=True,
              observers=[Watch()])
    return next(i for i, n in enumerate(grew) if n > prompt) + 1


def check_steps_to_first_token(impl=steps_to_first_token, seed=15):
    """Against the simulation for a grid of prompts, decodes and budgets."""
    print(f"seed={seed} (the grid is fixed)")
    for prompt, running, budget in itertools.product((1, 30, 64, 100), (0, 3, 8),
                                                     (12, 33, 64)):
        want = _served(prompt, running, budget)
        got = impl(prompt, running, budget)
        assert got == want, (prompt, running, budget, got, want)
    return {"cases": 36}


def check_budget_for(impl=budget_for, seed=15):
    """The budget it gives reaches the first token within the steps (by the simulation),
    and one token less does not."""
    print(f"seed={seed} (the grid is fixed)")
    for prompt, running, steps in itertools.product((10, 63, 100), (0, 4), (1, 2, 5)):
        b = impl(prompt, running, steps)
        assert _served(prompt, running, b) <= steps, (prompt, running, steps, b)
        if b - running > 2:
            assert _served(prompt, running, b - 1) > steps, (prompt, running, steps, b)
    return {"cases": 18}


# ---------------------------------------------------- wrong answers the checks must reject
def _without_the_decode_token(prompt, running, budget):
    return math.ceil(prompt / (budget - running))


def _decodes_not_charged(prompt, running, budget):
    return math.ceil((prompt + 1) / budget)


def _budget_without_decodes(prompt, running, steps):
    return max(2, math.ceil((prompt + 1) / steps))


def _budget_one_short(prompt, running, steps):
    return running + max(2, math.ceil(prompt / steps))


WRONG = {
    "steps_to_first_token": [_without_the_decode_token, _decodes_not_charged],
    "budget_for": [_budget_without_decodes, _budget_one_short],
}
