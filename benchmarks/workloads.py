"""RAG workloads built from real data (HotpotQA dev distractor), and the quality benchmark's tasks.

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

The quality tasks (:func:`task_examples`: HotpotQA, multi-document SQuAD,
RULER-style multi-value needle and variable tracking over the essays) are
:class:`TaskExample` lists, each example's documents the chunks.
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
import zlib
from typing import Any, Sequence

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


def marked_text(system: str, documents: Sequence[str], question: str, *,
                separator: str = SEPARATOR) -> tuple[str, list[int]]:
    """The rendered prompt and its ``relaxkv_chunks`` offsets: one ``[start, end)`` pair per document.

    The text is exactly :func:`render_prompt`'s layout (parts joined by
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


# ------------------------------------------------------------ quality tasks
#
# The quality benchmark's four tasks, each a list of :class:`TaskExample`
# with its documents as chunks. All are seeded (HotpotQA by its offset), so an
# example is the same on every machine. At the defaults, each prompt is about
# 1.5K SmolLM2 tokens over 10 chunks, like a HotpotQA example.

QUALITY_TASKS = ("hotpotqa", "squad", "niah_multivalue", "variable_tracking")

# The project's rule: tune on dev, report on test. Per split: where a run starts by default, and the
# HotpotQA dev examples and synthetic seeds ([first, end)) its examples may use. SQuAD's questions
# and documents come from disjoint halves of its articles for dev and test seeds (squad_multidoc).
QUALITY_SPLITS = {
    "dev": {"offset": 0, "seed": 0, "hotpotqa": (0, 3000), "seeds": (0, 1000)},
    "test": {"offset": 3000, "seed": 1000, "hotpotqa": (3000, 3200), "seeds": (1000, 1100)},
}

# Words for NIAH keys ("adjective-noun"); any fixed list works, it only has to
# name something the essays never mention.
_KEY_ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "eager", "frozen", "gentle", "hollow", "ivory", "jolly",
                   "kind", "lunar", "mellow", "narrow", "olive", "proud", "quiet", "rapid", "silent", "tidy")
_KEY_NOUNS = ("anchor", "badger", "canyon", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket",
              "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "ribbon", "saddle", "tulip")

NIAH_SYSTEM = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
               "I will quiz you about the numbers afterwards.")
VARIABLE_TRACKING_SYSTEM = "Memorize and track the chain of variable assignments hidden in the following text."


@dataclasses.dataclass
class TaskExample:
    """One example of a quality task, ready to render with :func:`marked_text`.

    ``documents`` are the chunk texts in prompt order; ``question`` is the
    whole text after the last document (it ends where the answer starts);
    ``answers`` are the references; ``scorer`` names the entry of
    :data:`benchmarks.metrics.SCORERS` that scores an answer against them
    (``qa_f1``: LongBench QA F1 of the answer's first line; ``string_match_all``:
    RULER's fraction of the references found in the answer); ``max_new_tokens``
    is enough for a complete answer.
    """

    task: str
    example_id: str
    system: str
    documents: list[str]
    question: str
    answers: list[str]
    scorer: str
    max_new_tokens: int
    titles: list[str] | None = None  # one per document (HotpotQA, SQuAD); None: untitled (essays)

    def marked(self, fmt: str = "plain") -> tuple[str, list[int]]:
        """The prompt text in ``fmt`` and its ``relaxkv_chunks`` offsets (one pair per document)."""
        return render_marked(self.system, self.documents, self.question, fmt, self.titles)

    def chunk_documents(self, fmt: str = "plain") -> list[str]:
        """The documents' chunk texts in ``fmt``, in prompt order."""
        return chunk_texts(*self.marked(fmt))


def hotpotqa_examples(n: int, *, offset: int = 0, data: list[dict] | None = None) -> list[TaskExample]:
    """HotpotQA dev examples ``offset .. offset + n - 1``: the 10 paragraphs in file order as chunks."""
    data = assets.load_data("hotpotqa") if data is None else data
    chosen = data[offset: offset + n]
    if len(chosen) < n:
        raise ValueError(f"HotpotQA has {len(data)} examples; offset {offset} + {n} is past the end")
    return [TaskExample(
        task="hotpotqa", example_id=str(ex.get("_id", offset + i)), system=SYSTEM_PROMPTS[0],
        documents=hotpotqa_paragraphs(ex), titles=[title for title, _ in ex["context"]],
        question=question_text(ex["question"]), answers=[ex["answer"]], scorer="qa_f1", max_new_tokens=16,
    ) for i, ex in enumerate(chosen)]


