"""Unit tests for benchmarks.rag_documents, prompt_formats, quality_tasks, metrics and the demo's client side.

No server and no model: the workload tests use synthetic HotpotQA-shaped
examples (one test reads the real file when it is already prepared), and the
demo tests run the real frontend program against an in-process fake backend.
"""

from __future__ import annotations

import collections
import json
import sys

import numpy as np
import pytest

from benchmarks import metrics
from benchmarks.prompt_formats import SEPARATOR, SYSTEM_PROMPTS, question_text
from benchmarks.rag_documents import RagRequest, format_paragraph, hotpotqa_requests, prompt_parts, render_prompt
from relaxkv_sglang import assets


def _example(k: int, n_paragraphs: int = 10) -> dict:
    """A HotpotQA-shaped example whose paragraph titles are unique to it."""
    context = [[f"T{k}-{j}", [f"Sentence {j} of {k}.", f" More about {j}."]] for j in range(n_paragraphs)]
    return {
        "_id": f"id{k}",
        "question": f"What is {k}?",
        "answer": f"answer {k}",
        "supporting_facts": [[f"T{k}-7", 0], [f"T{k}-2", 1]],
        "context": context,
    }


DATA = [_example(k) for k in range(40)] + [_example(100 + k, n_paragraphs=4) for k in range(5)]


# ------------------------------------------------------------------- workloads


def test_prompt_layout_is_exact():
    req = RagRequest(system="Sys.", documents=["A: one.", "B: two."], question="Who? ", answers=["x"], example_id="e")
    assert render_prompt(req) == "Sys.\n\nA: one.\n\nB: two.\n\nQuestion: Who?\nAnswer:"
    system, docs, question = prompt_parts(req)
    assert (system, docs, question) == ("Sys.", ["A: one.", "B: two."], question_text("Who? "))
    assert SEPARATOR.join([system, *docs, question]) == render_prompt(req)
    docs.append("mutating the returned list")
    assert req.documents == ["A: one.", "B: two."]


def test_format_paragraph_joins_sentences_as_written():
    assert format_paragraph("Ed Wood", ["Ed Wood is a film.", " It is American."]) == "Ed Wood: Ed Wood is a film. It is American."


def test_chunk_spans_and_texts_split_a_marked_prompt():
    from benchmarks.prompt_formats import chunk_spans, chunk_texts, marked_text

    text, offsets = marked_text("Sys.", ["A: one.", "B: two."], question_text("Q?"))
    assert chunk_spans(offsets) == [(6, 13), (15, 22)]
    assert chunk_texts(text, offsets) == ["A: one.", "B: two."]
    assert chunk_spans([]) == [] and chunk_texts("no chunks", []) == []


def _titled_example():
    from benchmarks.quality_tasks import TaskExample

    return TaskExample("hotpotqa", "e", "Sys.", ["Ed Wood: Ed Wood is a film.", "Paris: Paris is a city."],
                       question_text("Who?"), ["x"], "qa_f1", 16, titles=["Ed Wood", "Paris"])


@pytest.mark.parametrize("fmt", ["plain", "document", "chat"])
def test_marked_offsets_point_at_exactly_the_formatted_documents(fmt):
    from benchmarks.prompt_formats import PROMPT_FORMATS, chunk_texts, format_document
    from benchmarks.quality_tasks import niah_multivalue

    assert fmt in PROMPT_FORMATS
    for ex in (_titled_example(), niah_multivalue(1, n_docs=4, doc_chars=200, n_values=2, haystack=HAYSTACK)[0]):
        text, offsets = ex.marked(fmt)
        titles = ex.titles or [None] * len(ex.documents)
        formatted = [format_document(d, t, fmt) for d, t in zip(ex.documents, titles)]
        assert chunk_texts(text, offsets) == formatted == ex.chunk_documents(fmt)
        assert len(offsets) == 2 * len(ex.documents) and offsets == sorted(offsets)
        # Everything outside the chunks is the format's frame: system before, question after, separators.
        assert ex.system in text[:offsets[0]] and "Question: " in text[offsets[-1]:]
        assert all(text[e:s].strip() == "" for e, s in zip(offsets[1:-1:2], offsets[2::2]))


def test_plain_format_is_the_layout_from_before():
    from benchmarks.prompt_formats import marked_text, render_marked

    ex = _titled_example()
    assert ex.marked() == ex.marked("plain") == marked_text(ex.system, ex.documents, ex.question)
    text, offsets = ex.marked("plain")
    assert text == SEPARATOR.join([ex.system, *ex.documents, ex.question])
    assert text == "Sys.\n\nEd Wood: Ed Wood is a film.\n\nParis: Paris is a city.\n\nQuestion: Who?\nAnswer:"
    assert offsets == [6, 33, 35, 58]
    assert ex.chunk_documents() == ex.documents
    assert render_marked("S", ["a", "b"], "Q") == marked_text("S", ["a", "b"], "Q")  # titles are optional


