"""The wire schema of the plugin's request fields: each declared once, with its check.

A request opts in through ``custom_params`` (``sampling_params.custom_params`` of ``/generate``;
the top-level ``custom_params`` of ``/v1/chat/completions`` and ``/v1/completions``). Each
user-facing field is one :class:`Field` below: its name, JSON type, allowed values, default and
a one-line doc, and :meth:`Field.validate`, the check of a value (a bad one raises
:class:`RequestError`, a ``ValueError`` naming the field, which SGLang's HTTP server answers with
status 400). Every module that reads or writes the fields spells them through this one: the HTTP
side (``request/sglang/api.py``, ``request/sglang/chat.py``, ``request/sglang/parallel_encoding.py``), the scheduler side
(``request/plan.py``), the frontend (``lang.py``) and the client (``client.py``). ``docs/api.md``'s
field table is checked against it by ``tests/unit/test_schema.py``.

Also declared here:

* :data:`PLAN_KEY`, the internal ``custom_params`` key under which the HTTP side hands the scheduler
  the request's validated plan (``request/plan.py``'s ``RequestPlan``); every key under
  :data:`RESERVED_PREFIX`, which clients may not use;
* :data:`USER_PREFIX`: a client key under it must be one of :data:`FIELD_NAMES` (a typo is an error,
  not a request silently served without reuse);
* :data:`RECORD_KEY`, the ``meta_info`` key of the per-request report;
* the per-request policy header :data:`POLICY_HEADER` (:func:`header_policy`): a request's
  default policy where the body cannot carry one without replacing other fields (SGLang's native
  ``/generate`` takes ``custom_params`` inside ``sampling_params``, which load generators such as
  ``sglang.bench_serving`` build themselves). ``custom_params.relaxkv_policy`` in the body wins.

The policies come from :mod:`relaxkv_sglang.repair.policies`; the repair knobs' defaults from
:class:`relaxkv_sglang.repair.repair_config.RepairConfig`, read on first use (that module needs torch;
this one is imported by light clients). Imports only the standard library and
``relaxkv_sglang.core``; no SGLang.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

from relaxkv_sglang.repair.policies import CHUNK_POLICIES, DEFAULT_POLICY, SERVER_POLICIES
from relaxkv_sglang.repair.quality import AUTO as AUTO_BUDGET
from relaxkv_sglang.repair.quality import DEFAULT_QUALITY, QUALITY_LEVELS, parse_quality
from relaxkv_sglang.request.segments import ChunkSpecError, parse_chunk_offsets

__all__ = [
    "USER_PREFIX", "RESERVED_PREFIX", "RECORD_KEY", "RequestError", "Field",
    "ChunksField", "PolicyField", "RatioField", "BudgetField", "QualityField", "CHUNKS", "POLICY", "ANCHOR_RATIO",
    "CONTEXT_RATIO", "BUDGET", "QUALITY", "AUTO_BUDGET", "QUALITY_LEVELS",
    "FIELDS", "FIELD_NAMES", "REPAIR_KNOBS", "PLAN_KEY", "check_keys", "mentions_fields",
    "POLICY_HEADER", "header_policy",
]

USER_PREFIX = "relaxkv_"  # every user-facing field; another key under it is a typo (an error)
RESERVED_PREFIX = "_relaxkv_"  # the server's internal keys, present and future: clients may not send them
PLAN_KEY = RESERVED_PREFIX + "plan"  # the validated plan the HTTP side hands the scheduler
RECORD_KEY = "relaxkv"  # meta_info key of the per-request report (SGLang carries it as customized_info)
POLICY_HEADER = "X-RelaxKV-Policy"  # a request's default policy (HTTP header names are case-insensitive)


class RequestError(ValueError):
    """A client error naming its field; SGLang's HTTP layer answers ValueError with status 400.

    The message is ``invalid FIELD: MESSAGE``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid {field}: {message}")
        self.field = field
        self.message = message


