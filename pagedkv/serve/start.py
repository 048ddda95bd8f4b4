"""What the server's engine is made from (:class:`EngineSpec`), and making it where it runs
(:func:`make_engine`): in the engine's own process (the default) or the server's. A module
of its own, light to import, so that a child process can import it.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ..checks import cdiv
from ..config import EngineConfig
from ..errors import ConfigError

__all__ = ["EngineSpec", "make_engine", "GPU_TOKENS_PER_SEQ", "AUTO"]

log = logging.getLogger("pagedkv.serve")

#: Blocks of the default pool on a GPU: this many tokens for each of ``--max-seqs``
#: sequences, at most half of the device's free memory.
GPU_TOKENS_PER_SEQ = 2048
#: The settings the machine decides when they are not given.
AUTO = ("num_blocks", "max_seqs", "runner")


@dataclass(frozen=True)
class EngineSpec:
    """The model to load and the engine's settings: ``engine`` as given, where the
    settings named in ``auto`` are placeholders that :meth:`resolve` decides on the
    machine the model runs on (the pool, the batch and the runner are the GPU's to size).
    It crosses to the engine's process as it is."""
    model: str = "smollm2"             # "smollm2" (the GGUF file) or "tiny"
    gguf: str | None = None
    engine: EngineConfig = EngineConfig(num_blocks=256, max_seqs=32, token_budget=2048)
    auto: frozenset = frozenset(AUTO)

    def __post_init__(self):
        if self.model not in ("smollm2", "tiny"):
            raise ConfigError(f"the model must be 'smollm2' or 'tiny', got {self.model!r}")
        unknown = set(self.auto) - set(AUTO)
        if unknown:
            raise ConfigError(f"only {', '.join(AUTO)} can be left to the machine, got "
                              f"{', '.join(sorted(unknown))}")
        object.__setattr__(self, "auto", frozenset(self.auto))

    @classmethod
    def of(cls, model="smollm2", gguf=None, **settings) -> "EngineSpec":
        """A spec from the command line's values: 0 (or ``runner="auto"``) leaves
        ``num_blocks``, ``max_seqs`` and ``runner`` to the machine."""
        auto = {k for k in AUTO if settings.get(k) in (None, 0, "auto")}
        for k in auto:
            settings.pop(k, None)
        engine = EngineSpec.engine.replace(**settings)
        return cls(model, gguf, engine, frozenset(auto))

    def resolve(self, served, gpu: bool) -> EngineConfig:
        """The engine's config on this machine, for ``served`` (its end token is the
        stop token): on a GPU the fast runner, 256 sequences and a pool of
        :data:`GPU_TOKENS_PER_SEQ` tokens a sequence (at most half the free memory);
        else the plain runner, 32 sequences and 256 blocks. The fast runner keeps its
        books with :mod:`pagedkv.fast`; a prefill pass is the step's token budget."""
        c, changes = self.engine, {}
        if "runner" in self.auto:
            changes["runner"] = "fast" if gpu else "plain"
        runner = changes.get("runner", c.runner)
        if "max_seqs" in self.auto:
            changes["max_seqs"] = 256 if gpu else 32
        max_seqs = changes.get("max_seqs", c.max_seqs)
        if "num_blocks" in self.auto:
            changes["num_blocks"] = 256
            if gpu:
                from .. import backend
                block_bytes = served.model.kv_spec().block_bytes(c.block_size)
                free = backend.xp.cuda.Device().mem_info[0]
                want = max_seqs * cdiv(GPU_TOKENS_PER_SEQ, c.block_size)
                changes["num_blocks"] = max(256, min(want, free // 2 // block_bytes))
        return c.replace(**changes, stop_ids=(served.tokenizer.eos_id,),
                         bookkeeping="fast" if runner != "plain" else "teaching",
                         prefill_chunk=c.token_budget or 2048)


def make_engine(spec: EngineSpec):
    """The model and its engine, resolved for this machine, every CUDA graph captured:
    ``(engine, what else was chosen)``. Runs where the engine runs."""
    from .. import backend
    from ..model.blas import single_thread_blas
    from ..model.engine import Engine
    from .models import load

    single_thread_blas()
    served = load(spec.model, spec.gguf)
    engine = Engine(served.model, spec.resolve(served, backend.on_gpu))
    t = time.perf_counter()
    info = dict(graphs=engine.runner.capture_all())
    info["capture_s"] = time.perf_counter() - t
    if info["graphs"]:
        log.info("captured %d CUDA graphs (batch buckets up to %d) in %.1f s",
                 info["graphs"], engine.config.max_seqs, info["capture_s"])
    _inject_faults(engine)
    return engine, info


def _inject_faults(engine) -> None:
    """For the tests of a failing or stalling engine: ``PAGEDKV_SERVE_FAIL_STEPS="5,6"``
    makes the engine's 5th and 6th steps raise; ``PAGEDKV_SERVE_STALL="3:2.5"`` makes
    its 3rd step wait 2.5 s first."""
    fail = {int(s) for s in os.environ.get("PAGEDKV_SERVE_FAIL_STEPS", "").split(",") if s}
    stall = os.environ.get("PAGEDKV_SERVE_STALL")
    at, seconds = map(float, stall.split(":")) if stall else (0, 0.0)
    if not fail and not stall:
        return
    step, count = engine.step, [0]

    def faulty():
        count[0] += 1
        if count[0] == at:
            time.sleep(seconds)
        if count[0] in fail:
            raise RuntimeError(f"a failure injected at step {count[0]}")
        return step()
    engine.step = faulty
