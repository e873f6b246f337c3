"""The quality benchmark's tasks: HotpotQA, multi-document SQuAD, RULER-style needles and variable tracking.

Each task is a list of :class:`TaskExample`, its documents the chunks. All are seeded (HotpotQA by
its offset), so an example is the same on every machine. At the defaults, each prompt is about
1.5K SmolLM2 tokens over 10 chunks, like a HotpotQA example. :func:`task_examples` is the entry point.
"""

from __future__ import annotations

import dataclasses
import random
import re
import string

from benchmarks.prompt_formats import SYSTEM_PROMPTS, chunk_texts, question_text, render_marked
from benchmarks.rag_documents import format_paragraph, hotpotqa_paragraphs
from relaxkv_sglang import assets

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

        >>> example = task_examples("niah_multivalue", 1, seed=0)[0]  # the prepared essays
        >>> text, offsets = example.marked("chat")
        >>> len(offsets) // 2, example.scorer
        (10, 'string_match_all')
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
