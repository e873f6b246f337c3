"""Admission policies compared offline (the admission's unit test): a key trace replayed through a host tier."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from relaxkv_sglang.cache.tiers.host import HostTier
from relaxkv_sglang.cache.tiers.record import ChunkRecord

__all__ = ["simulate_tier"]


def simulate_tier(trace: Iterable[str], capacity: int, policy: str, sizes: Callable[[str], int] | None = None) -> dict:
    """Replay ``trace`` through a :class:`HostTier` of ``capacity`` tokens, each access counted in the
    sketch first as the server counts lookups; a miss stores the key (``sizes(key)`` tokens, default 1)."""
    tier = HostTier(capacity * 4, (1,), torch.float32, policy)  # one float32 per token
    hits = misses = 0
    for key in trace:
        n = sizes(key) if sizes else 1
        tier.record_access(key)
        if tier.exists(key):
            tier.entries.move_to_end(key)
            hits += 1
        else:
            misses += 1
            tier.set(key, ChunkRecord(torch.zeros(n, 1)))
    return {"policy": policy, "hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses)}
