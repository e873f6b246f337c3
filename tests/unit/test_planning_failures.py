"""Every planning failure leaves a request shaped for SGLang's abort task (issue 57).

SGLang's stream abort task (``create_abort_task``, ``tokenizer_manager.py``) reads ``obj.is_single``,
which a request refused before ``normalize_batch_and_arguments`` lacks; the hook sets it whatever
the planning raised, a ``RequestError`` (400) or anything else (a bug: 500).
"""

from __future__ import annotations

import asyncio

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput

from relaxkv_sglang.request.schema import RequestError
from relaxkv_sglang.request.sglang import api


async def _drain(obj: GenerateReqInput) -> None:
    async def never_called(*args, **kwargs):
        raise AssertionError("SGLang's generate_request ran after a planning failure")
        yield  # an async generator, as SGLang's is

    async for _ in api.around_generate_request(never_called, object(), obj):
        pass


@pytest.mark.parametrize("failure", [RequestError("relaxkv_chunks", "bad"), RuntimeError("a bug"),
                                     KeyError("x")], ids=["request_error", "runtime_error", "key_error"])
@pytest.mark.parametrize("rid, single", [("one", True), (["a", "b"], False)])
def test_any_planning_failure_sets_is_single(monkeypatch, failure, rid, single):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(api, "check_sglang_fields", fail)
    obj = GenerateReqInput(text="hi" if single else ["hi", "ho"], rid=rid)
    assert not hasattr(obj, "is_single")
    with pytest.raises(type(failure)):
        asyncio.run(_drain(obj))
    assert obj.is_single is single
