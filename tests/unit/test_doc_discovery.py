"""Chunk discovery in unmarked prompts: the block rules, token boundaries, the opt-in document
index, and a property test that no discovered chunk is ever served as another text's KV and that
every one starts and ends on a token boundary (request/doc_blocks.py, request/doc_index.py,
request/sglang/api.py::plan_item, prompt_boundaries, the index's server setting and its flush hook). The
regexes' linear time is tested in test_discovery_linear.py."""

from __future__ import annotations

import asyncio
import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaxkv_sglang.request.doc_blocks import candidate_spans, find_blocks
from relaxkv_sglang.request.doc_index import DocumentIndex, discover_chunks, token_boundaries
from relaxkv_sglang.request.segments import split_text, tokenize_parts
from relaxkv_sglang.request.schema import PLAN_KEY
from relaxkv_sglang.request.sglang import api
from relaxkv_sglang.request.sglang.api import item_namespace, plan_item, prompt_boundaries

WORDS = ("river", "stone", "market", "engine", "signal", "harbor", "lantern", "orbit", "meadow", "copper",
         "violet", "thunder", "canal", "archive", "summit", "falcon")


def sentence(rng: random.Random, n: int = 14) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(2)) for _ in range(n)]


DOCS = docs(5)


def found(text: str, regions=None, index=None, namespace=None) -> list[str]:
    return [text[s:e] for s, e in discover_chunks(text, index, namespace, regions=regions)]


# ------------------------------------------------------------------ the block rules, per framework shape

