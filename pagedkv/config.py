"""Settings as values: how a request is decoded (:class:`SamplingParams`) and how an engine is
built (:class:`EngineConfig`).

Both are frozen dataclasses, checked once when they are made, with errors that say what was
expected and what was given. They import nothing heavier than NumPy, so the HTTP layer can
build them without loading the model or the kernels, and a config crosses a process boundary
(the server's engine process) as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .checks import count, is_int, positive_int
from .errors import ConfigError

__all__ = ["SamplingParams", "EngineConfig", "Speculation", "RUNNERS", "BOOKKEEPINGS",
           "PREEMPTIONS", "KV_DTYPES"]

RUNNERS = ("plain", "fast", "fast-eager")
BOOKKEEPINGS = ("teaching", "fast")
PREEMPTIONS = ("recompute", "swap")
KV_DTYPES = ("float32", "float16", "bfloat16", "int8")   # float ones: the model's own only


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``temperature == 0`` is greedy; ``beam_width > 1`` is beam
    search (greedy, ``n == 1``); ``n > 1`` needs a temperature (else the samples are equal)."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0             # keep the k most likely tokens (ties at the k-th: all); 0: off
    n: int = 1
    beam_width: int = 1
    seed: int | None = None
    ignore_eos: bool = False   # an end token does not end the answer (benchmarks' lengths)
    min_tokens: int = 0        # no end token among the first min_tokens (it is masked)

    def __post_init__(self):
        positive_int(self.max_new_tokens, "max_new_tokens")
        positive_int(self.n, "n")
        positive_int(self.beam_width, "beam_width")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not self.temperature >= 0:
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ConfigError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(f"n = {self.n} samples need a temperature > 0 "
                              "(greedy decoding would give n equal answers)")
        if self.beam_width > 1 and (self.n > 1 or self.temperature > 0):
            raise ConfigError("beam search is greedy: give beam_width alone, without n or "
                              "temperature")
        if self.seed is not None and not (is_int(self.seed) and self.seed >= 0):
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not (is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_new_tokens):
            raise ConfigError(f"min_tokens must be an integer in [0, max_new_tokens = "
                              f"{self.max_new_tokens}], got {self.min_tokens!r}")
        if self.beam_width > 1 and (self.ignore_eos or self.min_tokens):
            raise ConfigError("beam search ends its hypotheses at the end token: give "
                              "ignore_eos and min_tokens without beam_width")

    @property
    def width(self) -> int:
        """How many sequences the request runs at once."""
        return max(self.n, self.beam_width)


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding's settings (:mod:`pagedkv.speculate`): a sequence guesses up to
    ``k`` tokens a step by prompt lookup (the tokens that followed the latest earlier
    occurrence of its last ``max_ngram`` down to ``min_ngram`` tokens: a lone repeated
    token guesses wrong too often), and one pass verifies them. No row guesses in a step
    where more than ``max_batch`` sequences decode: there a guessed row costs about what a
    decoded one does, and the step would lose the device's running ahead (guessing needs
    the newest token on the host). Nor does a sequence whose lookup's first guess was the
    token that came less than ``min_rate`` of the time lately
    (:class:`~pagedkv.speculate.Lookup`'s ``rate``): its guesses would cost rows and the
    device's running ahead for too few tokens. It guesses again once they come right."""
    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 2
    max_batch: int = 8          # where guessing still won on an H100 (speculate-h100-*.json)
    min_rate: float = 0.3

    def __post_init__(self):
        positive_int(self.k, "speculate.k (tokens a row guesses)")
        positive_int(self.max_ngram, "speculate.max_ngram")
        positive_int(self.min_ngram, "speculate.min_ngram")
        if self.min_ngram > self.max_ngram:
            raise ConfigError(f"speculate.min_ngram must be at most max_ngram, got "
                              f"min_ngram={self.min_ngram} and max_ngram={self.max_ngram}")
        positive_int(self.max_batch, "speculate.max_batch")
        if isinstance(self.min_rate, bool) or not isinstance(self.min_rate, (int, float)) \
                or not 0 <= self.min_rate <= 1:
            raise ConfigError(f"speculate.min_rate must be a share in [0, 1], got "
                              f"{self.min_rate!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~pagedkv.model.engine.Engine` is built from, but the model.

    * the pool: ``num_blocks`` blocks of ``block_size`` tokens; ``bookkeeping`` ``"teaching"``
      (the chapters' core) or ``"fast"`` (:mod:`pagedkv.fast`); ``prefix_caching`` keeps
      full blocks findable by their tokens after their sequence leaves; ``kv_dtype`` None
      (K/V in the model's dtype) or ``"int8"`` (the 8-bit cache of
      :mod:`pagedkv.kernels.kv8`: about half the bytes a token, so a block costs half);
    * who runs: at most ``max_seqs`` sequences at once; a step computes at most
      ``token_budget`` tokens (None: no budget), decodes first, and with ``chunked_prefill``
      a prompt that does not fit what is left is prefilled a chunk a step; admission keeps
      ``watermark`` of the pool free for the running requests to grow into; a step that
      runs out of blocks preempts by ``"recompute"`` or ``"swap"`` (into a host pool of
      ``host_blocks`` blocks);
    * how it runs: ``runner`` ``"plain"`` (chapter 10's forward pass), ``"fast"`` (fused
      kernels, static buffers, a CUDA graph per batch bucket on a GPU) or ``"fast-eager"``
      (the same without graphs); a page table holds ``max_context`` tokens (None: the
      model's context); prefill passes pack whole prompts up to about ``prefill_chunk``
      tokens; ``overlap`` plans step n + 1 while the device runs step n (None: where the
      runner is a fast one on a GPU);
    * the answers: ``stop_ids`` end a sequence (unless a request ignores them); ``audit``
      checks the pool's invariants after every step;
    * ``speculate``: guess tokens and verify them in the step's one pass (a
      :class:`Speculation`, or ``k`` for ``Speculation(k)``; None: off).
    """
    num_blocks: int
    block_size: int = 16
    max_seqs: int = 64
    stop_ids: tuple = ()
    prefill_chunk: int = 512
    audit: bool = False
    prefix_caching: bool = False
    preemption: str = "recompute"
    host_blocks: int = 0
    watermark: float = 0.01
    runner: str = "plain"
    max_context: int | None = None
    bookkeeping: str = "teaching"
    token_budget: int | None = None
    chunked_prefill: bool = True
    overlap: bool | None = None
    kv_dtype: str | None = None
    speculate: Speculation | None = None

    def __post_init__(self):
        positive_int(self.num_blocks, "num_blocks")
        positive_int(self.block_size, "block_size")
        positive_int(self.max_seqs, "max_seqs")
        positive_int(self.prefill_chunk, "prefill_chunk")
        ids = tuple(self.stop_ids)
        if not all(is_int(t) and t >= 0 for t in ids):
            raise ConfigError(f"stop_ids must be token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_ids", tuple(sorted({int(t) for t in ids})))
        for name in ("audit", "prefix_caching", "chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got "
                                  f"{getattr(self, name)!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ConfigError(f"overlap must be True, False or None (on where the runner is "
                              f"a fast one on a GPU), got {self.overlap!r}")
        if self.kv_dtype is not None:
            _one_of(self.kv_dtype, KV_DTYPES, "kv_dtype (None: the model's dtype)")
        _one_of(self.preemption, PREEMPTIONS, "preemption")
        _one_of(self.runner, RUNNERS, "runner")
        _one_of(self.bookkeeping, BOOKKEEPINGS, "bookkeeping")
        if self.preemption == "swap":
            positive_int(self.host_blocks, "host_blocks (the swap space)")
        else:
            count(self.host_blocks, "host_blocks")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be a share of the pool in [0, 1), "
                              f"got {self.watermark!r}")
        if self.max_context is not None:
            positive_int(self.max_context, "max_context")
        if self.token_budget is not None:
            positive_int(self.token_budget, "token_budget")
        if is_int(self.speculate):
            object.__setattr__(self, "speculate",
                               Speculation(positive_int(self.speculate, "speculate")))
        elif self.speculate is not None and not isinstance(self.speculate, Speculation):
            raise ConfigError(f"speculate must be a Speculation, a number of tokens to "
                              f"guess (k) or None (off), got {self.speculate!r}")

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (checked again)."""
        _known(changes)
        return replace(self, **changes)

    @classmethod
    def of(cls, config: "EngineConfig | None" = None, **settings) -> "EngineConfig":
        """``config`` with ``settings`` changed, or, without one, a config of ``settings``
        (what ``Engine(model, num_blocks=64, ...)`` builds)."""
        if config is not None:
            return config.replace(**settings)
        _known(settings)
        if "num_blocks" not in settings:
            raise ConfigError("an engine needs num_blocks (the pool's size in blocks)")
        return cls(**settings)


def _known(settings: dict) -> None:
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise ConfigError(f"EngineConfig has no setting {', '.join(unknown)}; the settings "
                          f"are {', '.join(sorted(names))}")


def _one_of(value, choices, name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}")
