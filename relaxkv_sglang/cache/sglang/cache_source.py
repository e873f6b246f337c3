"""The one place mapping :class:`~relaxkv_sglang.cache.tiers.TierName` onto SGLang's ``cache_source``
(``device`` / ``host`` / ``storage``, ``Req.cached_tokens_<source>``); any tier below host memory is ``storage``.
"""

from __future__ import annotations

from typing import Mapping

from relaxkv_sglang.cache.tiers import TierName

SGLANG_CACHE_SOURCES = ("device", "host", "storage")

_SOURCE = {TierName.DEVICE: "device", TierName.HOST: "host"}


def sglang_cache_source(tier: str) -> str:
    """SGLang's ``cache_source`` for tokens served from ``tier``."""
    return _SOURCE.get(tier, "storage")


def by_cache_source(tokens_by_tier: Mapping[str, int]) -> dict[str, int]:
    """Token counts per tier summed per SGLang ``cache_source``, every source present, SGLang's order."""
    out = dict.fromkeys(SGLANG_CACHE_SOURCES, 0)
    for tier, tokens in tokens_by_tier.items():
        out[sglang_cache_source(tier)] += tokens
    return out
