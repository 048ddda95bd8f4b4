"""KV-cache arithmetic: how many bytes a token's keys and values take, for a model shape."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import positive_int
from .errors import ConfigError

__all__ = ["KVSpec"]


@dataclass(frozen=True)
class KVSpec:
    """The shape of a model's KV cache.

    Every layer stores, for every token, one key and one value vector per KV head:
    ``2 * layers * kv_heads * head_dim`` numbers of ``dtype``.
    """
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self):
        for field in ("layers", "kv_heads", "head_dim"):
            positive_int(getattr(self, field), field)
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise ConfigError(f"unknown dtype {self.dtype!r}") from None

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token, all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    def block_bytes(self, block_size: int) -> int:
        """One block of ``block_size`` tokens, all layers."""
        return block_size * self.bytes_per_token

    def tokens_that_fit(self, nbytes: int) -> int:
        return int(nbytes) // self.bytes_per_token
