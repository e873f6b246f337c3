"""The RAG prompt layouts of the benchmarks, and the ``relaxkv_chunks`` offsets of their documents.

A plain RAG prompt is ``[system prompt] [doc 1] ... [doc n] [question]``, the parts joined by
:data:`SEPARATOR`; :func:`render_marked` writes the same example in the other common layouts
(:data:`PROMPT_FORMATS`). Every renderer returns ``(text, offsets)``: ``offsets`` is the flat
``[s0, e0, s1, e1, ...]`` list of the documents' character spans a request sends as
``relaxkv_chunks`` (:func:`chunk_spans`, :func:`chunk_texts` read it back).

    >>> text, offsets = marked_text("Sys.", ["Doc A.", "Doc B."], question_text("Who?"))
    >>> chunk_texts(text, offsets)
    ['Doc A.', 'Doc B.']
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

# Between the system prompt, each document and the question. Documents are
# separated by a blank line; the separator is kept outside the document texts
# so a document's own text (the reusable chunk) is the same wherever it lands.
SEPARATOR = "\n\n"

# A small fixed set: requests for the same documents arrive behind different
# system prompts, which already defeats a prefix cache at the first token
# after the shared part.
SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer the question using only the documents below. "
    "Reply with a short answer of a few words, not a sentence.",
    "Read the following passages carefully, then answer the question that comes after them. "
    "Give only the answer, as briefly as possible.",
    "You are a question answering system. Some of the documents below are relevant and some "
    "are distractors. Answer the question with a short phrase taken from the documents.",
)


def question_text(question: str) -> str:
    """The question block that ends every prompt; generation continues after ``Answer:``."""
    return f"Question: {question.strip()}\nAnswer:"


def marked_text(system: str, documents: Sequence[str], question: str, *,
                separator: str = SEPARATOR) -> tuple[str, list[int]]:
    """The rendered prompt and its ``relaxkv_chunks`` offsets: one ``[start, end)`` pair per document.

    The text is exactly :func:`benchmarks.rag_documents.render_prompt`'s layout (parts joined by
    ``separator``, :data:`SEPARATOR` by default); the separators stay outside the chunks.
    """
    return _marked(system + separator, documents, separator, separator + question)


def _marked(head: str, documents: Sequence[str], separator: str, tail: str) -> tuple[str, list[int]]:
    """``head``, the documents joined by ``separator``, ``tail``; and the documents' offsets."""
    text, offsets = head, []
    for i, doc in enumerate(documents):
        text += separator if i else ""
        offsets += [len(text), len(text) + len(doc)]
        text += doc
    return text + tail, offsets


# ------------------------------------------------------------ prompt formats
#
# The same example in common RAG prompt layouts. A repair policy's quality depends on the layout
# (e.g. whether every chunk opens with the same tokens, whether the question comes before or after
# the documents), so the quality benchmark measures each:
#
# * ``plain``: ``Title: text`` documents between blank lines (the default everywhere);
# * ``document``: each document a ``Document: <title>`` line then its text, single newlines, a
#   one-line instruction first;
# * ``chat``: ChatML turns, the template of SmolLM2-Instruct and Qwen2.5: system turn, documents and
#   question in the user turn, the answer's lead-in, if any, in the assistant turn;
# * ``langchain``: LangChain's RAG tutorial chat prompt in ChatML: :data:`LANGCHAIN_SYSTEM` then the
#   documents (blank lines between) as the system turn, the bare question as the user turn;
# * ``llamaindex``: LlamaIndex's default text-QA completion prompt (:data:`LLAMAINDEX_TEXT_QA_TEMPLATE`),
#   each node its ``file_path:`` metadata line, a blank line and its text (part of the chunk);
# * ``tagged``: Anthropic-style long-context tags, ``<document index="n">`` around each
#   document's ``<source>`` and ``<document_content>``, all inside ``<documents>``, question last;
# * ``numbered``: the OpenAI-SDK RAG shape in ChatML: a ``Documents:`` list of ``[n] document``
#   lines and the question in one user turn (:func:`numbered_parts`);
# * ``question_first``: ``plain`` with the question stated once before the documents, the
#   answer's lead-in after them.
#
# A chunk must be the same text in every request to be reused, so whatever depends on a
# document's position (``[n]``, ``index="n"``) is glue outside the chunks, while what belongs to
# the document wherever it lands (its title, its metadata line, its content tags) is inside. The
# task's own system prompt is kept except where a framework writes its own (``langchain``,
# ``llamaindex``).

