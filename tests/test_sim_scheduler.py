"""``sim.serve(scheduler=...)``: the class that decides is the caller's choice, a subclass
of the shared Scheduler; the default is that Scheduler."""
import pytest

from pagedkv import sim
from pagedkv.errors import ConfigError
from pagedkv.scheduler import Scheduler


def _serve(**kw):
    trace = sim.make_workload("chat", n=40, seed=3, rate=0.5)
    policy = sim.make_policy("paged:16", 16 * sim.MiB, trace.max_len)
    return sim.serve(trace, policy, token_budget=256, chunked_prefill=True, **kw)


def test_the_default_is_the_shared_scheduler():
    a, b = _serve(), _serve(scheduler=Scheduler)
    assert a.completions == b.completions == 40
    for name in a.series:
        assert (a.series[name] == b.series[name]).all(), name


def test_a_subclass_decides():
    made = []

    class Counting(Scheduler):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)
            self.steps = 0

        def schedule(self):
            plan = super().schedule()
            self.steps += bool(self.running)      # a step the simulation counts
            return plan

    run = _serve(scheduler=Counting)
    assert len(made) == 1 and made[0].steps == len(run.series["running"])


@pytest.mark.parametrize("bad", [object, "Scheduler",
                                 Scheduler(sim.PolicyMemory(None, None, None))])
def test_anything_else_is_refused(bad):
    with pytest.raises(ConfigError, match="scheduler must be Scheduler"):
        _serve(scheduler=bad)
