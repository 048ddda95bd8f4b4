"""The mutation score of the engine's core and the server's, kept by mutmut (issue 44).

    python scripts/mutation.py [scheduler engine memory sampler limits core client]
        [--max-children N]

For each module: a scratch copy of the working tree's package and tests (under
``--work``, by default ``/tmp/pagedkv-mutation``), a ``setup.cfg`` that tells mutmut to
mutate that module alone and to run only its own test files, then ``mutmut run`` there
(mutmut 3 runs, for each mutant, only the tests that call the mutated function, fastest
first, stopping at the first failure). The score and every surviving mutant, with its
diff and, where it is one, why it is equivalent, go to ``perf/mutation-report.md`` (the
sections of the modules run are replaced, the others kept).

mutmut is a dev tool, pinned in ``requirements-dev.txt`` and not in CI's path: install it
into a venv of its own that can also see the project's packages, e.g.

    python3.11 -m venv /tmp/mutvenv && /tmp/mutvenv/bin/pip install -r requirements-dev.txt
    echo "$PWD/.venv/lib/python3.11/site-packages" > \\
        /tmp/mutvenv/lib/python3.11/site-packages/zz_project.pth
    MUTMUT=/tmp/mutvenv/bin/mutmut python scripts/mutation.py

(a plain path in a ``.pth`` file: the project's packages without its editable install,
so that the tests import the mutated copy).
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "perf" / "mutation-report.md"


@dataclass
class Target:
    path: str                     # the module mutated
    tests: list                   # its own test files (and pytest options for them)
    functions: list = field(default_factory=list)   # only these (none: all)
    why: str = ""


TARGETS = {
    "scheduler": Target(
        "pagedkv/scheduler.py",
        ["tests/test_scheduler.py", "tests/test_budget_swaps.py",
         "tests/test_sim_scheduler.py"]),
    "engine": Target(
        "pagedkv/model/engine.py",
        ["tests/test_overlap.py", "tests/test_engine_behaviour.py",
         "tests/test_engine_core.py"],
        why="the engine's loop, the overlapped one (depth 1) included"),
    "memory": Target(
        "pagedkv/model/memory.py",
        ["tests/test_preempt.py", "tests/test_overlap.py", "tests/test_budget_swaps.py",
         "tests/test_engine_behaviour.py", "--deselect",
         "tests/test_preempt.py::test_real_model_same_answers_with_cache_and_preemption"],
        why="admission, prefill, decode rows, preemption, swapping and the seal (the draws, "
            "and each decode row's input in the overlapped loop); the real-model test of "
            "test_preempt.py is left out (it loads SmolLM2: minutes a mutant)"),
    "sampler": Target(
        "pagedkv/kernels/sampling.py",
        ["tests/test_sampling_device.py"],
        functions=["splitmix64", "uniforms", "derive_seed", "probabilities", "thresholds",
                   "reference_rows", "sample_rows", "pack_rows", "sample_packed",
                   "kept_tokens", "_check", "_per_row", "_on_host", "_xp"],
        why="the host sampler (the NumPy path the engine draws with on a CPU) and the "
            "GPU branches of its callers, run on a CPU against a stand-in for CuPy and the "
            "kernel: every function but the kernel's launchers (_kernel, _smem_limit, "
            "_params, _launch), which need a GPU"),
    "limits": Target(
        "pagedkv/serve/limits.py",
        ["tests/test_serve_front.py", "tests/test_serve_app.py"],
        functions=["read_body", "_too_large", "protocol_class", "allowed_hosts",
                   "is_loopback", "Guard.check", "Guard._needs_key"],
        why="the server's front door, its logic: the body's size and time limits, the "
            "deadline on a request's head, the Host names, and the Origin, key and "
            "Content-Type checks. Left out for time (most tests here start a server, about 3 "
            "s a mutant on this machine): front_door, Guard.__call__ and PlainErrors, which wire "
            "Starlette's middlewares and reword their refusals, and "
            "raise_open_files_limit. Run on an in-process uvicorn server and the "
            "in-process application: the real-server tests of test_serve_limits.py run the "
            "module in a child process, where mutmut cannot see it"),
    "core": Target(
        "pagedkv/serve/core.py",
        ["tests/test_serve_core.py", "tests/test_serve_client.py", "-k", "not process"],
        functions=[f"EngineCore.{f}" for f in (
            "busy", "handle", "submit", "cancel", "stop", "step", "_failed", "_admitted",
            "_news", "problem", "_forget")] + ["run_core"],
        why="the engine's core, the successor of serve/engine_process.py that issue 44 "
            "names (split since into core.py, the loop and its failure rules, the same "
            "in the engine's process and on its thread; client.py; and transport.py, "
            "which only carries messages): submits, refusals, cancels, steps, failed "
            "steps and when the engine is dead. Left out for time: __init__, _owners and "
            "stats (the pool maps' owners and the numbers for /metrics). The tests run on "
            "the thread transport (-k 'not process'): in a child process mutmut cannot see "
            "the core"),
    "client": Target(
        "pagedkv/serve/client.py",
        ["tests/test_serve_client.py", "tests/test_serve_core.py",
         "tests/test_serve_app.py", "-k", "not process"],
        functions=[f"EngineClient.{f}" for f in (
            "submit", "cancel", "health", "request_stop", "receive", "_answer", "_steps",
            "_report", "_step_failed", "_dead", "_end_all", "_watch")],
        why="the engine's client, the HTTP side of the old serve/engine_process.py: "
            "submits and cancels in order, the watchdog, a dead or stopping engine. Left "
            "out for time: __init__, start and stop (set-up), pool and _pool_read (GET "
            "/pool's plumbing), stats and _beat (numbers for /metrics)"),
}

# Survivors judged equivalent (or out of the module's reach), by mutant name, with a piece
# of the mutated line that must still be in its diff (so a note never sticks to another
# mutant after the code moves) and why.
SAME_XP = ("splitmix64 uses its xp only for xp.uint64, and cupy.uint64 is numpy.uint64: "
           "the same call on NumPy and CuPy alike")
UINT64_LATER = ("_params casts the seeds and counters to uint64 itself: float64 zeros are "
                "the same zeros")
FLOAT64 = "astype(None) is astype(float64): the same dtype"
BUDGET_AT_0 = ("decoders never exceed the budget (each was charged in the step its prefill "
               "ended or it was swapped in), so the budget here is >= 0; at 0 a prefill's "
               "chunk is 0 tokens and is skipped either way")
LAST_LOOP = "the loop is the function's last statement: break and return end it alike"
UNREAD = "prefilling is an ordered set: its values are never read"

ON_CPU_DEPTH = ("the same on a CPU: runner.on_gpu is False, so the default depth is 0 "
                "whatever the runner's name (the GPU tests tell them apart)")

HASHED_AGAIN = ("the prompt is hashed again where the one kept would do: the same value "
                "(hashing once is a matter of speed, not of what is answered)")

EQUIVALENT: dict = {
    'pagedkv.model.memory.x_prefill_prompt__mutmut_3': ("len(seq.prefill.tokens) != len(seq.tokens)", HASHED_AGAIN),
    'pagedkv.model.memory.xǁEngineMemoryǁadmit__mutmut_15': ("req.live[0].prefill = req.hashed", HASHED_AGAIN),
    'pagedkv.model.memory.xǁEngineMemoryǁpreempt__mutmut_22': ("req.prefilled = False", "None is false, as False is"),
    'pagedkv.model.engine.xǁEngineǁ__init____mutmut_72': ('c.runner != "plain" and self.runner.on_gpu', ON_CPU_DEPTH),
    'pagedkv.model.engine.xǁEngineǁ__init____mutmut_73': ('c.runner != "plain" and self.runner.on_gpu', ON_CPU_DEPTH),
    'pagedkv.model.engine.xǁEngineǁ__init____mutmut_74': ('c.runner != "plain" and self.runner.on_gpu', ON_CPU_DEPTH),
    'pagedkv.model.engine.xǁEngineǁsubmit__mutmut_33': ("secrets.randbits(63)",
        "the seed drawn for a request that gives none: any value below 2**64 is a valid "
        "seed, and which one is drawn cannot be observed"),
    'pagedkv.model.engine.xǁEngineǁupdate__mutmut_21': ("self._retire(req, seq, free=False)", "None is false, as False is"),
    'pagedkv.scheduler.xǁSchedulerǁprefill__mutmut_10': ('float("inf")', "float() reads 'INF' as it reads 'inf'"),
    'pagedkv.scheduler.xǁSchedulerǁprefill__mutmut_20': ('if budget <= 0 or req not in self.prefilling:', BUDGET_AT_0),
    'pagedkv.scheduler.xǁSchedulerǁ_admit__mutmut_14': ("break", LAST_LOOP),
    'pagedkv.scheduler.xǁSchedulerǁ_admit__mutmut_28': ("break", LAST_LOOP),
    'pagedkv.scheduler.xǁSchedulerǁ_admit__mutmut_38': ("break", LAST_LOOP),
    'pagedkv.scheduler.xǁSchedulerǁ_admit__mutmut_45': ("self.prefilling[req] = None", UNREAD),
    'pagedkv.scheduler.xǁSchedulerǁ_swap_in__mutmut_30': ("self.prefilling[req] = None", UNREAD),
    'pagedkv.kernels.sampling.x_uniforms__mutmut_6': (
        'start = splitmix64(xp.asarray(seeds, dtype=u), xp)', SAME_XP),
    'pagedkv.kernels.sampling.x_uniforms__mutmut_24': (
        'bits = splitmix64(state, xp) >> u(40)', SAME_XP),
    'pagedkv.kernels.sampling.x_kept_tokens__mutmut_35': (
        'zeros = np.zeros(rows, np.uint64)', UINT64_LATER),
    'pagedkv.kernels.sampling.x_kept_tokens__mutmut_37': (
        'zeros = np.zeros(rows, np.uint64)', UINT64_LATER),
    'pagedkv.kernels.sampling.x_sample_packed__mutmut_5': (
        't, tp = packed[:2].view(np.float64)',
        "view(None) is view(float64): NumPy reads a dtype of None as its default, float64"),
    'pagedkv.kernels.sampling.x_reference_rows__mutmut_30': ('u = uniforms(s, c).astype(np.float64)', FLOAT64),
    'pagedkv.kernels.sampling.x_reference_rows__mutmut_49': ('cum = np.cumsum(np.where(kept, p[r], 0).astype(np.float64))', FLOAT64),
    'pagedkv.kernels.sampling.x_thresholds__mutmut_21': ('group = np.bincount(inverse, weights=row[row > 0].astype(np.float64))', FLOAT64),
    'pagedkv.kernels.sampling.x_probabilities__mutmut_30': ('p = xp.exp(d.astype(xp.float64)).astype(xp.float32)', FLOAT64),
    'pagedkv.kernels.sampling.x_probabilities__mutmut_4': ('t = xp.asarray(temperature, dtype=xp.float64).astype(xp.float32)', "a temperature rounds to the same float32 whether it passes through float64 first or not (every float32, float64 or small integer value)"),
    'pagedkv.kernels.sampling.x_probabilities__mutmut_6': ('t = xp.asarray(temperature, dtype=xp.float64).astype(xp.float32)', "a temperature rounds to the same float32 whether it passes through float64 first or not (every float32, float64 or small integer value)"),
    'pagedkv.kernels.sampling.x_probabilities__mutmut_37': ('return xp.where(p < np.finfo(np.float32).tiny, xp.float32(0), p)   # no subnormals', "no float32 difference of logits gives a p of exactly float32's smallest normal number (the 6,000 float32 values around its log checked): < and <= flush the same values"),
    'pagedkv.kernels.sampling.x_reference_rows__mutmut_64': ('out[r] = np.argmax(past) if past.any() else np.flatnonzero(kept)[-1]', "the fallback is dead code: the last kept token's running mass is the whole kept mass and u < 1, so some running mass is always above u * mass"),
    'pagedkv.kernels.sampling.x_reference_rows__mutmut_66': ('out[r] = np.argmax(past) if past.any() else np.flatnonzero(kept)[-1]', "the fallback is dead code: the last kept token's running mass is the whole kept mass and u < 1, so some running mass is always above u * mass"),
    'pagedkv.kernels.sampling.x_reference_rows__mutmut_67': ('out[r] = np.argmax(past) if past.any() else np.flatnonzero(kept)[-1]', "the fallback is dead code: the last kept token's running mass is the whole kept mass and u < 1, so some running mass is always above u * mass"),
    'pagedkv.kernels.sampling.x_reference_rows__mutmut_68': ('out[r] = np.argmax(past) if past.any() else np.flatnonzero(kept)[-1]', "the fallback is dead code: the last kept token's running mass is the whole kept mass and u < 1, so some running mass is always above u * mass"),
    'pagedkv.kernels.sampling.x_thresholds__mutmut_3': ('thr, mass = np.ones(len(p), np.float32), np.ones(len(p))', "the thresholds held as float64 are the same float32 values: every comparison p >= t comes out the same"),
    'pagedkv.kernels.sampling.x_thresholds__mutmut_5': ('thr, mass = np.ones(len(p), np.float32), np.ones(len(p))', "the thresholds held as float64 are the same float32 values: every comparison p >= t comes out the same"),
    'pagedkv.kernels.sampling.x_thresholds__mutmut_46': ('i = len(vals) - 1 if k <= 0 or k >= count[-1] else int(np.argmax(count >= k))', "at k == the count of tokens with p > 0 both pick the last value (the counts of values at or above each value grow strictly, so the first to reach k is the last)"),
    'pagedkv.kernels.sampling.x_thresholds__mutmut_58': ('i = int(np.argmax(cum[:i + 1] >= float(top_p[r]) * cum[i]))', "argmax finds the first True, and it lies at or before i (cum[i] >= top_p * cum[i]): one more element past i is never chosen"),
    'pagedkv.kernels.sampling.x__per_row__mutmut_17': ('kinds = "iu" if name in _INTEGERS else "iuf"', "a dtype's kind is one letter, and X is no kind: the same kinds pass"),
    'pagedkv.kernels.sampling.x__per_row__mutmut_20': ('kinds = "iu" if name in _INTEGERS else "iuf"', "a dtype's kind is one letter, and X is no kind: the same kinds pass"),
    'pagedkv.kernels.sampling.x__per_row__mutmut_33': ('a = np.broadcast_to(h.astype(np.uint64) if name in _INTEGERS[1:] else h, (rows,))', "seeds and counters are checked to lie in [0, 2**64) first, and uniforms casts them to uint64 itself: the same numbers either way"),
    'pagedkv.kernels.sampling.x__per_row__mutmut_37': ('a = np.broadcast_to(h.astype(np.uint64) if name in _INTEGERS[1:] else h, (rows,))', "seeds and counters are checked to lie in [0, 2**64) first, and uniforms casts them to uint64 itself: the same numbers either way"),
}

LATIN_1 = "Python's codec names ignore case: 'LATIN-1' is 'latin-1'"
LIMITS_EQUIVALENT = {
    'x_read_body__mutmut_4': ('request.headers.get("CONTENT-LENGTH")',
                              "Starlette's request headers are looked up ignoring case"),
    'x_protocol_class__mutmut_18': ("if self.deadline is None:",
        "a deadline left armed on a lost connection fires later and does nothing (it "
        "closes only a transport that is not closing already)"),
    'x_protocol_class__mutmut_19': ("super().connection_lost(None)",
        "uvicorn's connection_lost reads exc only to close a transport that a clean EOF "
        "left open; closing one that is lost already does nothing"),
    'xǁGuardǁcheck__mutmut_5': ('k.decode("LATIN-1")', LATIN_1),
    'xǁGuardǁcheck__mutmut_16': ('origin.decode("LATIN-1")', LATIN_1),
    'xǁGuardǁcheck__mutmut_30': ('.decode("LATIN-1")', LATIN_1),
    'xǁGuardǁcheck__mutmut_87': ('.decode("LATIN-1")', LATIN_1),
    'xǁGuardǁcheck__mutmut_28': ('headers.get("host", b"XXXX")',
        "differs only for a request with no Host (HTTP/1.0, let through only where any "
        "Host is allowed) whose Origin is 'http://' or 'http://XXXX', neither of them a "
        "page's origin"),
    'xǁGuardǁcheck__mutmut_58': ('headers.get("authorization", b"XXXX")',
        "a request without the header is compared with b'XXXX' instead of b'': "
        "neither is 'Bearer KEY', so both are refused"),
}
EQUIVALENT.update({f"pagedkv.serve.limits.{k}": v for k, v in LIMITS_EQUIVALENT.items()})
FOR_NOBODY = ("the owners are computed where no map is made of them: the reports carry maps "
              "only for requests that ask, at most every pool_interval (a cost, not an answer)")
POPPED = ("EngineCore.cancel takes the request out of requests before the engine's cancel "
          "can fail: this second pop finds nothing, whatever key it is given")
CORE_EQUIVALENT = {
    'xǁEngineCoreǁstep__mutmut_21': ("now - self._pool_sent >= self.pool_interval or",
                                     FOR_NOBODY),
    'xǁEngineCoreǁstep__mutmut_27': ("if (pools) or True else {}", FOR_NOBODY),
    'xǁEngineCoreǁstep__mutmut_23': ("now - self._pool_sent > self.pool_interval",
        "_pool_sent is a time.monotonic() of an earlier step: the gap is never exactly "
        "pool_interval, so > and >= decide alike"),
    'xǁEngineCoreǁ_news__mutmut_5': ("if len(req.live) == 2 and not req.finished:",
        "the lone live sequence then takes the general way (a sorted list of one): the same "
        "updates; the short way only saves building that list"),
    'xǁEngineCoreǁ_failed__mutmut_15': ("self.requests.pop(None, None)", POPPED),
    'xǁEngineCoreǁhandle__mutmut_6': ("self.requests.pop(None, None)", POPPED),
    'xǁEngineCoreǁcancel__mutmut_8': ("self._forget(None)",
        "Engine.cancel never puts a request in the engine's finished list (its docstring "
        "says so), so there is nothing to forget"),
    'xǁEngineCoreǁstep__mutmut_52': ("self.stats(), None)]",
        "a Stepped's time is read by nobody: the client keeps the time it heard it"),
    'xǁEngineCoreǁ_news__mutmut_39': ("sent[seq.seq_id] = -2 if ended else n",
        "any negative mark means 'its end was reported' (seen < 0): -2 reads as -1 does"),
    'x_run_core__mutmut_15': ("put(Beat(core.stats(), None))",
        "a Beat's time is read by nobody: the client keeps the time it heard the beat"),
}
EQUIVALENT.update({f"pagedkv.serve.core.{k}": v for k, v in CORE_EQUIVALENT.items()})
OWN_CLOCK = ("timings(job) without a time reads the clock itself, microseconds after the "
             "message was heard: the same timings to the millisecond they are given in")
NOTHING_TO_END = ("while the engine is stalled, submit and pool refuse at once, so once the "
                  "watchdog has ended them no job or pool read is left: ending them all "
                  "again, where the original skips it, ends nothing")
CLIENT_EQUIVALENT = {
    'xǁEngineClientǁ_watch__mutmut_11': ("(self._stalled and self.jobs and not self.pools)",
                                        NOTHING_TO_END),
    'xǁEngineClientǁ_watch__mutmut_12': ("(self._stalled and not self.jobs and self.pools)",
                                        NOTHING_TO_END),
    'xǁEngineClientǁhealth__mutmut_6': ("if silent >= self.stall_timeout:",
        "a silence measured by time.monotonic() is never exactly stall_timeout"),
    'xǁEngineClientǁreceive__mutmut_2': ("self._stalled = None", "None is false, as False is"),
    'xǁEngineClientǁ_report__mutmut_31': ("timings(job, None)", OWN_CLOCK),
    'xǁEngineClientǁ_report__mutmut_33': ("timings(job, )", OWN_CLOCK),
}
EQUIVALENT.update({f"pagedkv.serve.client.{k}": v for k, v in CLIENT_EQUIVALENT.items()})


def mutant_module(path: str) -> str:
    return path[:-3].replace("/", ".")


def mutant_pattern(module: str, function: str) -> str:
    """mutmut's names for the mutants of a function, or of a method ("Class.method")."""
    if "." in function:
        cls, method = function.split(".")
        return f"{module}.x\u01c1{cls}\u01c1{method}__mutmut_*"
    return f"{module}.x_{function}__mutmut_*"


