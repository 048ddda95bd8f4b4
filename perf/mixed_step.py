"""A mixed engine step (a prefill chunk beside decode rows) as two passes and as one.

    python perf/mixed_step.py --json OUT.json          # SmolLM2-135M on the GPU, ~1 minute
    python perf/mixed_step.py --quick --json OUT.json  # a tiny random model (NumPy on a CPU)

On the fast runner (``FastRunner``, CUDA graphs on a GPU), with ``B`` sequences of
``--context`` tokens in the cache, each about to decode one token, and a new prompt whose
first ``C`` tokens are prefilled in the same step, it times:

* ``decode``: the decode step alone (``runner.decode``: one graph replay), B = 64 and 256;
* ``two_passes``: the mixed step as the engine runs it without the single pass:
  ``runner.prefill`` (the eager pass with the paged prefill kernel) then ``runner.decode``;
* ``single_pass``: the same step as ``runner.mixed``: one flattened batch, one eager pass;
* for a short prefill (C = 32, whose rows fit a graph bucket) both again: two graph replays
  against one (or, when the rows do not fit beside the decode rows, ``mixed`` falls back to
  the two replays itself).

Each time is the median of ``--reps`` calls (at least 20 on a GPU), by CUDA events on the
default stream around the whole call (the calls end by downloading their tokens, so the
events include the host's launches), with the wall-clock median beside it. Before timing,
the two ways' outputs are compared: the prefill's last-row logits and the decode rows'
logits (largest absolute difference, relative norm of the difference) and the decode rows'
greedy tokens (how many agree; a near tie in 16-bit arithmetic may flip one).

The cache is filled by real prefill passes of random prompts (seeded), so attention reads
real K/V. The JSON (``--json``) holds every number, the device and the date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv import backend                               # noqa: E402
from pagedkv.checks import cdiv                           # noqa: E402
from pagedkv.model import Llama, LlamaConfig, PagedKV, random_weights  # noqa: E402
from pagedkv.model.blas import single_thread_blas         # noqa: E402
from pagedkv.model.llama import Batch                     # noqa: E402
from pagedkv.model.runner import FastRunner               # noqa: E402

SEED = 20261203
BLOCK_SIZE = 16
TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)


def log(*a):
    print(*a, flush=True)


def i32(a):
    return np.asarray(a, dtype=np.int32)


def tables(manager, ids):
    rows = [manager.block_table(i) for i in ids]
    out = np.full((len(ids), max(map(len, rows))), -1, np.int32)
    for row, t in zip(out, rows):
        row[:len(t)] = t
    return out


def prefill_batch(manager, ids, tokens, n):
    """The first ``n`` tokens of each sequence in ``ids`` (their slots already planned)."""
    return Batch(i32(np.concatenate([tokens[i][:n] for i in ids])),
                 i32(np.tile(np.arange(n), len(ids))),
                 i32(np.concatenate([manager.slots(i)[:n] for i in ids])),
                 i32([n] * len(ids)), i32([n] * len(ids)), tables(manager, ids),
                 np.zeros((0, 2), np.int32))


def decode_batch(manager, ids, tokens, context):
    """One token for each sequence of ``ids``, at position ``context`` (slot planned)."""
    return Batch(i32([tokens[i][context] for i in ids]), i32([context] * len(ids)),
                 i32([manager.slots(i)[context] for i in ids]), np.ones(len(ids), np.int32),
                 i32([context + 1] * len(ids)), tables(manager, ids),
                 np.zeros((0, 2), np.int32))


class Scene:
    """A pool where ``max_b`` sequences hold ``context`` tokens (prefilled for real) and
    have a slot for one more, and prompts of each chunk size have their slots planned."""

    def __init__(self, model, max_b, context, chunks, pass_tokens):
        n_blocks = max_b * cdiv(context + 1, BLOCK_SIZE) + sum(cdiv(c, BLOCK_SIZE)
                                                                for c in chunks) + 8
        self.kv = PagedKV.for_model(model, n_blocks, BLOCK_SIZE)
        self.runner = FastRunner(model, self.kv, max_batch=max(max_b, 1), single_pass=True,
                                 max_context=max(context + 1, max(chunks)))
        rng = np.random.default_rng(SEED)
        vocab, m = model.config.vocab_size, self.kv.manager
        self.tokens = {i: rng.integers(1, vocab, context + 1).tolist() for i in range(max_b)}
        for i in range(max_b):
            m.add(i, context + 1)
        per_pass = max(1, pass_tokens // context)
        for start in range(0, max_b, per_pass):    # the context, for real
            ids = list(range(start, min(max_b, start + per_pass)))
            self.runner.prefill(prefill_batch(m, ids, self.tokens, context))
        self.prompt = {}
        for c in chunks:
            self.prompt[c] = pid = f"prompt{c}"
            self.tokens[pid] = rng.integers(1, vocab, c).tolist()
            m.add(pid, c)
        backend.synchronize()
        self.context = context

    def batches(self, b, c):
        m = self.kv.manager
        return (prefill_batch(m, [self.prompt[c]], self.tokens, c),
                decode_batch(m, list(range(b)), self.tokens, self.context))


def host(a):
    return backend.to_numpy(a).astype(np.float64)


def compare(runner, pb, db):
    """The two ways' outputs, side by side."""
    p_logits, _ = runner.prefill(pb)
    d_logits, d_greedy = runner.decode(db)
    p_a, d_a = host(p_logits), host(d_logits)
    first, logits, greedy = runner.mixed(pb, db)
    p_b, d_b = host(first), host(logits)
    rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(y))  # noqa: E731
    return dict(prefill_max_abs=float(np.abs(p_a - p_b).max()), prefill_rel=rel(p_b, p_a),
                prefill_argmax_equal=bool(np.array_equal(p_a.argmax(1), p_b.argmax(1))),
                decode_max_abs=float(np.abs(d_a - d_b).max()), decode_rel=rel(d_b, d_a),
                greedy_equal=int(sum(x == y for x, y in zip(d_greedy, greedy))),
                greedy_rows=len(greedy),
                greedy_is_argmax=bool(list(d_a.argmax(1)) == list(d_greedy)))