PROMPT_FORMATS = ("plain", "document", "chat", "langchain", "llamaindex", "tagged", "numbered", "question_first")
_ANSWER_LEAD = "\nAnswer:"

# The instruction of LangChain's RAG tutorial (its system message before ``{context}``).
LANGCHAIN_SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
                    "to answer the question. If you don't know the answer, say that you don't know. Use three "
                    "sentences maximum and keep the answer concise.")
# llama_index.core's DEFAULT_TEXT_QA_PROMPT_TMPL (llama-index-core 0.14.25, tests compare it with the installed
# one): written out here so the quality prompts do not change when a framework release edits its template.
LLAMAINDEX_TEXT_QA_TEMPLATE = ("Context information is below.\n---------------------\n{context_str}\n"
                               "---------------------\nGiven the context information and not prior knowledge, "
                               "answer the query.\nQuery: {query_str}\nAnswer: ")


def llamaindex_file_path(doc: str) -> str:
    """The ``file_path`` metadata a ``SimpleDirectoryReader`` node of ``doc`` carries (stable per document)."""
    return f"/data/docs/{zlib.crc32(doc.encode()):08x}.txt"


def _untitled(document: str, title: str | None) -> str:
    """A ``Title: text`` document's text without its title (any other document as it is)."""
    return document[len(title) + 2:] if title and document.startswith(f"{title}: ") else document


def format_document(document: str, title: str | None, fmt: str) -> str:
    """One document's chunk text in ``fmt``: ``document`` writes a ``Document: <title>`` line (the title
    taken off a ``Title: text`` document) then the text; ``llamaindex`` a node's ``file_path: ...`` line, a
    blank line, the text; ``tagged`` ``<source>title</source>`` (when titled) and
    ``<document_content>text</document_content>``; the other formats keep the document as is."""
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt format {fmt!r}; choose one of {', '.join(PROMPT_FORMATS)}")
    if fmt == "document":
        text = _untitled(document, title)
        return f"Document: {title}\n{text}" if title else f"Document:\n{text}"
    if fmt == "llamaindex":  # TextNode.get_content(MetadataMode.LLM): "{key}: {value}", "\n\n", the text
        return f"file_path: {llamaindex_file_path(document)}\n\n{document}"
    if fmt == "tagged":
        source = f"<source>{title}</source>\n" if title else ""
        return f"{source}<document_content>{_untitled(document, title)}</document_content>"
    return document


def _split_answer_lead(question: str) -> tuple[str, str, str]:
    """``(ask, answer lead-in, the lead-in after "Answer:")`` of a question block: ``Question: q\\nAnswer: The
    numbers are`` gives ``("Question: q", "Answer: The numbers are", "The numbers are")``; no lead-in: ``""``."""
    ask, lead, rest = question.partition(_ANSWER_LEAD)
    return ask, lead.lstrip("\n") + rest if lead else "", rest.lstrip()


def _marked_parts(parts: Sequence[tuple[str, bool]]) -> tuple[str, list[int]]:
    """The parts' text and the offsets of those flagged as chunks (``(text, is_chunk)`` pairs, in order)."""
    text, offsets = "", []
    for piece, chunk in parts:
        if chunk:
            offsets += [len(text), len(text) + len(piece)]
        text += piece
    return text, offsets


def numbered_parts(documents: Sequence[str], ask: str) -> list[tuple[str, bool]]:
    """The OpenAI-SDK RAG user message as ``(text, is_chunk)`` parts: ``Documents:``, one ``[n] document``
    line per document (the ``[n] `` marker outside the chunk), a blank line, ``ask``."""
    parts = [("Documents:\n", False)]
    for i, doc in enumerate(documents):
        parts += [(("\n" if i else "") + f"[{i + 1}] ", False), (doc, True)]
    return parts + [(f"\n\n{ask}", False)]


