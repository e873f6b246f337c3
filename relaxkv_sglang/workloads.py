"""RAG workloads built from real data (HotpotQA dev distractor).

A RAG request is ``[system prompt] [doc 1] ... [doc n] [question]``. What a
RAG KV cache can exploit is that the *same documents* come back in later
requests, in another order and after another system prompt; SGLang's radix
cache only reuses an identical prefix, so it misses those. To produce that
recurrence from HotpotQA (whose examples do not share paragraphs), a trace of
``n`` requests is drawn from a small pool of examples: each pool example is
asked several times, each time with its paragraphs re-shuffled and a system
prompt drawn from a fixed set of three. Everything is seeded, so a trace is the
same on every machine.

The prompt text is built in one place, :func:`prompt_parts` /
:func:`render_prompt`, so that frontend programs which mark the documents
(``document(text)``) produce exactly the same text as the plain rendering.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from relaxkv_sglang import assets

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


@dataclasses.dataclass
class RagRequest:
    """One RAG request of a trace.

    ``documents`` are already in this request's order; ``answers`` are the gold
    references (HotpotQA has one per question). ``example_id`` is the HotpotQA
    ``_id``: requests that share it share their documents.
    """

    system: str
    documents: list[str]
    question: str
    answers: list[str]
    example_id: str


def format_paragraph(title: str, sentences: Sequence[str]) -> str:
    """A HotpotQA paragraph as one document: ``"Title: sentence sentence ..."``.

    HotpotQA's sentences already carry their leading space (``" He lives..."``),
    so they are joined without one.
    """
    return f"{title}: {''.join(sentences)}".strip()


def question_text(question: str) -> str:
    """The question block that ends every prompt; generation continues after ``Answer:``."""
    return f"Question: {question.strip()}\nAnswer:"


def prompt_parts(req: RagRequest) -> tuple[str, list[str], str]:
    """``(system, documents, question block)``: the pieces :func:`render_prompt` joins.

    A frontend program that marks documents sends ``system``, then for each
    document ``SEPARATOR + document``, then ``SEPARATOR + question block``; the
    resulting text is exactly :func:`render_prompt`'s.
    """
    return req.system, list(req.documents), question_text(req.question)


def render_prompt(req: RagRequest) -> str:
    """The full prompt text: system, blank line, documents separated by blank lines, blank line, question."""
    system, docs, question = prompt_parts(req)
    return SEPARATOR.join([system, *docs, question])


def _select_paragraphs(example: dict, k: int, rng: random.Random) -> list[str]:
    """``k`` documents of an example: the gold (supporting) paragraphs first, then distractors.

    With the default ``k = 10`` this is every paragraph; with fewer, the gold
    ones are kept so the question stays answerable.
    """
    gold_titles = {title for title, _ in example.get("supporting_facts", [])}
    gold = [p for p in example["context"] if p[0] in gold_titles]
    rest = [p for p in example["context"] if p[0] not in gold_titles]
    rng.shuffle(rest)
    chosen = (gold + rest)[:k]
    return [format_paragraph(title, sentences) for title, sentences in chosen]


def hotpotqa_requests(
    n: int,
    *,
    seed: int = 0,
    docs_per_request: int = 10,
    pool: int | None = None,
    data: list[dict] | None = None,
) -> list[RagRequest]:
    """A seeded trace of ``n`` RAG requests over HotpotQA dev (distractor setting).

    ``pool`` distinct examples (default ``max(1, n // 3)``, so each is asked
    about three times) are sampled; request ``i`` asks example ``i % pool``;
    each request re-shuffles that example's documents and draws one of
    :data:`SYSTEM_PROMPTS`; finally the trace order is shuffled, so the repeats
    of an example are spread through the trace. ``data`` replaces the HotpotQA
    file (for tests); by default it is ``assets.load_data("hotpotqa")``.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 1 <= docs_per_request <= 10:
        raise ValueError(f"docs_per_request must be between 1 and 10, got {docs_per_request}")
    pool = max(1, n // 3) if pool is None else pool
    if not 1 <= pool <= n:
        raise ValueError(f"pool must be between 1 and n={n}, got {pool}")
    if data is None:
        data = assets.load_data("hotpotqa")
    # A few dev examples carry fewer than 10 paragraphs; they cannot fill a request.
    eligible = [ex for ex in data if len(ex["context"]) >= docs_per_request]
    if len(eligible) < pool:
        raise ValueError(f"only {len(eligible)} examples have {docs_per_request} paragraphs; pool={pool}")

    rng = random.Random(seed)
    examples = rng.sample(eligible, pool)
    # Which documents an example contributes is fixed once per example, so its
    # repeats share all of them (only the order changes).
    doc_sets = [_select_paragraphs(ex, docs_per_request, rng) for ex in examples]
    requests: list[RagRequest] = []
    for i in range(n):
        ex, docs = examples[i % pool], list(doc_sets[i % pool])
        rng.shuffle(docs)
        requests.append(RagRequest(
            system=rng.choice(SYSTEM_PROMPTS),
            documents=docs,
            question=ex["question"],
            answers=[ex["answer"]],
            example_id=str(ex.get("_id", i % pool)),
        ))
    rng.shuffle(requests)
    return requests


def marked_text(system: str, documents: Sequence[str], question: str) -> tuple[str, list[int]]:
    """The rendered prompt and its ``relaxkv_chunks`` offsets: one ``[start, end)`` pair per document.

    The text is exactly :func:`render_prompt`'s layout (parts joined by
    :data:`SEPARATOR`); the separators stay outside the chunks.
    """
    text, offsets = system, []
    for doc in documents:
        text += SEPARATOR
        offsets += [len(text), len(text) + len(doc)]
        text += doc
    return text + SEPARATOR + question, offsets
