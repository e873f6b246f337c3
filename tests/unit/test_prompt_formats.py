"""Unit tests of the quality benchmark's prompt formats (``benchmarks.prompt_formats.render_marked``).

Every format of :data:`~benchmarks.prompt_formats.PROMPT_FORMATS` is rendered for examples of every
quality task (built from small synthetic data by the tasks' own builders); the framework layouts
are compared with what the installed frameworks render (``langchain_core`` / ``langchain_openai``,
``llama_index.core``) and, where a model is prepared, with its own chat template.
"""

from __future__ import annotations

import pytest

from benchmarks import prompt_formats, quality_tasks
from benchmarks.replay import TraceRequest
from benchmarks.prompt_formats import PROMPT_FORMATS, chunk_spans, chunk_texts, format_document, render_marked
from benchmarks.quality_tasks import hotpotqa_examples, niah_multivalue, squad_multidoc, variable_tracking
from relaxkv_sglang import assets

NEW_FORMATS = ("langchain", "llamaindex", "tagged", "numbered", "question_first")


def _hotpotqa_data(n: int = 2) -> list[dict]:
    return [{"_id": f"h{k}", "question": f"Which film did director {k} make?", "answer": f"Film {k}",
             "supporting_facts": [[f"Director {k}-1", 0]],
             "context": [[f"Director {k}-{j}", [f"Director {k}-{j} made film {j}.", f" It was released in 19{j}0."]]
                         for j in range(5)]} for k in range(n)]


def _squad_data() -> dict:
    return {"version": "v2.0", "data": [
        {"title": f"Article_{a}", "paragraphs": [
            {"context": f"Paragraph {p} of article {a} says the code is K{a}x{p}.",
             "qas": [{"id": f"q{a}-{p}", "question": f"What is the code of {a}/{p}?", "is_impossible": False,
                      "answers": [{"text": f"K{a}x{p}", "answer_start": 0}]}]} for p in range(3)]}
        for a in range(8)]}


HAYSTACK = " ".join(f"Sentence number {i} talks about {'startups' if i % 3 else 'essays'} and more."
                    for i in range(2000))


def _examples() -> dict[str, quality_tasks.TaskExample]:
    """One example of every quality task, from the tasks' own builders over synthetic data."""
    return {"hotpotqa": hotpotqa_examples(1, data=_hotpotqa_data())[0],
            "squad": squad_multidoc(1, seed=0, distractors=4, data=_squad_data())[0],
            "niah_multivalue": niah_multivalue(1, n_docs=5, doc_chars=200, n_values=2, haystack=HAYSTACK)[0],
            "variable_tracking": variable_tracking(1, n_docs=5, doc_chars=200, n_hops=2, haystack=HAYSTACK)[0]}


EXAMPLES = _examples()


def _bare_question(ex: quality_tasks.TaskExample) -> str:
    """The question as a user would type it: the block's first line less ``Question: ``."""
    return ex.question.split("\n", 1)[0].removeprefix("Question: ")


def _lead_in(ex: quality_tasks.TaskExample) -> str:
    """The answer's lead-in: the question block from ``Answer:`` on."""
    return ex.question[ex.question.index("\nAnswer:") + 1:]


def _glue(text: str, offsets: list[int]) -> list[str]:
    """The text outside the chunks: before the first, between each two, after the last."""
    bounds = [0, *offsets, len(text)]
    return [text[bounds[i]:bounds[i + 1]] for i in range(0, len(bounds), 2)]


def _reversed(ex: quality_tasks.TaskExample, fmt: str, system: str | None = None) -> tuple[str, list[int]]:
    titles = ex.titles[::-1] if ex.titles else None
    return render_marked(ex.system if system is None else system, ex.documents[::-1], ex.question, fmt, titles)


