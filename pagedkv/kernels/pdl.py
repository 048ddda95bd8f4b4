"""Programmatic dependent launch: a kernel that starts before the one ahead of it has ended.

In a CUDA stream (and in a graph captured from one) a kernel normally starts only after the
kernel before it has finished and its writes are visible: between two kernels the GPU drains
one grid, then launches and ramps up the next. A decode step of ~180 small kernels pays that
gap every time (chapter 12). Hopper GPUs (the H200 is one) let a launch say *programmatic
stream serialization*: the next kernel's CTAs may start as soon as the one before has
signalled (``griddepcontrol.launch_dependents`` in PTX, or when its CTAs exit), and run
whatever does not depend on it, such as asking L2 for their weights, until they reach
``griddepcontrol.wait``, which returns when the kernel before has finished and its writes
are visible. ``common.cuh`` spells the two as ``wait_for_prior_grid()`` and
``let_next_grid_start()``.

So a kernel may be launched this way only if it waits before it touches anything the kernel
before it writes, or writes anything that kernel reads. The kernels of the decode step that do
are launched through :func:`launch`; inside ``with programmatic(True):`` it launches them with
that attribute, otherwise (and always on NumPy, or a GPU older than Hopper) exactly as CuPy
would. CuPy's kernel call has no place for launch attributes, so :func:`launch` calls the CUDA
driver's ``cuLaunchKernelEx`` itself through ``ctypes`` (the driver library that CuPy
already uses; no new dependency), with CuPy's compiled function and the current stream.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools

import numpy as np

from ..errors import ConfigError

__all__ = ["launch", "programmatic", "programmatic_available"]

_ON = contextvars.ContextVar("pagedkv_programmatic_launch", default=False)

# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION in cuda.h
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte union of values."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    """CUlaunchConfig: grid and block shapes, shared memory, stream, attributes."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuLaunchKernelEx
    f.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


@functools.lru_cache(maxsize=None)
def programmatic_available() -> bool:
    """Can this machine launch programmatically? A CuPy GPU of compute capability 9.0 or
    later, and a driver with ``cuLaunchKernelEx``."""
    from .. import backend
    if backend.xp is np:
        return False
    try:
        major = int(backend.xp.cuda.Device().compute_capability) // 10
        _driver()
    except Exception:
        return False
    return major >= 9


@contextlib.contextmanager
def programmatic(on: bool = True):
    """Within the block, :func:`launch` launches programmatically where it can (``on``)."""
    token = _ON.set(bool(on) and programmatic_available())
    try:
        yield
    finally:
        _ON.reset(token)


def _holder(a):
    """A ctypes value holding one kernel argument, as CuPy would pass it."""
    if isinstance(a, np.generic):
        return np.ctypeslib.as_ctypes_type(a.dtype)(a.item())
    data = getattr(a, "data", None)
    if data is not None and hasattr(data, "ptr"):           # a CuPy array: its address
        return ctypes.c_void_p(data.ptr)
    raise ConfigError(f"a programmatic launch takes CuPy arrays and NumPy scalars as "
                      f"arguments (their C types are known), got {type(a).__name__}")


_ATTRIBUTE = _Attribute(_PROGRAMMATIC_STREAM_SERIALIZATION)
_ATTRIBUTE.value[0] = 1                            # programmaticStreamSerializationAllowed


@functools.lru_cache(maxsize=4096)
def _config(grid, block, shared_mem, stream):
    """The launch configuration of one shape on one stream, built once: an eager pass
    launches the same few shapes again and again."""
    return _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                   stream, ctypes.pointer(_ATTRIBUTE), 1)


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """``fn(grid, block, args, shared_mem=shared_mem)``, programmatically inside
    :func:`programmatic` (``fn`` must then wait with ``wait_for_prior_grid()`` before it
    touches what the kernel before it writes or reads)."""
    if not _ON.get():
        fn(grid, block, args, shared_mem=shared_mem)
        return
    from .. import backend
    config = _config((tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3],
                     int(shared_mem), backend.xp.cuda.get_current_stream().ptr)
    holders = [_holder(a) for a in args]
    params = (ctypes.c_void_p * max(len(holders), 1))(
        *[ctypes.addressof(h) for h in holders])
    status = _driver()(ctypes.byref(config), getattr(fn, "kernel", fn).ptr, params, None)
    if status != 0:
        raise ConfigError(f"cuLaunchKernelEx failed with CUDA driver error {status}")
