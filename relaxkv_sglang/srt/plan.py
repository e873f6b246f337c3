"""A request's reuse plan, as the scheduler process sees it.

The HTTP side (:mod:`relaxkv_sglang.srt.api`) validates what the user sent,
tokenizes each part on its own, and hands the scheduler two internal entries
of ``sampling_params.custom_params``: the policy and the chunks' token spans
(a flat list ``[s0, e0, s1, e1, ...]``, since custom params carry only flat
lists). This module reads them back once per request.
"""

from __future__ import annotations

import dataclasses

PLAN_POLICY_KEY = "_relaxkv_policy"
PLAN_SPANS_KEY = "_relaxkv_token_spans"

# Policies the server accepts; those in CHUNK_POLICIES reuse chunk KV.
SERVER_POLICIES = ("full", "prefix", "pic")
CHUNK_POLICIES = frozenset({"pic"})


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """policy: one of SERVER_POLICIES; chunk_spans: token spans [start, end) in
    prompt order; namespace: the tenant key chunks are stored under."""

    policy: str
    chunk_spans: tuple[tuple[int, int], ...]
    namespace: str | None

    @property
    def reuses_chunks(self) -> bool:
        return self.policy in CHUNK_POLICIES and bool(self.chunk_spans)

    @property
    def exact_len(self) -> int | None:
        """Tokens whose KV is the exact causal KV (those before the first chunk)."""
        return self.chunk_spans[0][0] if self.reuses_chunks else None


def request_namespace(req) -> str | None:
    """Chunks are shared only between requests with the same extra_key and cache_salt."""
    extra = getattr(req, "extra_key", None) or ""
    salt = getattr(req, "cache_salt", None) or ""
    return f"{extra}\x1f{salt}" if (extra or salt) else None


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
        plan = RequestPlan(str(params[PLAN_POLICY_KEY]), spans, request_namespace(req))
    req.__dict__["_relaxkv_plan"] = plan
    return plan
