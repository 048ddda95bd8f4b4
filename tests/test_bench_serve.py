"""The serving benchmark's parts on their own (workload, percentiles, the spike measure), and
``python -m pagedkv.bench.serve --quick`` end to end on the real model: its numbers are
printed, not asserted; what is asserted is that every request got exactly its tokens."""
import json
import random

import numpy as np
import pytest

from pagedkv.bench import serve
from pagedkv.model.gguf import ModelNotFound, model_path


def test_the_default_workload_is_nano_vllms():
    reqs = serve.make_requests(256, 100, 1024, seed=0)
    rnd = random.Random(0)                       # bench.py's draws, in its order
    prompts = [[rnd.randint(0, 10000) for _ in range(rnd.randint(100, 1024))]
               for _ in range(256)]
    outputs = [rnd.randint(100, 1024) for _ in range(256)]
    assert [p for _, p, _ in reqs] == prompts and [o for *_, o in reqs] == outputs
    assert sum(outputs) == 133_966 and all(a == 0 for a, *_ in reqs)


def test_poisson_arrivals_are_seeded_and_start_at_zero():
    a = [t for t, *_ in serve.make_requests(200, 4, 8, seed=3, rate=10.0)]
    b = [t for t, *_ in serve.make_requests(200, 4, 8, seed=3, rate=10.0)]
    gaps = np.diff(a)
    assert a == b and a[0] == 0 and (gaps >= 0).all()
    assert 0.07 < gaps.mean() < 0.13                    # 1/rate, within sampling error


def test_latency_percentiles_in_milliseconds():
    got = serve.latency([0.001 * i for i in range(1, 101)])
    assert got["max"] == pytest.approx(100) and got["p50"] == pytest.approx(50.5)
    assert np.isnan(serve.latency([])["p99"])


def test_spike_reads_the_gaps_around_the_long_prompt():
    # two running requests, a token every 10 ms, and one gap of 100 ms at t = 0.5 s
    tokens = [0.01 * i for i in range(50)] + [0.59 + 0.01 * i for i in range(20)]
    result = {"stamps": [tokens, tokens, [0.6, 0.61]], "due": [0.0, 0.0, 0.45]}
    got = serve.spike(result)
    assert got["worst_itl_ms"] == pytest.approx(100)
    assert got["median_itl_ms"] == pytest.approx(10)
    assert got["worst_over_median"] == pytest.approx(10)
    assert got["long_prompt_ttft_ms"] == pytest.approx(150)


def test_bad_arguments_are_refused(capsys):
    for bad in (["--rate", "0"], ["--lengths", "5", "2"], ["--requests", "0"],
                ["--token-budget", "-1"]):
        with pytest.raises(SystemExit):
            serve.main(["--quick", *bad])


def test_quick_run_end_to_end(tmp_path, capsys):
    try:
        model_path()
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    out = tmp_path / "serve.json"
    assert serve.main(["--quick", "--requests", "5", "--token-budget", "32", "--no-peer",
                       "--json", str(out)]) == 0
    print(capsys.readouterr().out)                   # the numbers, for the log
    r = json.loads(out.read_text())
    p = r["pagedkv"]
    assert p["completed"] == 5 and p["output_tokens"] == r["workload"]["output_tokens"]
    assert p["token_budget"] == 32 and p["ttft_ms"]["p50"] > 0
    assert r["command"].startswith("python -m pagedkv.bench.serve --quick")
