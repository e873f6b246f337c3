"""The wire schema (relaxkv_sglang/request/schema.py): its field checks, and docs/api.md's field table against it."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import pickle
import re
import types

import pytest

from relaxkv_sglang.request import schema
from relaxkv_sglang.runtime import settings
from relaxkv_sglang.repair.policies import DEFAULT_POLICY, SERVER_POLICIES
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.request.schema import (
    ANCHOR_RATIO,
    CHUNKS,
    CONTEXT_RATIO,
    FIELDS,
    POLICY,
    RequestError,
    check_keys,
    mentions_fields,
)

API_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"
FIELD_TABLE_HEADER = "| field | type | allowed values | default | meaning |"


# ------------------------------------------------------------------ docs/api.md


def _table_rows(lines: list[str], start: int) -> list[list[str]]:
    """Cells of the markdown table whose header is ``lines[start]`` (separator row skipped)."""
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


@pytest.fixture(scope="module")
def field_table() -> dict[str, dict[str, str]]:
    lines = API_MD.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == FIELD_TABLE_HEADER]
    assert len(starts) == 1, f"docs/api.md must hold one field table headed {FIELD_TABLE_HEADER!r}"
    table = {}
    for name, type_, allowed, default, meaning in _table_rows(lines, starts[0]):
        (field_name,) = _ticked(name)
        table[field_name] = {"type": type_, "allowed": allowed, "default": default, "meaning": meaning}
    return table


def test_docs_field_table_names_the_schema_fields_in_order(field_table):
    assert list(field_table) == [f.name for f in FIELDS]


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_docs_field_table_row_matches_the_schema(field_table, field):
    row = field_table[field.name]
    assert row["type"] == field.type
    assert row["meaning"].replace("`", "") == field.doc.replace("`", "")
    server_settings = (settings.DEFAULT_POLICY_ENV, settings.DEFAULT_BUDGET_ENV, settings.QUALITY_ENV)
    defaults = [t for t in _ticked(row["default"]) if t not in server_settings]
    assert defaults == ([] if field.default is None else [str(field.default)]), row["default"]


def test_docs_field_table_allowed_values_match_the_schema(field_table):
    assert _ticked(field_table[POLICY.name]["allowed"]) == list(SERVER_POLICIES)
    assert settings.DEFAULT_POLICY_ENV in _ticked(field_table[POLICY.name]["default"])
    for knob in (ANCHOR_RATIO, CONTEXT_RATIO):
        assert _ticked(field_table[knob.name]["allowed"]) == [f"[{knob.low}, {knob.high}]"]
    assert str(CHUNKS.max_chunks) in _ticked(field_table[CHUNKS.name]["allowed"])


def test_docs_policy_table_lists_the_server_policies():
    lines = API_MD.read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.strip() == "| policy | reuse |"]
    documented = [name for row in _table_rows(lines, start) for name in _ticked(row[0])]
    assert sorted(documented) == sorted(SERVER_POLICIES)


# ------------------------------------------------------------------ declarations


def test_names_and_prefixes():
    assert len(set(schema.FIELD_NAMES)) == len(FIELDS)
    for field in FIELDS:
        assert field.name.startswith(schema.USER_PREFIX)
    assert schema.PLAN_KEY.startswith(schema.RESERVED_PREFIX)  # so no client can send one


def test_defaults_come_from_the_registries():
    config = RepairConfig()
    assert ANCHOR_RATIO.default == config.anchor_ratio
    assert CONTEXT_RATIO.default == config.context_ratio
    assert POLICY.default == DEFAULT_POLICY
    assert POLICY.choices == SERVER_POLICIES
    assert CHUNKS.default is None


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("knob", (ANCHOR_RATIO, CONTEXT_RATIO), ids=lambda f: f.name)
@pytest.mark.parametrize("value", ["0.1", None, True, [0.1], {"r": 0.1}])
def test_ratio_of_the_wrong_type_names_the_field(knob, value):
    with pytest.raises(ValueError) as info:
        knob.validate(value)
    assert str(info.value) == f"invalid {knob.name}: must be a number in [0, 1], got {value!r}"
    assert isinstance(info.value, RequestError) and info.value.field == knob.name


@pytest.mark.parametrize("knob", (ANCHOR_RATIO, CONTEXT_RATIO), ids=lambda f: f.name)
@pytest.mark.parametrize("value", [1.5, -0.1, 2, math.nan, math.inf])
def test_ratio_out_of_range_names_the_field(knob, value):
    with pytest.raises(ValueError, match=rf"^invalid {knob.name}: must be a number in \[0, 1\]"):
        knob.validate(value)


@pytest.mark.parametrize("value", [0, 1, 0.5, 0.0, 1.0])
def test_ratio_in_range_is_a_float(value):
    out = ANCHOR_RATIO.validate(value)
    assert out == value and type(out) is float


@pytest.mark.parametrize("value", ["magic", "PIC", "pic\x00", "random", 3, None, ["pic"]])
def test_unknown_policy_names_the_field_and_the_choices(value):
    with pytest.raises(ValueError) as info:
        POLICY.validate(value)
    assert str(info.value) == (f"invalid relaxkv_policy: unknown policy {value!r}; "
                               f"choose one of {', '.join(SERVER_POLICIES)}")
    assert not POLICY.is_valid(value)


def test_every_served_policy_is_valid_and_reuse_follows_the_registry():
    for name in SERVER_POLICIES:
        assert POLICY.validate(name) == name
    assert [p for p in SERVER_POLICIES if POLICY.reuses_chunks(p)] == [
        "pic", "epic", "cacheblend", "prophetkv", "relaxkv", "relaxkv_fullctx", "relaxkv_randctx"]
    assert not POLICY.reuses_chunks("magic") and not POLICY.reuses_chunks(3)


@pytest.mark.parametrize("value,expect", [
    ("0,5", "invalid relaxkv_chunks: must be a list"),
    (None, "invalid relaxkv_chunks: must be a list"),
    ([0, 5, 3], "invalid relaxkv_chunks: must hold start/end pairs"),
    ([0, 2.5], "invalid relaxkv_chunks: offset at index 1 must be an integer"),
    ([False, True], "invalid relaxkv_chunks: offset at index 0 must be an integer"),
    ([0, 500], "invalid relaxkv_chunks: chunk 0 (offsets[0], offsets[1]) = (0, 500): end is past the end"),
    ([6, 9, 0, 5], "invalid relaxkv_chunks: chunk 1"),
    (list(range(2050)), "invalid relaxkv_chunks: at most 1024 chunks allowed, got 1025"),
])
def test_bad_chunks_name_the_field(value, expect):
    with pytest.raises(RequestError) as info:
        CHUNKS.validate(value, text="Hello there, general Kenobi.")
    assert str(info.value).startswith(expect), str(info.value)
    assert info.value.field == CHUNKS.name


def test_chunks_need_text():
    with pytest.raises(ValueError, match=r"^invalid relaxkv_chunks: character offsets need the prompt as `text`"):
        CHUNKS.validate([0, 1], text=None)


def test_chunks_give_spans():
    assert CHUNKS.validate([0, 5, 6, 9], text="Hello there") == [(0, 5), (6, 9)]
    assert CHUNKS.validate([], text="Hello") == []


def test_custom_params_keys():
    check_keys({"relaxkv_chunks": [], "relaxkv_policy": "pic", "other": 1, 3: "x"})
    with pytest.raises(ValueError, match=r"^invalid custom_params._relaxkv_future: is reserved for the server$"):
        check_keys({"_relaxkv_future": 1})
    with pytest.raises(ValueError, match=r"^invalid custom_params.relaxkv_chunk: unknown field; the relaxkv fields "
                                         r"are relaxkv_chunks, relaxkv_policy, relaxkv_anchor_ratio, "
                                         r"relaxkv_context_ratio, relaxkv_budget, relaxkv_quality$"):
        check_keys({"relaxkv_chunk": [0, 5]})
    assert mentions_fields({"_relaxkv_policy": "pic"}) and mentions_fields({"relaxkv_x": 1})
    assert not mentions_fields({"other": 1, 3: "x"})


# ------------------------------------------------------------------ HTTP side -> scheduler


def test_the_http_side_parses_once_into_the_plan_the_scheduler_reads():
    from relaxkv_sglang.request.sglang.api import plan_item
    from relaxkv_sglang.request.plan import request_namespace, request_plan

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    text = "Sys. DOC ONE. Q?"
    cp = {CHUNKS.name: [5, 13], POLICY.name: "relaxkv", ANCHOR_RATIO.name: 0.3, "other": 7}
    ids, planned = plan_item(text, {"custom_params": cp}, encode, 1 << 20, DEFAULT_POLICY)
    assert ids == encode(text[:5], True) + encode(text[5:13], False) + encode(text[13:], False)
    assert planned["other"] == 7
    # SGLang pickles custom_params to the scheduler, which only adds the namespace SGLang decides
    planned = pickle.loads(pickle.dumps(planned))
    req = types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=planned), origin_input_ids=ids,
                                extra_key="tenant", cache_salt=None)
    plan = request_plan(req)
    assert plan == dataclasses.replace(planned[schema.PLAN_KEY], namespace=request_namespace(req))
    assert (plan.policy, plan.chunk_spans) == ("relaxkv", ((6, 14),))
    # a ratio the request did not give stays unset: the served model's calibration (or the default) applies
    assert (plan.anchor_ratio, plan.context_ratio) == (0.3, None)
    assert plan.repairs and plan.reuses_chunks
    # SGLang's abort (set_finish_with_abort) swaps the prompt for a one-token stub: no plan then
    req.origin_input_ids = [0]
    assert request_plan(req) is None
    # a plan-shaped value from anywhere but the HTTP side (a client past it) is not a plan
    shaped = {schema.PLAN_KEY: {"policy": "relaxkv", "chunk_spans": [[6, 14]]}}
    req = types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=shaped), origin_input_ids=ids)
    assert request_plan(req) is None


@pytest.mark.parametrize("bos_stripped", [False, True])
def test_a_session_turn_plans_its_chunks_after_the_history(bos_stripped):
    """SGLang serves a session turn on its history + the turn's ids (less a leading BOS,
    ``Session.create_req``): the spans move by what was prepended and still hold the same tokens."""
    from relaxkv_sglang.request.sglang.api import plan_item
    from relaxkv_sglang.request.plan import request_plan

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    text = "Sys. DOC ONE. DOC TWO. Q?"
    ids, planned = plan_item(text, {"custom_params": {CHUNKS.name: [5, 13, 14, 22], POLICY.name: "pic"}},
                             encode, 1 << 20, DEFAULT_POLICY)
    history = [1] + [ord(c) for c in "an earlier turn and its answer"]
    served = history + (ids[1:] if bos_stripped else ids)
    req = types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=planned), origin_input_ids=served)
    plan = request_plan(req)
    assert [served[s:e] for s, e in plan.chunk_spans] == [encode("DOC ONE.", False), encode("DOC TWO.", False)]
    assert plan.exact_len > len(history)  # the history is the exact prefix


def test_plan_item_reports_the_first_bad_field():
    from relaxkv_sglang.request.sglang.api import plan_item

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return [ord(c) for c in text]

    with pytest.raises(RequestError, match=r"^invalid relaxkv_policy: unknown policy 'magic'"):
        plan_item("abc", {"custom_params": {POLICY.name: "magic", ANCHOR_RATIO.name: 2}}, encode, 100, "prefix")
    with pytest.raises(RequestError, match=r"^invalid relaxkv_anchor_ratio: must be a number in \[0, 1\], got 2$"):
        plan_item("abc", {"custom_params": {ANCHOR_RATIO.name: 2, CHUNKS.name: "x"}}, encode, 100, "prefix")
    with pytest.raises(RequestError, match=r"^invalid relaxkv_chunks: character offsets need the prompt as `text`"):
        plan_item(None, {"custom_params": {CHUNKS.name: [0, 1]}}, encode, 100, "prefix")
    with pytest.raises(RequestError, match=r"^invalid sampling_params.custom_params: must be an object, got list$"):
        plan_item("abc", {"custom_params": []}, encode, 100, "prefix")


def test_sglang_fields_that_stop_its_scheduler_are_refused_naming_them():
    from relaxkv_sglang.request.sglang.api import _check_batch_shape, check_sglang_fields

    def obj(**fields):
        return types.SimpleNamespace(**{"text": "Hi.", "input_ids": None, "sampling_params": {},
                                        "logprob_start_len": None, **fields})

    for ok in (None, -1, 0, 7, [0, -1]):
        check_sglang_fields(obj(logprob_start_len=ok))
    for bad, where in ((-2, ""), (-5, ""), (1.5, ""), (True, ""), ([0, -3], " (item 1)")):
        with pytest.raises(RequestError, match=rf"invalid logprob_start_len: must be -1 \(none\) or a token "
                                               rf"position >= 0{re.escape(where)}, got"):
            check_sglang_fields(obj(logprob_start_len=bad))
    _check_batch_shape(obj(text=["a", "b"], sampling_params=[{}, {}]))
    for texts, sps in ((["a"], [{}, {"custom_params": {"relaxkv_policy": "bogus"}}]), (["a", "b"], [{}]), ("a", [{}, {}])):
        with pytest.raises(RequestError, match=r"invalid sampling_params: a list needs one object per prompt"):
            _check_batch_shape(obj(text=texts, sampling_params=sps))


def test_budget_takes_a_share_or_auto_and_quality_a_level_or_a_target():
    from relaxkv_sglang.request.schema import BUDGET, QUALITY

    assert BUDGET.validate("auto") == "auto" and BUDGET.validate(0.2) == 0.2 and BUDGET.validate(1) == 1.0
    for bad in ("Auto", "0.2", 1.5, True, None):
        with pytest.raises(ValueError, match=r"^invalid relaxkv_budget: must be a number in \[0, 1\] or 'auto'"):
            BUDGET.validate(bad)
    assert QUALITY.validate("HIGH") == "high" and QUALITY.validate(0.03) == 0.03
    for bad in ("best", 0, -0.1, False, None):
        with pytest.raises(ValueError, match="^invalid relaxkv_quality: must be one of low, medium, high"):
            QUALITY.validate(bad)