SHAPES = {
    # LangChain's RAG tutorial: instructions, then the documents joined by blank lines; question after
    "blank lines": "You are an assistant for question-answering tasks.\n\n" + "\n\n".join(DOCS) + "\n\nWhat?",
    # LlamaIndex's default text-QA template (a completion)
    "llamaindex": ("Context information is below.\n---------------------\n" + "\n\n".join(DOCS)
                   + "\n---------------------\nGiven the context information and not prior knowledge, "
                     "answer the query.\nQuery: what?\nAnswer: "),
    "numbered": "Use the sources.\n" + "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(DOCS)) + "\nQuestion: what?",
    "document headers": "Answer.\n" + "\n".join(f"Document {i + 1}: {d}" for i, d in enumerate(DOCS)) + "\nQ: what?",
    "metadata": "Answer.\n\n" + "\n\n".join(f"file_path: /data/{i}.txt\n\n{d}" for i, d in enumerate(DOCS)) + "\n\nQ?",
    "metadata single newline": "Answer.\n" + "\n".join(f"source: s{i}\n{d}" for i, d in enumerate(DOCS)) + "\nQ: x?",
    "tags": ("Answer.\n<documents>\n" + "\n".join(f"<doc id='{i}'>{d}</doc>" for i, d in enumerate(DOCS))
             + "\n</documents>\nQuestion: what?"),
    "one per line": "Answer from these.\n" + "\n".join(DOCS) + "\nQuestion: what?",
    "titled blocks": "Answer.\n" + "\n".join(f"Title {i}\n{d}" for i, d in enumerate(DOCS)) + "\nQuestion: what?",
    "rule lines": "Answer.\n" + "".join(f"=====\n{d}\n" for d in DOCS) + "=====\nQuestion: what?",
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_framework_shape_yields_each_document(shape):
    text = SHAPES[shape]
    chunks = found(text)
    want = [f"Title {i}\n{d}" for i, d in enumerate(DOCS)] if shape == "titled blocks" else DOCS
    if shape == "llamaindex":  # the template's instruction before its question line is one block more
        want = DOCS + ["Given the context information and not prior knowledge, answer the query."]
    if shape == "metadata":  # a document's metadata lines belong to it (the same in every prompt)
        want = [f"file_path: /data/{i}.txt\n\n{d}" for i, d in enumerate(DOCS)]
    assert chunks == want, (shape, chunks)


def test_the_system_prompt_and_the_question_are_never_chunks():
    system = "You are a careful assistant who answers only from the documents given below, citing them."
    question = "Which of the documents talks about the harbor and the lantern, and why does it matter here?"
    text = f"{system}\n\n" + "\n\n".join(DOCS[:2]) + f"\n\n{question}"
    assert found(text) == DOCS[:2]
    # ... but a labelled document opening a prompt is one
    assert found(f"[1] {DOCS[0]}\n[2] {DOCS[1]}\nQ?") == DOCS[:2]


def test_chat_markup_between_regions_is_never_a_chunk():
    system = "Answer from the documents below."
    content = system + "\n\n" + "\n\n".join(DOCS[:3])
    text = f"<|im_start|>system\n{content}<|im_end|>\n<|im_start|>user\nWhat?<|im_end|>\n<|im_start|>assistant\n"
    s0 = text.index(content)
    regions = [(s0, s0 + len(content)), (text.index("What?"), text.index("What?") + 5)]
    assert found(text, regions) == DOCS[:3]
    # the same rendered text without regions: the special tokens and role words are markup
    assert found(text) == DOCS[:3]


def test_blocks_are_trimmed_and_inside_the_text():
    text = "Sys.\n\n   " + DOCS[0] + "   \n \n" + DOCS[1] + "\n\nQ"
    blocks = find_blocks(text)
    assert [text[b.start:b.end] for b in blocks if b.kind == "text"] == ["Sys.", DOCS[0], DOCS[1], "Q"]
    assert candidate_spans(blocks) == [(b.start, b.end) for b in blocks[1:3]]
    with pytest.raises(ValueError):
        find_blocks(text, min_chunk_chars=0)


def test_hard_wrapped_prose_is_not_cut_by_line():
    para = ("Excite really never got the business model right at all.  We fell\n"
            "  into the classic problem of how when a new medium comes out it\n"
            "  adopts the practices, the content, the business models of the old\n"
            "  medium, which fails, and then the more appropriate models get\n"
            "  figured out.")
    assert found(f"Sys.\n\n{para}\n\nQ?") == [para]


# ------------------------------------------------------------------ the document index


def test_a_known_document_is_found_whatever_surrounds_it():
    index = DocumentIndex()
    index.remember(None, DOCS[:3])
    for before, after in [("Context:", "\nQuery:"), ("xx", "yy"), ("<doc>", "</doc>"), ("\n", ""), ("", " and")]:
        text = "Be brief. " + before + DOCS[1] + after + " " + DOCS[0] + "? Q"
        assert [text[s:e] for s, e in index.find(text, None)] == [DOCS[1], DOCS[0]], before
    assert found("Q " + DOCS[2] + " Z", index=index) == [DOCS[2]]


def test_namespaces_never_see_each_other():
    index = DocumentIndex()
    index.remember("a", [DOCS[0]])
    text = "Sys " + DOCS[0] + " Q"
    assert index.find(text, "a") == [(4, 4 + len(DOCS[0]))]
    assert index.find(text, "b") == [] and index.find(text, None) == []


def test_near_duplicates_and_overlaps():
    index = DocumentIndex()
    a, b = DOCS[0], DOCS[1]
    index.remember(None, [a, b])
    near = a[:30] + ("X" if a[30] != "X" else "Y") + a[31:]
    assert index.find("S " + near + " Q", None) == []
    # overlapping known documents: the longer wins, the other is not cut out of it
    short = a[10:80]
    index.remember(None, [short])
    text = "S " + a + " Q"
    assert [text[s:e] for s, e in index.find(text, None)] == [a]
    # a new document holding a known one keeps what is left of it as a candidate
    text = "Sys.\n\n" + b + " " + DOCS[2] + "\n\nQ?"
    assert found(text, index=index) == [b, DOCS[2]]


def test_regions_bound_a_hit():
    index = DocumentIndex()
    index.remember(None, [DOCS[0]])
    text = "S " + DOCS[0] + " Q"
    cut = 2 + len(DOCS[0]) // 2
    assert index.find(text, None, [(0, cut), (cut, len(text))]) == []
    assert index.find(text, None, [(0, len(text))]) == [(2, 2 + len(DOCS[0]))]


def test_the_index_is_bounded():
    index = DocumentIndex(max_docs=3, max_chars=10_000, max_per_key=2)
    many = docs(6, seed=1)
    index.remember(None, many)
    assert len(index) == 3 and index.find("S " + many[0] + " Q", None) == []
    assert index.find("S " + many[5] + " Q", None) != []
    index.remember(None, ["x" * 100, "short"])  # no boundary character / too short: not filed
    assert len(index) == 3
    # documents with one anchor window, the same (they differ before their only boundary
    # character): at most max_per_key of them share it, the oldest leaves
    same = [f"Opening{i} " + "x" * 70 for i in range(3)]
    index = DocumentIndex(max_per_key=2)
    index.remember(None, same)
    assert len(index) == 2 and index.chars == len(same[1]) + len(same[2])
    assert [index.find("S " + d + " Q", None) != [] for d in same] == [False, True, True]
    small = DocumentIndex(max_chars=len(DOCS[0]) + len(DOCS[1]))
    small.remember("t", DOCS[:3])
    assert len(small) == 2 and small.chars <= len(DOCS[0]) + len(DOCS[1])
    small.clear()
    assert len(small) == 0 and small.chars == 0 and small.find("S " + DOCS[2] + " Q", "t") == []


@pytest.mark.parametrize("max_per_key", [1, 8])
def test_documents_that_open_alike_do_not_evict_each_other(max_per_key):
    """Issue 46 item 4: 20 LlamaIndex nodes of one folder open with the same 40-odd characters
    (their ``file_path:`` line), more than ``max_per_key`` of them share the first anchor window;
    each is filed under a window of its own, so every one is still found."""
    rng = random.Random(46)
    nodes = [f"file_path: /data/essays/folder_{'x' * 8}/{zlib.crc32(str(i).encode())}.txt\n\n"
             + " ".join(sentence(rng) for _ in range(2)) for i in range(20)]
    assert len({n[11:11 + 24] for n in nodes}) == 1  # the window right after "file_path:" is shared
    index = DocumentIndex(max_per_key=max_per_key)
    index.remember("t", nodes)
    assert len(index) == 20
    for order in (nodes[:10], nodes[10:][::-1], nodes[5:15]):
        text = "Context information is below.\n---\n" + "\n\n".join(order) + "\n---\nQuery: q?\nAnswer: "
        assert [text[s:e] for s, e in index.find(text, "t")] == order


def test_plan_item_remembers_only_discovered_chunks_per_namespace():
    index = DocumentIndex()

    def encode(text: str, special: bool) -> list[int]:
        return ([1] if special else []) + [ord(c) for c in text]

    sp = {"custom_params": {"relaxkv_policy": "pic"}}
    text = "Sys.\n\n" + "\n\n".join(DOCS[:2]) + "\n\nQ?"
    ids, cp = plan_item(text, sp, encode, 1 << 20, "prefix", "", index, "t")
    assert len(cp[PLAN_KEY].chunk_spans) == 2 and len(index) == 2
    # the same documents glued to other text are found in the same namespace only
    glued = "Sys: " + DOCS[1] + " " + DOCS[0] + " Q?"
    _, cp = plan_item(glued, sp, encode, 1 << 20, "prefix", "", index, "t")
    assert len(cp[PLAN_KEY].chunk_spans) == 2
    _, cp = plan_item(glued, sp, encode, 1 << 20, "prefix", "", index, None)
    assert cp[PLAN_KEY].chunk_spans == ()
    # without the index (the server's default) the glued text is not split at them, whatever was sent
    _, cp = plan_item(glued, sp, encode, 1 << 20, "prefix", "", None, "t")
    assert cp[PLAN_KEY].chunk_spans == ()
    # prefix requests neither find nor remember
    assert plan_item(text, {}, encode, 1 << 20, "prefix", "", index, "u") is None and len(index) == 2
    # a client's marks are never remembered: they change no other prompt's chunks
    marked = {"custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": [0, len(DOCS[3]) + 5]}}
    plan_item(DOCS[3] + " tail Q?", marked, encode, 1 << 20, "prefix", "", index, "t")
    assert len(index) == 2


