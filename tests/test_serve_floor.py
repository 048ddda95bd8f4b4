"""The serving benchmark's floor (pagedkv.bench.serve): the workload's bytes and FLOP counted
against brute force, the issue's arithmetic for nano-vllm's workload reproduced, the bandwidth
and rate measured on the CPU, and a run of the tiny model on the 8-bit cache reporting it."""
import pytest

from pagedkv.bench import serve
from pagedkv.model.gguf import LlamaConfig
from pagedkv.spec import KVSpec

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3,
                      head_dim=64, ffn=1536, rope_base=100000.0, context=8192)


def test_decode_reads_are_the_sum_over_steps():
    reqs = serve.make_requests(20, 3, 40, seed=5)
    brute = sum(len(p) + k for _, p, o in reqs for k in range(o))   # step k reads p + k
    formula = serve.decode_kv_tokens(reqs)
    assert formula == sum(len(p) * o + o * o / 2 for _, p, o in reqs)
    assert abs(formula - brute) == pytest.approx(sum(o / 2 for *_, o in reqs))


def test_prefill_flop_counts_weights_attention_and_the_head():
    tiny = LlamaConfig(vocab_size=10, hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4,
                       ffn=16)
    reqs = [(0.0, [1] * 3, 5), (0.0, [2] * 1, 1)]
    per_layer = 8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16            # q, k, v, o; gate, up, down
    brute = 0
    for _, p, _ in reqs:
        for pos in range(len(p)):
            brute += 2 * 2 * per_layer                             # 2 FLOP a weight, 2 layers
            brute += 2 * 2 * (2 * 2 * 4) * (pos + 1)               # q.k and p.v, 2 layers
        brute += 2 * 10 * 8                                        # the head, once
    assert serve.prefill_flop(reqs, tiny) == brute


def test_nano_vllms_workload_floor_is_the_issues_arithmetic():
    """Issue 39's numbers: 1.21e8 tokens of K/V at 23,040 bytes = 2.79 TB, 1,171 reads of
    269 MB of weights, at 3.0 TB/s about 1.04 s; the 8-bit cache reads 12,240 bytes a token."""
    reqs = serve.make_requests()
    f16 = KVSpec(30, 3, 64, "float16").bytes_per_token
    i8 = KVSpec(30, 3, 64, "int8").bytes_per_token
    flop = serve.prefill_flop(reqs, SMOLLM2)
    common = dict(weight_bytes=269e6, steps=1171, prefill_flop=flop, copy_bytes_per_s=3.0e12,
                  flop_per_s=650e12)
    a = serve.floor(reqs, kv_bytes_per_token=f16, **common)
    b = serve.floor(reqs, kv_bytes_per_token=i8, **common)
    assert serve.decode_kv_tokens(reqs) == pytest.approx(1.21e8, rel=2e-3)
    assert a["kv_bytes"] == pytest.approx(2.79e12, rel=2e-3)
    assert a["bytes_s"] == pytest.approx(1.04, rel=1e-2)
    assert 30e12 < flop < 39e12 and a["prefill_s"] < 0.06
    assert b["kv_bytes"] / a["kv_bytes"] == pytest.approx(12240 / 23040)
    assert a["floor_s"] == pytest.approx(a["bytes_s"] + a["prefill_s"])
    assert b["output_tokens_per_s"] / a["output_tokens_per_s"] > 1.6


def test_bandwidth_and_rate_are_measured_and_labelled():
    c = serve.copy_bandwidth(1 << 24, repeat=2)
    m = serve.matmul_rate(128, repeat=2)
    assert c["bytes_per_s"] > 0 and "copy" in c["how"]
    assert m["flop_per_s"] > 0 and "matmul" in m["how"]
    if "NumPy" in c["how"]:
        assert "not a GPU" in c["how"]


def test_a_run_on_the_int8_cache_reports_its_floor():
    """serve_pagedkv on the tiny model and the 8-bit cache (what ``--kv-dtype int8`` asks
    for), its floor from the run's own steps and the cache's bytes, and the table's lines."""
    from _tiny import tiny_llama, TINY
    reqs = serve.make_requests(3, 4, 12, seed=1)
    reqs = [(a, [t % TINY.vocab_size for t in p], o) for a, p, o in reqs]
    p = serve.serve_pagedkv(tiny_llama(3), reqs, serve.options(kv_dtype="int8",
                                                               runner="plain"))
    assert p["kv_dtype"] == "int8" and p["completed"] == 3
    assert p["kv_bytes_per_token"] == KVSpec(2, 2, 64, "int8").bytes_per_token
    f = serve.run_floor(reqs, p, TINY, copy={"bytes_per_s": 1e10, "how": "given"},
                        rate={"flop_per_s": 1e11, "how": "given"})
    want = (serve.decode_kv_tokens(reqs) * p["kv_bytes_per_token"]
            + p["steps"] * p["weight_bytes"]) / 1e10 + serve.prefill_flop(reqs, TINY) / 1e11
    assert f["floor_s"] == pytest.approx(want)
    assert f["run_over_floor"] == pytest.approx(p["wall_s"] / want)
    text = serve.table({"pagedkv": p, "floor": f})
    assert "int8 K/V" in text and "x the floor" in text
