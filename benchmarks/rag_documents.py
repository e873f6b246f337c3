"""Documents from real data (HotpotQA dev distractor, SQuAD v2 dev) and the demo's seeded HotpotQA trace.

What a RAG KV cache can exploit is that the *same documents* come back in later requests, in
another order and after another system prompt; SGLang's radix cache only reuses an identical
prefix, so it misses those. HotpotQA's examples do not share paragraphs, so a trace of ``n``
requests (:func:`hotpotqa_requests`) is drawn from a small pool of examples: each is asked several
times, its paragraphs re-shuffled and a system prompt drawn from
:data:`~benchmarks.prompt_formats.SYSTEM_PROMPTS`. Everything is seeded, so a trace is the same on
every machine. :func:`render_prompt` writes a request in the plain layout of
:mod:`benchmarks.prompt_formats`.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from benchmarks.prompt_formats import SEPARATOR, SYSTEM_PROMPTS, question_text
from relaxkv_sglang import assets


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


def hotpotqa_paragraphs(example: dict) -> list[str]:
    """Every paragraph of a HotpotQA example, in file order, as documents (:func:`format_paragraph`)."""
    return [format_paragraph(title, sentences) for title, sentences in example["context"]]


def document_pool(source: str, n: int, seed: int, *, data: Any = None) -> list[str]:
    """``n`` distinct documents drawn (seeded) from HotpotQA's first 2000 examples' paragraphs or SQuAD's.

    ``source`` is ``"hotpotqa"`` or ``"squad"`` (SQuAD v2 dev: every paragraph's
    context as written); ``data`` replaces the data file (for tests).
    """
    if source not in ("hotpotqa", "squad"):
        raise ValueError(f"unknown document source {source!r}; choose hotpotqa or squad")
    data = assets.load_data(source) if data is None else data
    if source == "hotpotqa":
        paragraphs = [doc for ex in data[:2000] for doc in hotpotqa_paragraphs(ex)]
    else:  # {"data": [{"paragraphs": [{"context": ...}]}]}
        paragraphs = [p["context"] for art in data["data"] for p in art["paragraphs"]]
    return random.Random(seed).sample(sorted(set(paragraphs)), n)



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

        >>> trace = hotpotqa_requests(6, seed=0)  # the prepared HotpotQA dev file
        >>> len(trace), len({req.example_id for req in trace}), len(render_prompt(trace[0])) > 0
        (6, 2, True)
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
