"""The fast runner's device plumbing: its buffers as one bucket sees them, graph buckets,
node counts, pinned staging and the gather that gives a row an input token the device
already holds (:mod:`pagedkv.model.runner`)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

__all__ = ["Views", "buckets", "graph_node_count", "gather_kernel", "host_int32"]


class Views(NamedTuple):
    """Every buffer of one pass: the first ``b`` rows of the full-size arrays."""
    tokens: object
    positions: object
    slots: object
    seq_lens: object
    tables: object
    x: object          # the residual stream [b, hidden]
    h: object          # a normed copy of it
    qkv: object        # [b, (heads + 2 kv_heads) * head_dim]
    q: object          # [b, heads, head_dim], rotated
    attn: object       # [b, heads, head_dim]
    gate_up: object    # [b, 2 ffn]
    act: object        # [b, ffn]
    logits: object     # float32 [b, vocab]
    greedy: object     # int32 [b]
    plan: object       # the attention's launch for this bucket (GPU), or None
    scratch: object    # its split results (GPU), or None
    query_start: object = None   # a prefill's: where each sequence's rows begin


def buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every 8 up to 64, then every 16,
    ending at ``max_batch`` (a batch runs in the smallest bucket that holds it)."""
    out, b = [], 1
    while b < min(8, max_batch):
        out.append(b)
        b *= 2
    while b < max_batch:
        out.append(b)
        b += 8 if b < 64 else 16
    return out + [max_batch]


def graph_node_count(graph) -> int | None:
    """The nodes of a captured ``cupy.cuda.graph.Graph`` (its ``graph`` attribute is the
    ``cudaGraph_t`` handle): through cuda-bindings' ``cudaGraphGetNodes`` if installed, else
    the driver's ``cuGraphGetNodes`` by ctypes (a ``cudaGraph_t`` is a ``CUgraph``); None
    when neither answers."""
    handle = int(graph.graph)
    try:
        from cuda.bindings import runtime as rt
        answer = rt.cudaGraphGetNodes(handle, 0)       # (error, nodes: none asked, count)
        if answer[0] == rt.cudaError_t.cudaSuccess:
            return int(answer[-1])
    except Exception:                                  # not installed, or another API
        pass
    try:
        import ctypes
        count = ctypes.c_size_t(0)
        if ctypes.CDLL("libcuda.so.1").cuGraphGetNodes(
                ctypes.c_void_p(handle), None, ctypes.byref(count)) == 0:
            return int(count.value)
    except Exception:
        pass
    return None


@functools.lru_cache(maxsize=None)
def gather_kernel():
    """``tokens[i] = drawn[src[i]]`` where ``src[i] >= 0``, on the device (one small
    launch; the other rows keep the token the host gave)."""
    import cupy
    return cupy.ElementwiseKernel("raw int32 drawn, int32 src", "int32 token",
                                  "if (src >= 0) token = drawn[src]", "pagedkv_follow")


def host_int32(n: int, pinned: bool) -> np.ndarray:
    """An int32 host array; page-locked on a GPU, so copies to the device run asynchronously."""
    if not pinned:
        return np.zeros(n, np.int32)
    import cupyx
    return cupyx.empty_pinned((n,), np.int32)