def copy_tree(dest: Path) -> None:
    """The working tree's package and tests (tracked and untracked, not ignored)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "pagedkv", "tests", "pyproject.toml"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def setup_cfg(t: Target) -> str:
    tests = "\n    ".join(t.tests)
    return (f"[mutmut]\nsource_paths = pagedkv\nonly_mutate = {t.path}\n"
            f"pytest_add_cli_args_test_selection =\n    {tests}\n"
            f"pytest_add_cli_args = -p no:cacheprovider\n")


def results(here: Path, mutmut: str, env: dict, t: Target) -> dict:
    """Mutant name -> status, for the target's mutants, from the last run in ``here``."""
    module = mutant_module(t.path)
    patterns = [mutant_pattern(module, f) for f in t.functions]
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=here, env=env,
                         check=True, capture_output=True, text=True).stdout
    status = {}
    for line in out.splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key.startswith(module + ".") and (not t.functions or any(
                fnmatch.fnmatch(key, p) for p in patterns)):
            status[key] = value
    return status


def run_target(name: str, t: Target, work: Path, mutmut: str, children: int,
               again: bool = False) -> dict:
    """Run mutmut on one target; ``again``: keep the last run's results in its scratch
    copy and run only its survivors again (not those listed as equivalent), with the
    working tree's tests as they are now (new tests are found and traced by mutmut; a
    killed mutant stays killed)."""
    here = work / name
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    module = mutant_module(t.path)
    if again and (here / "mutants").is_dir():
        names = [k for k, v in results(here, mutmut, env, t).items()
                 if v not in ("killed", "timeout") and k not in EQUIVALENT]
        for tests in (here / "tests", here / "mutants" / "tests"):
            shutil.rmtree(tests)
            shutil.copytree(ROOT / "tests", tests,
                            ignore=shutil.ignore_patterns("__pycache__"))
        done = here / "seconds.json"
        previous = json.loads(done.read_text()) if done.exists() else []
    else:
        copy_tree(here)
        (here / "setup.cfg").write_text(setup_cfg(t))
        names = [mutant_pattern(module, f) for f in t.functions]
        previous = []
    start = time.monotonic()
    if names or not again:
        with open(here / "mutmut-run.log", "a" if again else "w") as log:
            subprocess.run([mutmut, "run", "--max-children", str(children), *names],
                           cwd=here, env=env, stdout=log, stderr=subprocess.STDOUT,
                           check=True)
    runs = previous + [round(time.monotonic() - start)]
    (here / "seconds.json").write_text(json.dumps(runs))
    seconds = sum(runs)
    status = results(here, mutmut, env, t)
    diffs = {}
    for key, value in status.items():
        if value not in ("killed", "timeout"):
            diffs[key] = subprocess.run([mutmut, "show", key], cwd=here, env=env,
                                        capture_output=True, text=True).stdout.strip()
    return dict(status=status, diffs=diffs, seconds=seconds, runs=runs)


