"""A tier of the tiered store: a storage with a name and a declared role, which the store acts on:

* ``exclusive`` (host): a chunk is in the pool or in this tier, not both, so together they hold more
  than either: the pool's evictions spill here through the tier's admission (:meth:`Tier.would_admit`),
  a chunk loaded back leaves it (:meth:`~.store.TieredChunkStore.taken`); a flush clears it.
* ``write_through`` (disk, hicache): every computed chunk is written here on publish, in the background
  (:class:`~.writer.AsyncWriter`); a load keeps the copy; it survives a flush and a restart.
* ``prefetchable`` (disk, hicache): reads slow enough to start ahead of the load, for queued requests
  (:class:`~.prefetch.PrefetchStage`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar, Mapping, Optional, Sequence

import torch

from relaxkv_sglang.cache.tiers.keys import ModelIdentity
from relaxkv_sglang.cache.tiers.names import TierName
from relaxkv_sglang.cache.tiers.storage import ChunkStorage
from relaxkv_sglang.cache.tiers.value import DEFAULT_MAX_TOKENS

__all__ = ["TierRole", "Tier", "TierContext", "TierConfig"]


@dataclasses.dataclass(frozen=True)
class TierRole:
    exclusive: bool = False
    write_through: bool = False
    prefetchable: bool = False


class Tier(ChunkStorage):
    """A storage with its name and role; ``counters`` (cumulative) are reported as ``tier_<name>_<counter>``."""

    name: ClassVar[TierName]
    role: ClassVar[TierRole]
    counters: dict

    def would_admit(self, key: str, n_tokens: int) -> bool:
        """Whether a chunk of ``n_tokens`` spilled under ``key`` would be stored now (default: yes)."""
        return True

    def count_refused(self) -> None:
        """A spill the tier's admission refused (asked before the KV leaves the pool)."""
        self.counters["rejected"] += 1

    def record_access(self, key: str) -> None:
        """One lookup of ``key`` by the server, any tier (admission's frequencies); default: ignored."""

    def clear(self) -> None:
        """Drop every entry, counters kept (an exclusive tier on a cache flush)."""
        raise NotImplementedError(f"the {self.name} tier cannot be cleared")

    def describe(self) -> dict:
        """Configuration worth reporting beside the counters (e.g. a folder); default: none."""
        return {}


@dataclasses.dataclass(frozen=True)
class TierContext:
    """What every tier of one server shares: ``token_shape`` ``(layers, 2, kv_heads, head_dim)``, one token's
    KV; ``max_tokens``: the most a stored value may hold (a header claiming more is damaged)."""

    identity: ModelIdentity
    token_shape: Sequence[int]
    dtype: torch.dtype
    max_tokens: int = DEFAULT_MAX_TOKENS


class TierConfig(ABC):
    """One tier's configuration, an entry of ``cache/sglang/tier_configs.py::TIER_CONFIGS``."""

    @classmethod
    @abstractmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["TierConfig"]:
        """The tier ``env`` asks for, or None; :class:`~.env.TierConfigError` for a malformed value."""

    @abstractmethod
    def build(self, ctx: TierContext) -> Optional[Tier]:
        """The tier, or None when this configuration asks for none (e.g. a zero bound)."""

    def summary(self) -> str:
        """One phrase for the startup line (default: the dataclass's fields)."""
        return repr(self)
