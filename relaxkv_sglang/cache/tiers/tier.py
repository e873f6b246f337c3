"""A tier of the tiered store: a storage with a name and a declared role.

:class:`~.store.TieredChunkStore` takes an ordered list of tiers (fastest first) and treats
each by its :class:`TierRole`, never by its name:

* ``exclusive``: a chunk lives in the device pool or in this tier, not both. Chunks the pool
  evicts spill here through the tier's admission (:meth:`Tier.would_admit`); a chunk loaded
  from it back into the pool leaves it (:meth:`~.store.TieredChunkStore.taken`), so pool and
  tier together hold more than either. Volatile: a cache flush clears it. (The host tier.)
* ``write_through``: every newly computed chunk is written here on publish, asynchronously
  (:class:`~.writer.AsyncWriter`), and a loaded chunk keeps its copy; an evicted chunk spills
  here only if the tier lacks it. Survives a flush and a restart. (The disk tier.)
* ``prefetchable``: reading is slow enough to start it ahead of the load on a background thread
  (:class:`~.prefetch.PrefetchStage`), for chunks of requests still queued. (The disk tier.)

Adding a tier is one :class:`Tier` subclass (its ``name``, ``role`` and the five storage methods)
and its :class:`TierConfig` (what the server's configuration gives it; ``build`` makes the tier).
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
    """How the tiered store uses a tier (module doc)."""

    exclusive: bool = False
    write_through: bool = False
    prefetchable: bool = False


class Tier(ChunkStorage):
    """A storage the tiered store holds in its list: its name, its role and the hooks the store calls.

    Attributes:
        name: the tier's name in the one vocabulary (reports, counters, ``ChunkEntry.origin``).
        role: how the store uses it (module doc).
        counters: cumulative counters, reported as ``tier_<name>_<counter>``.
    """

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
    """What every tier of one server shares: the model identity and one token's KV shape.

    Attributes:
        identity: the model identity chunk keys and stored entries are salted with.
        token_shape: one token's KV shape, ``(layers, 2, kv_heads, head_dim)``.
        dtype: the KV dtype.
        max_tokens: the most tokens a stored value may hold (a stored header claiming more is damaged).
    """

    identity: ModelIdentity
    token_shape: Sequence[int]
    dtype: torch.dtype
    max_tokens: int = DEFAULT_MAX_TOKENS


class TierConfig(ABC):
    """One tier's configuration (a frozen dataclass in the tier's module): ``from_env`` reads it,
    ``build`` makes the tier. A server's tiers are the table ``cache/sglang/tier_configs.py::TIER_CONFIGS``:
    a new tier is its module plus one entry there."""

    @classmethod
    @abstractmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["TierConfig"]:
        """The tier the environment asks for, None when it asks for none; :class:`~.env.TierConfigError`
        (naming the variable) for a malformed value."""

    @abstractmethod
    def build(self, ctx: TierContext) -> Optional[Tier]:
        """The tier, or None when this configuration asks for none (e.g. a zero bound)."""

    def summary(self) -> str:
        """One phrase for the startup line (default: the dataclass's fields)."""
        return repr(self)
