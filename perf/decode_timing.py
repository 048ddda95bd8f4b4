"""What perf/fold_check.py, perf/pdl_check.py and perf/rows_check.py share: SmolLM2-135M's
shapes, a decode batch of ``b`` rows, and the timing of one runner's decode step (replayed
from its bucket's graph on a GPU)."""
from __future__ import annotations

import argparse
import datetime
import json
import time

import numpy as np

from pagedkv.model import Llama, LlamaConfig, PagedKV, random_weights
from pagedkv.model.llama import Batch

SMOL = LlamaConfig(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3,
                   head_dim=64, ffn=1536, rope_base=100000.0, context=2048)
POSITION, BLOCK_SIZE, BLOCKS_PER_ROW = 100, 16, 8


def batch_of(b: int) -> Batch:
    """``b`` decode rows, row i at POSITION in blocks i*8 .. i*8+7."""
    tables = np.arange(b * BLOCKS_PER_ROW, dtype=np.int32).reshape(b, BLOCKS_PER_ROW)
    slots = tables[:, POSITION // BLOCK_SIZE] * BLOCK_SIZE + POSITION % BLOCK_SIZE
    one = np.ones(b, np.int32)
    tokens = (np.arange(b, dtype=np.int32) * 37 + 11) % SMOL.vocab_size
    return Batch(tokens, one * POSITION, slots.astype(np.int32), one, one * (POSITION + 1),
                 tables, np.zeros((0, 2), np.int32))


def time_decode(runner, batch: Batch, steps: int, warmup: int = 5) -> tuple[dict, object]:
    """``steps`` decode steps of ``batch`` after ``warmup``: the graph's nodes, the median
    and fastest step in ms, the first row's greedy token; and the last step's logits."""
    for _ in range(warmup):
        logits, greedy = runner.decode(batch)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits, greedy = runner.decode(batch)
        times.append(time.perf_counter() - t)
    return (dict(nodes=runner.graph_nodes(runner._bucket(len(batch.tokens))),
                 step_ms_median=1e3 * float(np.median(times)),
                 step_ms_min=1e3 * float(np.min(times)), greedy_first=int(greedy[0])),
            logits)


def host(a) -> np.ndarray:
    """A NumPy copy of a CuPy or NumPy array."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def write_result(path, what: str, **fields) -> None:
    """The JSON of one check: what it measured, when (UTC), and ``fields``."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(path, "w") as f:
        json.dump(dict(what=what, date=date, **fields), f, indent=1)


def arguments(buckets: str, *extra) -> argparse.Namespace:
    """A check's command line: ``--json FILE``, ``--buckets`` (default ``buckets``),
    ``--steps`` and ``extra`` (name, default) string options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--buckets", default=buckets)
    ap.add_argument("--steps", type=int, default=200)
    for name, default in extra:
        ap.add_argument(name, default=default)
    return ap.parse_args()


def smol_and_pool(buckets: list) -> tuple:
    """SmolLM2's shapes with random float16 weights (seed 0), and a pool for the largest
    of ``buckets`` rows (perf/decode_timing.py's batch_of)."""
    model = Llama(SMOL, random_weights(SMOL, 0), dtype=np.float16)
    return model, PagedKV.for_model(model, max(buckets) * BLOCKS_PER_ROW + 8, BLOCK_SIZE)
