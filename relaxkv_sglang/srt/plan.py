"""A request's reuse plan, as the scheduler process sees it.

The HTTP side (:mod:`relaxkv_sglang.srt.api`) validates what the user sent,
tokenizes each part on its own, and hands the scheduler internal entries of
``sampling_params.custom_params``: the policy, the chunks' token spans (a flat
list ``[s0, e0, s1, e1, ...]``, since custom params carry only flat lists) and
the repair knobs. This module reads them back once per request.
"""

from __future__ import annotations

import dataclasses

PLAN_POLICY_KEY = "_relaxkv_policy"
PLAN_SPANS_KEY = "_relaxkv_token_spans"
PLAN_ANCHOR_KEY = "_relaxkv_anchor_ratio"
PLAN_CONTEXT_KEY = "_relaxkv_context_ratio"
PLAN_KEYS = (PLAN_POLICY_KEY, PLAN_SPANS_KEY, PLAN_ANCHOR_KEY, PLAN_CONTEXT_KEY)

# Policies the server accepts. CHUNK_POLICIES reuse chunk KV; REPAIR_POLICIES
# also recompute anchors (see relaxkv_sglang.core.selection.RepairPolicy).
REPAIR_POLICIES = ("epic", "cacheblend", "prophetkv", "relaxkv", "relaxkv_fullctx", "relaxkv_randctx")
SERVER_POLICIES = ("full", "prefix", "pic") + REPAIR_POLICIES
CHUNK_POLICIES = frozenset(("pic",) + REPAIR_POLICIES)
# The name the plugin registers its tree cache and attention backend under.
BACKEND_NAME = "relaxkv"


def chunk_tree_served(server_args) -> bool:
    """Whether the server runs the plugin's chunk tree (else the plugin leaves requests alone)."""
    return getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME


# meta_info key of the per-request report (SGLang carries it as customized_info).
RECORD_KEY = "relaxkv"
DEFAULT_ANCHOR_RATIO = 0.15
DEFAULT_CONTEXT_RATIO = 0.25


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """policy: one of SERVER_POLICIES; chunk_spans: token spans [start, end) in
    prompt order; namespace: the tenant key chunks are stored under."""

    policy: str
    chunk_spans: tuple[tuple[int, int], ...]
    namespace: str | None
    anchor_ratio: float = DEFAULT_ANCHOR_RATIO
    context_ratio: float = DEFAULT_CONTEXT_RATIO

    @property
    def reuses_chunks(self) -> bool:
        return self.policy in CHUNK_POLICIES and bool(self.chunk_spans)

    @property
    def repairs(self) -> bool:
        return self.policy in REPAIR_POLICIES and bool(self.chunk_spans)

    @property
    def query_start(self) -> int:
        """First token after the last chunk (the API keeps the query non-empty)."""
        return self.chunk_spans[-1][1]

    @property
    def exact_len(self) -> int | None:
        """Tokens whose KV is the exact causal KV (those before the first chunk)."""
        return self.chunk_spans[0][0] if self.reuses_chunks else None


def request_namespace(req) -> str | None:
    """Chunks are shared only between requests with the same extra_key and cache_salt.

    The key is unambiguous (extra_key's length first): both are client strings,
    and with a bare separator an extra_key ending in it and a salt starting with
    it would name the same namespace as another pair."""
    extra = getattr(req, "extra_key", None) or ""
    salt = getattr(req, "cache_salt", None) or ""
    return f"{len(extra)}:{extra}\x1f{salt}" if (extra or salt) else None


def request_plan(req) -> RequestPlan | None:
    """The plan of an SGLang ``Req`` (cached on it), or None for a plain request."""
    cached = req.__dict__.get("_relaxkv_plan", False)
    if cached is not False:
        return cached
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    plan = None
    if PLAN_POLICY_KEY in params:
        flat = list(params.get(PLAN_SPANS_KEY) or [])
        spans = tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))
        plan = RequestPlan(
            str(params[PLAN_POLICY_KEY]), spans, request_namespace(req),
            float(params.get(PLAN_ANCHOR_KEY, DEFAULT_ANCHOR_RATIO)),
            float(params.get(PLAN_CONTEXT_KEY, DEFAULT_CONTEXT_RATIO)),
        )
    req.__dict__["_relaxkv_plan"] = plan
    return plan
