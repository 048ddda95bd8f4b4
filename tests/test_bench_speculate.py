"""The speculation benchmark's pieces on the tiny random model (timings are not checked):
every mode runs the same prompts to the same greedy answers, every promised number is
there, and the threshold reads the batches where guessing won."""
import json

import numpy as np

from pagedkv.bench import speculate as bench
from pagedkv.model.blas import single_thread_blas

single_thread_blas()
SEED = 77


def test_every_mode_gives_the_same_answers_and_every_number(tiny):
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    base = rng.integers(1, 96, 9).tolist()
    prompts = [base * 3, rng.integers(1, 96, 20).tolist()]
    engs = bench.engines(tiny, 2, max(map(len, prompts)), 12, (0,), "fast-eager")
    assert set(engs) == set(bench.MODES)
    params = bench.SamplingParams(max_new_tokens=12, ignore_eos=True)
    got = bench.measure(engs, prompts, params, repeat=2)
    for mode in bench.MODES:
        r = got[mode]
        assert r["identical"] == 1.0 and r["output_tokens"] == 24
        assert len(r["tokens_per_s_all"]) == 2 and r["steps"] > 0
        for key in ("seconds", "first_step_s", "tokens_per_s", "tokens_per_seq_step",
                    "drafted", "accepted", "acceptance", "speedup"):
            assert key in r, key
    assert got["off"]["drafted"] == 0 and got["on"]["drafted"] > 0
    assert got["on"]["tokens_per_seq_step"] > got["off"]["tokens_per_seq_step"]
    json.dumps(got)                                    # the JSON takes it as it is
    print(bench.line("tiny", 2, got))


def test_the_threshold_is_the_largest_batch_where_guessing_won():
    def at(speedup):
        return {"on": {"speedup": speedup}}
    results = {"repeat": {1: at(2.0), 8: at(1.4), 64: at(0.9)},
               "chat": {1: at(0.97), 8: at(0.8)}}
    assert bench.threshold(results) == {"repeat": 8, "chat": None}


def test_k_sets_the_guesses_of_on_and_default_and_the_rows_they_need(tiny):
    engs = bench.engines(tiny, 4, 20, 8, (0,), "fast-eager", k=7)
    assert engs["off"].config.speculate is None
    assert engs["on"].config.speculate.k == engs["default"].config.speculate.k == 7
    assert engs["on"].config.max_seqs == 4 * (7 + 1)      # every sequence's k + 1 rows
    lone = bench.engines(tiny, 1, 20, 8, (0,), "fast-eager", k=4)
    assert lone["off"].config.max_seqs == 20     # a 20-token prompt fits one graph bucket
    default = bench.engines(tiny, 4, 20, 8, (0,), "fast-eager")
    assert default["on"].config.speculate.k == bench.Speculation().k
