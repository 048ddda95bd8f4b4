"""Capacity: how many sequences fit at once in one GPU's memory, beside a model's weights.

Two ways to count, for the same memory and the same requests:

* :func:`fit_sequences` — arithmetic from :class:`~pagedkv.spec.KVSpec` alone. A contiguous
  reservation holds the model's whole context for every sequence; paging holds each
  sequence's own length, rounded up to whole blocks. Requests are taken in arrival order,
  each counted at its *final* length (prompt + output), so every sequence counted could run
  to its end without being preempted.
* :func:`simulate_capacity` — the simulation (:func:`~pagedkv.sim.serving.serve`) on a pool
  of the same number of token slots, requests arriving faster than they finish, so that
  memory is what limits the batch; :func:`concurrency` reads how many ran at once.

The numbers, and where they come from:

* Llama-3-8B's K/V shape (:data:`LLAMA3_8B`): 32 layers, 8 KV heads of 128 numbers in
  bfloat16 (its ``config.json``; the Llama 3 paper, Grattafiori et al. 2024), so 131,072
  bytes a token; its context, 8,192 tokens (:data:`LLAMA3_8B_CONTEXT`, the config's
  ``max_position_embeddings``).
* Its weights (:data:`LLAMA3_8B_PARAMS`): 8,030,261,248 parameters (counted from the same
  config in :func:`llama3_8b_params`; "8.03B params" as Hugging Face lists the model), 2
  bytes each in bfloat16.
* One H200's memory (:data:`H200_BYTES`): 141 GB of HBM3e by NVIDIA's datasheet, read as
  141 x 10**9 bytes. ``nvidia-smi`` on the H200 machines this project runs on reports
  143,771 MiB (150.8 x 10**9 bytes; seen 2026-10-27 and 2026-12-02): the datasheet is the
  smaller, so the counts here are not flattered by it.
* The share a serving engine takes (:data:`GPU_MEMORY_UTILIZATION`): 0.9, the default of
  vLLM's ``gpu_memory_utilization`` up to at least v0.10.2 (``CacheConfig`` in
  ``vllm/config/cache.py``; its current docs give 0.92). vLLM fits the weights, the K/V
  cache and the peak activations inside that share; here the K/V cache gets the share less
  the weights, and the rest of the card (10 %) stands for activations and the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import cdiv, positive_int
from ..errors import ConfigError
from ..spec import KVSpec
from .kvdata import SIM_SPEC
from .measure import Run
from .policies import make_policy
from .serving import serve
from .workloads import Workload

__all__ = ["LLAMA3_8B", "LLAMA3_8B_CONTEXT", "LLAMA3_8B_PARAMS", "BYTES_PER_PARAM",
           "H200_BYTES", "GPU_MEMORY_UTILIZATION", "GB", "llama3_8b_params", "Budget",
           "kv_budget", "Fit", "fit_sequences", "simulate_capacity", "concurrency",
           "capacity_table"]

GB = 10**9

#: Llama-3-8B's KV cache: 32 layers x 8 KV heads x head dim 128, bfloat16 (``config.json``:
#: ``num_hidden_layers``, ``num_key_value_heads``, ``hidden_size / num_attention_heads``).
LLAMA3_8B = KVSpec(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
#: Llama-3-8B's context length (``max_position_embeddings`` in its ``config.json``).
LLAMA3_8B_CONTEXT = 8192
#: Llama-3-8B's parameters, as :func:`llama3_8b_params` counts them from its config.
LLAMA3_8B_PARAMS = 8_030_261_248
#: bfloat16 weights.
BYTES_PER_PARAM = 2
#: One H200: 141 GB of HBM3e (NVIDIA's datasheet), in bytes.
H200_BYTES = 141 * GB
#: The share of the GPU a serving engine claims for weights and K/V: vLLM's default
#: ``gpu_memory_utilization`` (0.9 through v0.10.2 at least; 0.92 in its current docs).
GPU_MEMORY_UTILIZATION = 0.9


def llama3_8b_params(vocab: int = 128_256, hidden: int = 4096, intermediate: int = 14_336,
                     layers: int = 32, heads: int = 32, kv_heads: int = 8) -> int:
    """Llama-3-8B's parameter count from its ``config.json`` shape: untied input and
    output embeddings, and per layer the four attention projections (K and V are
    ``kv_heads`` heads wide), the three MLP matrices and two RMSNorm weights; one final
    norm."""
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


@dataclass(frozen=True)
class Budget:
    """One GPU's memory, split: the weights, the share left for activations and the
    runtime, and the K/V cache (what is left of the engine's share after the weights)."""
    gpu_bytes: int
    weight_bytes: int
    utilization: float

    @property
    def engine_bytes(self) -> int:
        """What the engine claims: ``utilization`` of the GPU."""
        return int(self.utilization * self.gpu_bytes)

    @property
    def runtime_bytes(self) -> int:
        """Left out of the engine's share: activations, the CUDA context, the runtime."""
        return self.gpu_bytes - self.engine_bytes

    @property
    def kv_bytes(self) -> int:
        return self.engine_bytes - self.weight_bytes


def kv_budget(gpu_bytes: int = H200_BYTES,
              weight_bytes: int = LLAMA3_8B_PARAMS * BYTES_PER_PARAM,
              utilization: float = GPU_MEMORY_UTILIZATION) -> Budget:
    """The K/V cache's share of one GPU beside a model's weights (one H200 and
    Llama-3-8B in bfloat16 by default)."""
    gpu_bytes = positive_int(gpu_bytes, "gpu_bytes")
    weight_bytes = positive_int(weight_bytes, "weight_bytes")
    if isinstance(utilization, bool) or not 0 < utilization <= 1:
        raise ConfigError(f"utilization must be a share of the GPU in (0, 1], "
                          f"got {utilization!r}")
    budget = Budget(gpu_bytes, weight_bytes, float(utilization))
    if budget.kv_bytes < 1:
        raise ConfigError(f"the weights ({weight_bytes:,} bytes) leave no room for K/V in "
                          f"{utilization:.0%} of {gpu_bytes:,} bytes "
                          f"({budget.engine_bytes:,} bytes)")
    return budget


@dataclass(frozen=True)
class Fit:
    """How many sequences one scheme fits in a pool, counted in token slots: the pool's
    slots (for paging, its whole blocks), the slots the sequences hold, and the tokens
    they store at their full lengths."""
    scheme: str
    sequences: int
    pool_tokens: int
    held_tokens: int
    stored_tokens: int
    token_bytes: int

    @property
    def empty_tokens(self) -> int:
        """Held but never filled: the rest of a reservation, the end of a last block."""
        return self.held_tokens - self.stored_tokens

    @property
    def free_tokens(self) -> int:
        return self.pool_tokens - self.held_tokens


def _lengths(lengths, context: int) -> np.ndarray:
    a = np.asarray(lengths)
    if a.ndim != 1 or not len(a) or a.dtype.kind not in "iu" or a.min() < 1:
        raise ConfigError(f"lengths must be a non-empty 1-D array of positive integers, "
                          f"got {a.dtype} of shape {a.shape}")
    if a.max() > context:
        raise ConfigError(f"a sequence of {int(a.max())} tokens is longer than the "
                          f"context of {context}")
    return a.astype(np.int64)


def fit_sequences(lengths, kv_bytes: int, *, spec: KVSpec = LLAMA3_8B,
                  context: int = LLAMA3_8B_CONTEXT,
                  block_size: int = 16) -> tuple[Fit, Fit]:
    """How many sequences fit at once in ``kv_bytes``: (contiguous, paged).

    Contiguous: every sequence reserves ``context`` slots, so ``pool // context`` fit
    (ranges of one size leave no holes). Paged: the pool is ``kv_bytes // block bytes``
    blocks; sequences are taken in the order given, each holding
    ``ceil(length / block_size)`` blocks at its full ``length``, while they fit. Raises
    :class:`ConfigError` if every length given fits (give more to fill the pool)."""
    context = positive_int(context, "context")
    block_size = positive_int(block_size, "block_size")
    lens = _lengths(lengths, context)
    kv_bytes = positive_int(kv_bytes, "kv_bytes")
    pool = spec.tokens_that_fit(kv_bytes)
    if pool < context:
        raise ConfigError(f"{kv_bytes:,} bytes hold {pool} tokens of "
                          f"{spec.bytes_per_token} bytes, less than one context of "
                          f"{context}")
    n_contig = pool // context
    blocks = kv_bytes // spec.block_bytes(block_size)
    held = np.cumsum(cdiv(lens, block_size))
    n_paged = int(np.searchsorted(held, blocks, side="right"))
    if n_paged == len(lens) or n_contig > len(lens):
        raise ConfigError(f"all {len(lens)} lengths fit in {blocks} blocks of "
                          f"{block_size} tokens; give more lengths to fill the pool")
    stored = np.cumsum(lens)
    contiguous = Fit(f"contiguous, {context}", n_contig, pool, n_contig * context,
                     int(stored[n_contig - 1]) if n_contig else 0, spec.bytes_per_token)
    paged = Fit(f"paged, block {block_size}", n_paged, blocks * block_size,
                int(held[n_paged - 1]) * block_size if n_paged else 0,
                int(stored[n_paged - 1]) if n_paged else 0, spec.bytes_per_token)
    return contiguous, paged


def simulate_capacity(workload: Workload, kv_bytes: int, *, spec: KVSpec = LLAMA3_8B,
                      context: int = LLAMA3_8B_CONTEXT,
                      policies=("max-length", "paged:16"),
                      bookkeeping: str = "fast") -> dict[str, Run]:
    """Serve ``workload`` with each policy on a pool of as many token slots as
    ``kv_bytes`` holds at ``spec``'s bytes per token; max-length reserves ``context``.

    Only memory limits the batch: no cap on the sequences running and no token budget
    a step (each is raised past the workload's size). The simulation counts slots, not
    bytes, so it runs on :data:`~pagedkv.sim.SIM_SPEC`'s small tokens at the same number
    of slots: the host never claims (or touches: nothing is written) the GPU's bytes."""
    slots = spec.tokens_that_fit(positive_int(kv_bytes, "kv_bytes"))
    pool = slots * SIM_SPEC.bytes_per_token
    n = len(workload)
    budget = max(n * workload.longest, 1)
    runs = {}
    for name in policies:
        options = dict(bookkeeping=bookkeeping, max_seqs=n) if name.startswith("paged") \
            else {}
        policy = make_policy(name, pool, context, **options)
        runs[name] = serve(workload, policy, max_seqs=n, token_budget=budget)
    return runs


def concurrency(run: Run) -> float:
    """Sequences running at once, averaged over the steps when a request was waiting
    (memory was what held it back); 0.0 if none waited."""
    s = run.series
    busy = s["waiting"] > 0
    return float(s["running"][busy].mean()) if busy.any() else 0.0


def capacity_table(budget: Budget, fits, simulated=()) -> str:
    """The budget and, per scheme in ``fits``, the sequences that fit, the shares of the
    K/V pool they store, hold empty and leave free, and (``simulated``, one number per
    fit, e.g. :func:`concurrency`) how many ran at once in the simulation. Lines of at
    most 88 columns."""
    simulated = list(simulated)
    if simulated and len(simulated) != len(fits):
        raise ConfigError(f"simulated needs one number per fit ({len(fits)}), "
                          f"got {len(simulated)}")
    rows = [f"GPU {budget.gpu_bytes / GB:.1f} GB, {budget.utilization:.0%} to the engine: "
            f"weights {budget.weight_bytes / GB:.2f} GB, runtime "
            f"{budget.runtime_bytes / GB:.2f} GB, K/V {budget.kv_bytes / GB:.2f} GB",
            f"{'scheme':<18}{'sequences':>10}{'K/V stored':>12}{'held empty':>12}"
            f"{'free':>8}{'simulated':>11}"]
    for i, f in enumerate(fits):
        sim_col = f"{simulated[i]:>11,.0f}" if simulated else f"{'-':>11}"
        rows.append(f"{f.scheme:<18}{f.sequences:>10,}"
                    f"{f.stored_tokens / f.pool_tokens:>12.1%}"
                    f"{f.empty_tokens / f.pool_tokens:>12.1%}"
                    f"{f.free_tokens / f.pool_tokens:>8.1%}{sim_col}")
    return "\n".join(rows)
