"""scripts/slim_flashinfer_wheel.py keeps what the paged decode wrapper compiles from and
drops the other kernel families' sources, with a RECORD that matches what is left."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import pathlib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("slim", ROOT / "scripts" /
                                              "slim_flashinfer_wheel.py")
slim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim)

C = "flashinfer/data/csrc/"
KEPT = ["flashinfer/__init__.py", "flashinfer/fused_moe/api.py",
        "flashinfer/data/include/flashinfer/attention/decode.cuh",
        "flashinfer/data/cutlass/include/cute/tensor.hpp",
        C + "batch_decode.cu", C + "batch_decode_jit_binding.cu", C + "batch_prefill.cu",
        C + "batch_prefill_paged.cuh", C + "tvm_ffi_utils.h",
        C + "batch_decode_kernel_inst.jinja", C + "fmha_v2/kernels.json",
        "flashinfer_python-9.9.dist-info/METADATA"]
DROPPED = [C + "norm.cu", C + "fused_moe/gemm.cu", C + "kda/kernel.cuh", C + "xqa/mha.h"]


def test_slim_keeps_the_decode_sources_and_rewrites_record(tmp_path):
    full = tmp_path / "full" / "flashinfer_python-9.9-py3-none-any.whl"
    full.parent.mkdir()
    with zipfile.ZipFile(full, "w") as z:
        for name in KEPT + DROPPED:
            z.writestr(name, f"contents of {name}")
        z.writestr("flashinfer_python-9.9.dist-info/RECORD", "stale\n")
    dest, kept, dropped = slim.slim(full, tmp_path / "out")
    assert dest.name == full.name and (kept, dropped) == (len(KEPT), len(DROPPED))
    with zipfile.ZipFile(dest) as z:
        names = set(z.namelist())
        assert names == set(KEPT) | {"flashinfer_python-9.9.dist-info/RECORD"}
        record = z.read("flashinfer_python-9.9.dist-info/RECORD").decode().splitlines()
        for line in record[:-1]:
            name, digest, size = line.split(",")
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + want.decode() and int(size) == len(data)
        assert record[-1] == "flashinfer_python-9.9.dist-info/RECORD,,"
        assert len(record) == len(KEPT) + 1
