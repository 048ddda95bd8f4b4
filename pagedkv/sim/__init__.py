"""The multi-sequence simulation: many completions served from one pool, K/V written.

* :mod:`~pagedkv.sim.workloads` — requests drawn from a named preset with a fixed seed;
* :mod:`~pagedkv.sim.kvdata` — the K/V data path: a manager and the bytes it manages,
  every token written and read back through its page table;
* :mod:`~pagedkv.sim.policies` — paging, and the contiguous reservations that came
  before it, behind one interface;
* :mod:`~pagedkv.sim.serving` — the continuous-batching loop, :func:`serve`, on the
  scheduler the engine uses too (:mod:`pagedkv.scheduler`);
* :mod:`~pagedkv.sim.preemption` — preemption by swap, or none (the worst case reserved),
  beside recompute;
* :mod:`~pagedkv.sim.measure` — observers that measure the loop from outside;
* :mod:`~pagedkv.sim.report` — the chapter's runs, and their numbers as text;
* :mod:`~pagedkv.sim.sharing` — beam search and parallel sampling, copy-on-write.
"""
from .kvdata import BOOKKEEPING, SIM_SPEC, CheckedKV, check_bookkeeping, token_values
from .measure import SERIES, ManagerProbe, Observer, Observers, Recorder, Run
from .policies import POLICY_NAMES, PagedPolicy, Policy, ReservationPolicy, make_policy
from .preemption import (Latency, ReservePolicy, SwapPolicy, compare_preemption,
                         preemption_table)
from .report import (MiB, compare_policies, dashboard, memory_needed, memory_table,
                     scale_run, simulate, work_table)
from .serving import TOKEN_BUDGET, PolicyMemory, Queue, Running, newest, serve
from .sharing import beam_children, beam_search, parallel_sampling, sharing_savings
from .workloads import PRESETS, Request, Workload, make_workload

__all__ = ["Request", "Workload", "PRESETS", "make_workload", "SIM_SPEC", "BOOKKEEPING",
           "check_bookkeeping", "token_values", "CheckedKV", "Policy", "PagedPolicy",
           "ReservationPolicy", "make_policy", "POLICY_NAMES", "TOKEN_BUDGET", "Queue",
           "Running", "PolicyMemory", "serve", "newest", "Observer", "Observers", "Recorder",
           "ManagerProbe", "Run", "SERIES", "MiB", "simulate", "dashboard",
           "compare_policies", "memory_table", "work_table", "scale_run", "memory_needed",
           "beam_children", "beam_search", "parallel_sampling", "sharing_savings",
           "SwapPolicy", "ReservePolicy", "Latency", "compare_preemption", "preemption_table"]
