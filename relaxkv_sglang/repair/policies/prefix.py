"""``prefix``: SGLang's radix cache, exact prefix reuse only (the default: the plugin changes nothing)."""

from __future__ import annotations

from relaxkv_sglang.repair.policies.base import PolicySpec
from relaxkv_sglang.repair.policies.full import every_eligible

SPEC = PolicySpec("prefix", "SGLang's radix cache: exact prefix reuse only", "baseline", every_eligible,
                  reuses_chunks=False, repairs=False)
