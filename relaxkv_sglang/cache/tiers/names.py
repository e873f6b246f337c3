"""The one vocabulary of where chunk KV lives: the device pool and the lower tiers.

Every part that names a tier uses :class:`TierName`: a chunk entry's origin
(:attr:`~relaxkv_sglang.cache.pool_index.ChunkEntry.origin`), the tiered store's tiers and
counters (``tier_<name>_*``), the fold's per-window hit split and the request report
(``chunk_tokens_from_<name>``). SGLang has its own names for the same places
(``cache_source`` = device / host / storage); they are mapped once, at the SGLang boundary
(``cache/sglang/cache_source.py::sglang_cache_source``).

A :class:`TierName` is a ``str`` (``StrEnum``): it compares, hashes, formats and serialises as
its value, so ``"host"`` read from a report or a stats dict is the same key.
"""

from __future__ import annotations

import enum
from typing import Mapping

__all__ = ["TierName", "LOWER_TIERS", "split_hits"]


class TierName(enum.StrEnum):
    """Where a chunk's KV is held, fastest first (the declaration order is the lookup order)."""

    DEVICE = "device"  # the KV pool (PoolChunkIndex)
    HOST = "host"      # host memory (HostTier)
    DISK = "disk"      # a local folder (DiskTier)
    HICACHE = "hicache"  # a HiCache storage backend of SGLang's, e.g. Mooncake (PagedTier over cache/sglang/hicache_tier.py)


LOWER_TIERS: tuple[TierName, ...] = tuple(t for t in TierName if t is not TierName.DEVICE)


def split_hits(hit_tokens: int, tier_tokens: Mapping[str, int]) -> dict[TierName, int]:
    """A window's chunk hit tokens by the tier they came from, device first.

    Args:
        hit_tokens: the window's reused chunk tokens (after the rows the fold had to keep).
        tier_tokens: of those, the tokens of chunks loaded from each lower tier (tier -> tokens);
            may over-count by the kept rows, so each tier is capped by what is left, in
            :data:`LOWER_TIERS` order.

    Returns:
        ``{DEVICE: n, HOST: n, DISK: n, HICACHE: n}``, summing to ``hit_tokens``; the device gets the rest.
    """
    left, lower = hit_tokens, {}
    for tier in LOWER_TIERS:
        lower[tier] = min(tier_tokens.get(tier, 0), left)
        left -= lower[tier]
    return {TierName.DEVICE: left, **lower}