def _chatml(messages: list[dict]) -> str:
    """Chat messages as ChatML with the generation prompt (SmolLM2-Instruct's and Qwen2.5's template)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def test_every_task_example_has_the_tasks_question_block():
    assert set(EXAMPLES) == set(quality_tasks.QUALITY_TASKS)
    assert all(ex.question.startswith("Question: ") and "\nAnswer:" in ex.question for ex in EXAMPLES.values())
    assert _lead_in(EXAMPLES["hotpotqa"]) == "Answer:"
    assert _lead_in(EXAMPLES["niah_multivalue"]).startswith("Answer: The special magic numbers for ")


@pytest.mark.parametrize("task", sorted(EXAMPLES))
@pytest.mark.parametrize("fmt", PROMPT_FORMATS)
def test_offsets_mark_exactly_the_documents_and_the_chunks_are_reusable(fmt, task):
    ex = EXAMPLES[task]
    text, offsets = ex.marked(fmt)
    titles = ex.titles or [None] * len(ex.documents)
    expected = [format_document(d, t, fmt) for d, t in zip(ex.documents, titles)]
    assert chunk_texts(text, offsets) == expected == ex.chunk_documents(fmt)
    assert len(offsets) == 2 * len(ex.documents) and offsets == sorted(offsets)
    assert all(s < e for s, e in chunk_spans(offsets))
    # Each chunk holds its document's text (less a title the format writes on its own).
    for chunk, doc, title in zip(expected, ex.documents, titles):
        assert (doc.removeprefix(f"{title}: ") if title else doc) in chunk
    # Another order (and another system prompt): the same chunk texts, so each is reused.
    other, other_offsets = _reversed(ex, fmt, system="Another system prompt.")
    assert chunk_texts(other, other_offsets) == expected[::-1]
    # The same system prompt, another order: the glue is the same, only the chunks moved.
    assert _glue(*_reversed(ex, fmt)) == _glue(text, offsets)
    # The question is asked exactly once, outside every chunk; the prompt ends with the answer's lead-in.
    bare = _bare_question(ex)
    assert text.count(bare) == 1 and not any(bare in c for c in expected)
    assert text.index(bare) > offsets[-1] or (fmt == "question_first" and text.index(bare) < offsets[0])
    assert text.rstrip(" ").endswith(_lead_in(ex))


@pytest.mark.parametrize("fmt", ("plain", "document", "tagged", "numbered", "question_first", "chat"))
def test_the_tasks_own_system_prompt_opens_the_formats_that_keep_it(fmt):
    for ex in EXAMPLES.values():
        text, offsets = ex.marked(fmt)
        assert ex.system in text[:offsets[0]]


def test_framework_formats_write_the_frameworks_instruction_instead():
    for ex in EXAMPLES.values():
        assert ex.system not in ex.marked("langchain")[0] and ex.system not in ex.marked("llamaindex")[0]
        assert ex.marked("langchain")[0].startswith("<|im_start|>system\n" + prompt_formats.LANGCHAIN_SYSTEM + "\n\n")


def test_the_formats_are_the_old_three_then_the_new_layouts():
    assert PROMPT_FORMATS == ("plain", "document", "chat", *NEW_FORMATS)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown prompt format"):
        render_marked("S", ["a"], "Q", "markdown")


# ---------------------------------------------------------------- the layouts, written out


def _small():
    return quality_tasks.TaskExample("hotpotqa", "e", "Sys.", ["Ed Wood: Ed Wood is a film.", "Paris: Paris is a city."],
                                 prompt_formats.question_text("Who?"), ["x"], "qa_f1", 16, titles=["Ed Wood", "Paris"])


def test_tagged_keeps_the_position_dependent_tags_outside_the_chunks():
    text, offsets = _small().marked("tagged")
    assert text == ('Sys.\n\n<documents>\n<document index="1">\n'
                    "<source>Ed Wood</source>\n<document_content>Ed Wood is a film.</document_content>\n"
                    '</document>\n<document index="2">\n'
                    "<source>Paris</source>\n<document_content>Paris is a city.</document_content>\n"
                    "</document>\n</documents>\n\nQuestion: Who?\nAnswer:")
    assert chunk_texts(text, offsets) == [
        "<source>Ed Wood</source>\n<document_content>Ed Wood is a film.</document_content>",
        "<source>Paris</source>\n<document_content>Paris is a city.</document_content>"]
    assert all('index="' not in c for c in chunk_texts(text, offsets))
    # An untitled document (the essays) has no <source>.
    assert format_document("Some text.", None, "tagged") == "<document_content>Some text.</document_content>"


def test_numbered_keeps_the_numbers_outside_the_chunks():
    text, offsets = _small().marked("numbered")
    assert text == ("<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nDocuments:\n"
                    "[1] Ed Wood: Ed Wood is a film.\n[2] Paris: Paris is a city.\n\nQuestion: Who?<|im_end|>\n"
                    "<|im_start|>assistant\nAnswer:")
    assert chunk_texts(text, offsets) == _small().documents
    assert [text[s - 4:s] for s, _ in chunk_spans(offsets)] == ["[1] ", "[2] "]


def test_question_first_states_the_question_once_before_the_documents():
    text, offsets = _small().marked("question_first")
    assert text == ("Sys.\n\nQuestion: Who?\n\nEd Wood: Ed Wood is a film.\n\nParis: Paris is a city.\n\nAnswer:")
    assert chunk_texts(text, offsets) == _small().documents
    niah = EXAMPLES["niah_multivalue"]
    text, offsets = niah.marked("question_first")
    assert text[offsets[-1]:] == "\n\n" + _lead_in(niah)


def test_old_formats_are_unchanged():
    """plain, document and chat as recorded before the other layouts were added (golden prompts)."""
    ex = _small()
    assert ex.marked("plain") == ("Sys.\n\nEd Wood: Ed Wood is a film.\n\nParis: Paris is a city.\n\n"
                                  "Question: Who?\nAnswer:", [6, 33, 35, 58])
    assert ex.marked("document") == ("Sys.\nDocument: Ed Wood\nEd Wood is a film.\nDocument: Paris\nParis is a city.\n"
                                     "Question: Who?\nAnswer:", [5, 41, 42, 74])
    assert ex.marked("chat") == ("<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nEd Wood: Ed Wood is a film."
                                 "\n\nParis: Paris is a city.\n\nQuestion: Who?<|im_end|>\n<|im_start|>assistant\n"
                                 "Answer:", [51, 78, 80, 103])


# ---------------------------------------------------------------- against the frameworks themselves


def _trace_request(ex: quality_tasks.TaskExample) -> TraceRequest:
    """The example as ``bench_cache_hit --frameworks`` sends a request (its bare question block)."""
    return TraceRequest(ex.system, list(ex.documents), prompt_formats.question_text(_bare_question(ex)),
                        list(range(len(ex.documents))))


def _lead_after_template(ex: quality_tasks.TaskExample) -> str:
    """What follows the frameworks' own ``Answer: ``: the task's lead-in less ``Answer:``."""
    return _lead_in(ex).removeprefix("Answer:").lstrip()


@pytest.mark.parametrize("task", sorted(EXAMPLES))
def test_langchain_is_langchains_rag_prompt_in_chatml(task):
    pytest.importorskip("langchain_openai")
    from langchain_core.prompts import ChatPromptTemplate

    from benchmarks import cache_hit_frameworks as fw

    ex = EXAMPLES[task]
    text, offsets = ex.marked("langchain")
    _, body = fw.langchain_chat(_trace_request(ex))  # what ChatOpenAI sends
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert text == _chatml(body["messages"]) + _lead_in(ex)
    prompt = ChatPromptTemplate.from_messages([("system", prompt_formats.LANGCHAIN_SYSTEM + "\n\n{context}"),
                                               ("human", "{input}")])
    messages = prompt.format_messages(context="\n\n".join(ex.documents), input=_bare_question(ex))
    assert [m.content for m in messages] == [m["content"] for m in body["messages"]]
    assert chunk_texts(text, offsets) == ex.documents


@pytest.mark.parametrize("task", sorted(EXAMPLES))
def test_llamaindex_is_the_default_text_qa_prompt_with_the_nodes_metadata(task):
    pytest.importorskip("llama_index.core")
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT, DEFAULT_TEXT_QA_PROMPT_TMPL
    from llama_index.core.schema import MetadataMode, TextNode

    from benchmarks import cache_hit_frameworks as fw

    assert prompt_formats.LLAMAINDEX_TEXT_QA_TEMPLATE == DEFAULT_TEXT_QA_PROMPT_TMPL
    ex = EXAMPLES[task]
    text, offsets = ex.marked("llamaindex")
    expected = DEFAULT_TEXT_QA_PROMPT.format(context_str=fw.llamaindex_context(_trace_request(ex)),
                                             query_str=_bare_question(ex))
    assert text == expected + _lead_after_template(ex)
    assert fw.llamaindex_completion(_trace_request(ex))[1]["prompt"] == expected
    # Each chunk is a node as LlamaIndex renders it: its metadata line, a blank line, its text.
    nodes = [TextNode(text=d, metadata={"file_path": prompt_formats.llamaindex_file_path(d)}) for d in ex.documents]
    assert chunk_texts(text, offsets) == [n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
    assert all(c.startswith("file_path: /data/docs/") for c in chunk_texts(text, offsets))


@pytest.mark.parametrize("task", sorted(EXAMPLES))
def test_numbered_is_the_openai_sdk_shape_in_chatml(task):
    from benchmarks import cache_hit_frameworks as fw

    ex = EXAMPLES[task]
    _, body = fw.openai_sdk(_trace_request(ex))
    assert ex.marked("numbered")[0] == _chatml(body["messages"]) + _lead_in(ex)


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-0.5b"])
@pytest.mark.parametrize("fmt", ["langchain", "numbered"])
def test_chatml_layouts_are_the_models_own_chat_template_when_prepared(model, fmt):
    """What the server renders from the framework's messages with the model's own template, then the
    answer's lead-in (``chat`` is checked so in test_bench_quality). Skipped where the model is not
    prepared: the test never downloads or converts one."""
    folder = assets.cache_root() / "models" / model
    if not folder.is_dir() or assets.manifest_problem(folder) is not None:
        pytest.skip(f"{model} is not prepared here (relaxkv-sglang model {model})")
    from benchmarks import cache_hit_frameworks as fw

    if fmt == "langchain":
        pytest.importorskip("langchain_openai")
    ex = EXAMPLES["niah_multivalue"]
    messages = (fw.langchain_chat if fmt == "langchain" else fw.openai_sdk)(_trace_request(ex))[1]["messages"]
    rendered = assets.load_tokenizer(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ex.marked(fmt)[0] == rendered + _lead_in(ex)


# ---------------------------------------------------------------- the real data


def test_every_real_task_example_renders_in_every_format_when_prepared():
    for name in ("hotpotqa", "squad", "essays"):
        folder = assets.cache_root() / "data" / name
        if not folder.exists() or assets.manifest_problem(folder) is not None:
            pytest.skip(f"{name} not prepared (relaxkv-sglang data {name})")
    for task in quality_tasks.QUALITY_TASKS:
        for ex in quality_tasks.task_examples(task, 2, seed=0):
            bare = _bare_question(ex)
            for fmt in PROMPT_FORMATS:
                text, offsets = ex.marked(fmt)
                assert len(chunk_spans(offsets)) == len(ex.documents) == 10
                assert chunk_texts(text, offsets) == ex.chunk_documents(fmt)
                assert text.count(bare) == 1, (task, ex.example_id, fmt)
                assert chunk_texts(*_reversed(ex, fmt)) == ex.chunk_documents(fmt)[::-1]
