"""Write a copy of a FlashInfer wheel without the CUDA sources of kernel families the kernel
benchmark never compiles, so that it fits in one transfer to the GPU machine.

FlashInfer compiles its kernels on first use from the sources it ships under
``flashinfer/data/csrc`` (about 30 MiB of the 0.7.2.post1 wheel's 59, compressed). The paged
decode wrapper, on both its paths, compiles only ``batch_decode*.cu`` and ``batch_prefill*.cu``
from there (``gen_customize_batch_decode_module`` and the fa2 branch of
``gen_customize_batch_prefill_module`` in ``flashinfer/jit/attention/modules.py``), with the
headers and templates beside them. So the copy keeps every Python file, the headers under
``data/include``, CUTLASS, CCCL and spdlog, every top-level file of ``csrc`` that is not a
``.cu`` source, and the ``batch_decode*``/``batch_prefill*`` sources; it drops the C/C++
sources in ``csrc``'s subfolders and the other top-level ``.cu`` files. RECORD is rewritten
to list what is left. Any other kernel of that copy fails to compile (a missing file).

Usage: python scripts/slim_flashinfer_wheel.py FULL.whl OUT_DIR
"""
from __future__ import annotations

import base64
import hashlib
import pathlib
import re
import sys
import zipfile

CSRC = "flashinfer/data/csrc/"
SOURCES = (".cu", ".cuh", ".h", ".hpp", ".cc", ".cpp", ".c", ".inl", ".ptx")
KEEP_CU = re.compile(r"batch_(decode|prefill)[^/]*\.cu$")


def keep(name: str) -> bool:
    """Whether a file of the wheel stays in the slim copy."""
    if not name.startswith(CSRC):
        return True
    rel = name[len(CSRC):]
    if not rel.endswith(SOURCES):
        return True                          # templates (.jinja), configs (.inc), json
    if "/" in rel:
        return False                         # the sources of other kernel families
    return not rel.endswith(".cu") or bool(KEEP_CU.match(rel))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(full: pathlib.Path, out_dir: pathlib.Path) -> tuple[pathlib.Path, int, int]:
    """Write the slim copy (same file name) into ``out_dir``; returns (path, files kept,
    files dropped)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / full.name
    kept = dropped = 0
    with zipfile.ZipFile(full) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED,
                                                       compresslevel=9) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in src.infolist():
            if info.filename == record_name or info.is_dir():
                continue
            if not keep(info.filename):
                dropped += 1
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            lines.append(_record_line(info.filename, data))
            kept += 1
        lines.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(lines) + "\n")
    return dest, kept, dropped


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    path, kept, dropped = slim(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
    print(f"{path}: {kept} files kept, {dropped} dropped, "
          f"{path.stat().st_size / 2**20:.1f} MiB")
