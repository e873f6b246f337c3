"""A request's reuse plan, as the scheduler process sees it.

The HTTP side (:mod:`relaxkv_sglang.request.sglang.api`) validates a request's fields once into a
:class:`RequestPlan`, which SGLang pickles to the scheduler in ``sampling_params.custom_params``
(:data:`relaxkv_sglang.request.schema.PLAN_KEY`). The scheduler adds only what SGLang decides there (the
tenant namespace, a session's history) and keeps it in the request's :class:`RequestState`.

A request SGLang aborts before its prefill (``Req.set_finish_with_abort``) runs one prefill of a one-token
stub whose spans point past it: :func:`request_plan` gives it no plan, so it is served as without the plugin.
A session turn (``session_params``, ``sglang/srt/session/session_controller.py``) is served after its
session's history: :func:`_scheduled_plan` shifts the spans by what was prepended (the chunks never hold
position 0, so a stripped BOS does not matter)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from relaxkv_sglang.repair.policies import CHUNK_POLICIES, REPAIR_POLICIES
from relaxkv_sglang.request.schema import PLAN_KEY, RECORD_KEY
from relaxkv_sglang.runtime import records

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.server_args import ServerArgs

__all__ = ["BACKEND_NAME", "RECORD_KEY", "RequestPlan", "RequestState", "chunk_tree_served", "fits_prompt",
           "request_namespace", "request_plan", "request_state"]

BACKEND_NAME = "relaxkv"  # the plugin's tree cache and attention backend


def chunk_tree_served(server_args: Optional[ServerArgs]) -> bool:
    """Whether the server runs the plugin's chunk tree (else the plugin leaves requests alone)."""
    return getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """``policy``: one of :data:`~relaxkv_sglang.repair.policies.SERVER_POLICIES`; ``chunk_spans``: token spans
    [start, end) in prompt order; ``namespace``: :func:`request_namespace`, set by the scheduler; the repair knobs
    as the request gave them, None where not (then the served model's calibrated value or RepairConfig's default,
    ``repair.request_repair_config``; a ``budget`` decides both ratios, ``"auto"`` from the query pass:
    ``repair/auto_budget.py``; ``quality``: what it aims at); ``prompt_len``: the planned prompt's length."""

    policy: str
    chunk_spans: tuple[tuple[int, int], ...]
    namespace: str | None = None
    anchor_ratio: float | None = None
    context_ratio: float | None = None
    budget: float | str | None = None
    quality: str | float | None = None
    prompt_len: int | None = None

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
    """Chunks are shared only between requests with the same extra_key and cache_salt (client strings: with a
    bare separator and no length first, two pairs could name one namespace)."""
    extra = getattr(req, "extra_key", None) or ""
    salt = getattr(req, "cache_salt", None) or ""
    return f"{len(extra)}:{extra}\x1f{salt}" if (extra or salt) else None


@dataclasses.dataclass(frozen=True)
class RequestState:
    """A ``Req``'s record in the scheduler: its plan as scheduled (None: a plain request)."""

    plan: Optional[RequestPlan]


def request_state(req: Req) -> RequestState:
    """The request's :class:`RequestState`, made on first use."""
    held = records.record(req, RequestState, create=False)
    return held if held is not None else records.attach(req, RequestState(_scheduled_plan(req)))


def request_plan(req: Req) -> RequestPlan | None:
    """The plan of an SGLang ``Req``, or None for a plain request and for one whose prompt SGLang
    replaced (an aborted request's stub, module doc)."""
    plan = request_state(req).plan
    return plan if plan is not None and fits_prompt(plan, req) else None


def fits_prompt(plan: RequestPlan, req: Req) -> bool:
    """Whether the plan's chunks lie in the request's prompt with a query after them (the HTTP side
    guarantees it for the prompt it planned; SGLang's abort stub is shorter)."""
    return not plan.chunk_spans or plan.query_start < len(req.origin_input_ids)


def _scheduled_plan(req: Req) -> Optional[RequestPlan]:
    """The HTTP side's plan in the request's ``custom_params`` with its namespace, its spans shifted past what
    SGLang prepended (a shorter prompt, an abort stub, keeps them); None: no plan (a value not made by the HTTP
    side, as from a client that bypassed it, is not one)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    plan = params.get(PLAN_KEY)
    if not isinstance(plan, RequestPlan):
        return None
    shift = max(len(req.origin_input_ids) - plan.prompt_len, 0) if plan.prompt_len is not None else 0
    spans = tuple((s + shift, e + shift) for s, e in plan.chunk_spans)
    return dataclasses.replace(plan, chunk_spans=spans, namespace=request_namespace(req))
