"""Beyond one GPU, on a CPU: prefill on one pool and decode on another gives the tokens of
one engine on one pool; attention split by KV heads over two "ranks" under one page table
gives the tokens (and, to float rounding, the K/V and logits) of one pool; the two-GPU
launcher refuses a machine without two GPUs; NCCL is never needed to import the module."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.disagg import decode, disaggregated, prefill
from pagedkv.model.engine import Engine
from pagedkv.model.llama import PagedKV, forward
from pagedkv.model.requests import SamplingParams
from pagedkv.model.tensor_parallel import shard, shard_caches, tp_forward
from pagedkv.transfer import nccl_env, pool_blocks

single_thread_blas()

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, context=256)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
    return Llama(TINY, random_weights(TINY, 4321), xp=np)


def _prompts(seed, lengths=(5, 17, 1, 33)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in lengths]


def _engine_tokens(model, prompts, new, block_size):
    engine = Engine(model, num_blocks=64, block_size=block_size, audit=True)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=new))
    return [r.outputs()[0].generated for r in reqs]


@pytest.mark.parametrize("block_size", [4, 16])
def test_disaggregated_tokens_equal_one_engine(tiny, block_size):
    prompts = _prompts(7)
    a = PagedKV.for_model(tiny, 64, block_size)
    b = PagedKV.for_model(tiny, 64, block_size)
    b.manager.add("already here", 3 * block_size + 1)   # B's free blocks start at 4
    out = disaggregated(tiny, prompts, 10, a, b)
    assert out["tokens"] == _engine_tokens(tiny, prompts, 10, block_size)
    assert out["plan"].pairs[:, 1].min() == 4           # not block i onto block i
    assert a.manager.allocator.num_free == 64           # A gave every block back
    a.manager.audit()
    b.manager.audit()


def test_a_transfer_that_drops_a_block_changes_the_tokens(tiny):
    """The check above can fail: the same run with one block left behind differs."""
    prompts = _prompts(8, (33,))
    good = disaggregated(tiny, prompts, 8, PagedKV.for_model(tiny, 32, 4),
                         PagedKV.for_model(tiny, 32, 4))["tokens"]
    a, b = PagedKV.for_model(tiny, 32, 4), PagedKV.for_model(tiny, 32, 4)
    first = prefill(lambda batch: forward(tiny, a, batch), a.manager, prompts)
    from pagedkv.transfer import copy_between, plan_transfer
    plan = plan_transfer(a.manager, b.manager, [0])
    copy_between(pool_blocks(a), pool_blocks(b), plan.pairs[1:])  # block 0 stays behind
    bad = decode(lambda batch: forward(tiny, b, batch), b.manager, first, 7)
    assert bad != good


@pytest.mark.parametrize("block_size", [4, 16])
def test_tensor_parallel_attention_equals_one_pool(tiny, block_size):
    prompts = _prompts(9)
    one = PagedKV.for_model(tiny, 64, block_size)
    run_one = lambda batch: forward(tiny, one, batch)            # noqa: E731
    want = decode(run_one, one.manager, prefill(run_one, one.manager, prompts), 9)
    parts = [shard(tiny, r, 2) for r in range(2)]
    caches = shard_caches(tiny, 2, 64, block_size)
    run_tp = lambda batch: tp_forward(tiny, parts, caches, batch)  # noqa: E731
    got = decode(run_tp, caches[0].manager, prefill(run_tp, caches[0].manager, prompts), 9)
    assert got == want
    assert caches[1].manager is caches[0].manager       # one manager, rank 0's
    for i in range(TINY.layers):                        # each rank holds its heads' K/V
        for r in range(2):
            mine = one.layers[i][:, :, :, r:r + 1]
            np.testing.assert_allclose(caches[r].layers[i], mine, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_logits_match_one_pool_and_a_missing_rank_does_not(tiny):
    prompt = _prompts(10, (20,))[0]
    one = PagedKV.for_model(tiny, 16, 4)
    from pagedkv.model.disagg import prefill_batch
    want = forward(tiny, one, prefill_batch(one.manager, 0, prompt))
    parts = [shard(tiny, r, 2) for r in range(2)]
    caches = shard_caches(tiny, 2, 16, 4)
    got = tp_forward(tiny, parts, caches, prefill_batch(caches[0].manager, 0, prompt))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    caches = shard_caches(tiny, 2, 16, 4)
    half = tp_forward(tiny, parts, caches, prefill_batch(caches[0].manager, 0, prompt),
                      all_reduce=lambda partial: partial[0])   # rank 1 left out
    assert np.abs(half - want).max() > 1e-2


def test_uneven_kv_heads_are_refused():
    smol = LlamaConfig(vocab_size=96, hidden=96, layers=1, heads=9, kv_heads=3,
                       head_dim=32, ffn=64, context=64)      # SmolLM2's 9 / 3 heads
    model = Llama(smol, random_weights(smol, 0), xp=np)
    with pytest.raises(ConfigError, match="3 KV heads do not split evenly over 2 ranks"):
        shard(model, 0, 2)
    with pytest.raises(ConfigError, match=r"rank must be in \[0, 3\), got 3"):
        shard(model, 3, 3)


def test_nccl_env_switches_multicast_off():
    assert nccl_env({"NCCL_NVLS_ENABLE": "1", "X": "y"}) == {"NCCL_NVLS_ENABLE": "0",
                                                               "X": "y"}
    assert nccl_env()["NCCL_NVLS_ENABLE"] == "0"


def test_the_module_imports_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"   # any import of cupy now fails
            "import pagedkv.transfer as t, pagedkv.bench.disagg as d\n"
            "print(d.gpus_or_why()[0])\n"
            "try:\n    t.NcclLink(0, 2, None)\nexcept ImportError:\n    print('no cupy')\n")
    env = dict(os.environ, PYTHONPATH=ROOT, PAGEDKV_BACKEND="numpy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "no", "cupy"]


def test_the_launcher_says_why_it_cannot_run():
    from pagedkv.bench.disagg import gpus_or_why
    if not gpus_or_why()[1]:
        pytest.skip("two GPUs are usable here: the launcher would run")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "pagedkv.bench.disagg"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "needs two CUDA GPUs with NCCL" in out.stderr
    assert "Nothing was run" in out.stderr


@pytest.mark.parametrize("mode", [[], ["--tp"]])
def test_the_launcher_protocol_runs_on_two_cpu_processes(tmp_path, mode):
    """``--cpu``: the two ranks' steps (offer, answer, blocks, decode; or the sharded
    passes with an all-reduce per layer) over a pipe, tokens against one process."""
    import json
    path = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "pagedkv.bench.disagg", "--cpu",
                          "--prompt-len", "40", "--new-tokens", "6", "--num-blocks", "64",
                          "--json", str(path)] + mode,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "CPU dry run" in out.stdout
    result = json.loads(path.read_text())
    key = "tp_tokens_equal_one_gpu" if mode else "disagg_tokens_equal_one_gpu"
    assert result[key] is True and result["cpu_dry_run"] is True
    if not mode:
        rank0 = result["ranks"]["0"]
        assert rank0["blocks"] == 3 and rank0["transfer_bytes"] == 3 * 16 * 2 * 4 * 4 * 64 * 4
