"""The peers ``python -m pagedkv.bench.kernels`` times beside our kernels: FlashInfer's paged
decode on the very same cache memory (zero-copy through DLPack) and PyTorch's tensors for SDPA.
Both are optional: the benchmark runs without them and says so."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys


def to_torch(a, dtype):
    import torch
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" and t.dtype == torch.uint16 else t


def load_peers():
    peers, notes = {}, {}
    try:
        import torch
        peers["torch"], notes["torch"] = torch, torch.__version__
        import flashinfer
        peers["flashinfer"] = flashinfer
        notes["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as exc:
        notes.setdefault("torch", f"not importable: {type(exc).__name__}: {exc}")
        notes.setdefault("flashinfer", f"not importable: {type(exc).__name__}: {exc}")
    return peers, notes


def flashinfer_release(version):
    """(major, minor) of a FlashInfer version string ("0.2.14.post1" -> (0, 2)); None if the
    string does not start with two numbers."""
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return (int(m[1]), int(m[2])) if m else None


def _prebuild_api(release):
    """The functions a release offers for making its decode (CUDA cores) and prefill (tensor
    cores) JIT modules and building them in one ninja run: (decode, prefill, build, names).

    * 0.2.x: ``flashinfer.jit.attention.pytorch`` and ``flashinfer.jit.core.build_jit_specs``;
    * later (read in 0.7.2.post1): ``flashinfer.jit`` exports ``gen_batch_decode_module`` and
      ``build_jit_specs``. Its tensor-core decode builds the prefill module that
      ``flashinfer.jit.attention.modules._gen_batch_prefill_primary_module`` makes; where that
      function is absent the public ``gen_batch_prefill_module`` is the one it builds.

    Raises ImportError or AttributeError when the release lacks one of them."""
    if release < (0, 3):
        gen = importlib.import_module("flashinfer.jit.attention.pytorch")
        core = importlib.import_module("flashinfer.jit.core")
        return (gen.gen_batch_decode_module, gen.gen_batch_prefill_module,
                core.build_jit_specs, "flashinfer.jit.attention.pytorch")
    jit = importlib.import_module("flashinfer.jit")
    decode, build = jit.gen_batch_decode_module, jit.build_jit_specs
    try:
        modules = importlib.import_module("flashinfer.jit.attention.modules")
        return (decode, modules._gen_batch_prefill_primary_module, build,
                "flashinfer.jit (prefill: _gen_batch_prefill_primary_module)")
    except (ImportError, AttributeError):
        return decode, jit.gen_batch_prefill_module, build, "flashinfer.jit"


def prebuild_flashinfer(torch, dtypes, head_dim, flashinfer=None):
    """Compile FlashInfer's decode (CUDA cores) and prefill (tensor cores) modules for these
    dtypes in one parallel ninja run, instead of one after the other at first use, through
    the API of the installed release. Returns what the run's JSON records:
    ``flashinfer_version``, ``flashinfer_prebuilt`` (bool) and ``flashinfer_prebuild`` (the
    API used, or why nothing was built: then the modules compile at first use, before any
    timing, since every peer is called once before it is timed)."""
    if flashinfer is None:
        import flashinfer
    version = str(getattr(flashinfer, "__version__", "?"))
    res = dict(flashinfer_version=version, flashinfer_prebuilt=False)
    release = flashinfer_release(version)
    if release is None:
        res["flashinfer_prebuild"] = f"skipped: version {version!r} is not one this knows"
        return res
    try:
        gen_decode, gen_prefill, build, api = _prebuild_api(release)
        specs = []
        for name in dtypes:
            dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]
            specs.append(gen_decode(dt, dt, dt, torch.int32, head_dim, head_dim, 0, False,
                                    False))
            specs.append(gen_prefill("fa2", dt, dt, dt, torch.int32, head_dim, head_dim, 0,
                                     False, False, False))
    except (ImportError, AttributeError, TypeError) as exc:
        res["flashinfer_prebuild"] = (f"skipped: FlashInfer {version} has no prebuild API "
                                      f"known here ({type(exc).__name__}: {exc})")
        return res
    try:
        build(specs)
    except Exception as exc:   # the build itself failed: first use will try again, and say
        res["flashinfer_prebuild"] = f"failed: {api}: {type(exc).__name__}: {exc}"[:600]
        return res
    res.update(flashinfer_prebuilt=True, flashinfer_prebuild=api)
    return res


class FlashInferDecode:
    """FlashInfer's paged decode over our cache memory (zero-copy through DLPack)."""

    def __init__(self, flashinfer, torch, q, cache, tables, lens, dtype, use_tensor_cores):
        batch, q_heads, d = q.shape
        _, _, bs, kv_heads, _ = cache.shape
        self.q, self.cache = to_torch(q, dtype), to_torch(cache, dtype)
        t_tables, t_lens = torch.from_dlpack(tables), torch.from_dlpack(lens)
        pages = (t_lens + bs - 1) // bs
        indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
        indptr[1:] = torch.cumsum(pages, 0)
        cols = torch.arange(t_tables.shape[1], device="cuda")[None, :]
        indices = t_tables[cols < pages[:, None]].to(torch.int32).contiguous()
        last = ((t_lens - 1) % bs + 1).to(torch.int32)
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=use_tensor_cores)
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        self.w.plan(indptr, indices, last, q_heads, kv_heads, d, bs, pos_encoding_mode="NONE",
                    q_data_type=tdt, kv_data_type=tdt)
        self.out = torch.empty_like(self.q)
        # what plan chose (0.7 wrappers say: "fa2" on the H200); older ones do not say
        self.backend = getattr(self.w, "resolved_backend", None)

    def __call__(self):
        return self.w.run(self.q, self.cache, out=self.out)


PROBE = """
import sys, torch, flashinfer
qh, kh, dt = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
for tc in (True, False):
    print("try", tc, flush=True)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc)
    w.plan(torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda"),
           torch.arange(8, dtype=torch.int32, device="cuda"),
           torch.tensor([16, 16], dtype=torch.int32, device="cuda"), qh, kh, 128, 16,
           q_data_type=dt, kv_data_type=dt)
    w.run(torch.randn(2, qh, 128, dtype=dt, device="cuda"),
          torch.randn(8, 2, 16, kh, 128, dtype=dt, device="cuda"))
    torch.cuda.synchronize()
    print("ok", tc, flush=True)
"""


def probe_flashinfer(q_heads, kv_heads, dtype):
    """Which FlashInfer paths run for this head layout, tried in a child process (a crash in
    ``plan`` takes the whole process down). Returns ({use_tensor_cores: True/False}, note)."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(q_heads), str(kv_heads), dtype],
                       capture_output=True, text=True, timeout=300)
    ok = {tc: f"ok {tc}" in r.stdout for tc in (True, False)}
    note = f"child exit code {r.returncode}" + ("" if r.returncode >= 0 else
                                                 f" (signal {-r.returncode})")
    return ok, note + "; " + r.stdout.replace("\n", " ").strip()
