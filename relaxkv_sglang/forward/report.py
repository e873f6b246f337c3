"""The per-request report, ``meta_info.relaxkv`` (its fields: ``docs/api.md``): what the fold and the repair
did. Over several prefill steps (chunked prefill windows, a retraction) counters are summed and the repair
fields are those of the step that completed the prompt.

SGLang carries ``req.customized_info`` to the HTTP process; the key is declared request-level (hook on
``managers/scheduler_components/output_streamer.py``), so the record is sent once, not per output token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from relaxkv_sglang.runtime.hooks import Hook
from relaxkv_sglang.cache.tiers import TierName
from relaxkv_sglang.model.tensor_parallel import digest
from relaxkv_sglang.request.plan import RECORD_KEY

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    from relaxkv_sglang.repair.sglang.layer_loop import LoopRows
    from relaxkv_sglang.forward.query_pass import RequestRows
    from relaxkv_sglang.forward.repair_stage import RepairOutcome

_TIER_FIELDS = {tier: f"chunk_tokens_from_{tier.value}" for tier in TierName if tier != TierName.DEVICE}
_SUMMED_OVER_PREFILLS = ("chunks_seen", "chunks_hit", "chunk_tokens_reused", *_TIER_FIELDS.values(), "tokens_computed",
                         "prefills", "repairs")


def request_record(r: "RequestRows", outcome: Optional["RepairOutcome"]) -> dict:
    """This prefill step's report for one request (``outcome`` None: the repair did not run for it)."""
    f = r.fold
    repair = outcome.rows if outcome is not None else None
    sources = f.hit_sources()
    record = {
        "policy": f.plan.policy if f.plan else "prefix",
        "chunks_seen": f.chunks_seen,
        "chunks_hit": f.chunks_hit,
        "chunk_tokens_reused": f.hit_tokens,
        **{field: sources[tier] for tier, field in _TIER_FIELDS.items()},
        "tokens_computed": r.n_rows + (repair.n_rows if repair is not None else 0),
        "repaired": repair is not None,
        "prefills": int(f.completes_prompt),  # 1: this step decided the repair
        "repairs": int(repair is not None),
    }
    reason = outcome.not_repaired_reason if outcome is not None else r.not_repaired_reason
    if repair is not None:
        record.update(repair_record(repair))
        record.update(outcome.budget_report)
    elif reason is not None:
        record["not_repaired_reason"] = reason
    return record


def repair_record(rows: "LoopRows") -> dict:
    """The repair fields of the report, from the repair pass's rows, its plan and the pairs its
    anchor executor counted as it ran (``rows.work``: no second pass over the layouts)."""
    schedule, work = rows.anchor_schedule, rows.work
    n_layers = max(int(rows.exits.max()) if rows.n_rows else 0, 1)
    anchor_exits = rows.exits[rows.anchor]
    anchor_layers = int(anchor_exits.sum())
    n_eligible = schedule.n_eligible
    return {
        "anchor_ratio": anchor_layers / (n_layers * n_eligible) if n_eligible else 0.0,
        "anchors_per_layer": anchor_layers / n_layers,
        "anchors_by_layer": [int((anchor_exits > l).sum()) for l in range(n_layers)],
        "anchor_set_digest": f"{digest(rows.positions[rows.anchor], anchor_exits):016x}",
        "context_ratio": work.visible / work.full if work.full else 1.0,
        "repair_kv_pairs": work.visible,
        "repair_kv_pairs_executed": work.executed,
    }


def merge_record(req: "Req", step: dict) -> None:
    """Merge this prefill step's report into the request's ``meta_info.relaxkv``."""
    info = req.customized_info if req.customized_info is not None else {}
    old = info.get(RECORD_KEY, [None])[-1]
    if old is not None:
        decided = step["prefills"] > 0
        summed = [key for key in _SUMMED_OVER_PREFILLS if key in step or key in old]
        for key in summed:
            step[key] = step.get(key, 0) + old.get(key, 0)
        if not decided:
            # An earlier window of a split prompt, or a window of generated tokens after the
            # prompt's: it decided nothing, so the last decision stands.
            step = {**old, **{key: step[key] for key in ["policy"] + summed}}
    info[RECORD_KEY] = [step]
    req.customized_info = info


def around_is_request_level_key(original: Callable, streamer: "SchedulerOutputStreamer", key: str) -> bool:
    """Hook on ``SchedulerOutputStreamer.is_request_level_customized_info_key``."""
    return key == RECORD_KEY or original(streamer, key)


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
         ".is_request_level_customized_info_key",
         around_is_request_level_key, ("self", "key")),
)
