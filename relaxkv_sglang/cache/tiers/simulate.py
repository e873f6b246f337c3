"""Admission policies compared offline: a key trace replayed through a host tier.

``simulate_tier`` is what the admission's unit test measures (100 Zipf-popular documents and 3
one-shot keys per request, a tier of 40: warm-document hit rate LRU vs TinyLFU).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from relaxkv_sglang.cache.tiers.host import HostTier
from relaxkv_sglang.cache.tiers.record import ChunkRecord

__all__ = ["simulate_tier"]


def simulate_tier(trace: Iterable[str], capacity: int, policy: str, sizes: Callable[[str], int] | None = None) -> dict:
    """Replay a key trace through a :class:`HostTier` of ``capacity`` tokens: a miss stores the key.

    Every access is counted in the sketch first (as the server counts every lookup).
    ``sizes(key)`` is a key's tokens (default 1). Returns hits, misses and the hit rate.
    """
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