def test_a_marked_fragment_never_changes_another_prompts_chunks(tokenizer):
    """Issue 46 item 3, the reproduction: an unsalted client marks a fragment of a document that
    starts mid-word; another unsalted prompt holding that document chunks exactly as before, with
    the index off (the default) and on, and its chunks start and end on its token boundaries."""

    def encode(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    def boundaries_of(text: str) -> list[int]:
        return prompt_boundaries(tokenizer, text)

    sp = {"custom_params": {"relaxkv_policy": "pic"}}
    prompt = "You answer from the documents.\n\n" + "\n\n".join(DOCS[:3]) + "\n\nWhich one is about the harbor?"
    fragment = DOCS[1][3:]  # starts inside the document's first word
    other = {"custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": [6, 6 + len(fragment)]}}
    for index in (None, DocumentIndex()):
        before = plan_item(prompt, sp, encode, 1 << 20, "prefix", "", index, None, boundaries_of)
        plan_item("Text: " + fragment + " and more text after it.", other, encode, 1 << 20, "prefix", "", index,
                  None, boundaries_of)
        after = plan_item(prompt, sp, encode, 1 << 20, "prefix", "", index, None, boundaries_of)
        assert after == before and len(before[1][PLAN_KEY].chunk_spans) == 3
    spans = discover_chunks(prompt, None, None, boundaries=boundaries_of(prompt))
    assert [prompt[s:e] for s, e in spans] == DOCS[:3]


