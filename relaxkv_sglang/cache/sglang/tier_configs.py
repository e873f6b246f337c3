"""The server's lower chunk tiers: which the environment asks for, and building them for the pool
(:func:`build_tiers`, the one way). A new tier is its module plus one entry in :data:`TIER_CONFIGS`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from relaxkv_sglang.cache.tiers import (
    DiskTierConfig, HostTierConfig, ModelIdentity, TierConfig, TierConfigError, TierContext, TieredChunkStore,
)
from relaxkv_sglang.cache.sglang.hicache_tier import HiCacheTierConfig
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV

#: The tiers a server may have, fastest first (each reads its own variables).
TIER_CONFIGS: tuple[type[TierConfig], ...] = (HostTierConfig, DiskTierConfig, HiCacheTierConfig)


def tier_configs_from_env(env: Mapping[str, str],
                          kinds: Sequence[type[TierConfig]] = TIER_CONFIGS) -> list[TierConfig]:
    """The tiers ``env`` (``ServerSettings.environment``) asks for, fastest first; SystemExit with one line
    if a variable is malformed."""
    try:
        return [config for kind in kinds if (config := kind.from_env(env)) is not None]
    except TierConfigError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc}") from None


def build_tiers(configs: Sequence[TierConfig], pool_kv: PoolKV, identity: ModelIdentity,
                max_tokens: int, **options: Any) -> TieredChunkStore:
    """The lower tiers for this pool's KV layout, in ``configs``' order; ``max_tokens``: the most a stored
    value may hold (the context length); ``options``: :class:`~relaxkv_sglang.cache.tiers.TieredChunkStore`'s."""
    ctx = TierContext(identity, tuple(pool_kv.token_shape), pool_kv.dtype, max_tokens=max_tokens)
    return TieredChunkStore([tier for c in configs if (tier := c.build(ctx)) is not None], identity, **options)
