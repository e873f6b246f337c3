"""The host-memory tier: a bounded, pre-allocated buffer of token rows, LRU, TinyLFU admission.

One ``uint8 [capacity_tokens, token_bytes]`` buffer allocated once and untouched until written (so
resident memory never exceeds the bound), a free list of its rows and an LRU of chunks,
``key -> (row indices int64 [n], canonical_start)``. Admission ``tinylfu`` (default) takes a chunk that
needs victims only if its estimated frequency (:class:`~.frequency_sketch.FrequencySketch`, fed by every
lookup) beats every victim's; ``lru`` takes every chunk. Every ``capacity / 16`` bytes stored, the C
heap's free pages go back to the OS (:func:`~.memory.release_free_heap`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Mapping, Optional, Sequence

import torch

from relaxkv_sglang.cache.tiers.frequency_sketch import FrequencySketch
from relaxkv_sglang.cache.tiers.memory import release_free_heap
from relaxkv_sglang.cache.tiers.names import TierName
from relaxkv_sglang.cache.tiers.record import ChunkRecord, token_bytes
from relaxkv_sglang.cache.tiers.env import TierConfigError, env_number
from relaxkv_sglang.cache.tiers.record import GB
from relaxkv_sglang.cache.tiers.tier import Tier, TierConfig, TierContext, TierRole

__all__ = ["HostTier", "HostTierConfig"]


class HostTier(Tier):
    name = TierName.HOST
    role = TierRole(exclusive=True)
    POLICIES = ("tinylfu", "lru")

    def __init__(self, capacity_bytes: int, token_shape: Sequence[int], dtype: torch.dtype,
                 policy: str = "tinylfu", sketch: FrequencySketch | None = None) -> None:
        """``capacity_bytes`` is rounded down to whole token rows of ``token_shape``
        ``(layers, 2, kv_heads, head_dim)``."""
        if policy not in self.POLICIES:
            raise ValueError(f"host tier policy must be one of {self.POLICIES}, got {policy!r}")
        self.token_shape = tuple(int(s) for s in token_shape)
        self.dtype = dtype
        self.token_bytes = token_bytes(self.token_shape, dtype)
        self.capacity_tokens = max(0, int(capacity_bytes) // self.token_bytes)
        self.capacity_bytes = self.capacity_tokens * self.token_bytes
        # torch.empty does not touch the pages: resident memory grows only with what is written.
        self.buffer = torch.empty((self.capacity_tokens, self.token_bytes), dtype=torch.uint8)
        self.free = torch.arange(self.capacity_tokens, dtype=torch.int64)
        self.n_free = self.capacity_tokens
        self.policy = policy
        self.sketch = sketch if sketch is not None else FrequencySketch()
        self.entries: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()  # key -> (rows, start); LRU first
        self.counters = dict(hits=0, misses=0, hit_bytes=0, sets=0, set_bytes=0, rejected=0,
                             evictions=0, evicted_bytes=0)
        self.trim_every = max(8 << 20, self.capacity_bytes // 16)  # bytes stored between heap trims
        self.since_trim = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def used_bytes(self) -> int:
        return (self.capacity_tokens - self.n_free) * self.token_bytes

    def record_access(self, key: str) -> None:
        self.sketch.increment(key)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.entries for k in keys]

    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        out = []
        for key in keys:
            item = self.entries.get(key)
            if item is None:
                self.counters["misses"] += 1
                out.append(None)
                continue
            rows, start = item
            self.entries.move_to_end(key)
            kv = self.buffer.index_select(0, rows).view(self.dtype).reshape(rows.shape[0], *self.token_shape)
            self.counters["hits"] += 1
            self.counters["hit_bytes"] += rows.shape[0] * self.token_bytes
            out.append(ChunkRecord(kv, start))
        return out

    def _victims(self, n_tokens: int) -> list[str]:
        need, victims = n_tokens - self.n_free, []
        for key, (rows, _) in self.entries.items():
            if need <= 0:
                break
            victims.append(key)
            need -= rows.shape[0]
        return victims

    def would_admit(self, key: str, n_tokens: int) -> bool:
        if key in self.entries:
            return True
        if n_tokens > self.capacity_tokens or n_tokens <= 0:
            return False
        if self.policy == "lru" or n_tokens <= self.n_free:
            return True
        freq = self.sketch.estimate(key)
        return all(freq > self.sketch.estimate(v) for v in self._victims(n_tokens))

    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        return [self._set(key, record) for key, record in zip(keys, records)]

    def _set(self, key: str, record: ChunkRecord) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        rows_in = record.rows()
        n = rows_in.shape[0]
        if rows_in.shape[1] != self.token_bytes:
            raise ValueError(f"record has {rows_in.shape[1]} bytes per token, the tier {self.token_bytes}")
        if not self.would_admit(key, n):
            self.counters["rejected"] += 1
            return False
        for victim in self._victims(n):
            self._remove(victim, evicted=True)
        rows = self.free[self.n_free - n: self.n_free].clone()
        self.n_free -= n
        self.buffer.index_copy_(0, rows, rows_in)  # faster than buffer[rows] = ... on fresh pages
        self.entries[key] = (rows, int(record.canonical_start))
        self.counters["sets"] += 1
        self.counters["set_bytes"] += n * self.token_bytes
        self.since_trim += n * self.token_bytes
        if self.since_trim >= self.trim_every:
            self.since_trim = 0
            release_free_heap()
        return True

    def _remove(self, key: str, evicted: bool = False) -> bool:
        item = self.entries.pop(key, None)
        if item is None:
            return False
        rows = item[0]
        self.free[self.n_free: self.n_free + rows.shape[0]] = rows
        self.n_free += rows.shape[0]
        if evicted:
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += rows.shape[0] * self.token_bytes
        return True

    def delete(self, key: str) -> bool:
        return self._remove(key)

    def clear(self) -> None:
        for key in list(self.entries):
            self._remove(key)

    def stats(self) -> dict:
        return dict(self.counters, entries=len(self.entries), bytes_held=self.used_bytes,
                    capacity_bytes=self.capacity_bytes)


@dataclasses.dataclass(frozen=True)
class HostTierConfig(TierConfig):
    """The host tier asked for; ``capacity_bytes`` 0 (or less than one token row): none."""

    capacity_bytes: int = 0
    policy: str = "tinylfu"

    GB_ENV = "RELAXKV_HOST_CACHE_GB"
    POLICY_ENV = "RELAXKV_HOST_CACHE_POLICY"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["HostTierConfig"]:
        """``RELAXKV_HOST_CACHE_GB`` (default 0: none) and ``RELAXKV_HOST_CACHE_POLICY`` (default tinylfu)."""
        gb = env_number(env, cls.GB_ENV, 0.0, "GB")
        policy = env.get(cls.POLICY_ENV) or "tinylfu"
        if policy not in HostTier.POLICIES:
            raise TierConfigError(f"{cls.POLICY_ENV}={policy!r}: must be one of {', '.join(HostTier.POLICIES)}")
        return cls(int(gb * GB), policy) if gb > 0 else None

    def summary(self) -> str:
        return f"host {self.capacity_bytes} bytes ({self.policy})"

    def build(self, ctx: TierContext) -> Optional[HostTier]:
        if self.capacity_bytes <= 0:
            return None
        tier = HostTier(self.capacity_bytes, ctx.token_shape, ctx.dtype, self.policy)
        return tier if tier.capacity_tokens > 0 else None
