"""The fast runner's device plumbing: graph buckets, node counts, pinned staging and the
gather that feeds a step the tokens of the step before (:mod:`pagedkv.model.runner`)."""
from __future__ import annotations

import functools

import numpy as np

__all__ = ["buckets", "graph_node_count", "gather_kernel", "host_int32"]


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
    """``tokens[i] = greedy[src[i]]`` on the device (one small launch)."""
    import cupy
    return cupy.ElementwiseKernel("raw int32 greedy, int32 src", "int32 token",
                                  "token = greedy[src]", "pagedkv_follow")


def host_int32(n: int, pinned: bool) -> np.ndarray:
    """An int32 host array; page-locked on a GPU, so copies to the device run asynchronously."""
    if not pinned:
        return np.zeros(n, np.int32)
    import cupyx
    return cupyx.empty_pinned((n,), np.int32)