# ------------------------------------------------------------------ token boundaries


def test_token_boundaries_are_the_offsets_no_token_straddles():
    assert token_boundaries([(0, 2), (2, 5), (5, 6)], 6) == [0, 2, 5, 6]
    # a special token the tokenizer added has an empty span; a gap (a trimmed space) leaves both ends
    assert token_boundaries([(0, 0), (0, 3), (4, 7)], 8) == [0, 3, 4, 7, 8]
    # byte-fallback tokens share one character's span; a token inside another is no boundary
    assert token_boundaries([(0, 3), (1, 2), (3, 4), (3, 4), (4, 6)], 6) == [0, 3, 4, 6]
    assert token_boundaries([], 5) == [0, 5]


def test_prompt_boundaries_are_the_tokenizations_own(tokenizer):
    """Every boundary ends one token of the prompt's tokenization and starts the next (the tiny
    model's small vocabulary cuts words into several tokens: its boundaries fall inside words)."""
    text = "<|im_start|>system\nAnswer from these.<|im_end|>\n<|im_start|>user\nWhere is the harbor?"
    spans = [(s, e) for s, e in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
             if s < e]
    bounds = prompt_boundaries(tokenizer, text)
    assert bounds == sorted({0, len(text)} | {s for s, _ in spans} | {e for _, e in spans})
    assert all(a <= b for (_, a), (b, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-0.5b"])
def test_prompt_boundaries_never_cut_a_word_or_a_special_token(model):
    """With a real vocabulary (skipped where the model is not prepared: nothing is downloaded)."""
    from relaxkv_sglang import assets

    folder = assets.cache_root() / "models" / model
    if not folder.is_dir() or assets.manifest_problem(folder) is not None:
        pytest.skip(f"{model} is not prepared here (relaxkv-sglang model {model})")
    tok = assets.load_tokenizer(folder)
    text = "<|im_start|>system\nAnswer from these.<|im_end|>\n<|im_start|>user\nWhere is the harbor?"
    bounds = prompt_boundaries(tok, text)
    for piece in ("Answer", "harbor", "<|im_start|>", "<|im_end|>"):
        at = text.index(piece)
        assert not any(at < b < at + len(piece) for b in bounds), piece
    # the documents of a [n] list: their first word's token takes the space before it, so each chunk
    # starts with that space and keeps the word (issue 57; where a stop and the newline after it are
    # one token, as in Qwen's vocabulary, it ends before the stop): the document, or all but its stop
    listing = "Documents:\n" + "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(DOCS[:3])) + "\n\nQuestion: what?"
    bounds = prompt_boundaries(tok, listing)
    chunks = discover_chunks(listing, None, None, boundaries=bounds)
    assert len(chunks) == 3 and set(x for span in chunks for x in span) <= set(bounds)
    for (s, e), doc in zip(chunks, DOCS):
        kept = listing[s:e].strip()
        assert doc.startswith(kept) and len(kept) >= len(doc) - 1, (listing[s:e], doc)


def test_a_tokenizer_without_offsets_discovers_nothing(tokenizer):
    text = "<|im_start|>system\nAnswer from these.<|im_end|>"

    class Slow:  # a tokenizer without offsets (a slow HF tokenizer): nothing is discovered
        def __call__(self, *args, **kwargs):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")

    assert prompt_boundaries(Slow(), text) is None
    encode = lambda t, special: tokenizer.encode(t, add_special_tokens=special)  # noqa: E731
    sp = {"custom_params": {"relaxkv_policy": "pic"}}
    structured = "Sys.\n\n" + "\n\n".join(DOCS[:2]) + "\n\nQ?"
    _, cp = plan_item(structured, sp, encode, 1 << 20, "prefix", "", None, None, lambda t: None)
    assert cp[PLAN_KEY].chunk_spans == ()


def test_candidate_spans_move_inward_to_token_boundaries():
    text = "Sys.\n\n[1] " + DOCS[0] + "\n[2] " + DOCS[1] + "\n\nQ?"
    plain = discover_chunks(text, None, None)
    assert [text[s:e] for s, e in plain] == DOCS[:2]
    # a tokenizer whose tokens take the space before a word (" The") and keep newlines apart: the
    # documents' first words start inside a token, so each chunk starts back at the space before
    # that word, keeping it (issue 57: it used to start after it)
    spaces, newlines = ({i for i, c in enumerate(text) if c == sep} for sep in " \n")
    bounds = sorted({0, len(text)} | spaces | newlines | {i + 1 for i in newlines})
    spans = discover_chunks(text, None, None, boundaries=bounds)
    assert spans == [(s - 1, e) for s, e in plain]
    # boundaries that leave less than min_chunk_chars of a candidate drop it
    assert discover_chunks(text, None, None, boundaries=[0, 20, len(text)]) == []
    # a known document must start and end on boundaries too
    index = DocumentIndex()
    index.remember(None, DOCS[2:3])
    glued = "Sys: xx" + DOCS[2] + " Q?"
    at = glued.index(DOCS[2])
    assert index.find(glued, None) == [(at, at + len(DOCS[2]))]
    assert index.find(glued, None, boundaries=[0, at - 2, at + len(DOCS[2]), len(glued)]) == []
    assert index.find(glued, None, boundaries=[0, at, at + len(DOCS[2]), len(glued)]) == [(at, at + len(DOCS[2]))]


def _whole(text: str, tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


@pytest.mark.parametrize("layout", ["numbered", "one per line"])
def test_a_space_glued_tokenizer_keeps_each_documents_first_word(tokenizer, layout):
    """Issue 57: the tiny model's byte-level BPE glues a word's leading space to it (``"ĠThe"``), so
    after ``"[3] "`` no boundary lies right before the document; its chunk starts at the space
    instead of after the first word, and holds the prompt's own tokens there."""
    text = SHAPES[layout]
    bounds = prompt_boundaries(tokenizer, text)
    spans = discover_chunks(text, None, None, boundaries=bounds)
    assert [text[s:e].strip() for s, e in spans] == DOCS
    assert set(x for span in spans for x in span) <= set(bounds)
    if layout == "numbered":
        assert all(text[s:e] == " " + d for (s, e), d in zip(spans, DOCS))
    ids, offsets = _whole(text, tokenizer)
    for s, e in spans:  # tokenized alone, a chunk has the tokens the whole prompt has there
        inside = [t for t, (a, b) in zip(ids, offsets) if s <= a and b <= e and a < b]
        assert tokenizer.encode(text[s:e], add_special_tokens=False) == inside


def test_a_document_after_any_list_number_has_the_same_chunk_ids(tokenizer, encode):
    """The same document discovered after ``"[1] "`` in one prompt and after ``"[3] "`` in another
    is one chunk: the same token ids, so its KV is reused."""
    doc, others = DOCS[2], docs(3, seed=57)
    first = "Use the sources.\n[1] " + doc + "\n[2] " + others[0] + "\nQuestion: what?"
    third = ("Sources below.\n" + "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(others[1:])) + "\n[3] " + doc
             + "\nQuestion: which?")
    sp = {"custom_params": {"relaxkv_policy": "pic"}}
    chunk_ids = []
    for text, n in ((first, 2), (third, 3)):
        ids, cp = plan_item(text, sp, encode, 1 << 20, "prefix", "", None, None,
                            lambda t: prompt_boundaries(tokenizer, t))
        chunks = [ids[s:e] for s, e in cp[PLAN_KEY].chunk_spans]
        assert len(chunks) == n
        chunk_ids.append([c for c in chunks if tokenizer.decode(c).strip() == doc])
    assert len(chunk_ids[0]) == 1 and chunk_ids[0] == chunk_ids[1]
    assert chunk_ids[0][0] == encode(" " + doc, False)


def test_the_start_moves_back_neither_into_a_known_document_nor_out_of_its_region(tokenizer):
    """Moving back over whitespace stops at the end of a known document before it and at the start
    of its region (a chat message's content)."""
    # a known document right before a new one: the new one starts where the known one ends
    index = DocumentIndex()
    index.remember(None, [DOCS[0]])
    text = "Sys.\n\n" + DOCS[0] + " " + DOCS[1] + "\n\nQ?"
    bounds = prompt_boundaries(tokenizer, text)
    spans = discover_chunks(text, index, None, boundaries=bounds)
    at = text.index(DOCS[0])
    assert spans == [(at, at + len(DOCS[0])), (at + len(DOCS[0]), at + len(DOCS[0]) + 1 + len(DOCS[1]))]
    # a region starting right after the space: the chunk stays inside it (its first word's token
    # starts before the region, so the chunk starts after that word)
    head = "First message, its own paragraph of text here.\n\n" + DOCS[2]
    text = head + "\n\n " + DOCS[3] + "\n\nWhich one?"
    at = text.index(DOCS[3])
    regions = [(0, len(head)), (at, len(text))]
    bounds = prompt_boundaries(tokenizer, text)
    assert at not in bounds and at - 1 in bounds
    spans = discover_chunks(text, None, None, regions=regions, boundaries=bounds)
    assert spans[-1][0] >= at and text[spans[-1][0]:spans[-1][1]] in DOCS[3]
    without = discover_chunks(text, None, None, boundaries=bounds)
    assert text[without[-1][0]:without[-1][1]] == " " + DOCS[3]


# ------------------------------------------------------------------ the index's server setting and flush


def test_the_index_is_off_unless_the_server_turns_it_on(settings_env):
    class TokenizerManager:
        pass

    tm = TokenizerManager()
    settings_env(RELAXKV_DISCOVERY_INDEX=None)
    assert api.document_index(tm) is None
    settings_env(RELAXKV_DISCOVERY_INDEX="0")
    assert api.document_index(tm) is None
    settings_env(RELAXKV_DISCOVERY_INDEX="1")
    index = api.document_index(tm)
    assert isinstance(index, DocumentIndex) and api.document_index(tm) is index
    settings_env(RELAXKV_DISCOVERY_INDEX="maybe")
    with pytest.raises(SystemExit, match="RELAXKV_DISCOVERY_INDEX='maybe': must be 1 or 0"):
        api.document_index(tm)

    class Result:
        def __init__(self, success: bool) -> None:
            self.success = success

    async def flush(manager, timeout_s=None, success=True):
        return Result(success)

    settings_env(RELAXKV_DISCOVERY_INDEX="1")
    index.remember(None, DOCS[:2])
    asyncio.run(api.around_flush_cache(flush, tm, timeout_s=1.0, success=False))  # refused (busy): kept
    assert len(index) == 2
    assert asyncio.run(api.around_flush_cache(flush, tm, timeout_s=1.0)).success and len(index) == 0


def test_item_namespace_reads_sglangs_fields():
    class Obj:
        extra_key, cache_salt = ["a", ""], "s"

    assert item_namespace(Obj(), 0) == "1:a\x1fs" and item_namespace(Obj(), 1) == "0:\x1fs"
    assert item_namespace(object()) is None


# ------------------------------------------------------------------ never a wrong reuse (property test)

SEPARATORS = ("\n\n", "\n", " ", "", "\n---------------------\n", "\n[2] ", "\nDocument 3: ", "<doc>", "</doc>\n",
              "\nfile_path: /a.txt\n", ": ")
BASE = docs(6, seed=7)
POOL = BASE + [
    BASE[0][:40] + "Z" + BASE[0][41:],          # near-duplicate of BASE[0]
    BASE[1][len(BASE[1]) // 2:] + " " + BASE[2][: len(BASE[2]) // 2],  # overlaps BASE[1] and BASE[2]
    BASE[3][20:120],                            # inside BASE[3]
    BASE[4] + " " + BASE[5],                    # two documents as one
]


@st.composite
def requests_(draw):
    """A prompt of pool documents (some split across two messages), its chat regions, its tenant."""
    n = draw(st.integers(1, 5))
    picked = draw(st.lists(st.sampled_from(POOL), min_size=n, max_size=n))
    seps = draw(st.lists(st.sampled_from(SEPARATORS), min_size=n + 1, max_size=n + 1))
    chat = draw(st.booleans())
    markup = draw(st.sampled_from(["", "\n<|user|>\n", "<|im_end|><|im_start|>user\n"]))
    split_at = draw(st.integers(0, n - 1)) if chat and draw(st.booleans()) else None
    text, regions, start = "Answer from these." + seps[0], [], 0
    for i, doc in enumerate(picked):
        if i == split_at:  # this document's second half goes into the next message
            half = len(doc) // 2
            text += doc[:half]
            regions.append((start, len(text)))
            text += markup
            start = len(text)
            text += doc[half:] + seps[i + 1]
        else:
            text += doc + seps[i + 1]
    text += "Which one is about the harbor?"
    regions.append((start, len(text)))
    return text, (regions if chat else None), draw(st.sampled_from([None, "tenant-a", "tenant-b"]))


@pytest.fixture(scope="module")
def encode(tokenizer):
    def enc(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    return enc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(requests_(), min_size=2, max_size=6))
def test_no_discovered_chunk_is_served_as_another_texts_kv(encode, tokenizer, trace):
    """Each request is planned as the server plans it (with the index on; chat: as chat.py
    discovers and remembers, then marks); a model chunk store keyed like the real one
    ((namespace, token ids) -> the text its KV was computed from) never serves a chunk computed
    from another text; every chunk is exactly the text at its span, tokenized on its own, inside
    one message, starting and ending on a token boundary of the prompt; a chunk found by the index
    is one its own tenant discovered before; without the index a prompt plans the same at any
    point of the trace."""
    index, store, discovered = DocumentIndex(), {}, {}

    def boundaries_of(text: str) -> list[int]:
        return prompt_boundaries(tokenizer, text)

    def plan_alone(text: str, ns):
        return plan_item(text, {"custom_params": {"relaxkv_policy": "pic"}}, encode, 1 << 20, "prefix", "", None, ns,
                         boundaries_of)

    alone = [plan_alone(text, ns) for text, regions, ns in trace if regions is None]
    for text, regions, ns in trace:
        bounds = boundaries_of(text)
        structural = discover_chunks(text, None, ns, regions=regions, boundaries=bounds)
        spans = discover_chunks(text, index, ns, regions=regions, boundaries=bounds)
        for s, e in spans:
            assert regions is None or any(rs <= s and e <= re_ for rs, re_ in regions), "a chunk crosses messages"
            assert _on_boundaries(bounds, s, e), "a chunk cuts a token"
            inside_block = any(bs <= s and e <= be for bs, be in structural)
            assert inside_block or text[s:e] in discovered.get(ns, set()), "found from another tenant's documents"
        if regions is None:  # the native path plans unmarked text itself
            ids, cp = plan_item(text, {"custom_params": {"relaxkv_policy": "pic"}}, encode, 1 << 20, "prefix", "",
                                index, ns, boundaries_of)
        else:  # chat: the offsets found are remembered, then become relaxkv_chunks
            index.remember(ns, [text[s:e] for s, e in spans])
            flat = [x for span in spans for x in span]
            ids, cp = plan_item(text, {"custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": flat}}, encode,
                                1 << 20, "prefix", "", index, ns, boundaries_of)
        segments = split_text(text, spans if text[spans[-1][1]:] else spans[:-1]) if spans else split_text(text, [])
        layout = tokenize_parts(segments, encode)
        assert ids == layout.input_ids
        assert list(cp[PLAN_KEY].chunk_spans) == [tuple(span) for span in layout.chunk_spans]
        for chunk_text, (ts, te) in zip(segments.chunks, layout.chunk_spans):
            key = (ns, tuple(ids[ts:te]))
            assert list(key[1]) == encode(chunk_text, False)
            assert store.setdefault(key, chunk_text) == chunk_text, "a chunk reused another text's KV"
            discovered.setdefault(ns, set()).add(chunk_text)
    assert [plan_alone(text, ns) for text, regions, ns in trace if regions is None] == alone


def _on_boundaries(bounds: list[int], *offsets: int) -> bool:
    return set(offsets) <= set(bounds)