def _chatml(system: Sequence[tuple[str, bool]], user: Sequence[tuple[str, bool]],
            answer_lead: str) -> list[tuple[str, bool]]:
    """A system and a user turn in ChatML (SmolLM2-Instruct's and Qwen2.5's template), then the
    assistant turn opened with ``answer_lead``."""
    return [("<|im_start|>system\n", False), *system, ("<|im_end|>\n<|im_start|>user\n", False), *user,
            (f"<|im_end|>\n<|im_start|>assistant\n{answer_lead}", False)]


def render_marked(system: str, documents: Sequence[str], question: str, fmt: str = "plain",
                  titles: Sequence[str] | None = None) -> tuple[str, list[int]]:
    """The prompt in format ``fmt`` (:data:`PROMPT_FORMATS`) and its ``relaxkv_chunks`` offsets.

    ``question`` is the block that ends the plain prompt (e.g. ``Question: ...\\nAnswer:``);
    ``titles`` (one per document, or None) name the documents for the ``document`` and ``tagged`` formats.
    """
    titles = list(titles) if titles else [None] * len(documents)
    docs = [format_document(d, t, fmt) for d, t in zip(documents, titles)]
    if fmt == "plain":
        return marked_text(system, docs, question)
    if fmt == "document":
        return marked_text(system, docs, question, separator="\n")
    ask, answer_lead, lead_rest = _split_answer_lead(question)
    bare = ask.strip().removeprefix("Question: ").strip()  # what a framework user types
    if fmt == "chat":  # the lead-in of the answer (from "Answer:" on) opens the assistant turn
        return _marked(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", docs, "\n\n",
                       f"\n\n{ask}<|im_end|>\n<|im_start|>assistant\n{answer_lead}")
    if fmt == "langchain":  # ChatPromptTemplate([("system", LANGCHAIN_SYSTEM + "\n\n{context}"), ("human", "{input}")])
        context = [p for i, d in enumerate(docs) for p in (("\n\n" if i else "", False), (d, True))]
        return _marked_parts(_chatml([(LANGCHAIN_SYSTEM + "\n\n", False), *context], [(bare, False)], answer_lead))
    if fmt == "llamaindex":  # the template's "Answer: " ends the prompt, the task's lead-in (if any) after it
        head, tail = LLAMAINDEX_TEXT_QA_TEMPLATE.split("{context_str}")
        return _marked(head, docs, "\n\n", tail.replace("{query_str}", bare) + lead_rest)
    if fmt == "tagged":
        parts = [(f"{system}\n\n<documents>\n", False)]
        for i, doc in enumerate(docs):
            parts += [(f'<document index="{i + 1}">\n', False), (doc, True), ("\n</document>\n", False)]
        return _marked_parts(parts + [(f"</documents>\n\n{question}", False)])
    if fmt == "numbered":
        return _marked_parts(_chatml([(system, False)], numbered_parts(docs, ask), answer_lead))
    # question_first: the question once, before the documents; the answer's lead-in after them.
    return _marked(SEPARATOR.join([system, ask]) + SEPARATOR, docs, SEPARATOR, SEPARATOR + answer_lead)


def chunk_spans(offsets: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` pairs of a flat ``relaxkv_chunks`` list (``[s0, e0, s1, e1, ...]``)."""
    return list(zip(offsets[::2], offsets[1::2]))


def chunk_texts(text: str, offsets: Sequence[int]) -> list[str]:
    """The documents a ``relaxkv_chunks`` list marks in ``text``, in prompt order."""
    return [text[s:e] for s, e in chunk_spans(offsets)]


def token_ids(tokenizer: Any, text: str, *, special: bool = False) -> list[int]:
    """``text``'s token ids on its own (with the tokenizer's special tokens, e.g. BOS, if ``special``).

    A document tokenized this way is what the server computes for it as a
    chunk (each marked part is tokenized on its own); a whole prompt with
    ``special=True`` is what it prefills for an unmarked prompt.
    """
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def token_count(tokenizer: Any, text: str, *, special: bool = False) -> int:
    """How many tokens :func:`token_ids` gives ``text``."""
    return len(token_ids(tokenizer, text, special=special))
