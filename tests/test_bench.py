"""The benchmark command runs and reports every number it promises (timings are not checked)."""
import json
import sys

import pytest

from pagedkv.bench import peers
from pagedkv.bench.__main__ import main

KEYS = ("alloc_free_ns", "decode_step_us", "decode_step_in_loop_us",
        "decode_step_no_new_block_us", "teaching_decode_step_us", "fork_beams_us",
        "teaching_alloc_free_ns", "teaching_fork_beams_us")


def test_bench_json_has_every_key(capsys):
    assert main(["--json", "--repeat", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert isinstance(out[key], float) and out[key] > 0, key
        assert out[key + "_min"] <= out[key], key
    assert out["command"] == "python -m pagedkv.bench --json --repeat 1"


def test_bench_table_and_missing_peers(capsys, monkeypatch):
    monkeypatch.setattr(peers, "_source_of", lambda package: None)     # not on the path
    assert main(["--repeat", "1", "--peers"]) == 0
    text = capsys.readouterr().out
    assert "one block allocated and freed" in text and "teaching" in text
    assert "nano-vllm's block manager: not importable" in text
    assert "vLLM's BlockPool: not importable" in text


@pytest.mark.parametrize("bad", ["0", "-3", "x"])
def test_bench_rejects_bad_repeats(bad):
    with pytest.raises(SystemExit):
        main(["--repeat", bad])


# Stand-ins for the peers' sources, with their shapes (the real ones are not installed in CI):
# what the harness imports and calls, so that its loading and its traces are exercised.
FAKE_NANO = {
    "nanovllm/__init__.py": "raise ImportError('the engine needs torch')\n",
    "nanovllm/engine/sequence.py": """
class Sequence:
    block_size = 256
    def __init__(self, token_ids):
        self.token_ids, self.block_table = list(token_ids), []
    def __len__(self):
        return len(self.token_ids)
    def append_token(self, t):
        self.token_ids.append(t)
""",
    "nanovllm/engine/block_manager.py": """
from collections import deque
from nanovllm.engine.sequence import Sequence
class Block:
    def __init__(self, i):
        self.block_id, self.ref_count = i, 0
class BlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size, self.blocks = block_size, [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))
    def _allocate_block(self):
        b = self.free_block_ids.popleft()
        self.blocks[b].ref_count = 1
        return b
    def _deallocate_block(self, b):
        self.free_block_ids.append(b)
    def allocate(self, seq, num_cached_blocks):
        for _ in range(-(-len(seq) // self.block_size)):
            seq.block_table.append(self._allocate_block())
    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)
    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block())
""",
}
FAKE_VLLM = {
    "vllm/__init__.py": "raise ImportError('vllm needs torch')\n",
    "vllm/v1/core/kv_cache_utils.py": """
from vllm.logger import init_logger
from vllm.config import VllmConfig
logger = init_logger(__name__)
class KVCacheBlock:
    def __init__(self, i):
        self.block_id, self.ref_cnt = i, 0
""",
    "vllm/v1/core/block_pool.py": """
from collections import deque
from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.core.kv_cache_utils import KVCacheBlock
class BlockPool:
    def __init__(self, num_gpu_blocks, enable_caching, hash_block_size, medium=MEDIUM_GPU):
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free = deque(self.blocks[1:])
    def get_num_free_blocks(self):
        return len(self.free)
    def get_new_blocks(self, n):
        got = [self.free.popleft() for _ in range(n)]
        for b in got:
            b.ref_cnt += 1
        return got
    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free.appendleft(b)
""",
}


def test_peers_are_loaded_from_their_sources_and_run(tmp_path, monkeypatch):
    for name, text in {**FAKE_NANO, **FAKE_VLLM}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for k in [k for k in sys.modules if k.split(".")[0] in ("nanovllm", "vllm")]:
        monkeypatch.delitem(sys.modules, k)
    try:
        nano = peers.nano_vllm(1)
        vllm = peers.vllm_block_pool(1)
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "nanovllm"]:
            del sys.modules[k]
    assert nano["nano_vllm_decode_step_us"] > 0 and nano["nano_vllm_alloc_free_ns"] > 0, nano
    assert vllm["vllm_block_pool_decode_step_us"] > 0, vllm
    assert not any(k.split(".")[0] == "vllm" for k in sys.modules)   # stand-ins removed
