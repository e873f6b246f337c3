"""The repair's query pass inside SGLang's forward: the scores the attention backend records for a
request, its set-up, and the repaired rows written over SGLang's output (forward/context.py,
forward/query_pass.py, forward/repair_stage.py)."""

from __future__ import annotations

import types

import pytest
import torch

from relaxkv_sglang.attention.query_scores import query_attention_scores
from relaxkv_sglang.attention.extend_rows import ExtendRows, QueryScores, record_query_scores
from relaxkv_sglang.repair.sglang.layer_loop import LoopRows
from relaxkv_sglang.forward.repair_stage import _replace_rows

H, HKV, D = 4, 2, 8


def _pool(n_slots: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n_slots, HKV, D, generator=torch.Generator().manual_seed(seed))


def test_recorded_scores_are_the_query_attention_over_the_request_slots():
    # request: positions 0..9, context 0..6, query 7..8, position 9 a generated token (retraction);
    # its KV lives in scattered pool slots
    slots = torch.tensor([12, 3, 7, 0, 15, 9, 4, 11, 2, 6])
    k_cache = _pool(16)
    positions = torch.arange(2, 10)  # the batch holds rows 2..9 (0..1: an exact radix prefix)
    q = torch.randn(8, H, D, generator=torch.Generator().manual_seed(1))
    scores = QueryScores(n_context=7, query_end=9, slots=slots)
    other = ExtendRows(req_pool_idx=0, row_start=0, positions=torch.arange(3), scope_start=torch.zeros(3, dtype=torch.long))
    mine = ExtendRows(req_pool_idx=1, row_start=3, positions=positions, scope_start=torch.zeros(8, dtype=torch.long),
                      scores=scores)
    batch_q = torch.cat([torch.randn(3, H, D), q])
    for _ in range(2):
        record_query_scores([other, mine], batch_q, k_cache, scale=0.3)
    expected = query_attention_scores(q[5:7], k_cache[slots[:9]], 7, 0.3)
    assert scores.stacked(2).shape == (2, 7)
    assert torch.allclose(scores.stacked(2)[0], expected) and torch.allclose(scores.stacked(2)[1], expected)
    # the query's mass on the context is at most the number of query tokens times heads
    assert 0 < float(expected.sum()) <= 2 * H
    with pytest.raises(RuntimeError, match="2 of 3 layers"):
        scores.stacked(3)


def test_a_query_pass_without_the_whole_query_is_refused():
    scores = QueryScores(n_context=7, query_end=9, slots=torch.arange(10))
    with pytest.raises(RuntimeError, match="whole query"):
        scores.record(torch.randn(2, H, D), torch.tensor([8, 9]), _pool(10), 1.0)  # query row 7 missing


def _repair_rows(positions: list[int], anchor: list[bool]) -> LoopRows:
    n = len(positions)
    return LoopRows(slots=torch.arange(32), positions=torch.tensor(positions), exits=torch.full((n,), 2),
                    scope=torch.zeros(n, dtype=torch.long), anchor=torch.tensor(anchor))


def test_repaired_glue_and_query_rows_replace_sglang_rows_and_nothing_else():
    # the batch: another request's 3 rows, then this request's rows at positions 10..19 of a window
    # starting at 10 (rows before 10: an earlier window); the repair pass: anchors 4, 12, 13 (one of an
    # earlier window), glue 8 (earlier window, not in the batch) and 16, query 18..19
    hidden = torch.zeros(13, 2)
    batch_positions = torch.arange(10, 20)
    rows = _repair_rows([4, 8, 12, 13, 16, 18, 19], [True, False, True, True, False, False, False])
    repaired = torch.arange(1, 8, dtype=torch.float32)[:, None].repeat(1, 2)  # row i -> value i + 1
    _replace_rows(hidden, 3, batch_positions, repaired, rows)
    written = {int(p): float(hidden[3 + int(p) - 10, 0]) for p in batch_positions if hidden[3 + int(p) - 10, 0] != 0}
    assert written == {16: 5.0, 18: 6.0, 19: 7.0}
    assert not bool(hidden[:3].any())  # the other request's rows are untouched