def squad_multidoc(n: int, *, seed: int = 0, distractors: int = 9, max_chars: int = 800,
                   data: dict | None = None) -> list[TaskExample]:
    """Multi-document SQuAD: each question's gold paragraph among ``distractors`` from other articles.

    Questions are answerable SQuAD v2 dev questions, one per paragraph,
    drawn with ``seed``; the gold paragraph lands at a seeded position.
    Paragraphs (gold and distractors) have at most ``max_chars`` characters, so
    10 of them are about 1.5K tokens. A document is ``"Article title: paragraph"``.
    Seeds of the test split (:data:`QUALITY_SPLITS`) draw questions and documents from the
    odd-numbered articles, every other seed from the even-numbered ones, so no test example
    shares a question or a document with a development example.
    """
    data = assets.load_data("squad") if data is None else data
    rng = random.Random(seed)
    test_seeds = QUALITY_SPLITS["test"]["seeds"]
    half = 1 if test_seeds[0] <= seed < test_seeds[1] else 0
    paragraphs = [(a, format_paragraph(art["title"].replace("_", " "), [par["context"]]), par["qas"])
                  for a, art in enumerate(data["data"]) if a % 2 == half for par in art["paragraphs"]
                  if len(par["context"]) <= max_chars]
    title_of = {text: data["data"][a]["title"].replace("_", " ") for a, text, _ in paragraphs}
    candidates = [(i, q) for i, (_, _, qas) in enumerate(paragraphs) for q in qas
                  if not q.get("is_impossible") and q["answers"]]
    rng.shuffle(candidates)
    examples, used = [], set()
    for i, qa in candidates:
        if len(examples) == n:
            break
        if i in used:  # one question per paragraph, so examples differ in their gold document
            continue
        used.add(i)
        article, gold, _ = paragraphs[i]
        others = [text for a, text, _ in paragraphs if a != article]
        if len(others) < distractors:
            raise ValueError(f"only {len(others)} paragraphs outside article {article}; "
                             f"{distractors} distractors asked")
        docs = rng.sample(others, distractors)
        docs.insert(rng.randrange(distractors + 1), gold)
        answers = list(dict.fromkeys(a["text"] for a in qa["answers"]))  # unique, in order
        examples.append(TaskExample(
            task="squad", example_id=str(qa["id"]), system=SYSTEM_PROMPTS[0], documents=docs,
            titles=[title_of[d] for d in docs], question=question_text(qa["question"]), answers=answers, scorer="qa_f1", max_new_tokens=16))
    if len(examples) < n:
        raise ValueError(f"SQuAD has only {len(examples)} answerable paragraphs of at most {max_chars} characters")
    return examples


def _essay_documents(haystack: str, n_docs: int, doc_chars: int, rng: random.Random) -> list[list[str]]:
    """``n_docs`` consecutive pieces of essay text from a seeded start, each a list of whole sentences.

    Each piece takes sentences until it has at least ``doc_chars`` characters.
    """
    need = 3 * n_docs * doc_chars + 2000
    if len(haystack) <= need:
        raise ValueError(f"haystack has {len(haystack)} characters; {need} needed for {n_docs} x {doc_chars}")
    start = rng.randrange(len(haystack) - need)
    text = " ".join(haystack[start: start + need].split())
    # The essays' paragraphs are run together ("mistakes.If you"): split those too.
    text = re.sub(r"([.!?])([A-Z])", r"\1 \2", text)
    sentences = re.split(r"(?<=[.!?])\s+", text)[1:-1]  # the first and last are cut by the window
    docs, current, size = [], [], 0
    for sentence in sentences:
        current.append(sentence)
        size += len(sentence) + 1
        if size >= doc_chars:
            docs.append(current)
            current, size = [], 0
            if len(docs) == n_docs:
                return docs
    raise ValueError("the essay window ran out of sentences")  # only with pathologically long sentences


def _fresh(rng: random.Random, draw, taken: set, text: str) -> str:
    """A value from ``draw(rng)`` that is neither in ``taken`` nor anywhere in ``text``."""
    while True:
        value = draw(rng)
        if value not in taken and value not in text:
            taken.add(value)
            return value


def _essay_windows(n: int, seed: int, n_docs: int, doc_chars: int, haystack: str | None):
    """Per example ``i``: ``(i, rng, pieces, plain, taken)``: ``n_docs`` essay pieces (sentence
    lists, :func:`_essay_documents`) from a window drawn with the one seeded ``rng`` the caller
    keeps drawing from, their plain text, and an empty set of values already used."""
    haystack = assets.load_data("essays")["text"] if haystack is None else haystack
    rng = random.Random(seed)
    for i in range(n):
        pieces = _essay_documents(haystack, n_docs, doc_chars, rng)
        yield i, rng, pieces, " ".join(s for piece in pieces for s in piece), set()


