"""A request's reuse plan, as the scheduler process sees it.

The HTTP side (:mod:`relaxkv_sglang.srt.api`) validates what the user sent,
tokenizes each part on its own, and hands the scheduler internal entries of
``sampling_params.custom_params`` (the plan keys of :mod:`relaxkv_sglang.schema`):
the policy, the chunks' token spans (a flat list ``[s0, e0, s1, e1, ...]``,
since custom params carry only flat lists) and the repair knobs. This module
reads them back once per request.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from relaxkv_sglang.core.policies import CHUNK_POLICIES, REPAIR_POLICIES
from relaxkv_sglang.schema import ANCHOR_RATIO, BUDGET, CHUNKS, CONTEXT_RATIO, POLICY, RECORD_KEY, REPAIR_KNOBS

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

__all__ = ["BACKEND_NAME", "RECORD_KEY", "RequestPlan", "chunk_tree_served", "request_namespace", "request_plan"]

# The name the plugin registers its tree cache and attention backend under.
BACKEND_NAME = "relaxkv"


def chunk_tree_served(server_args: Any) -> bool:
    """Whether the server runs the plugin's chunk tree (else the plugin leaves requests alone).

    ``server_args`` is SGLang's ``ServerArgs`` (or None).
    """
    return getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """policy: one of core.policies.SERVER_POLICIES; chunk_spans: token spans [start, end) in
    prompt order; namespace: the tenant key chunks are stored under; anchor_ratio,
    context_ratio and budget: the repair knobs (defaults: the schema's, i.e. RepairConfig's;
    a budget, when set, decides the two ratios)."""

    policy: str
    chunk_spans: tuple[tuple[int, int], ...]
    namespace: str | None
    anchor_ratio: float = ANCHOR_RATIO.default
    context_ratio: float = CONTEXT_RATIO.default
    budget: float | None = BUDGET.default

    @property
    def reuses_chunks(self) -> bool:
        """Chunk KV comes from the chunk tree: a chunk policy and at least one chunk."""
        return self.policy in CHUNK_POLICIES and bool(self.chunk_spans)

    @property
    def repairs(self) -> bool:
        """Anchors are recomputed: a repair policy and at least one chunk."""
        return self.policy in REPAIR_POLICIES and bool(self.chunk_spans)

    @property
    def query_start(self) -> int:
        """First token after the last chunk (the API keeps the query non-empty)."""
        return self.chunk_spans[-1][1]

    @property
    def exact_len(self) -> int | None:
        """Tokens whose KV is the exact causal KV (those before the first chunk)."""
        return self.chunk_spans[0][0] if self.reuses_chunks else None


def request_namespace(req: Req) -> str | None:
    """Chunks are shared only between requests with the same extra_key and cache_salt.

    The key is unambiguous (extra_key's length first): both are client strings,
    and with a bare separator an extra_key ending in it and a salt starting with
    it would name the same namespace as another pair."""
    extra = getattr(req, "extra_key", None) or ""
    salt = getattr(req, "cache_salt", None) or ""
    return f"{len(extra)}:{extra}\x1f{salt}" if (extra or salt) else None


def request_plan(req: Req) -> RequestPlan | None:
    """The plan of an SGLang ``Req`` (cached on it), or None for a plain request."""
    cached = req.__dict__.get("_relaxkv_plan", False)
    if cached is not False:
        return cached
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    plan = None
    if POLICY.plan_key in params:
        flat = list(params.get(CHUNKS.plan_key) or [])
        spans = tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))
        knobs = {f.config_attr: params.get(f.plan_key, f.default) for f in REPAIR_KNOBS}
        knobs = {k: float(v) if v is not None else None for k, v in knobs.items()}
        plan = RequestPlan(str(params[POLICY.plan_key]), spans, request_namespace(req), **knobs)
    req.__dict__["_relaxkv_plan"] = plan
    return plan