def time_call(fn, reps):
    """(median ms by CUDA events on the default stream, median wall-clock ms) of ``fn``
    (NumPy: wall clock for both); after two warm-up calls."""
    for _ in range(2):
        fn()
    backend.synchronize()
    events, walls = [], []
    cp = backend.xp if backend.on_gpu else None
    for _ in range(reps):
        if cp is not None:
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
        t = time.perf_counter()
        fn()
        if cp is not None:
            b.record()
            b.synchronize()
            events.append(cp.cuda.get_elapsed_time(a, b))
        else:
            backend.synchronize()
        walls.append(1e3 * (time.perf_counter() - t))
    wall = statistics.median(walls)
    return (statistics.median(events) if events else wall), wall


def run(args) -> dict:
    single_thread_blas()
    if args.quick:
        model = Llama(TINY, random_weights(TINY, SEED))
        name, bs, chunks, short = "tiny random (quick)", [4, 8], [16, 48], 8
        context, reps = 24, args.reps or 5
    else:
        from pagedkv.model import load_gguf
        from pagedkv.model.gguf import model_path
        ckpt = load_gguf(model_path(args.gguf))
        model = Llama(ckpt.config, ckpt.weights)
        name, bs, chunks, short = "SmolLM2-135M-Instruct", [64, 256], [512, 2048], 32
        context, reps = args.context, max(20, args.reps or 30)
    bs, chunks = args.batches or bs, args.chunks or chunks
    r = dict(model=name, dtype=str(model.dtype), backend=backend.describe(),
             date=datetime.datetime.now().isoformat(timespec="seconds"),
             command="python perf/mixed_step.py " + " ".join(sys.argv[1:]),
             context=context, block_size=BLOCK_SIZE, reps=reps, seed=SEED,
             decode={}, mixed=[], equal=[])
    log(f"{name}, {model.dtype} on {backend.name}; {context} tokens of context per decode "
        f"row; medians of {reps}")
    t = time.perf_counter()
    scene = Scene(model, max(bs), context, chunks + [short], args.pass_tokens)
    runner = scene.runner
    log(f"cache filled in {time.perf_counter() - t:.1f} s")
    for b in bs:
        _, db = scene.batches(b, short)
        ms, wall = time_call(lambda: runner.decode(db), reps)
        r["decode"][b] = dict(ms=round(ms, 3), wall_ms=round(wall, 3))
        log(f"decode    B {b:>4}:                 {ms:8.3f} ms (wall {wall:.3f})")
    for c in chunks + [short]:
        for b in bs:
            pb, db = scene.batches(b, c)
            eq = dict(B=b, C=c, **compare(runner, pb, db))
            r["equal"].append(eq)
            two = time_call(lambda: (runner.prefill(pb), runner.decode(db)), reps)
            one = time_call(lambda: runner.mixed(pb, db), reps)
            route = _route(runner, pb, db)
            r["mixed"].append(dict(B=b, C=c, route=route, two_passes_ms=round(two[0], 3),
                                   two_passes_wall_ms=round(two[1], 3),
                                   single_pass_ms=round(one[0], 3),
                                   single_pass_wall_ms=round(one[1], 3),
                                   saved_ms=round(two[0] - one[0], 3)))
            log(f"mixed C {c:>5} + B {b:>4}: two passes {two[0]:8.3f} ms, single pass "
                f"{one[0]:8.3f} ms ({route}); greedy equal {eq['greedy_equal']}/"
                f"{eq['greedy_rows']}, decode logits max |diff| {eq['decode_max_abs']:.2e}, "
                f"prefill {eq['prefill_max_abs']:.2e}")
    return r


def _route(runner, pb, db) -> str:
    """Which way ``runner.mixed`` went for these batches."""
    if runner._short(pb, beside=len(db.tokens)):
        return "one graph replay"
    if runner._short(pb):
        return "two graph replays"
    return "one eager pass"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny random model, a few reps")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--gguf", help="the model file (default: $PAGEDKV_GGUF or the package's)")
    p.add_argument("--context", type=int, default=512,
                   help="tokens in the cache per decode row (default 512)")
    p.add_argument("--reps", type=int, help="repetitions per time (default 30, at least 20; "
                   "quick 5)")
    p.add_argument("--batches", type=int, nargs="+", help="decode rows B (default 64 256)")
    p.add_argument("--chunks", type=int, nargs="+",
                   help="prefill chunk sizes C (default 512 2048; a short one is added)")
    p.add_argument("--pass-tokens", type=int, default=8192,
                   help="tokens per prefill pass when filling the cache")
    args = p.parse_args(argv)
    r = run(args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(r, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
