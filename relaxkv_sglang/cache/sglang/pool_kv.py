"""The one accessor of chunk KV in SGLang's KV pool: copy between slots, read out, write back.

Per layer the pool holds ``[slots, kv_heads, head_dim]`` K and V buffers. A move by ``delta`` positions
re-rotates K (RoPE composes: K at ``p + delta`` is K at ``p`` rotated by ``delta``); V is copied as is.
SGLang's pool (``mem_cache/memory_pool.py``) is read through ``get_key_buffer`` / ``get_value_buffer``,
``start_layer`` and ``layer_num`` only (the unit tests pass a stand-in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from relaxkv_sglang.model.rope import RopeSpec, rotate_keys
from relaxkv_sglang.cache.tiers import ChunkRecord

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache


class PoolKV:
    def __init__(self, kv_pool: KVCache, rope: RopeSpec) -> None:
        """``rope``: the rotation K is stored with."""
        self.kv_pool = kv_pool
        self.rope = rope
        self.layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)

    @property
    def dtype(self) -> torch.dtype:
        """The pool's KV dtype."""
        return self.kv_pool.get_key_buffer(self.layers.start).dtype

    @property
    def token_shape(self) -> tuple[int, int, int, int]:
        """(layers, 2, kv_heads, head_dim): one token's KV in a record; ValueError if K and V differ."""
        k0 = self.kv_pool.get_key_buffer(self.layers.start)
        v0 = self.kv_pool.get_value_buffer(self.layers.start)
        if k0.shape[1:] != v0.shape[1:]:
            raise ValueError(f"K {tuple(k0.shape[1:])} and V {tuple(v0.shape[1:])} differ per token")
        return (len(self.layers), 2, int(k0.shape[1]), int(k0.shape[2]))

    def layout(self) -> str:
        """The KV layout as the model identity names it (layers, heads, head dim, RoPE)."""
        n_layers, _, heads, head_dim = self.token_shape
        return f"layers={n_layers} kv_heads={heads} head_dim={head_dim} rope={self.rope!r}"

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        """Copy the KV of slots ``src`` into slots ``dst`` (both int64 [n]), K rotated by ``delta``."""
        for layer in self.layers:
            k_buf = self.kv_pool.get_key_buffer(layer)
            v_buf = self.kv_pool.get_value_buffer(layer)
            k = k_buf[src]
            k_buf[dst] = rotate_keys(k, delta, self.rope) if delta else k
            v_buf[dst] = v_buf[src]

    def read(self, slots: torch.Tensor, canonical_start: int) -> ChunkRecord:
        """The KV of ``slots`` (int64 [n]), computed at ``canonical_start``, as a CPU record [n, L, 2, H, D]."""
        per_layer = []
        for layer in self.layers:
            k = self.kv_pool.get_key_buffer(layer)[slots]
            v = self.kv_pool.get_value_buffer(layer)[slots]
            per_layer.append(torch.stack([k, v], dim=1))
        kv = torch.stack(per_layer, dim=1)  # [n, L, 2, H, D]
        return ChunkRecord(kv.cpu(), int(canonical_start))  # stack made a copy already

    def write(self, slots: torch.Tensor, record: ChunkRecord, delta: int = 0) -> None:
        """Write a record into ``slots`` (int64 [n]), K re-rotated by ``delta`` positions."""
        device = self.kv_pool.get_key_buffer(self.layers.start).device
        kv = record.kv.to(device)
        for i, layer in enumerate(self.layers):
            k = kv[:, i, 0]
            self.kv_pool.get_key_buffer(layer)[slots] = rotate_keys(k, delta, self.rope) if delta else k
            self.kv_pool.get_value_buffer(layer)[slots] = kv[:, i, 1]