def test_a_repair_that_misses_the_last_row_is_refused():
    rows = _repair_rows([12, 16, 18], [True, False, False])
    with pytest.raises(RuntimeError, match="last row"):
        _replace_rows(torch.zeros(10, 2), 0, torch.arange(10, 20), torch.ones(3, 2), rows)


# ------------------------------------------------- one request's failure is served as pic


def _request_fold(policy: str, keep: list[int], n: int = 10) -> "RequestFold":
    """A request of 10 prompt tokens, one chunk at 2..6, query 6..9, window 0..n; ``keep``: its rows."""
    from relaxkv_sglang.forward.fold import RequestFold
    from relaxkv_sglang.request.plan import RequestPlan

    req = types.SimpleNamespace(origin_input_ids=list(range(10)), rid=f"req-{policy}", logprob_start_len=-1)
    rows = torch.tensor(keep, dtype=torch.int64)
    return RequestFold(req, 0, 0, n, rows, torch.zeros_like(rows), RequestPlan(policy, ((2, 6),), None))


def _cache() -> types.SimpleNamespace:
    return types.SimpleNamespace(req_to_token=torch.arange(40, dtype=torch.int32).view(2, 20),
                                 publish_chunks=lambda *args: None)


def test_a_request_whose_query_pass_would_miss_query_rows_is_served_as_pic(caplog):
    from relaxkv_sglang.forward.query_pass import _set_up_request

    with caplog.at_level("WARNING"):
        broken = _set_up_request(_cache(), _request_fold("relaxkv", [0, 1, 6, 7, 8]), True)  # query row 9 missing
    assert not broken.to_repair and broken.scores is None
    assert broken.not_repaired_reason.endswith("(served as pic)") and "3 of the query's rows 6..9" in broken.not_repaired_reason
    assert sum("req-relaxkv not repaired" in m for m in caplog.messages) == 1  # logged once
    whole = _set_up_request(_cache(), _request_fold("relaxkv", [0, 1, 6, 7, 8, 9]), True)
    assert whole.to_repair and whole.scores is not None and whole.not_repaired_reason is None


def test_a_model_without_the_repair_pass_is_served_as_pic_before_the_forward():
    from relaxkv_sglang.forward.query_pass import _set_up_request

    rows = _set_up_request(_cache(), _request_fold("relaxkv", [0, 1, 6, 7, 8, 9]), False)
    assert not rows.to_repair and rows.not_repaired_reason.startswith("the model's layer stack")


def test_a_request_whose_repair_cannot_be_planned_is_served_as_pic(monkeypatch):
    from relaxkv_sglang.forward import repair_stage as repair
    from relaxkv_sglang.forward.query_pass import RequestRows
    from relaxkv_sglang.repair.repair_config import RepairConfig
    from relaxkv_sglang.repair.sglang.served_calibration import ServedCalibration
    from relaxkv_sglang.repair.sglang.services import RepairServices

    def schedule_anchors(*args, **kwargs):
        raise ValueError("no anchors fit")

    monkeypatch.setattr(repair, "schedule_anchors", schedule_anchors)
    f = _request_fold("epic", [0, 1, 6, 7, 8, 9])
    r = RequestRows(f, f.keep, f.scope_start, to_repair=True, slots=torch.arange(10))
    services = RepairServices(anchor_attention=None, cost=None, lm_head=None, vocab_size=32, kv_pool=None, rope=None,
                              calibration=ServedCalibration("tiny", None, RepairConfig()))
    stage = repair.RepairStage(_cache(), services, None)
    outcome = stage._plan(r, 2, None, None)
    assert outcome.not_repaired_reason == "its repair could not be planned (no anchors fit) (served as pic)"
    assert outcome.rows is None


def test_a_broken_invariant_is_not_served_as_pic(monkeypatch):
    from relaxkv_sglang.forward import query_pass
    from relaxkv_sglang.runtime.failures import InvariantError

    def broken(*args):
        raise InvariantError("relaxkv: the pool is inconsistent")

    monkeypatch.setattr(query_pass, "_query_pass_rows", broken)
    with pytest.raises(InvariantError):
        query_pass._set_up_request(_cache(), _request_fold("relaxkv", [0, 1, 6, 7, 8, 9]), True)