def section(name: str, t: Target, result: dict, command: str) -> str:
    status = result["status"]
    counts: dict = {}
    for v in status.values():
        counts[v] = counts.get(v, 0) + 1
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    equivalent = [k for k in result["diffs"] if _note(k, result["diffs"][k])]
    total = len(status)
    score = killed / total if total else 0.0
    lines = [f"<!-- module: {name} -->",
             f"<!-- score: {name} {t.path} {total} {killed} {len(equivalent)} -->",
             f"## {name}: `{t.path}`", ""]
    if t.why:
        lines += [f"Mutated: {t.why}.", ""]
    lines += [f"Tests run as the runner: {', '.join(f'`{x}`' for x in t.tests)}.", "",
              f"Run: `{command}`, {result['seconds'] / 60:.1f} min on this machine"
              + (f" (the whole run, then its survivors again with the tests as they are "
                 f"now: {', '.join(f'{s / 60:.1f}' for s in result['runs'])} min)"
                 if len(result['runs']) > 1 else "") + ".", "",
              "| mutants | killed | timeout | survived | no tests | other | score | "
              "score, equivalent ones left out |",
              "|---|---|---|---|---|---|---|---|",
              f"| {total} | {counts.get('killed', 0)} | {counts.get('timeout', 0)} | "
              f"{counts.get('survived', 0)} | {counts.get('no tests', 0)} | "
              f"{total - sum(counts.get(k, 0) for k in ('killed', 'timeout', 'survived', 'no tests'))} | "
              f"{100 * score:.1f} % | "
              f"{100 * killed / max(total - len(equivalent), 1):.1f} % |", ""]
    survivors = sorted(result["diffs"], key=_natural)
    if survivors:
        lines += ["Surviving mutants (`mutmut show NAME` in the scratch copy):", ""]
    for key in survivors:
        note = _note(key, result["diffs"][key])
        lines += [f"### `{key}`: {status[key]}", ""]
        lines += [f"Equivalent: {note}" if note else "Not killed yet.", ""]
        body = "\n".join(l for l in result["diffs"][key].splitlines()
                         if l.startswith(("+", "-", "@@")) and not l.startswith(("+++", "---")))
        lines += ["```diff", body, "```", ""]
    lines += [f"<!-- end: {name} -->", ""]
    return "\n".join(lines)


