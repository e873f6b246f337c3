"""Unit tests of ``bench_cache_hit --frameworks``' prompt builders and its rows (no server).

The builders render the trace request through the installed frameworks' own templates
(``langchain_core`` / ``langchain_openai``, ``llama_index.core``); the expected values below are the
shapes their RAG tutorials send, written out by hand.
"""

from __future__ import annotations

import pytest

from benchmarks import cache_hit_frameworks as fw
from benchmarks.replay import TraceRequest

pytest.importorskip("langchain_openai")
pytest.importorskip("llama_index.core")

DOCS = ["Alpha document: the first paragraph, long enough to be a chunk of its own in a prompt.",
        "Beta document: the second paragraph, about something else entirely, also long enough."]
REQ = TraceRequest("System prompt of the trace.", DOCS, "Question: Who is first?\nAnswer:", [3, 7])


def test_question_is_the_bare_question():
    assert fw.question_of(REQ) == "Who is first?"


def test_langchain_chat_has_the_documents_in_the_system_message():
    route, body = fw.langchain_chat(REQ)
    assert route == "chat"
    assert body == {"messages": [
        {"role": "system", "content": fw.LANGCHAIN_SYSTEM + "\n\n" + DOCS[0] + "\n\n" + DOCS[1]},
        {"role": "user", "content": "Who is first?"}]}


def test_llamaindex_chat_and_completion_use_the_text_qa_template():
    context = (f"file_path: {fw.llamaindex_file_path(DOCS[0])}\n\n{DOCS[0]}\n\n"
               f"file_path: {fw.llamaindex_file_path(DOCS[1])}\n\n{DOCS[1]}")
    template = ("Context information is below.\n---------------------\n" + context + "\n---------------------\n"
                "Given the context information and not prior knowledge, answer the query.\n"
                "Query: Who is first?\nAnswer: ")
    route, body = fw.llamaindex_chat(REQ)
    assert route == "chat" and [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][0]["content"].startswith("You are an expert Q&A system")
    assert body["messages"][1]["content"] == template
    assert fw.llamaindex_completion(REQ) == ("completion", {"prompt": template})
    assert fw.llamaindex_file_path(DOCS[0]) != fw.llamaindex_file_path(DOCS[1])


def test_openai_sdk_sends_one_numbered_string():
    route, body = fw.openai_sdk(REQ)
    assert route == "chat"
    assert body["messages"] == [
        {"role": "system", "content": "System prompt of the trace."},
        {"role": "user", "content": f"Documents:\n[1] {DOCS[0]}\n[2] {DOCS[1]}\n\nQuestion: Who is first?"}]


def test_content_parts_mark_each_document():
    route, body = fw.content_parts(REQ)
    assert route == "chat"
    assert body["messages"][1]["content"] == [{"type": "text", "text": DOCS[0]}, {"type": "text", "text": DOCS[1]},
                                              {"type": "text", "text": "Who is first?"}]
    assert list(fw.SHAPES)[0] == "content-parts"


def test_rows_compare_each_shape_with_content_parts():
    result = {"workload": {}, "results": [
        {"shape": "content-parts", "route": "chat", "cache_hit_rate_pct": 60.0, "best_possible_hit_rate_pct": 75.0,
         "share_of_best_pct": 80.0, "vs_content_parts_points": 0.0, "share_vs_content_parts_points": 0.0,
         "latency_mean_s": 0.25},
        {"shape": "openai-sdk", "route": "chat", "cache_hit_rate_pct": 54.5, "best_possible_hit_rate_pct": 70.0,
         "share_of_best_pct": 77.9, "vs_content_parts_points": -5.5, "share_vs_content_parts_points": -2.1,
         "latency_mean_s": 0.3}]}
    heads, rows = fw.framework_rows(result)
    assert heads[:5] == ["shape", "route", "hit rate", "best", "hit/best"]
    assert rows[1] == ["openai-sdk", "chat", "54.5%", "70.0%", "77.9%", "-5.5", "-2.1", "0.30"]
