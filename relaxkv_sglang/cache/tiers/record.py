"""One chunk's KV off the device: the record every tier stores and returns.

One row of ``token_bytes = layers * 2 * kv_heads * head_dim * itemsize`` bytes per token.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

__all__ = ["GB", "ChunkRecord", "token_bytes"]

GB = 1 << 30


def token_bytes(token_shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of one token's KV of shape ``token_shape`` (``(layers, 2, kv_heads, head_dim)``)."""
    return int(torch.Size([int(s) for s in token_shape]).numel()) * torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass
class ChunkRecord:
    """``kv``: ``[n_tokens, layers, 2, kv_heads, head_dim]`` (K then V) on the CPU, K rotated to
    ``canonical_start``."""

    kv: torch.Tensor
    canonical_start: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.kv.shape[0])

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def rows(self) -> torch.Tensor:
        """uint8 ``[n_tokens, token_bytes]`` view of the KV (contiguous)."""
        kv = self.kv.contiguous()
        return kv.view(torch.uint8).reshape(kv.shape[0], -1)