def _note(key: str, diff: str) -> str | None:
    entry = EQUIVALENT.get(key)
    if entry is None:
        return None
    snippet, why = entry
    return why if snippet in diff else None


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def write_report(sections: dict, header: str) -> None:
    old = REPORT.read_text() if REPORT.exists() else ""
    kept = {m.group(1): m.group(0) for m in re.finditer(
        r"(?s)<!-- module: (\w+) -->.*?<!-- end: \1 -->\n", old)}
    kept.update(sections)
    body = [kept[n] for n in TARGETS if n in kept]
    summary = ["| module | mutants | killed | score | equivalent | score, equivalent ones "
               "left out |", "|---|---|---|---|---|---|"]
    for text in body:
        found = re.search(r"<!-- score: (\S+) (\S+) (\d+) (\d+) (\d+) -->", text)
        if found is None:                          # a section of an older report
            continue
        name, path, total, killed, equivalent = found.groups()
        total, killed, equivalent = int(total), int(killed), int(equivalent)
        summary.append(f"| {name} (`{path}`) | {total} | {killed} | "
                       f"{100 * killed / max(total, 1):.1f} % | {equivalent} | "
                       f"{100 * killed / max(total - equivalent, 1):.1f} % |")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(header + "\n".join(summary) + "\n\n" + "\n".join(body))


