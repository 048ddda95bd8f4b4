"""KV-cache arithmetic: how many bytes a token's keys and values take, for a model shape."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import positive_int
from .errors import ConfigError

__all__ = ["KVSpec", "INT8", "NUMS_PER_SCALE", "SCALE_BYTES"]

#: The 8-bit cache's dtype name: int8 numbers, and a float16 scale for every
#: :data:`NUMS_PER_SCALE` of them (llama.cpp's ``q8_0`` numbers; pagedkv.kernels.kv8 has the
#: layout and the rounding).
INT8 = "int8"
#: Numbers of a K or V row that share one scale (llama.cpp's QK8_0).
NUMS_PER_SCALE = 32
#: Bytes of one scale (float16).
SCALE_BYTES = 2


@dataclass(frozen=True)
class KVSpec:
    """The shape of a model's KV cache.

    Every layer stores, for every token, one key and one value vector per KV head:
    ``2 * layers * kv_heads * head_dim`` numbers of ``dtype``. With ``dtype="int8"`` each
    number is one byte and every :data:`NUMS_PER_SCALE` of them share a float16 scale:
    ``head_dim + head_dim / 16`` bytes a row (68 at head_dim 64, against 128 for float16).
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
        if self.quantized and self.head_dim % NUMS_PER_SCALE:
            raise ConfigError(f"an int8 cache needs head_dim a multiple of {NUMS_PER_SCALE} "
                              f"(one scale for every {NUMS_PER_SCALE} numbers), got "
                              f"{self.head_dim}")

    @property
    def quantized(self) -> bool:
        """Is this the 8-bit cache (int8 numbers with scales)?"""
        return str(np.dtype(self.dtype)) == INT8

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def scale_bytes(self) -> int:
        """The int8 cache's scales of one token, all layers (0 for any other dtype)."""
        if not self.quantized:
            return 0
        return 2 * self.layers * self.kv_heads * self.head_dim // NUMS_PER_SCALE * SCALE_BYTES

    @property
    def row_bytes(self) -> int:
        """One kv head's K (or V) of one token: its numbers, and its scales if any."""
        return self.bytes_per_token // (2 * self.layers * self.kv_heads)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token, all layers (and with an int8 cache, their scales)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize + self.scale_bytes

    def block_bytes(self, block_size: int) -> int:
        """One block of ``block_size`` tokens, all layers."""
        return block_size * self.bytes_per_token

    def tokens_that_fit(self, nbytes: int) -> int:
        return int(nbytes) // self.bytes_per_token

    def blocks_that_fit(self, nbytes: int, block_size: int) -> int:
        """Whole blocks of ``block_size`` tokens in ``nbytes``: a pool's ``num_blocks`` for
        a memory budget (an int8 cache gets about 1.9 times float16's)."""
        return int(nbytes) // self.block_bytes(block_size)
