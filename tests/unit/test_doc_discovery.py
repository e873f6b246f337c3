"""Chunk discovery in unmarked prompts: the block rules, the document index, and a property test
that no discovered chunk is ever served as another text's KV (core/doc_blocks.py,
core/doc_index.py, srt/api.py::plan_item)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaxkv_sglang.core.doc_blocks import candidate_spans, find_blocks
from relaxkv_sglang.core.doc_index import DocumentIndex, discover_chunks
from relaxkv_sglang.core.segments import split_text, tokenize_parts
from relaxkv_sglang.schema import CHUNKS
from relaxkv_sglang.srt.api import item_namespace, plan_item

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
    same = ["Shared opening words here " + "and then a different tail number %d " % i * 3 for i in range(3)]
    index = DocumentIndex(max_per_key=2)
    index.remember(None, same)
    assert len(index) == 2 and index.chars == len(same[1]) + len(same[2])
    small = DocumentIndex(max_chars=len(DOCS[0]) + len(DOCS[1]))
    small.remember("t", DOCS[:3])
    assert len(small) == 2 and small.chars <= len(DOCS[0]) + len(DOCS[1])


def test_plan_item_remembers_its_chunks_per_namespace():
    index = DocumentIndex()

    def encode(text: str, special: bool) -> list[int]:
        return ([1] if special else []) + [ord(c) for c in text]

    sp = {"custom_params": {"relaxkv_policy": "pic"}}
    text = "Sys.\n\n" + "\n\n".join(DOCS[:2]) + "\n\nQ?"
    ids, cp = plan_item(text, sp, encode, 1 << 20, "prefix", "", index, "t")
    assert len(cp[CHUNKS.plan_key]) == 4 and len(index) == 2
    # the same documents glued to other text are found in the same namespace only
    glued = "Sys: " + DOCS[1] + " " + DOCS[0] + " Q?"
    _, cp = plan_item(glued, sp, encode, 1 << 20, "prefix", "", index, "t")
    assert len(cp[CHUNKS.plan_key]) == 4
    _, cp = plan_item(glued, sp, encode, 1 << 20, "prefix", "", index, None)
    assert cp[CHUNKS.plan_key] == []
    # prefix requests neither find nor remember
    assert plan_item(text, {}, encode, 1 << 20, "prefix", "", index, "u") is None and len(index) == 2


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
def test_no_discovered_chunk_is_served_as_another_texts_kv(encode, trace):
    """Each request is planned as the server plans it; a model chunk store keyed like the real one
    ((namespace, token ids) -> the text its KV was computed from) never serves a chunk computed
    from another text; every chunk is exactly the text at its span, tokenized on its own, inside
    one message; a chunk found by the index is one its own tenant planned before."""
    index, store, planned = DocumentIndex(), {}, {}
    for text, regions, ns in trace:
        structural = discover_chunks(text, None, ns, regions=regions)
        spans = discover_chunks(text, index, ns, regions=regions)
        for s, e in spans:
            assert regions is None or any(rs <= s and e <= re_ for rs, re_ in regions), "a chunk crosses messages"
            inside_block = any(bs <= s and e <= be for bs, be in structural)
            assert inside_block or text[s:e] in planned.get(ns, set()), "found from another tenant's documents"
        if regions is None:  # the native path plans unmarked text itself
            ids, cp = plan_item(text, {"custom_params": {"relaxkv_policy": "pic"}}, encode, 1 << 20, "prefix", "",
                                index, ns)
        else:  # chat: the offsets found become relaxkv_chunks
            flat = [x for span in spans for x in span]
            ids, cp = plan_item(text, {"custom_params": {"relaxkv_policy": "pic", "relaxkv_chunks": flat}}, encode,
                                1 << 20, "prefix", "", index, ns)
        segments = split_text(text, spans if text[spans[-1][1]:] else spans[:-1]) if spans else split_text(text, [])
        layout = tokenize_parts(segments, encode)
        assert ids == layout.input_ids
        token_spans = cp[CHUNKS.plan_key]
        assert list(zip(token_spans[::2], token_spans[1::2])) == layout.chunk_spans
        for chunk_text, (ts, te) in zip(segments.chunks, layout.chunk_spans):
            key = (ns, tuple(ids[ts:te]))
            assert list(key[1]) == encode(chunk_text, False)
            assert store.setdefault(key, chunk_text) == chunk_text, "a chunk reused another text's KV"
            planned.setdefault(ns, set()).add(chunk_text)