HEADER = """# Mutation score of the engine's core and the server's (issue 44)

Written by `scripts/mutation.py` (mutmut {version}; see the script's text for how to
install it). A mutant is *killed* when one of the module's own test files fails on it;
*timeout* counts as killed (the mutant made the tests run far past their time); *no
tests*: no test of those files calls the mutated function. The score is (killed +
timeout) / mutants; the last column leaves out the survivors listed as equivalent.
Last run: {date}, commit {commit}, {cores} cores.

"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pagedkv-mutation"))
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--again", action="store_true",
                    help="run only the last run's survivors again, with the tests as "
                         "they are now (the scratch copy of the last run is kept)")
    ap.add_argument("--mutmut", default=os.environ.get("MUTMUT") or shutil.which("mutmut"))
    args = ap.parse_args(argv)
    unknown = [n for n in args.targets if n not in TARGETS]
    if unknown:
        ap.error(f"unknown module(s) {', '.join(unknown)}: choose of {', '.join(TARGETS)}")
    if not args.mutmut:
        sys.exit("mutmut not found: install requirements-dev.txt (see this script's text) "
                 "and put it on PATH or in $MUTMUT")
    python = Path(args.mutmut).with_name("python")     # mutmut's own interpreter
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('mutmut'))"], capture_output=True,
                             text=True).stdout.strip() or "(version unknown)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "pagedkv", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    sections = {}
    for name in args.targets or list(TARGETS):
        t = TARGETS[name]
        print(f"mutating {t.path} ...", flush=True)
        result = run_target(name, t, args.work, args.mutmut, args.max_children, args.again)
        command = f"python scripts/mutation.py {name} --max-children {args.max_children}"
        if len(result["runs"]) > 1:
            command += "`, then `... --again"
        sections[name] = section(name, t, result, command)
        s = result["status"]
        killed = sum(v in ("killed", "timeout") for v in s.values())
        print(f"{name}: {killed}/{len(s)} killed ({100 * killed / max(len(s), 1):.1f} %), "
              f"{result['seconds'] / 60:.1f} min", flush=True)
    header = HEADER.format(version=version, date=datetime.date.today().isoformat(),
                           commit=commit + (" (with uncommitted changes)" if dirty else ""),
                           cores=os.cpu_count())
    write_report(sections, header)
    print(f"report: {REPORT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
