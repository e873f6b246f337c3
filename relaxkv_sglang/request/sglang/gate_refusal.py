"""The startup gate's verdict in the HTTP process: whether chunk policies are refused, and why. The gate runs
in the scheduler (:mod:`relaxkv_sglang.server.sglang.gate`), so its verdict is asked for once through SGLang's
``TokenizerManager.get_internal_state`` and kept; a chunk policy is refused with a 400 naming the reason."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from relaxkv_sglang.runtime import records

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager


@dataclasses.dataclass
class GateRefusal:
    """The ``TokenizerManager``'s record: why chunk policies are refused, "" when served (None: not asked yet)."""

    reason: Optional[str] = None


async def chunk_refusal(tokenizer_manager: "TokenizerManager") -> str:
    """Why chunk policies are refused ("" when served): ``relaxkv.gate`` of every scheduler's internal state (one
    per data-parallel rank); any failed gate refuses, a state without one (the gate never ran) nothing."""
    held = records.record(tokenizer_manager, GateRefusal)
    if held.reason is not None:
        return held.reason
    states = await tokenizer_manager.get_internal_state()
    reasons = []
    for internal in states:
        gate = (internal or {}).get("relaxkv", {}).get("gate") or {}
        if gate.get("status") == "failed":
            reasons.append(gate.get("reason") or "the gate failed")
    refusal = "; ".join(dict.fromkeys(reasons))
    held.reason = refusal
    return refusal
