"""The startup gate's verdict in the HTTP process: whether chunk policies are refused, and why.

The gate runs in the scheduler (:mod:`relaxkv_sglang.server.sglang.gate`) and puts its verdict on
``/get_server_info`` under ``relaxkv.gate``; :func:`chunk_refusal` asks for it once, through
SGLang's own ``TokenizerManager.get_internal_state``, and keeps the answer on the tokenizer
manager, so a chunk policy is refused with a 400 naming the reason (:mod:`~relaxkv_sglang.request.sglang.api`).
"""

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
    """Why chunk policies are refused ("" when served), asked of the scheduler once and kept.

    Reads ``relaxkv.gate`` of every scheduler's internal state (one per data-parallel rank); any
    failed gate refuses. A state without a gate (the gate never ran) refuses nothing.
    """
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
