"""Lower tiers of the chunk cache: chunk KV off the device, in an ordered list of tiers.

Below the KV pool, :class:`TieredChunkStore` holds the tiers fastest first, each used by its declared
:class:`TierRole`, never by its name; the flows between them: docs/architecture.md, "Lower tiers of the
chunk store".

A new tier: a :class:`Tier` subclass and its :class:`TierConfig` (reading its own variables,
``from_env``) in one module, a :class:`TierName` member, and one entry in
``cache/sglang/tier_configs.py::TIER_CONFIGS``. Standard library and torch only.
"""

from relaxkv_sglang.cache.tiers.frequency_sketch import FrequencySketch
from relaxkv_sglang.cache.tiers.disk import DiskTier, DiskTierConfig
from relaxkv_sglang.cache.tiers.env import TierConfigError, env_number
from relaxkv_sglang.cache.tiers.host import HostTier, HostTierConfig
from relaxkv_sglang.cache.tiers.keys import FORMAT_VERSION, ModelIdentity
from relaxkv_sglang.cache.tiers.memory import release_free_heap
from relaxkv_sglang.cache.tiers.names import LOWER_TIERS, TierName, split_hits
from relaxkv_sglang.cache.tiers.paged import PagedTier, PageStore
from relaxkv_sglang.cache.tiers.prefetch import PrefetchStage
from relaxkv_sglang.cache.tiers.reconnect import ReconnectingPageStore
from relaxkv_sglang.cache.tiers.record import GB, ChunkRecord
from relaxkv_sglang.cache.tiers.simulate import simulate_tier
from relaxkv_sglang.cache.tiers.storage import ChunkStorage, StoreUnavailable
from relaxkv_sglang.cache.tiers.store import TieredChunkStore
from relaxkv_sglang.cache.tiers.tier import Tier, TierConfig, TierContext, TierRole
from relaxkv_sglang.cache.tiers.value import Damaged, ValueLayout, decode_value, encode_value
from relaxkv_sglang.cache.tiers.writer import AsyncWriter

__all__ = [
    "FORMAT_VERSION", "GB", "LOWER_TIERS", "AsyncWriter", "ChunkRecord", "ChunkStorage", "Damaged", "DiskTier",
    "DiskTierConfig", "FrequencySketch", "HostTier", "HostTierConfig", "ModelIdentity", "PageStore", "PagedTier",
    "PrefetchStage", "ReconnectingPageStore", "StoreUnavailable", "Tier", "TierConfig", "TierConfigError",
    "TierContext", "TierName", "TierRole", "TieredChunkStore",
    "ValueLayout", "decode_value", "encode_value", "env_number", "release_free_heap", "simulate_tier", "split_hits",
]