def niah_multivalue(n: int, *, seed: int = 0, n_docs: int = 10, doc_chars: int = 560, n_values: int = 4,
                    haystack: str | None = None) -> list[TaskExample]:
    """RULER-style multi-value needle in a haystack over essay chunks.

    The haystack is ``n_docs`` consecutive pieces of the Paul Graham essays
    (a seeded start), each a document. One key (``"quiet-lantern"``) gets
    ``n_values`` 7-digit values, each in a RULER needle sentence ("One of the
    special magic numbers for KEY is: VALUE.") inserted at a seeded sentence
    boundary of a different, seeded document. The answer is all the values,
    scored by RULER's ``string_match_all``.
    """
    if not 1 <= n_values <= n_docs:
        raise ValueError(f"n_values must be between 1 and n_docs={n_docs}, got {n_values}")
    examples = []
    for i, rng, pieces, plain, taken in _essay_windows(n, seed, n_docs, doc_chars, haystack):
        key = _fresh(rng, lambda r: f"{r.choice(_KEY_ADJECTIVES)}-{r.choice(_KEY_NOUNS)}", taken, plain)
        values = []
        for d in sorted(rng.sample(range(n_docs), n_values)):
            value = _fresh(rng, lambda r: str(r.randint(1_000_000, 9_999_999)), taken, plain)
            pieces[d].insert(rng.randint(0, len(pieces[d])), f"One of the special magic numbers for {key} is: {value}.")
            values.append(value)
        examples.append(TaskExample(
            task="niah_multivalue", example_id=f"niah-s{seed}-{i}", system=NIAH_SYSTEM,
            documents=[" ".join(piece) for piece in pieces],
            question=(f"Question: What are all the special magic numbers for {key} mentioned in the provided text?\n"
                      f"Answer: The special magic numbers for {key} mentioned in the provided text are"),
            answers=values, scorer="string_match_all", max_new_tokens=10 * n_values))
    return examples


def variable_tracking(n: int, *, seed: int = 0, n_docs: int = 10, doc_chars: int = 560, n_hops: int = 4,
                      haystack: str | None = None) -> list[TaskExample]:
    """RULER-style variable tracking over essay chunks.

    A chain ``VAR A = 12345.``, ``VAR B = VAR A.``, ... (``n_hops`` hops,
    5-letter names, a 5-digit value) is spread over ``n_hops + 1`` seeded
    documents in order, one statement each at a seeded sentence boundary,
    among essay text as in :func:`niah_multivalue`. The question asks which
    variables equal the value; the answer is every name in the chain, scored
    by RULER's ``string_match_all``.
    """
    if not 1 <= n_hops + 1 <= n_docs:
        raise ValueError(f"a chain of {n_hops} hops needs {n_hops + 1} documents; n_docs={n_docs}")
    examples = []
    for i, rng, pieces, plain, taken in _essay_windows(n, seed, n_docs, doc_chars, haystack):
        value = _fresh(rng, lambda r: str(r.randint(10_000, 99_999)), taken, plain)
        names = [_fresh(rng, lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), taken, plain)
                 for _ in range(n_hops + 1)]
        statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        for d, statement in zip(sorted(rng.sample(range(n_docs), n_hops + 1)), statements):
            pieces[d].insert(rng.randint(0, len(pieces[d])), statement)
        examples.append(TaskExample(
            task="variable_tracking", example_id=f"vt-s{seed}-{i}", system=VARIABLE_TRACKING_SYSTEM,
            documents=[" ".join(piece) for piece in pieces],
            question=(f"Question: Find all variables that are assigned the value {value} in the text above.\n"
                      f"Answer: According to the chain of variable assignments in the text above, {n_hops + 1} "
                      f"variables are assigned the value {value}, they are:"),
            answers=names, scorer="string_match_all", max_new_tokens=6 * (n_hops + 1) + 2))
    return examples


# Documents per quality-task prompt (HotpotQA's examples come with their own 10 paragraphs), and
# the tasks whose prompts grow with the number of documents (the long-context runs).
DOCUMENTS_PER_PROMPT = 10
SCALABLE_TASKS = ("squad", "niah_multivalue", "variable_tracking")


def task_examples(task: str, n: int, *, seed: int = 0, offset: int = 0,
                  documents: int = DOCUMENTS_PER_PROMPT) -> list[TaskExample]:
    """``n`` examples of a quality task (:data:`QUALITY_TASKS`); ``offset`` is HotpotQA's, ``seed`` the others'.

    ``documents``: documents (chunks) per prompt, ~150 SmolLM2 tokens each (50 make a ~7K-token
    prompt); other than :data:`DOCUMENTS_PER_PROMPT` only for :data:`SCALABLE_TASKS`.
    """
    if task not in QUALITY_TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(QUALITY_TASKS)}")
    if documents < 1:
        raise ValueError(f"documents must be >= 1, got {documents}")
    if documents != DOCUMENTS_PER_PROMPT and task not in SCALABLE_TASKS:
        raise ValueError(f"{task} has {DOCUMENTS_PER_PROMPT} documents per example; documents={documents} needs one of "
                         f"{', '.join(SCALABLE_TASKS)}")
    if task == "hotpotqa":
        return hotpotqa_examples(n, offset=offset)
    if task == "squad":
        return squad_multidoc(n, seed=seed, distractors=documents - 1)
    if task == "niah_multivalue":
        return niah_multivalue(n, seed=seed, n_docs=documents)
    return variable_tracking(n, seed=seed, n_docs=documents)
