"""Lower tiers of the chunk cache: chunk KV off the device, in an ordered list of tiers.

The device tier is the KV pool, its chunks indexed by
:class:`~relaxkv_sglang.cache.pool_index.PoolChunkIndex`. Below it, :class:`TieredChunkStore`
holds a list of tiers, fastest first, each used by its declared role (:class:`TierRole`:
exclusive, write-through, prefetchable), never by name::

    device pool  --evict: spill-->  host tier (HostTier, exclusive)  --evict-->  gone
         |  ^                            |                            (the disk copy stays)
  publish|  |load at admission           |
         v  |                            v
    disk tier (DiskTier, write-through + prefetchable: fsynced, LRU-bounded, shared by processes)
    hicache tier (PagedTier, write-through + prefetchable: values in pages of a HiCache storage
                  backend such as Mooncake, shared by servers on any host; cache/sglang/hicache_tier.py)

One module per concept:

============  =================================================================================
names         :class:`TierName` (device / host / disk / hicache), the one vocabulary of where KV lives
keys          :class:`ModelIdentity` (salts :meth:`~relaxkv_sglang.cache.chunk_key.ChunkKey.content_key`)
record        :class:`ChunkRecord` (``[n_tokens, layers, 2, kv_heads, head_dim]`` on the CPU)
storage       :class:`ChunkStorage`, the HiCache-shaped storage interface
tier          :class:`Tier` (a storage with a name and a role), :class:`TierConfig`
frequency_sketch  :class:`FrequencySketch` (TinyLFU's count-min sketch)
memory        :func:`release_free_heap` (glibc ``malloc_trim``)
host          :class:`HostTier` + :class:`HostTierConfig` (bounded host memory)
value         the self-describing bytes of a stored chunk and the checks a load makes
disk          :class:`DiskTier` + :class:`DiskTierConfig` (bounded, checksummed folder)
paged         :class:`PagedTier` over a :class:`PageStore` (values in fixed-size pages)
reconnect     :class:`ReconnectingPageStore` (a network page store: calls bounded, reconnected with backoff)
writer        :class:`AsyncWriter` (writes on a background thread, bounded queue)
prefetch      :class:`PrefetchStage` (reads started ahead of the load, staged)
store         :class:`TieredChunkStore` (the list of tiers for the server)
simulate      :func:`simulate_tier` (admission policies replayed offline)
============  =================================================================================

A new tier: a :class:`Tier` subclass and its :class:`TierConfig` (which reads its own variables,
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
    "PrefetchStage", "ReconnectingPageStore", "StoreUnavailable", "Tier", "TierConfig", "TierConfigError", "TierContext", "TierName", "TierRole", "TieredChunkStore",
    "ValueLayout", "decode_value", "encode_value", "env_number", "release_free_heap", "simulate_tier", "split_hits",
]
