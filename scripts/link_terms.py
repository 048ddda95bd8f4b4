"""Link a glossary term at its first use in a chapter: ``python scripts/link_terms.py``.

Each entry of ``FIRST_USES`` names a chapter, the words as its prose has them and the
glossary term they use; the first occurrence of the words in the chapter's markdown cells
(outside code spans, roles, headings and directive lines) becomes ``{term}`words <term>```.
Idempotent: a chapter whose words already carry a ``{term}`` link to that term is left alone.
``--check`` exits 1 if anything would change.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIRST_USES = [   # (chapter file, the words in the prose, the glossary term)
    ("01_why_paging", "KV cache", "KV cache"),
    ("01_why_paging", "grouped-query attention", "grouped-query attention"),
    ("03_allocator", "audit", "audit"),
    ("06_simulation", "continuous-batching", "continuous batching"),
    ("06_simulation", "watermark", "watermark"),
    ("06_simulation", "token budget", "token budget"),
    ("07_copy_on_write", "Parallel sampling", "parallel sampling"),
    ("07_copy_on_write", "beam search", "beam search"),
    ("09_attention_kernels", "PagedAttention kernel", "paged attention"),
    ("09_attention_kernels", "online", "online softmax"),
    ("09_attention_kernels", "tensor core", "tensor core"),
    ("11_prefix_caching", "Prefix caching", "prefix caching"),
    ("11_prefix_caching", "Preemption", "preemption"),
    ("11_prefix_caching", "idle", "idle block"),
    ("11_prefix_caching", "evicted", "eviction"),
    ("12_fast_decode", "launch", "kernel launch"),
    ("12_fast_decode", "CUDA graph", "CUDA graph"),
    ("12_fast_decode", "bucket", "bucket"),
    ("12_fast_decode", "padding row", "padding row"),
    ("12_fast_decode", "cuBLAS", "cuBLAS"),
    ("12_fast_decode", "CUDA stream", "CUDA stream"),
    ("12_fast_decode", "persistent kernel", "persistent kernel"),
    ("12_fast_decode", "Programmatic dependent launch", "PDL"),
    ("12_fast_decode", "L2", "L2"),
    ("12_fast_decode", "GGUF", "GGUF"),
    ("12_fast_decode", "Q4_1", "Q4_1"),
    ("12_fast_decode", "roofline", "roofline"),
    ("10_real_model", "GGUF", "GGUF"),
    ("13_scheduling", "token budget", "token budget"),
    ("13_scheduling", "chunks", "chunked prefill"),
    ("14_two_gpus", "Disaggregated serving", "disaggregated prefill"),
    ("14_two_gpus", "Tensor parallelism", "tensor parallelism"),
    ("14_two_gpus", "NCCL", "NCCL"),
    ("14_two_gpus", "all-reduce", "all-reduce"),
    ("15_serving", "OpenAI's API", "OpenAI-compatible API"),
    ("15_serving", "server-sent events", "server-sent events"),
    ("15_serving", "stop string", "stop string"),
    ("15_serving", "time to first token", "time to first token"),
    ("16_engines", "radix tree", "radix tree"),
]
SKIP_LINE = re.compile(r"^\s*(#|```|:[a-z-]+:)")


def _free(line: str, i: int) -> bool:
    """Whether position ``i`` of ``line`` lies outside code spans and roles."""
    return line[:i].count("`") % 2 == 0


def link(cells: list, words: str, term: str) -> bool:
    """Link the first free occurrence of ``words``; False if none (or already linked)."""
    role = f"{{term}}`{words}`" if words.lower() == term.lower() else \
        f"{{term}}`{words} <{term}>`"
    pattern = re.compile(rf"(?<![\w`<-]){re.escape(words)}(?![\w`>-])")
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        low = text.lower()                    # {term}`Tensor parallelism` links it too
        if f"<{term.lower()}>`" in low or f"{{term}}`{term.lower()}`" in low:
            return False
        lines = text.split("\n")
        for n, line in enumerate(lines):
            if SKIP_LINE.match(line):
                continue
            for m in pattern.finditer(line):
                if _free(line, m.start()):
                    lines[n] = line[:m.start()] + role + line[m.end():]
                    cell["source"] = "\n".join(lines).splitlines(True)
                    return True
    return False


def main(argv) -> int:
    check = "--check" in argv
    changed = 0
    for name, words, term in FIRST_USES:
        path = ROOT / "book" / f"{name}.ipynb"
        nb = json.loads(path.read_text())
        if link(nb["cells"], words, term):
            changed += 1
            print(f"{name}: {words!r} -> {term}")
            if not check:
                path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