@functools.cache
def _repair_defaults() -> dict[str, Any]:
    """RepairConfig's field defaults (imported on first use: repair.repair_config needs torch)."""
    from relaxkv_sglang.repair.repair_config import RepairConfig

    return {f.name: f.default for f in dataclasses.fields(RepairConfig)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Field:
    """One user-facing request field.

    Attributes:
        name: the key in ``custom_params``.
        type: its JSON type, as documented.
        doc: one line: what it means.
    """

    name: str
    type: str
    doc: str

    @property
    def config_attr(self) -> str:
        """Its name without :data:`USER_PREFIX`: the attribute a repair knob sets (``RequestPlan``'s,
        and ``RepairConfig``'s for the ratios)."""
        return self.name.removeprefix(USER_PREFIX)

    @property
    def default(self) -> Any:
        """The value a request without the field gets (None: no value)."""
        return None

    def validate(self, value: Any, *, text: Optional[str] = None) -> Any:
        """``value`` checked and normalized; raises :class:`RequestError` naming the field.

        ``text`` is the request's prompt, for a field whose range depends on it.
        """
        raise NotImplementedError

    def is_valid(self, value: Any, *, text: Optional[str] = None) -> bool:
        """Whether :meth:`validate` accepts ``value``."""
        try:
            self.validate(value, text=text)
        except ValueError:
            return False
        return True

    def error(self, message: str) -> RequestError:
        """A :class:`RequestError` naming this field."""
        return RequestError(self.name, message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunksField(Field):
    """Character offsets of the documents in ``text``, checked by
    :func:`relaxkv_sglang.request.segments.parse_chunk_offsets`.

    Attributes:
        max_chunks: the most pairs one request may hold.
    """

    max_chunks: int

    def validate(self, value: Any, *, text: Optional[str] = None) -> list[tuple[int, int]]:
        """The chunks' spans ``[(s0, e0), ...]`` in ``text``; offsets need the prompt as text."""
        if text is None:
            raise self.error("character offsets need the prompt as `text`, not `input_ids`")
        try:
            return parse_chunk_offsets(text, value, field=self.name, max_chunks=self.max_chunks)
        except ChunkSpecError as exc:
            raise RequestError(exc.field, exc.message) from exc


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyField(Field):
    """A policy name, one of the server's policies (:mod:`relaxkv_sglang.repair.policies`).

    Attributes:
        choices: the accepted names, in the registry's order.
    """

    choices: tuple[str, ...]

    @property
    def default(self) -> str:
        """The server default policy when ``RELAXKV_DEFAULT_POLICY`` is not set (``runtime/settings.py``)."""
        return DEFAULT_POLICY

    def validate(self, value: Any, *, text: Optional[str] = None) -> str:
        """``value`` if it names a served policy."""
        if not isinstance(value, str) or value not in self.choices:
            raise self.error(f"unknown policy {value!r}; choose one of {', '.join(self.choices)}")
        return value

    def reuses_chunks(self, value: Any) -> bool:
        """Whether ``value`` is a valid policy that reuses chunks (``pic`` or a repair policy)."""
        return self.is_valid(value) and value in CHUNK_POLICIES


@dataclasses.dataclass(frozen=True, kw_only=True)
class RatioField(Field):
    """A repair knob: a number (not a bool) in ``[low, high]``, named after the
    :class:`~relaxkv_sglang.repair.repair_config.RepairConfig` attribute it sets.

    Attributes:
        low, high: the closed range.
    """

    type: str = "number"
    low: int = 0
    high: int = 1

    @property
    def default(self) -> Optional[float]:
        """``RepairConfig``'s default of :attr:`config_attr` (None: unset)."""
        return _repair_defaults()[self.config_attr]

    @property
    def expected(self) -> str:
        """What a valid value is, as the error says it."""
        return f"a number in [{self.low}, {self.high}]"

    def validate(self, value: Any, *, text: Optional[str] = None) -> float:
        """``value`` as a float if it is a number in range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            raise self.error(f"must be {self.expected}, got {value!r}")
        return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetField(RatioField):
    """``relaxkv_budget``: a cost share in ``[low, high]``, or :data:`AUTO_BUDGET` (the budget chosen per
    request from the query pass, ``repair/auto_budget.py``)."""

    type: str = "number or string"

    @property
    def expected(self) -> str:
        return f"{super().expected} or {AUTO_BUDGET!r}"

    def validate(self, value: Any, *, text: Optional[str] = None) -> float | str:
        """``value`` as a float in range, or ``"auto"``."""
        return AUTO_BUDGET if value == AUTO_BUDGET else super().validate(value, text=text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityField(Field):
    """``relaxkv_quality``: what an ``auto`` budget aims at, a level of :data:`QUALITY_LEVELS` or a
    target mean KL (a number above 0); the server's default is ``RELAXKV_QUALITY`` (``runtime/settings.py``)."""

    type: str = "string or number"

    @property
    def default(self) -> str:
        return DEFAULT_QUALITY

    def validate(self, value: Any, *, text: Optional[str] = None) -> str | float:
        """A level name (lower-cased) or a float above 0."""
        try:
            return parse_quality(value)
        except ValueError as exc:
            raise self.error(str(exc)) from None


CHUNKS = ChunksField(
    name="relaxkv_chunks",
    type="array of integers",
    doc="flat character offsets [s0, e0, s1, e1, ...] into `text`; each pair is one document chunk",
    max_chunks=1024,
)
POLICY = PolicyField(
    name="relaxkv_policy",
    type="string",
    doc="what the request reuses: nothing, SGLang's radix cache, or chunks (then maybe repaired)",
    choices=SERVER_POLICIES,
)
ANCHOR_RATIO = RatioField(
    name="relaxkv_anchor_ratio",
    doc="repair policies: mean share of reusable chunk tokens recomputed per layer",
)
CONTEXT_RATIO = RatioField(
    name="relaxkv_context_ratio",
    doc="relaxkv, relaxkv_randctx: share of the context before each anchor's own chunk it attends to "
        "(its own chunk and the first tokens always)",
)

BUDGET = BudgetField(
    name="relaxkv_budget",
    doc="repair policies: the repair's cost as a share of recomputing the chunks in full (sets the anchor "
        "and context ratios, joint allocation), or `auto`: the anchor ratio chosen per request for `relaxkv_quality`",
)
QUALITY = QualityField(
    name="relaxkv_quality",
    doc="with an `auto` budget: what it aims at, `low`, `medium`, `high` or a target mean first-token KL",
)

FIELDS: tuple[Field, ...] = (CHUNKS, POLICY, ANCHOR_RATIO, CONTEXT_RATIO, BUDGET, QUALITY)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
REPAIR_KNOBS: tuple[RatioField | QualityField, ...] = (ANCHOR_RATIO, CONTEXT_RATIO, BUDGET, QUALITY)


def check_keys(custom_params: Mapping[Any, Any]) -> None:
    """Reject a reserved key and an unknown ``relaxkv_`` key (a typo would be served without reuse)."""
    for key in custom_params:
        if not isinstance(key, str):
            continue
        if key.startswith(RESERVED_PREFIX):
            raise RequestError(f"custom_params.{key}", "is reserved for the server")
        if key.startswith(USER_PREFIX) and key not in FIELD_NAMES:
            raise RequestError(f"custom_params.{key}", f"unknown field; the relaxkv fields are {', '.join(FIELD_NAMES)}")


def mentions_fields(custom_params: Mapping[Any, Any]) -> bool:
    """Whether any key is a field or under one of the two prefixes (so :func:`check_keys` must see it)."""
    return any(isinstance(k, str) and k.startswith((USER_PREFIX, RESERVED_PREFIX)) for k in custom_params)


def header_policy(headers: Optional[Mapping[str, str]]) -> Optional[str]:
    """The policy the request's :data:`POLICY_HEADER` names, or None without the header.

    ``headers``: the HTTP request's headers (a case-insensitive mapping, e.g. Starlette's), or None
    for a request that came without HTTP (the Python engine). A value that is not a served policy
    raises :class:`RequestError` naming the header.
    """
    value = headers.get(POLICY_HEADER) if headers is not None else None
    if value is None:
        return None
    value = value.strip()
    if value not in POLICY.choices:
        raise RequestError(f"header {POLICY_HEADER}", f"unknown policy {value!r}; choose one of {', '.join(POLICY.choices)}")
    return value
