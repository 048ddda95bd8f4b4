"""The CuPy paths of the transfer on ONE GPU (skipped without one): two pools on one device,
the NCCL link as a communicator of one rank sending to itself (one group holding the send
and the receive), its all-reduce over one rank, and the disaggregated and tensor-parallel
runs on CuPy float16 against one pool. Two ranks on two GPUs cannot be tested here: NCCL
refuses two ranks on one device. ``python -m pagedkv.bench.disagg`` is that test."""
import numpy as np
import pytest

from pagedkv import backend

pytestmark = pytest.mark.skipif(not backend.on_gpu, reason=f"needs a GPU: {backend.reason}")

TINY = dict(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
            ffn=128, context=256)


@pytest.fixture(scope="module")
def tiny():
    from pagedkv.model import Llama, LlamaConfig, random_weights
    config = LlamaConfig(**TINY)
    return Llama(config, random_weights(config, 4321))


def _pools(num_blocks=12):
    cp = backend.xp
    rng = np.random.default_rng(0)
    a = cp.asarray(rng.standard_normal((3, num_blocks, 40)).astype(np.float16))
    return a, cp.zeros_like(a)


def test_copy_between_two_pools_on_one_gpu():
    from pagedkv.transfer import copy_between
    a, b = _pools()
    pairs = np.array([[5, 0], [2, 7], [5, 3]], dtype=np.int32)   # 5 goes twice
    copy_between(a, b, pairs)
    got, want = backend.to_numpy(b), np.zeros(b.shape, dtype=np.float16)
    src = backend.to_numpy(a)
    for s, d in pairs.tolist():
        want[:, d] = src[:, s]
    assert (got == want).all()


def test_nccl_link_of_one_rank_moves_blocks_and_sums():
    import os

    from pagedkv.transfer import NcclLink, _nccl
    link = NcclLink(0, 1, NcclLink.unique_id())
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    try:
        a, b = _pools()
        link.exchange(0, send=(a, [4, 1, 9]), recv=(b, [0, 2, 3]))
        got, src = backend.to_numpy(b), backend.to_numpy(a)
        assert (got[:, [0, 2, 3]] == src[:, [4, 1, 9]]).all()
        assert (got[:, [1, 4, 5, 6, 7, 8, 9, 10, 11]] == 0).all()
        assert link.bytes_sent == link.bytes_received == 3 * 3 * 40 * 2
        x = backend.xp.arange(6, dtype=np.float32)
        link.all_reduce(x)                           # one rank: the sum is itself
        assert backend.to_numpy(x).tolist() == list(range(6))
        header = backend.xp.asarray([17, 4], dtype=np.int64)
        nccl = _nccl()
        inbox = backend.xp.empty(2, dtype=np.int64)
        nccl.groupStart()                            # send_array/recv_array, grouped
        link.comm.send(header.data.ptr, 16, nccl.NCCL_UINT8, 0, link.stream.ptr)
        link.comm.recv(inbox.data.ptr, 16, nccl.NCCL_UINT8, 0, link.stream.ptr)
        nccl.groupEnd()
        link.stream.synchronize()
        assert backend.to_numpy(inbox).tolist() == [17, 4]
    finally:
        link.close()


def test_disaggregated_on_one_gpu_equals_one_pool(tiny):
    """The same passes on one pool (prefill by prompt, then decode): the transfer copies
    bytes exactly, so the float16 tokens are identical."""
    from pagedkv.model.disagg import decode, disaggregated, prefill
    from pagedkv.model.llama import PagedKV, forward
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 96, n).tolist() for n in (5, 17, 33)]
    a, b = PagedKV.for_model(tiny, 64, 16), PagedKV.for_model(tiny, 64, 16)
    b.manager.add("already here", 40)
    out = disaggregated(tiny, prompts, 10, a, b)
    one = PagedKV.for_model(tiny, 64, 16)
    run = lambda batch: forward(tiny, one, batch)               # noqa: E731
    assert out["tokens"] == decode(run, one.manager, prefill(run, one.manager, prompts), 9)


def test_tensor_parallel_on_one_gpu_matches_one_pool(tiny):
    """float16: the two partial sums round differently from one product, so the logits
    are compared with a tolerance (the tokens exactly on the CPU, in float32)."""
    from pagedkv.model.disagg import prefill_batch
    from pagedkv.model.llama import PagedKV, forward
    from pagedkv.model.tensor_parallel import shard, shard_caches, tp_forward
    prompt = np.random.default_rng(9).integers(1, 96, 33).tolist()
    one = PagedKV.for_model(tiny, 64, 16)
    want = backend.to_numpy(forward(tiny, one, prefill_batch(one.manager, 0, prompt)))
    parts = [shard(tiny, r, 2) for r in range(2)]
    caches = shard_caches(tiny, 2, 64, 16)
    got = tp_forward(tiny, parts, caches, prefill_batch(caches[0].manager, 0, prompt))
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-2, atol=5e-2)


def test_the_launcher_refuses_one_gpu():
    from pagedkv.bench.disagg import gpus_or_why, main
    n, why = gpus_or_why()
    if n >= 2:
        pytest.skip("two GPUs: run python -m pagedkv.bench.disagg instead")
    assert main([]) == 2
