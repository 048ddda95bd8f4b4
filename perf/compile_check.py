"""Compile the attention kernels with nvcc for sm_90, without a GPU: syntax, registers, spills.

    python perf/compile_check.py            # every template instance the launchers can ask for
    python perf/compile_check.py --quick    # one instance per kernel
    python perf/compile_check.py --nvrtc    # through NVRTC too, as CuPy compiles at run time

NVRTC (what CuPy uses at run time) and nvcc share the front end, so a kernel that compiles here
compiles there; ``-Xptxas -v`` reports registers, shared memory and spill bytes per instance.
Each instance is named the way the launchers name it (``pagedkv.kernels`` ``*_name`` helpers).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import struct
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv.kernels import _common, attention, prefill, staircase  # noqa: E402


def instances(quick: bool):
    """(source file, kernel names) for every kernel family."""
    out = []
    prod, tc = [], []
    dts = (1,) if quick else (0, 1, 2)
    for dt in dts:
        for d in ((128,) if quick else (64, 128, 256)):
            for g in ((4, 8) if quick else range(1, 9)):
                for bs in ((16,) if quick else (8, 16, 32)):
                    prod.append(attention.cuda_core_name(dt, d, g, bs))
                    prod.append(attention.cuda_core_name(dt, d, g, bs, kv8=True))   # int8 K/V
                    if dt:
                        tc.append(attention.tensor_core_name(dt, d, g, bs))
                        tc.append(attention.tensor_core_name(dt, d, g, bs, kv8=True))
    prod += [f"merge_splits<{dt}>" for dt in dts]
    out.append(("paged_decode.cu", prod))
    out.append(("paged_decode_tc.cu", tc))
    out.append(("staircase.cu", staircase.all_names(quick)))
    out.append((prefill.PREFILL_SOURCE, prefill_instances(quick)))
    return out


#: Launch shapes of the prefill kernel besides the default that perf/prefill_check.py times.
PREFILL_SWEEP = {64: [(8, 1, 64, 2), (2, 1, 64, 2), (4, 2, 32, 2), (4, 1, 128, 2),
                      (4, 1, 64, 3)],
                 128: [(8, 1, 64, 2), (2, 1, 64, 2), (4, 1, 32, 2), (4, 1, 64, 3)]}


def prefill_instances(quick: bool):
    """Every dtype, head_dim, group and block size with the default launch shape, and the
    swept shapes for SmolLM2's (fp16, 64, group 3) and a Llama-8B-like (bf16, 128, group 4)."""
    names = []
    for dt in (1,) if quick else (1, 2):
        for d in prefill.PREFILL_HEAD_DIMS:
            for g in ((3, 8) if quick else range(1, _common.MAX_GROUP + 1)):
                for bs in ((16,) if quick else _common.BLOCK_SIZES):
                    names.append(prefill.prefill_name(dt, d, g, bs))
                    names.append(prefill.prefill_name(dt, d, g, bs, kv8=True))   # int8 K/V
    for dt, d, g in ((1, 64, 3), (2, 128, 4)):
        names += [prefill.prefill_name(dt, d, g, 16, c) for c in PREFILL_SWEEP[d]]
    return names


def compile_one(fname, names, arch="sm_90"):
    src = _common.load_source(fname)
    refs = ",\n".join(f"    (void*)&{n}" for n in sorted(set(names)))
    src += f"\nvoid* pagedkv_instances[] = {{\n{refs}\n}};\n"
    with tempfile.TemporaryDirectory() as tmp:
        cu = pathlib.Path(tmp) / fname
        cu.write_text(src)
        cmd = ["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "--use_fast_math", "-Xptxas",
               "-v", "-o", str(cu.with_suffix(".cubin")), str(cu)]
        r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def cubin_resources(cubin: bytes):
    """(registers, stack frame bytes) from a one-kernel cubin's .nv.info section: the records
    EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11), each (format 4, attribute, size,
    function symbol, value). A frame above 0 means local memory: spills, or arrays the
    compiler could not keep in registers."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
             for i in range(shnum)]
    names_at = heads[shstrndx][4]
    found = {}
    for h in heads:
        name = cubin[names_at + h[0]:cubin.index(b"\0", names_at + h[0])]
        if name != b".nv.info":
            continue
        data, i = cubin[h[4]:h[4] + h[5]], 0
        while i + 4 <= len(data):
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt == 4:
                if attr in (0x2f, 0x11):
                    found[attr] = struct.unpack_from("<I", data, i + 8)[0]
                i += 4 + size
            else:
                i += 4
    return found.get(0x2f, -1), found.get(0x11, -1)


def compile_nvrtc(fname, names, arch="sm_90"):
    """Each instance through NVRTC the way ``pagedkv.kernels._common.kernel`` has CuPy do it
    (one program per template instance, found by its name expression; CuPy's options: ours,
    -arch, --device-as-default-execution-space), without a GPU: needs CuPy and libnvrtc (the
    nvidia-cuda-nvrtc wheel's, say, on LD_LIBRARY_PATH). Returns {name: (registers, frame
    bytes)} and [(name, why)] for failures."""
    from cupy.cuda import compiler
    src, ok, bad = _common.load_source(fname), {}, []
    options = _common.NVRTC_OPTIONS + (f"-arch={arch}", "--device-as-default-execution-space")
    for name in names:
        try:
            prog = compiler._NVRTCProgram(src, "kern.cu", (), (), name_expressions=[name],
                                          method="cubin")
            cubin, mapping = prog.compile(options)
            if not cubin or not mapping or not mapping.get(name):
                bad.append((name, "no code or no lowered name"))
            else:
                ok[name] = cubin_resources(cubin)
        except Exception as exc:
            bad.append((name, f"{type(exc).__name__}: {str(exc)[:3000]}"))
    return ok, bad


def report(log):
    """One line per instance: name, registers, spill stores/loads, shared memory."""
    lines, name = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and name:
            spill = (int(m.group(2)), int(m.group(3)))
        m2 = re.search(r"Used (\d+) registers", line)
        if m2 and name:
            smem = re.search(r"(\d+) bytes smem", line)
            lines.append((name, int(m2.group(1)), spill, int(smem.group(1)) if smem else 0))
            name = None
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--nvrtc", action="store_true", help="compile through NVRTC as well")
    args = ap.parse_args()
    bad = 0
    for fname, names in instances(args.quick):
        rc, log = compile_one(fname, names)
        rows = report(log)
        spilled = [r for r in rows if r[2] != (0, 0)]
        print(f"{fname}: {len(names)} instances, rc={rc}, registers "
              f"{min((r[1] for r in rows), default=0)}-{max((r[1] for r in rows), default=0)}, "
              f"{len(spilled)} with spills")
        if rc or args.verbose:
            print(log[-6000:])
        for r in spilled:
            print(f"   spills: {r}")
        bad += rc != 0
        if args.nvrtc:
            done, failed = compile_nvrtc(fname, sorted(set(names)))
            regs = [r for r, _ in done.values()]
            framed = [n for n, (_, f) in done.items() if f != 0]
            print(f"   NVRTC: {len(done)} of {len(set(names))} compiled, registers "
                  f"{min(regs, default=0)}-{max(regs, default=0)}, {len(framed)} with a stack "
                  f"frame")
            for name in framed if not args.verbose else sorted(done):
                print(f"   NVRTC {name}: {done[name][0]} registers, {done[name][1]} B frame")
            for name, why in failed:
                print(f"   NVRTC failed: {name}: {why}")
            bad += bool(failed)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
