"""The server's lower chunk tiers: which the environment asks for, and building them for the pool.

The tiers themselves are :mod:`relaxkv_sglang.cache.tiers` (bounded host memory, a bounded disk
folder) and :mod:`.hicache_tier` (a HiCache storage backend); each tier's configuration class
reads its own variables (``from_env``: ``RELAXKV_HOST_CACHE_*``, ``RELAXKV_CHUNK_DIR`` and
``RELAXKV_DISK_CACHE_GB``, ``RELAXKV_HICACHE_*``; ``relaxkv-sglang serve --host-cache-gb/--chunk-dir/
--disk-cache-gb`` set the first ones). :data:`TIER_CONFIGS` is the table of the tiers a server may
have, fastest first: a new tier is its module plus one entry here. A bad value stops the server
at startup with one line naming the variable.

SGLang objects read: none (the factory, ``server/sglang/startup.py``, passes the pool and the context length).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from relaxkv_sglang.cache.tiers import (
    DiskTierConfig, HostTierConfig, ModelIdentity, TierConfig, TierConfigError, TierContext, TieredChunkStore,
)
from relaxkv_sglang.cache.sglang.hicache_tier import HiCacheTierConfig
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV

#: The tiers a server may have, fastest first (each reads its own variables).
TIER_CONFIGS: tuple[type[TierConfig], ...] = (HostTierConfig, DiskTierConfig, HiCacheTierConfig)


def tier_configs_from_env(env: Mapping[str, str], kinds: Sequence[type[TierConfig]] = TIER_CONFIGS) -> list[TierConfig]:
    """The tiers ``env`` asks for (the server's: ``ServerSettings.environment``), fastest first
    (empty: none); SystemExit with one line if a variable is malformed."""
    try:
        return [config for kind in kinds if (config := kind.from_env(env)) is not None]
    except TierConfigError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc}") from None


def build_tiers(configs: Sequence[TierConfig], pool_kv: PoolKV, identity: ModelIdentity,
                max_tokens: int) -> TieredChunkStore:
    """The lower tiers for this pool's KV layout, in ``configs``' order; ``max_tokens``: the most
    tokens a stored value may hold (the context length)."""
    ctx = TierContext(identity, tuple(pool_kv.token_shape), pool_kv.dtype, max_tokens=max_tokens)
    return TieredChunkStore([tier for c in configs if (tier := c.build(ctx)) is not None], identity)