def test_document_format_opens_every_chunk_with_its_title_line():
    from benchmarks.prompt_formats import format_document

    ex = _titled_example()
    text, offsets = ex.marked("document")
    assert ex.chunk_documents("document") == ["Document: Ed Wood\nEd Wood is a film.", "Document: Paris\nParis is a city."]
    assert text == ("Sys.\nDocument: Ed Wood\nEd Wood is a film.\nDocument: Paris\nParis is a city.\n"
                    "Question: Who?\nAnswer:")
    assert all(text[s:].startswith(f"Document: {t}\n") for s, t in zip(offsets[::2], ex.titles))
    # A document that does not start with its title keeps all its text; an untitled one gets a bare label.
    assert format_document("Some text.", "T", "document") == "Document: T\nSome text."
    assert format_document("Some text.", None, "document") == "Document:\nSome text."
    with pytest.raises(ValueError, match="unknown prompt format"):
        format_document("x", None, "markdown")


def test_chat_format_ends_with_the_assistant_turn_and_the_answer_lead_in():
    from benchmarks.quality_tasks import niah_multivalue

    ex = _titled_example()
    text, offsets = ex.marked("chat")
    assert text.startswith("<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("\n\nQuestion: Who?<|im_end|>\n<|im_start|>assistant\nAnswer:")
    assert ex.chunk_documents("chat") == ex.documents  # documents as in plain, in the user turn
    assert text.index("<|im_start|>user") < offsets[0] and offsets[-1] < text.index("<|im_start|>assistant")
    # The RULER prompts' lead-in ("Answer: The special magic numbers ... are") opens the assistant turn.
    niah = niah_multivalue(1, n_docs=4, doc_chars=200, n_values=2, haystack=HAYSTACK)[0]
    lead = niah.question.split("\n", 1)[1]
    assert lead.startswith("Answer: The special magic numbers")
    assert niah.marked("chat")[0].endswith("<|im_end|>\n<|im_start|>assistant\n" + lead)


def test_token_ids_and_count_leave_special_tokens_to_the_caller():
    from benchmarks.prompt_formats import token_count, token_ids

    tok = _CharTokenizer()
    assert token_ids(tok, "ab") == [97, 98] and token_ids(tok, "ab", special=True) == [1, 97, 98]
    assert token_count(tok, "abc") == 3 and token_count(tok, "abc", special=True) == 4


def test_document_pool_is_seeded_distinct_and_from_either_source():
    from benchmarks.rag_documents import document_pool, hotpotqa_paragraphs

    assert hotpotqa_paragraphs(DATA[0])[:2] == [format_paragraph(t, s) for t, s in DATA[0]["context"][:2]]
    pool = document_pool("hotpotqa", 12, seed=3, data=DATA)
    assert pool == document_pool("hotpotqa", 12, seed=3, data=DATA) != document_pool("hotpotqa", 12, seed=4, data=DATA)
    assert len(set(pool)) == 12 and all(d in {p for ex in DATA for p in hotpotqa_paragraphs(ex)} for d in pool)
    squad = {"data": [{"paragraphs": [{"context": f"P{i}"} for i in range(5)]}, {"paragraphs": [{"context": "P0"}]}]}
    assert sorted(document_pool("squad", 5, seed=0, data=squad)) == ["P0", "P1", "P2", "P3", "P4"]
    with pytest.raises(ValueError, match="unknown document source"):
        document_pool("wiki", 1, seed=0, data=[])


def test_trace_is_seeded_and_shaped():
    a = hotpotqa_requests(24, seed=3, data=DATA)
    b = hotpotqa_requests(24, seed=3, data=DATA)
    c = hotpotqa_requests(24, seed=4, data=DATA)
    assert [render_prompt(r) for r in a] == [render_prompt(r) for r in b]
    assert [render_prompt(r) for r in a] != [render_prompt(r) for r in c]
    assert len(a) == 24
    for req in a:
        assert len(req.documents) == 10
        assert req.system in SYSTEM_PROMPTS
        assert req.answers == [f"answer {req.example_id[2:]}"]
        assert req.example_id.startswith("id") and int(req.example_id[2:]) < 40  # short examples never drawn


def test_pool_repeats_documents_in_new_orders():
    trace = hotpotqa_requests(24, seed=0, data=DATA)
    by_example = collections.defaultdict(list)
    for req in trace:
        by_example[req.example_id].append(req)
    assert len(by_example) == 8  # default pool = n // 3
    assert all(len(reqs) == 3 for reqs in by_example.values())
    orders_differ = 0
    for reqs in by_example.values():
        assert len({frozenset(r.documents) for r in reqs}) == 1  # same documents every time
        orders_differ += len({tuple(r.documents) for r in reqs}) > 1
    assert orders_differ == len(by_example)
    # Repeats are spread through the trace, not back to back in pool order.
    assert [r.example_id for r in trace[:8]] != [r.example_id for r in trace[8:16]]
    assert len({r.system for r in trace}) > 1


def test_uneven_pool_and_explicit_pool():
    trace = hotpotqa_requests(7, seed=1, data=DATA)
    counts = collections.Counter(r.example_id for r in trace)
    assert len(counts) == 2 and sorted(counts.values()) == [3, 4]
    one = hotpotqa_requests(5, pool=1, data=DATA)
    assert len({r.example_id for r in one}) == 1
    assert len(hotpotqa_requests(1, data=DATA)) == 1


def test_fewer_documents_keep_the_gold_paragraphs():
    for req in hotpotqa_requests(6, docs_per_request=3, seed=2, data=DATA):
        k = req.example_id[2:]
        titles = {d.split(":")[0] for d in req.documents}
        assert len(req.documents) == 3
        assert {f"T{k}-7", f"T{k}-2"} <= titles


@pytest.mark.parametrize("kwargs", [
    {"n": 0}, {"n": 3, "pool": 4}, {"n": 3, "pool": 0}, {"n": 3, "docs_per_request": 11},
    {"n": 3, "docs_per_request": 0},
])
def test_bad_arguments_are_refused(kwargs):
    n = kwargs.pop("n")
    with pytest.raises(ValueError):
        hotpotqa_requests(n, data=DATA, **kwargs)


def test_too_few_eligible_examples():
    with pytest.raises(ValueError, match="only 0 examples"):
        hotpotqa_requests(3, data=DATA[40:])


def test_real_hotpotqa_when_prepared():
    folder = assets.cache_root() / "data" / "hotpotqa"
    if not folder.exists() or assets.manifest_problem(folder) is not None:
        pytest.skip("hotpotqa not prepared (relaxkv-sglang data hotpotqa)")
    trace = hotpotqa_requests(24, seed=0)
    assert len(trace) == 24 and len({r.example_id for r in trace}) == 8
    assert all(len(r.documents) == 10 and r.answers[0] for r in trace)
    assert hotpotqa_requests(24, seed=0)[5].documents == trace[5].documents


# --------------------------------------------------------------------- metrics


def test_normalize_answer():
    assert metrics.normalize_answer("The Theater, an  Anthem!") == "theater anthem"
    assert metrics.normalize_answer("  A.B.C. ") == "abc"
    assert metrics.normalize_answer("") == ""


@pytest.mark.parametrize("pred, refs, expected", [
    ("The Eiffel Tower", "eiffel tower", 1.0),
    ("Paris, France", "Paris", 2 / 3),
    ("in 1995 and 1996", ["1996", "1995 and 1996"], 6 / 7),  # max over references
    ("yes yes", "yes", 2 / 3),  # token multiset, not set
    ("", "x", 0.0),
    ("the", "a", 0.0),  # both normalise to nothing: 0, as LongBench scores it
    ("totally wrong", "right", 0.0),
])
def test_qa_f1(pred, refs, expected):
    assert metrics.qa_f1(pred, refs) == pytest.approx(expected)


def test_exact_agreement():
    assert metrics.exact_agreement(" The Beatles.", "beatles") == 1.0
    assert metrics.exact_agreement("Beatles band", "beatles") == 0.0
    assert metrics.exact_agreement("no", ["yes", "No"]) == 1.0
    with pytest.raises(ValueError):
        metrics.qa_f1("x", [])


def test_percentile_matches_numpy():
    values = [0.9, 0.1, 0.5, 2.0, 0.3, 0.3, 7.5]
    for q in (0, 1, 10, 25, 50, 77.7, 90, 99, 100):
        assert metrics.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert metrics.percentile([4.0], 90) == 4.0
    with pytest.raises(ValueError):
        metrics.percentile([], 50)
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_latency_summary():
    s = metrics.latency_summary(x / 10 for x in range(1, 11))
    assert set(s) == {"mean", "p50", "p90", "p99"}
    assert s["mean"] == pytest.approx(0.55)
    assert s["p50"] == pytest.approx(0.55)
    assert s["p90"] == pytest.approx(0.91)
    assert s["p99"] == pytest.approx(0.991)
    empty = metrics.latency_summary([])
    assert empty == {"mean": None, "p50": None, "p90": None, "p99": None}
    json.dumps(empty)  # JSON-safe: no NaN


def test_hit_rate():
    assert metrics.hit_rate(25, 100) == 0.25
    assert metrics.hit_rate(0, 0) == 0.0
    with pytest.raises(ValueError):
        metrics.hit_rate(-1, 10)


def test_reusable_tokens_counts_repeats_after_first_sight():
    trace = [
        [("a", 10), ("b", 20)],
        [("b", 20), ("c", 5)],   # b repeats: 20
        [("c", 5), ("a", 10), ("a", 10)],  # c, a, and a again in the same request: 25
    ]
    assert metrics.reusable_tokens(trace) == 45
    assert metrics.reusable_tokens([]) == 0
    assert metrics.reusable_tokens(iter([iter([("x", 3)]), iter([("x", 3)])])) == 3


# ----------------------------------------------------- demo client (no server)


class _FakeBackend:
    """Streams a canned answer in chunks, like RuntimeEndpoint.generate_stream, and records the prompt."""

    def __init__(self, chunks):
        from sglang.lang.backend.base_backend import BaseBackend

        self._base = BaseBackend()
        self.chunks = chunks
        self.prompts = []
        self.sampling = []

    def __getattr__(self, name):
        return getattr(self._base, name)

    def generate_stream(self, s, sampling_params):
        self.prompts.append(s.text_)
        self.sampling.append(sampling_params)
        n = len(self.chunks)
        for i, text in enumerate(self.chunks):
            yield text, {"prompt_tokens": 100, "cached_tokens": 40, "completion_tokens": i + 1,
                         "finish_reason": {"type": "stop"} if i == n - 1 else None}


def _request():
    return RagRequest(system="Sys.", documents=["A: one.", "B: two."], question="Which?", answers=["Paris"],
                      example_id="e1")


def test_demo_program_sends_exactly_the_rendered_prompt():
    from benchmarks import demo_modes

    fake = _FakeBackend(["", " Paris", " France"])  # first event has empty text, as a stop-string start can
    backend = demo_modes.ModeBackend(fake, {"relaxkv_policy": "prefix"})
    rec = demo_modes.serve_one(demo_modes.MODES["prefix"], backend, _request(), max_new_tokens=7)
    assert fake.prompts == [render_prompt(_request())]
    params = fake.sampling[0]
    assert params.max_new_tokens == 7 and params.temperature == 0 and "\n" in params.stop
    # The mode's policy travels in the request body, as RuntimeEndpoint builds it.
    body = params.to_srt_kwargs()
    assert body["custom_params"] == {"relaxkv_policy": "prefix"} and body["max_new_tokens"] == 7
    assert rec["answer"] == " Paris France"
    assert (rec["prompt_tokens"], rec["cached_tokens"], rec["completion_tokens"]) == (100, 40, 3)
    assert 0 <= rec["client_overhead_s"] <= rec["ttft_s"] <= rec["latency_s"]
    assert rec["f1"] == pytest.approx(2 / 3)
    assert backend.times == {}  # popped once recorded


def test_demo_request_waits_for_the_answer_every_time():
    from benchmarks import demo_modes

    # run(stream=True) returns before the program has submitted its gen; each
    # of these must still come back with the whole answer and its meta info.
    backend = demo_modes.ModeBackend(_FakeBackend([" a", " b"]))
    for _ in range(30):
        rec = demo_modes.serve_one(demo_modes.MODES["prefix"], backend, _request(), max_new_tokens=2)
        assert rec["answer"] == " a b" and rec["completion_tokens"] == 2


class _FailingBackend(_FakeBackend):
    def generate_stream(self, s, sampling_params):
        raise RuntimeError({"error": "invalid relaxkv_policy: unknown policy"})
        yield  # a generator, like the real one


@pytest.mark.filterwarnings("ignore:Error in stream_executor")
def test_demo_request_failure_is_raised_and_reported_in_one_line():
    from benchmarks import demo, demo_modes

    with pytest.raises(RuntimeError, match="invalid relaxkv_policy"):
        demo_modes.serve_one(demo_modes.MODES["prefix"], demo_modes.ModeBackend(_FailingBackend([])), _request(), max_new_tokens=2)
    mode = demo_modes.Mode("failing", "test", demo_modes.plain_rag_program, make_backend=lambda url: _FailingBackend([]))
    with pytest.raises(demo_modes.DemoError, match=r"^mode failing: request \d: .*invalid relaxkv_policy"):
        demo.run_mode(mode, "http://unused", [_request(), _request()], clients=2, max_new_tokens=2)


def test_with_custom_params_copies_and_leaves_plain_params_alone():
    from sglang.lang.ir import SglSamplingParams

    from benchmarks import demo_modes

    plain = SglSamplingParams(max_new_tokens=5, stop=["\n"])
    assert demo_modes.with_custom_params(plain, None) is plain
    assert "custom_params" not in plain.to_srt_kwargs()
    custom = {"relaxkv_policy": "pic"}
    wrapped = demo_modes.with_custom_params(plain, custom)
    custom["relaxkv_policy"] = "changed later"
    assert wrapped.to_srt_kwargs() == dict(plain.to_srt_kwargs(), custom_params={"relaxkv_policy": "pic"})


def test_demo_marked_program_sends_the_rendered_prompt_with_each_document_as_a_chunk():
    from benchmarks import demo_modes
    from benchmarks.prompt_formats import marked_text
    from relaxkv_sglang import lang

    fake = _FakeBackend([" Paris"])
    rec = demo_modes.serve_one(demo_modes.MODES["relaxkv"], demo_modes.ModeBackend(fake), _request(), max_new_tokens=4)
    assert rec["answer"] == " Paris"
    sent = fake.prompts[0]
    assert lang.strip_marks(sent) == render_prompt(_request())
    text, offsets = marked_text(*prompt_parts(_request()))
    # What RelaxKVEndpoint turns the program's request into (RuntimeEndpoint's body, then its marks).
    body = {"text": sent, "sampling_params": fake.sampling[0].to_srt_kwargs()}
    assert "custom_params" not in body["sampling_params"]  # the endpoint, not ModeBackend, adds them
    out = lang.mark_payload(body, "relaxkv", demo_modes.RELAXKV_PARAMS)
    assert out["text"] == text
    assert out["sampling_params"]["custom_params"] == {
        "relaxkv_chunks": offsets, "relaxkv_policy": "relaxkv",
        "relaxkv_anchor_ratio": 0.15, "relaxkv_context_ratio": 0.5}  # the schema's defaults
    assert [text[s:e] for s, e in zip(offsets[::2], offsets[1::2])] == _request().documents


def test_demo_modes_are_the_policies_of_one_plugin_server():
    from benchmarks import demo, demo_modes

    assert list(demo_modes.MODES) == ["full", "prefix", "pic", "relaxkv"]
    assert demo_modes.REFERENCE_MODE == "full"
    for name in ("full", "prefix"):
        mode = demo_modes.MODES[name]
        assert mode.program is demo_modes.plain_rag_program and mode.make_backend is demo_modes.runtime_endpoint
        assert mode.custom_params == {"relaxkv_policy": name}
    for name, params in (("pic", None), ("relaxkv", {"relaxkv_anchor_ratio": 0.15, "relaxkv_context_ratio": 0.5})):
        mode = demo_modes.MODES[name]
        assert mode.program is demo_modes.marked_rag_program and mode.custom_params is None and mode.needs_plugin
        assert mode.make_backend.func is demo_modes.relaxkv_endpoint
        assert mode.make_backend.keywords == {"policy": name, **({"custom_params": params} if params else {})}
    assert not demo_modes.MODES["prefix"].needs_plugin and demo_modes.MODES["full"].needs_plugin
    assert demo.select_modes(None, plugin=True) == ["full", "prefix", "pic", "relaxkv"]
    assert demo.select_modes(None, plugin=False) == ["prefix"]
    assert demo.select_modes(" relaxkv, full ", plugin=True) == ["relaxkv", "full"]
    with pytest.raises(demo_modes.DemoError, match="listed twice"):
        demo.select_modes("pic,pic", plugin=True)


def test_fidelity_f1():
    assert metrics.fidelity_f1("The Eiffel Tower", "eiffel tower") == 1.0
    assert metrics.fidelity_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert metrics.fidelity_f1("", " the ") == 1.0  # both answers empty: they agree
    assert metrics.fidelity_f1("Paris", "") == 0.0
    assert metrics.fidelity_f1("", "Paris") == 0.0


def _records():
    return [
        {"prompt_tokens": 100, "cached_tokens": 10, "completion_tokens": 4, "ttft_s": 0.5, "latency_s": 1.0,
         "answer": "Paris", "f1": 1.0, "exact_match": 1.0, "relaxkv": None},
        {"prompt_tokens": 300, "cached_tokens": 90, "completion_tokens": 4, "ttft_s": 1.5, "latency_s": 2.0,
         "answer": "Rome", "f1": 0.0, "exact_match": 0.0,
         "relaxkv": {"policy": "relaxkv", "anchor_ratio": 0.15, "context_ratio": 0.25, "anchors_per_layer": 30.0}},
    ]


def test_demo_table_and_summary():
    from benchmarks import demo, demo_modes

    records = _records()
    summary = demo.summarize(demo_modes.MODES["prefix"], {"records": records, "wall_s": 4.0}, None)
    assert summary["hit_rate"] == pytest.approx(0.25)
    assert summary["ttft_s"]["mean"] == pytest.approx(1.0)
    assert summary["answer_f1"] == pytest.approx(0.5)
    assert summary["requests_per_s"] == pytest.approx(0.5)
    assert summary["repair_anchor_ratio_mean"] == 0.15 and summary["repair_context_ratio_mean"] == 0.25
    assert "fidelity_to_full_f1" not in summary and not summary["is_reference"]
    workload = {"best_possible_hit_rate": 0.6, "reusable_document_tokens": 240, "prompt_tokens": 400,
                "best_possible_hit_rate_with_system_prompts": 0.65}
    lines = demo.format_table({"prefix": summary}, workload).splitlines()
    assert lines[0].split() == ["mode", "requests", "prompt", "tok", "cached", "tok", "hit", "rate", "TTFT", "mean",
                                "s", "p50", "s", "p90", "s", "F1", "vs", "gold", "fidelity", "to", "full", "wall", "s"]
    assert lines[2].split() == ["prefix", "2", "400", "100", "25.0%", "1.00", "1.00", "1.40", "0.500", "-", "4.0"]
    assert "best possible hit rate: 60.0%" in lines[3]
    assert "not measured" in lines[4]

    # With the full pass as reference: its own row reads "ref", the others their F1 against its answers.
    reference = [dict(records[0], answer="Paris"), dict(records[1], answer="in Rome")]
    summaries = {
        "full": demo.summarize(demo_modes.MODES["full"], {"records": reference, "wall_s": 5.0}, reference),
        "relaxkv": demo.summarize(demo_modes.MODES["relaxkv"], {"records": records, "wall_s": 4.0}, reference),
    }
    assert summaries["full"]["is_reference"] and summaries["full"]["fidelity_to_full_f1"] == 1.0
    assert summaries["relaxkv"]["fidelity_to_full_f1"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert summaries["relaxkv"]["agreement_with_full"] == 0.5
    lines = demo.format_table(summaries, workload).splitlines()
    assert lines[2].split()[0] == "full" and lines[2].split()[-2] == "ref"
    assert lines[3].split()[0] == "relaxkv" and lines[3].split()[-2] == "0.833"
    assert "reference row" in lines[5]
    json.dumps(summaries)


class _CharTokenizer:
    """One token per character, plus a BOS (id 1) with special tokens."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_demo_workload_bound_counts_repeated_documents_and_shared_prompt_beginnings(monkeypatch, tmp_path):
    import types

    from benchmarks import demo

    fake = types.SimpleNamespace(AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda path: _CharTokenizer()))
    monkeypatch.setitem(sys.modules, "transformers", fake)  # no real tokenizer needed (nor its import time)
    trace = [
        RagRequest(system="Sys A", documents=["doc one", "doc two"], question="Q?", answers=["x"], example_id="e"),
        RagRequest(system="Sys B", documents=["doc two", "doc one"], question="Q?", answers=["x"], example_id="e"),
        RagRequest(system="Sys A", documents=["doc one", "doc 3"], question="Q?", answers=["x"], example_id="f"),
    ]
    w = demo.workload_figures(trace, tmp_path)
    assert w["prompt_tokens"] == sum(1 + len(render_prompt(r)) for r in trace)
    assert w["reusable_document_tokens"] == 7 + 7 + 7  # both docs again, then "doc one" again
    # BOS + "Sys " shared with request 1; then all of BOS + "Sys A" + separator.
    assert w["reusable_system_prompt_tokens"] == 5 + 8
    assert w["best_possible_hit_rate"] == pytest.approx(21 / w["prompt_tokens"])
    assert w["best_possible_hit_rate_with_system_prompts"] == pytest.approx(34 / w["prompt_tokens"])
    assert (w["distinct_documents"], w["distinct_examples"]) == (3, 2)


def test_demo_cli_errors_are_one_line(capsys):
    from benchmarks import demo

    assert demo.main(["--modes", "nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("relaxkv-sglang demo: error: --modes: unknown mode nope") and "\n" not in err
    assert demo.main(["--requests", "0"]) == 2
    assert capsys.readouterr().err.strip() == "relaxkv-sglang demo: error: --requests must be at least 1, got 0"
    assert demo.main(["--model", "/nonexistent/model", "--modes", "prefix", "--output", "/tmp/x-demo.json"]) == 1
    assert "neither" in capsys.readouterr().err
    # The stock server serves only prefix; refused before anything starts.
    assert demo.main(["--server", "stock", "--modes", "prefix,relaxkv", "--output", "/tmp/x-demo.json"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("relaxkv-sglang demo: error: mode relaxkv needs the relaxkv plugin") and "\n" not in err


def test_demo_takes_the_benchmarks_model_and_results_folder(monkeypatch, tmp_path):
    import argparse
    import re

    from benchmarks import common, demo

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    out = demo.prepare_output(None)
    assert out.parent == tmp_path / "results" and out.parent.is_dir()
    assert re.fullmatch(r"demo-\d{8}T\d{6}Z\.json", out.name)
    assert demo.prepare_output(str(tmp_path / "x" / "y.json")) == tmp_path / "x" / "y.json"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert demo._resolve_model(argparse.Namespace(model=str(model))) == model
    args = demo.build_parser().parse_args([])
    assert (args.model, args.url, args.max_total_tokens, args.output) == ("smollm2-135m", None, 32768, None)
    assert not hasattr(args, "quick")


# --------------------------------------------------------------- quality tasks


def _squad(n_articles: int = 6, per_article: int = 4) -> dict:
    """A SQuAD-v2-shaped file: each paragraph has one answerable and one impossible question."""
    articles = []
    for a in range(n_articles):
        paragraphs = []
        for p in range(per_article):
            context = f"Paragraph {p} of article {a} says the code is K{a}x{p}."
            paragraphs.append({"context": context, "qas": [
                {"id": f"q{a}-{p}", "question": f"What is the code of {a}/{p}?", "is_impossible": False,
                 "answers": [{"text": f"K{a}x{p}", "answer_start": 0}, {"text": f"K{a}x{p}", "answer_start": 0},
                             {"text": f"code K{a}x{p}", "answer_start": 0}]},
                {"id": f"imp{a}-{p}", "question": "Unanswerable?", "is_impossible": True, "answers": []}]})
        articles.append({"title": f"Article_{a}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": articles}


# Essay-like text: sentences of varied length, some run together as in the real file ("end.Next").
HAYSTACK = " ".join(f"Sentence number {i} talks about {'startups' if i % 3 else 'essays'} and more."
                    + ("" if i % 7 else "Then") for i in range(3000))


def test_squad_multidoc_is_seeded_and_hides_the_gold_paragraph_among_other_articles():
    from benchmarks.quality_tasks import squad_multidoc

    data = _squad(n_articles=12)  # a seed draws from half of the articles
    a = squad_multidoc(5, seed=1, distractors=6, data=data)
    assert [e.documents for e in a] == [e.documents for e in squad_multidoc(5, seed=1, distractors=6, data=data)]
    assert [e.example_id for e in a] != [e.example_id for e in squad_multidoc(5, seed=2, distractors=6, data=data)]
    positions = set()
    for ex in a:
        assert ex.example_id.startswith("q") and ex.scorer == "qa_f1" and len(ex.documents) == 7
        art, par = ex.example_id[1:].split("-")
        assert ex.answers == [f"K{art}x{par}", f"code K{art}x{par}"]  # unique, in order
        gold = [i for i, d in enumerate(ex.documents) if f"K{art}x{par}" in d]
        assert len(gold) == 1  # the answer is in exactly the gold document
        positions.add(gold[0])
        assert ex.documents[gold[0]].startswith(f"Article {art}: Paragraph {par}")
        assert all(not d.startswith(f"Article {art}:") for i, d in enumerate(ex.documents) if i != gold[0])
        text, offsets = ex.marked()
        assert [text[s:e] for s, e in zip(offsets[::2], offsets[1::2])] == ex.documents
        assert text.endswith(question_text(f"What is the code of {art}/{par}?"))
    assert len(positions) > 1  # the gold position is drawn, not fixed
    assert len({e.example_id.split("-")[0] + e.example_id.split("-")[1] for e in a}) == 5  # one question per paragraph
    with pytest.raises(ValueError, match="answerable"):
        squad_multidoc(30, data=data)  # only 24 paragraphs in the seed's half


def test_squad_test_seeds_share_no_question_or_document_with_dev_seeds():
    from benchmarks.quality_tasks import squad_multidoc

    data = _squad(n_articles=8)
    dev = squad_multidoc(6, seed=3, distractors=5, data=data)
    test = squad_multidoc(6, seed=1000, distractors=5, data=data)
    assert not {e.example_id for e in dev} & {e.example_id for e in test}
    assert not {d for e in dev for d in e.documents} & {d for e in test for d in e.documents}


def test_niah_multivalue_puts_every_value_in_a_different_document():
    from benchmarks.quality_tasks import niah_multivalue

    a = niah_multivalue(4, seed=5, n_docs=8, doc_chars=300, n_values=3, haystack=HAYSTACK)
    assert [e.documents for e in a] == [e.documents for e in niah_multivalue(4, seed=5, n_docs=8, doc_chars=300,
                                                                                n_values=3, haystack=HAYSTACK)]
    assert a[0].documents != niah_multivalue(1, seed=6, n_docs=8, doc_chars=300, n_values=3,
                                             haystack=HAYSTACK)[0].documents
    for ex in a:
        assert len(ex.documents) == 8 and len(ex.answers) == 3 and ex.scorer == "string_match_all"
        assert all(len(d) >= 300 for d in ex.documents)
        key = ex.question.split(" for ")[1].split(" mentioned")[0]
        holders = []
        for value in ex.answers:
            assert len(value) == 7 and value.isdigit()
            needle = f"One of the special magic numbers for {key} is: {value}."
            holders += [i for i, d in enumerate(ex.documents) if needle in d]
        assert len(set(holders)) == 3  # each value once, each in its own document
        assert sum(d.count(key) for d in ex.documents) == 3
        assert ex.marked()[0].startswith(ex.system + SEPARATOR)
        assert metrics.score(ex.scorer, ", ".join(ex.answers), ex.answers) == 1.0
    with pytest.raises(ValueError):
        niah_multivalue(1, n_docs=3, n_values=4, haystack=HAYSTACK)
    with pytest.raises(ValueError, match="haystack"):
        niah_multivalue(1, haystack="Too short.")


def test_variable_tracking_chain_is_in_order_across_documents():
    from benchmarks.quality_tasks import variable_tracking

    a = variable_tracking(3, seed=2, n_docs=10, doc_chars=250, n_hops=4, haystack=HAYSTACK)
    assert [e.documents for e in a] == [e.documents for e in variable_tracking(3, seed=2, n_docs=10, doc_chars=250,
                                                                                  n_hops=4, haystack=HAYSTACK)]
    for ex in a:
        names = ex.answers
        assert len(names) == 5 and all(len(n) == 5 and n.isupper() for n in names)
        value = ex.question.split("assigned the value ")[1].split(" ")[0]
        text = ex.marked()[0]
        statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        where = [text.index(s) for s in statements]
        assert where == sorted(where)  # the chain reads in order
        docs_with = [[i for i, d in enumerate(ex.documents) if s in d] for s in statements]
        assert all(len(d) == 1 for d in docs_with) and len({d[0] for d in docs_with}) == 5
        assert text.count(value) == 3  # the assignment, and twice in the question block
        assert ex.max_new_tokens >= 6 * 5
    with pytest.raises(ValueError):
        variable_tracking(1, n_docs=4, n_hops=4, haystack=HAYSTACK)


def test_hotpotqa_examples_keep_the_file_order_and_dispatch():
    from benchmarks.quality_tasks import hotpotqa_examples, task_examples

    ex = hotpotqa_examples(3, offset=2, data=DATA)
    assert [e.example_id for e in ex] == ["id2", "id3", "id4"]
    assert ex[0].documents == [format_paragraph(t, s) for t, s in DATA[2]["context"]]
    assert ex[0].question == question_text("What is 2?") and ex[0].answers == ["answer 2"]
    assert ex[0].system == SYSTEM_PROMPTS[0] and ex[0].scorer == "qa_f1"
    with pytest.raises(ValueError, match="past the end"):
        hotpotqa_examples(5, offset=len(DATA) - 2, data=DATA)
    with pytest.raises(ValueError, match="unknown task"):
        task_examples("longbench", 1)
    with pytest.raises(ValueError, match="10 documents per example"):
        task_examples("hotpotqa", 1, documents=50)
    with pytest.raises(ValueError, match="documents must be >= 1"):
        task_examples("squad", 1, documents=0)


@pytest.mark.parametrize("task", ["squad", "niah_multivalue", "variable_tracking"])
def test_long_context_examples_have_the_asked_number_of_documents(task):
    from benchmarks.quality_tasks import task_examples

    long = task_examples(task, 2, seed=1000, documents=50)
    short = task_examples(task, 2, seed=1000)
    assert [len(e.documents) for e in long] == [50, 50] and [len(e.documents) for e in short] == [10, 10]
    # about 5x the characters: the ~8K-token prompts of the long-context runs
    ratio = sum(len(d) for d in long[0].documents) / sum(len(d) for d in short[0].documents)
    assert 3.5 < ratio < 6.5, ratio


def test_real_task_data_when_prepared():
    from benchmarks.quality_tasks import QUALITY_TASKS, task_examples

    for name in ("hotpotqa", "squad", "essays"):
        folder = assets.cache_root() / "data" / name
        if not folder.exists() or assets.manifest_problem(folder) is not None:
            pytest.skip(f"{name} not prepared (relaxkv-sglang data {name})")
    for task in QUALITY_TASKS:
        examples = task_examples(task, 3, seed=0)
        assert len(examples) == 3 and all(len(e.documents) == 10 for e in examples)
        text = examples[0].marked()[0]
        assert 4000 < len(text) < 9000  # about 1.5K tokens
        # The references occur in the documents (HotpotQA's yes/no answers need not).
        for e in examples:
            joined = " ".join(e.documents)
            found = [ref in joined for ref in e.answers]
            assert task == "hotpotqa" or (any(found) if e.scorer == "qa_f1" else all(found))


@pytest.mark.parametrize("pred, refs, expected", [
    ("The numbers are 1234567, 7654321.", ["1234567", "7654321"], 1.0),
    ("1234567 and 999", ["1234567", "7654321", "1111111", "2222222"], 0.25),
    ("vars: abcde, XYZQW", ["ABCDE", "XYZQW", "QQQQQ"], 2 / 3),  # case-insensitive, as RULER
    ("", ["x"], 0.0),
    ("anything", "anything", 1.0),
])
def test_string_match_all(pred, refs, expected):
    assert metrics.string_match_all(pred, refs) == pytest.approx(expected)


def test_score_dispatches_by_name():
    assert metrics.score("qa_f1", "Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    assert metrics.score("string_match_all", "Paris, France", ["Paris", "Rome"]) == 0.5
    with pytest.raises(ValueError, match="unknown scorer"):
        metrics.score("rouge", "a", ["a"])
    with pytest.raises(ValueError):
        metrics.string_match_all("a", [])
