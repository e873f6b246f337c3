"""meta_info.relaxkv over several prefill steps: the windows of a split prompt, a retraction."""

from __future__ import annotations

from types import SimpleNamespace

from relaxkv_sglang.forward.report import merge_record


def _step(prefills: int, repaired: bool, computed: int, **extra) -> dict:
    return {"policy": "relaxkv", "chunks_seen": 2, "chunks_hit": 1, "chunk_tokens_reused": 10,
            "tokens_computed": computed, "repaired": repaired, "prefills": prefills, "repairs": int(repaired),
            **extra}


def _record(req) -> dict:
    return req.customized_info["relaxkv"][-1]


def test_windows_before_the_last_keep_counting_and_the_last_decides():
    req = SimpleNamespace(customized_info=None)
    merge_record(req, _step(0, False, 100))  # first window of a split prompt: decides nothing
    assert _record(req)["repaired"] is False and _record(req)["prefills"] == 0
    merge_record(req, _step(1, True, 50, anchor_ratio=0.3))  # the window with the prompt's last token
    assert _record(req) == _step(1, True, 150, anchor_ratio=0.3) | {"chunks_seen": 4, "chunks_hit": 2,
                                                                    "chunk_tokens_reused": 20}


def test_a_window_after_the_prompt_keeps_the_decision():
    req = SimpleNamespace(customized_info=None)
    merge_record(req, _step(1, True, 50, anchor_ratio=0.3))
    merge_record(req, _step(0, False, 7))  # a retracted request's window of generated tokens only
    record = _record(req)
    assert record["repaired"] is True and record["anchor_ratio"] == 0.3
    assert (record["prefills"], record["repairs"], record["tokens_computed"]) == (1, 1, 57)


def test_a_retracted_request_reports_each_prefill_and_the_last_decision():
    req = SimpleNamespace(customized_info=None)
    merge_record(req, _step(1, True, 50, anchor_ratio=0.3))
    merge_record(req, _step(1, False, 40, not_repaired_reason="why"))  # prefilled again, not repaired
    record = _record(req)
    assert (record["prefills"], record["repairs"]) == (2, 1)
    assert record["repaired"] is False and record["not_repaired_reason"] == "why" and "anchor_ratio" not in record
