"""The wire schema of the plugin's request fields: each declared once, with its check.

A request opts in through ``custom_params`` (``sampling_params.custom_params`` of ``/generate``, the
top-level one of the OpenAI routes). Each field is one :class:`Field`: name, JSON type, allowed
values, default, a one-line doc and :meth:`Field.validate` (a bad value raises :class:`RequestError`,
which SGLang's HTTP server answers with 400). Every module that reads or writes the fields spells them
through this one (the HTTP side, ``request/plan.py``, ``lang.py``, ``client.py``); ``docs/api.md``'s
table is checked against it by ``tests/unit/test_schema.py``.

Also here: :data:`PLAN_KEY`, where the HTTP side hands the scheduler the validated plan, under
:data:`RESERVED_PREFIX` (clients may not use it); :data:`USER_PREFIX` (a key under it must be one of
:data:`FIELD_NAMES`: a typo is an error, not a request silently served without reuse);
:data:`RECORD_KEY`; and :data:`POLICY_HEADER`, a request's default policy where the body cannot carry
one (SGLang's ``/generate`` takes ``custom_params`` inside ``sampling_params``, which load generators
such as ``sglang.bench_serving`` build themselves); the body's ``relaxkv_policy`` wins.

The repair knobs' defaults come from :class:`relaxkv_sglang.repair.repair_config.RepairConfig`, read on
first use (it needs torch; light clients import this module). No SGLang.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional

from relaxkv_sglang.repair.policies import CHUNK_POLICIES, DEFAULT_POLICY, SERVER_POLICIES
from relaxkv_sglang.runtime.settings import DEFAULT_POLICY_ENV, ServerSettings, bad_variable
from relaxkv_sglang.runtime.quality import AUTO as AUTO_BUDGET
from relaxkv_sglang.runtime.quality import DEFAULT_QUALITY, QUALITY_LEVELS, parse_quality
from relaxkv_sglang.request.segments import ChunkSpecError, parse_chunk_offsets

__all__ = [
    "USER_PREFIX", "RESERVED_PREFIX", "RECORD_KEY", "RequestError", "Field",
    "ChunksField", "PolicyField", "RatioField", "BudgetField", "QualityField", "CHUNKS", "POLICY", "ANCHOR_RATIO",
    "CONTEXT_RATIO", "BUDGET", "QUALITY", "AUTO_BUDGET", "QUALITY_LEVELS",
    "FIELDS", "FIELD_NAMES", "REPAIR_KNOBS", "PLAN_KEY", "check_keys", "mentions_fields",
    "POLICY_HEADER", "header_policy",
]

USER_PREFIX = "relaxkv_"
RESERVED_PREFIX = "_relaxkv_"  # the server's internal keys, present and future: clients may not send them
PLAN_KEY = RESERVED_PREFIX + "plan"
RECORD_KEY = "relaxkv"  # meta_info key of the per-request report (SGLang carries it as customized_info)
POLICY_HEADER = "X-RelaxKV-Policy"  # case-insensitive, as every HTTP header name


class RequestError(ValueError):
    """``invalid FIELD: MESSAGE``; SGLang's HTTP layer answers ValueError with status 400."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid {field}: {message}")
        self.field = field
        self.message = message


