"""The one vocabulary of where chunk KV lives: the device pool and the lower tiers.

Every part naming a tier uses :class:`TierName` (:attr:`~relaxkv_sglang.cache.pool_index.ChunkEntry.origin`,
the counters ``tier_<name>_*``, the report's ``chunk_tokens_from_<name>``); SGLang's own ``cache_source``
names are mapped once, in ``cache/sglang/cache_source.py``. A ``StrEnum``: ``"host"`` read back from a
report or a stats dict is the same key.
"""

from __future__ import annotations

import enum
from typing import Mapping

__all__ = ["TierName", "LOWER_TIERS", "split_hits"]


class TierName(enum.StrEnum):
    """Where a chunk's KV is held, fastest first (the declaration order is the lookup order)."""

    DEVICE = "device"  # the KV pool (PoolChunkIndex)
    HOST = "host"
    DISK = "disk"
    HICACHE = "hicache"  # a HiCache storage backend of SGLang's, e.g. Mooncake (cache/sglang/hicache_tier.py)


LOWER_TIERS: tuple[TierName, ...] = tuple(t for t in TierName if t is not TierName.DEVICE)


def split_hits(hit_tokens: int, tier_tokens: Mapping[str, int]) -> dict[TierName, int]:
    """A window's ``hit_tokens`` (after the rows the fold kept) by tier: each lower tier's ``tier_tokens``
    (over-counting the kept rows) capped by what is left, in :data:`LOWER_TIERS` order; the device the rest."""
    left, lower = hit_tokens, {}
    for tier in LOWER_TIERS:
        lower[tier] = min(tier_tokens.get(tier, 0), left)
        left -= lower[tier]
    return {TierName.DEVICE: left, **lower}
