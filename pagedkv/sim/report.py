"""Runs put together, and their numbers as text: the chapter's simulation and its
dashboard, the same trace served by every policy, and a large bookkeeping-only run.

Every line printed here fits in 88 columns, and nothing printed depends on the machine.
"""
from __future__ import annotations

import numpy as np

from .measure import ManagerProbe, Run
from .policies import POLICY_NAMES, PagedPolicy, make_policy
from .serving import TOKEN_BUDGET, serve
from .workloads import Workload, make_workload

__all__ = ["MiB", "simulate", "dashboard", "compare_policies", "memory_table",
           "work_table", "scale_run", "memory_needed"]

MiB = 1 << 20

#: Host bytes a request costs a run, besides the pool: the Request object and its ints,
#: its place in the workload, the queue and the length draws (measured about 200;
#: rounded up).
REQUEST_BYTES = 256


def memory_needed(preset: str, n: int, max_seqs: int, pool_bytes: int) -> int:
    """About how many bytes of host memory serving ``n`` requests of ``preset``,
    ``max_seqs`` at a time, takes: the pool, each request, and each decode step's
    record (one int64 per series). A run lasts about ``n * mean output / max_seqs``
    steps (more when the pool, not ``max_seqs``, limits the batch: this is a lower
    bound)."""
    from .measure import SERIES
    from .workloads import PRESETS
    out = PRESETS[preset]["output"]
    mean_output = (out[1] + out[2]) / 2 if out[0] == "uniform" else out[1]
    steps = n * (mean_output / max_seqs + 1)
    return int(pool_bytes + n * REQUEST_BYTES + steps * 8 * len(SERIES))


def simulate(preset: str = "default", *, seed: int = 0, pool_bytes: int = 32 * MiB,
             block_size: int = 16, max_seqs: int = 8, n: int | None = None,
             rate: float | None = None, write: bool = True, audit_every: int = 50,
             observers=(), bookkeeping: str = "teaching") -> Run:
    """The chapter's simulation: ``preset``'s requests served ``max_seqs`` at a time
    from a paged pool, every token's K/V written (``write``) and checked when its
    request finishes, the manager audited every ``audit_every`` steps and its
    statistics checked every 25."""
    wl = make_workload(preset, n=n, seed=seed, rate=rate)
    policy = PagedPolicy(pool_bytes, block_size, write=write, bookkeeping=bookkeeping,
                         max_seqs=max_seqs, max_len=wl.max_len)
    probe = ManagerProbe(policy.manager, audit_every=audit_every, stats_every=25)
    return serve(wl, policy, max_seqs=max_seqs, observers=[probe, *observers])


def dashboard(run: Run) -> str:
    """A paged run's numbers as a small text report (no timings, no device names)."""
    bs, tb, s = run.block_size, run.token_bytes, run.series
    util = s["held"] / run.pool_slots
    peak = run.peak_used
    busiest = int(np.argmax(s["held"]))
    naive = int(s["running"][busiest]) * run.max_len   # max-length, the same requests
    ifrag = (s["held"] - s["tokens"]) / np.maximum(s["held"], 1)
    efrag = s.get("external_fragmentation", np.zeros(0))
    at = run.stats_at_peak or {}
    lines = [
        f"workload {run.workload!r}, seed {run.seed}: {run.completions} completions, "
        f"at most {run.max_seqs} at a time",
        f"decode steps: {run.steps}; preemptions: {run.preemptions}",
        f"pool: {run.pool_slots * tb / MiB:.0f} MiB = {run.pool_slots // bs} blocks"
        f" x {bs} tokens x {tb} B",
        f"K/V written: {run.tokens_written} tokens ({run.tokens_generated} decode + "
        f"{run.prefill_tokens} prefill); {run.allocations} block allocations",
        f"blocks in use: at most {peak // bs}, {util.max():.3%} of the pool",
        f"internal fragmentation (unfilled slots of used blocks): "
        f"{at.get('internal_fragmentation', 0):.2%} at peak, {np.mean(ifrag):.2%} mean",
        "external fragmentation as measured (1 - longest free run / free blocks):",
        f"  max {np.max(efrag, initial=0):.4f} over {len(efrag)} samples; "
        f"it costs a paged pool nothing",
        f"paged vs max-length reservation ({run.max_len} per sequence), busiest step:",
        f"  {peak} token slots in blocks vs {naive} reserved ({naive / peak:.2f}x)",
        f"verification: {run.verified_tokens} tokens read back through page tables, "
        f"{run.corrupted_tokens} corrupted",
    ]
    return "\n".join(lines)


def compare_policies(workload: Workload, pool_bytes: int, *,
                     block_sizes=(1, 8, 16, 32, 128), others=POLICY_NAMES,
                     max_seqs: int = 256, token_budget: int = TOKEN_BUDGET) -> list[Run]:
    """The same trace served by each paged block size and each reservation policy."""
    runs = []
    for name in [f"paged:{b}" for b in block_sizes] + list(others):
        options = {"max_seqs": max_seqs} if name.startswith("paged") else {}
        policy = make_policy(name, pool_bytes, workload.max_len, **options)
        runs.append(serve(workload, policy, max_seqs=max_seqs, token_budget=token_budget))
    return runs


def memory_table(runs, busy: bool = True) -> str:
    """Per policy: the time-averaged shares of the pool in each memory category."""
    rows = [f"{'policy':<17}{'tokens':>8}{'reserved':>10}{'internal':>10}{'external':>10}"
            f"{'free':>8}"]
    for r in runs:
        b = r.breakdown(busy)
        rows.append(f"{r.policy:<17}{b['tokens']:>8.1%}{b['reserved']:>10.1%}"
                    f"{b['internal']:>10.1%}{b['external']:>10.1%}{b['free']:>8.1%}")
    return "\n".join(rows)


def work_table(runs) -> str:
    """Per policy: most requests run at once, steps to finish, preemptions, and the
    tokens computed (prefills, recomputations included, and decodes) with the
    recomputed share."""
    rows = [f"{'policy':<17}{'peak seqs':>10}{'steps':>7}{'preempted':>10}"
            f"{'computed':>10}{'recomputed':>12}{'share':>7}"]
    for r in runs:
        rows.append(f"{r.policy:<17}{r.peak_running:>10}{r.steps:>7}{r.preemptions:>10}"
                    f"{r.tokens_computed:>10}{r.recomputed_tokens:>12}"
                    f"{r.recomputed_tokens / r.tokens_computed:>7.1%}")
    return "\n".join(rows)


def scale_run(n: int = 10_000, *, preset: str = "chat", seed: int = 0,
              pool_bytes: int = 256 * MiB, block_size: int = 16, max_seqs: int = 256,
              bookkeeping: str = "teaching") -> Run:
    """``n`` completions, bookkeeping only (no K/V written): how fast it serves."""
    wl = make_workload(preset, n=n, seed=seed)
    policy = PagedPolicy(pool_bytes, block_size, write=False, bookkeeping=bookkeeping,
                         max_seqs=max_seqs, max_len=wl.max_len)
    return serve(wl, policy, max_seqs=max_seqs)
