"""The tiny random Llama the engine's tests run on: two layers, 96 tokens, real code paths
(prefill, the paged decode kernel at block size 16, grouped-query attention), a second a run,
no model file. ``tests/conftest.py``'s ``tiny`` fixture builds it with the test module's
``SEED``."""
import numpy as np

from pagedkv.model import Llama, LlamaConfig, random_weights

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)


def tiny_llama(seed: int, **options) -> Llama:
    """The tiny model with weights drawn from ``seed`` (float32 NumPy unless ``options``
    say otherwise: ``xp``, ``dtype``)."""
    return Llama(TINY, random_weights(TINY, seed), **({"xp": np} | options))