@functools.cache
def _repair_defaults() -> dict[str, Any]:
    from relaxkv_sglang.repair.repair_config import RepairConfig

    return {f.name: f.default for f in dataclasses.fields(RepairConfig)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Field:
    """One user-facing request field: its ``custom_params`` key, JSON type and one-line doc."""

    name: str
    type: str
    doc: str

    @property
    def config_attr(self) -> str:
        """The ``RequestPlan`` attribute a knob sets (and ``RepairConfig``'s for the ratios)."""
        return self.name.removeprefix(USER_PREFIX)

    @property
    def default(self) -> Any:
        return None

    def validate(self, value: Any, *, text: Optional[str] = None) -> Any:
        """``value`` normalized, or :class:`RequestError`; ``text``: the prompt, if the range depends on it."""
        raise NotImplementedError

    def is_valid(self, value: Any, *, text: Optional[str] = None) -> bool:
        try:
            self.validate(value, text=text)
        except ValueError:
            return False
        return True

    def error(self, message: str) -> RequestError:
        return RequestError(self.name, message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunksField(Field):
    """The documents' character offsets in ``text`` (:func:`relaxkv_sglang.request.segments.parse_chunk_offsets`)."""

    max_chunks: int

    def validate(self, value: Any, *, text: Optional[str] = None) -> list[tuple[int, int]]:
        if text is None:
            raise self.error("character offsets need the prompt as `text`, not `input_ids`")
        try:
            return parse_chunk_offsets(text, value, field=self.name, max_chunks=self.max_chunks)
        except ChunkSpecError as exc:
            raise RequestError(exc.field, exc.message) from exc


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyField(Field):
    """``choices``: :mod:`relaxkv_sglang.repair.policies`' served names, in the registry's order."""

    choices: tuple[str, ...]

    @property
    def default(self) -> str:
        """Without ``RELAXKV_DEFAULT_POLICY`` (``runtime/settings.py``)."""
        return DEFAULT_POLICY

    def validate(self, value: Any, *, text: Optional[str] = None) -> str:
        if not isinstance(value, str) or value not in self.choices:
            raise self.error(f"unknown policy {value!r}; choose one of {', '.join(self.choices)}")
        return value

    def reuses_chunks(self, value: Any) -> bool:
        """``pic`` or a repair policy."""
        return self.is_valid(value) and value in CHUNK_POLICIES


@dataclasses.dataclass(frozen=True, kw_only=True)
class RatioField(Field):
    """A repair knob in ``[low, high]`` (not a bool), named after the
    :class:`~relaxkv_sglang.repair.repair_config.RepairConfig` attribute it sets."""

    type: str = "number"
    low: int = 0
    high: int = 1

    @property
    def default(self) -> Optional[float]:
        return _repair_defaults()[self.config_attr]

    @property
    def expected(self) -> str:
        return f"a number in [{self.low}, {self.high}]"

    def validate(self, value: Any, *, text: Optional[str] = None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            raise self.error(f"must be {self.expected}, got {value!r}")
        return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetField(RatioField):
    """A cost share, or :data:`AUTO_BUDGET` (chosen per request from the query pass, ``repair/auto_budget.py``)."""

    type: str = "number or string"

    @property
    def expected(self) -> str:
        return f"{super().expected} or {AUTO_BUDGET!r}"

    def validate(self, value: Any, *, text: Optional[str] = None) -> float | str:
        return AUTO_BUDGET if value == AUTO_BUDGET else super().validate(value, text=text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityField(Field):
    """A level of :data:`QUALITY_LEVELS` or a target mean KL above 0; the server's default is
    ``RELAXKV_QUALITY`` (``runtime/settings.py``)."""

    type: str = "string or number"

    @property
    def default(self) -> str:
        return DEFAULT_QUALITY

    def validate(self, value: Any, *, text: Optional[str] = None) -> str | float:
        try:
            return parse_quality(value)
        except ValueError as exc:
            raise self.error(str(exc)) from None



def check_default_policy(settings: ServerSettings) -> None:
    """SystemExit, one line naming ``RELAXKV_DEFAULT_POLICY``, unless the server's default policy is served
    (the plugin's ``register``, at startup)."""
    if settings.default_policy not in SERVER_POLICIES:
        raise bad_variable(DEFAULT_POLICY_ENV, settings.default_policy, f"not one of {', '.join(SERVER_POLICIES)}")


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
            raise RequestError(f"custom_params.{key}",
                               f"unknown field; the relaxkv fields are {', '.join(FIELD_NAMES)}")


def mentions_fields(custom_params: Mapping[Any, Any]) -> bool:
    """Whether :func:`check_keys` must see these keys."""
    return any(isinstance(k, str) and k.startswith((USER_PREFIX, RESERVED_PREFIX)) for k in custom_params)


def header_policy(headers: Optional[Mapping[str, str]]) -> Optional[str]:
    """``headers``: case-insensitive (Starlette's), None without HTTP (the Python engine). An unserved
    policy raises :class:`RequestError`."""
    value = headers.get(POLICY_HEADER) if headers is not None else None
    if value is None:
        return None
    value = value.strip()
    if value not in POLICY.choices:
        raise RequestError(f"header {POLICY_HEADER}",
                           f"unknown policy {value!r}; choose one of {', '.join(POLICY.choices)}")
    return value
