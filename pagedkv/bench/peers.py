"""The bookkeeping traces of :mod:`pagedkv.bench` through two peers, in the same process.

Neither peer is a dependency; ``python -m pagedkv.bench --peers`` includes each one whose source
is on ``PYTHONPATH``:

* **nano-vllm** (github.com/GeeeekExplorer/nano-vllm): its ``BlockManager`` (needs ``xxhash``).
  Its package ``__init__`` imports the whole engine (PyTorch, transformers), so the package is
  entered without running it; ``nanovllm/engine/block_manager.py`` and ``sequence.py`` run
  unchanged.
* **vLLM** (github.com/vllm-project/vllm, or the files of a vLLM wheel): the V1 ``BlockPool``.
  ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` run unchanged; every other module
  they import (configuration, logging, metrics, multimodal hashing, KV events) is a stand-in
  whose names are empty placeholders. The trace never reaches them: it uses the pool without
  prefix caching, events or metrics.

The traces: one block allocated and freed; 1024 sequences of 512 tokens each taking one more
token, which needs a new block in every sequence. For nano-vllm that is ``can_append`` and
``may_append`` per sequence (its scheduler's decode path); for vLLM, one ``get_new_blocks(1)``
per sequence appended to that request's block list (what its KV-cache manager asks of the pool
for a decode step). Neither builds a slot mapping or block-table arrays; ours does.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import types


def _source_of(package: str) -> str | None:
    """The directory of ``package`` on ``sys.path``, found without importing it."""
    for entry in sys.path:
        path = os.path.join(entry or ".", package)
        if os.path.isfile(os.path.join(path, "__init__.py")):
            return os.path.abspath(path)
    return None


def _describe(path: str) -> str:
    """Where a peer's source came from: a git commit, or a wheel's version."""
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    if commit:
        return f"git commit {commit}"
    parent = os.path.dirname(path)
    name = os.path.basename(path)
    for entry in sorted(os.listdir(parent)):
        if entry.startswith(name + "-") and entry.endswith(".dist-info"):
            return f"version {entry[len(name) + 1:-len('.dist-info')]}"
    return path


def _median(xs) -> float:
    return round(statistics.median(xs), 1)


# ---------------------------------------------------------------------- nano-vllm
def _nano_vllm_modules():
    path = _source_of("nanovllm")
    if path is None:
        raise ImportError("nanovllm is not on PYTHONPATH")
    if "nanovllm" not in sys.modules:          # enter the package without its __init__
        pkg = types.ModuleType("nanovllm")
        pkg.__path__ = [path]
        sys.modules["nanovllm"] = pkg
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.sequence import Sequence
    return BlockManager, Sequence, path


def nano_vllm(repeat: int) -> dict:
    try:
        BlockManager, Sequence, path = _nano_vllm_modules()
    except Exception as exc:  # not there, or its own imports fail
        return {"nano_vllm": f"not importable ({type(exc).__name__}: {exc})"}

    def alloc_free(bm, n):
        allocate, blocks, deallocate = bm._allocate_block, bm.blocks, bm._deallocate_block
        t = time.perf_counter()
        for _ in range(n):
            b = allocate()
            blocks[b].ref_count -= 1
            deallocate(b)
        return (time.perf_counter() - t) / n * 1e9

    bm = BlockManager(4096, 16)
    alloc_free(bm, 100_000)
    af = [alloc_free(bm, 200_000) for _ in range(repeat)]

    Sequence.block_size = 16
    first, loop = [], []
    for r in range(3 * repeat):
        bm = BlockManager(1024 * 40, 16)
        seqs = [Sequence(list(range(511))) for _ in range(1024)]
        for s in seqs:
            bm.allocate(s, 0)
        for step in range(2 + (8 * 16 if r == 3 * repeat - 1 else 0)):
            for s in seqs:                     # nano-vllm appends the token, then makes room
                s.append_token(1)
            t = time.perf_counter()
            for s in seqs:
                if bm.can_append(s):
                    bm.may_append(s)
            dt = (time.perf_counter() - t) * 1e6
            if len(seqs[0]) % 16 == 1:         # this step's token opened a new block
                (first if step == 1 else loop).append(dt)
        del bm, seqs                           # as in our harness: not right before a timing
    return {"nano_vllm": _describe(path), "nano_vllm_alloc_free_ns": _median(af),
            "nano_vllm_decode_step_us": _median(first),
            "nano_vllm_decode_step_in_loop_us": _median(loop)}


# ---------------------------------------------------------------------- vLLM
class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports any ``vllm.*`` module but the ``real`` ones as an empty stand-in package whose
    every name is a placeholder class."""

    def __init__(self, real):
        self.real = set(real)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm" and name not in self.real:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)

        def placeholder(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = type(attr, (), {"__init__": lambda self, *a, **k: None})
            setattr(module, attr, value)
            return value

        module.__getattr__ = placeholder
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _vllm_block_pool():
    """vLLM's ``BlockPool`` class, loaded from its unchanged source files."""
    path = _source_of("vllm")
    if path is None:
        raise ImportError("vllm is not on PYTHONPATH")
    real = ["vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool"]
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "vllm"}
    for k in saved:
        del sys.modules[k]
    finder = _StandIns(real)
    sys.meta_path.insert(0, finder)
    try:
        for name in real:
            file = os.path.join(path, *name.split(".")[1:]) + ".py"
            spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return module.BlockPool, path
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k.split(".")[0] == "vllm"]:
            del sys.modules[k]
        sys.modules.update(saved)


def vllm_block_pool(repeat: int) -> dict:
    try:
        BlockPool, path = _vllm_block_pool()
        BlockPool(8, enable_caching=False, hash_block_size=16).get_new_blocks(1)
    except Exception as exc:
        return {"vllm_block_pool": f"not importable ({type(exc).__name__}: {exc})"}

    def alloc_free(pool, n):
        get, free = pool.get_new_blocks, pool.free_blocks
        t = time.perf_counter()
        for _ in range(n):
            free(get(1))
        return (time.perf_counter() - t) / n * 1e9

    pool = BlockPool(4096, enable_caching=False, hash_block_size=16)
    pool.get_new_blocks(100)
    alloc_free(pool, 100_000)
    af = [alloc_free(pool, 200_000) for _ in range(repeat)]

    steps = []
    for _ in range(3 * repeat):
        pool = BlockPool(1024 * 40, enable_caching=False, hash_block_size=16)
        tables = [pool.get_new_blocks(32) for _ in range(1024)]   # 512 tokens each
        t = time.perf_counter()
        for table in tables:                   # token 513 of each: a new block
            if pool.get_num_free_blocks() >= 1:
                table.extend(pool.get_new_blocks(1))
        steps.append((time.perf_counter() - t) * 1e6)
        del pool, tables
    return {"vllm_block_pool": _describe(path), "vllm_block_pool_alloc_free_ns": _median(af),
            "vllm_block_pool_decode_step_us": _median(steps)}
