"""Unit tests for relaxkv_sglang.request.segments."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaxkv_sglang.request.segments import (
    ChunkSpecError,
    Part,
    TextSegments,
    TokenLayout,
    auto_chunk,
    common_prefix_len,
    parse_chunk_offsets,
    split_text,
    tokenize_parts,
)

TEXT = "System.\n\nDoc one here.\n\nDoc two.\n\nQuestion?"


# ---------------------------------------------------------------- parse_chunk_offsets


def test_parse_valid_offsets():
    assert parse_chunk_offsets(TEXT, [9, 22, 24, 32]) == [(9, 22), (24, 32)]
    assert parse_chunk_offsets(TEXT, []) == []
    # Touching chunks and a chunk covering the whole text are fine.
    assert parse_chunk_offsets("abcdef", [0, 3, 3, 6]) == [(0, 3), (3, 6)]
    assert parse_chunk_offsets("abcdef", (0, 6)) == [(0, 6)]


def test_parse_offsets_are_code_points():
    text = "héllo 😀 wörld"
    spans = parse_chunk_offsets(text, [6, 7])
    assert text[spans[0][0] : spans[0][1]] == "😀"
    with pytest.raises(ChunkSpecError):
        parse_chunk_offsets(text, [0, len(text) + 1])


@pytest.mark.parametrize(
    "offsets, fragment",
    [
        ("0,5", "must be a list"),
        ({"a": 1}, "must be a list"),
        (None, "must be a list"),
        ([0, 5, 7], "even number"),
        ([0, True], "index 1 must be an integer"),
        ([0.0, 5], "index 0 must be an integer"),
        ([0, 5.0], "index 1 must be an integer"),
        ([0, "5"], "index 1 must be an integer"),
        ([-1, 5], "chunk 0 (offsets[0], offsets[1]) = (-1, 5): start is negative"),
        ([0, 5, 6, 999], "chunk 1 (offsets[2], offsets[3]) = (6, 999): end is past the end"),
        ([3, 3], "empty or reversed"),
        ([5, 2], "empty or reversed"),
        ([0, 10, 5, 12], "chunk 1 (offsets[2], offsets[3]) = (5, 12): overlaps or precedes chunk 0"),
        ([10, 12, 0, 5], "chunk 1 (offsets[2], offsets[3]) = (0, 5): overlaps or precedes chunk 0"),
        ([0, 5, 4, 8], "chunk 1 (offsets[2], offsets[3]) = (4, 8): overlaps or precedes chunk 0"),
    ],
)
def test_parse_rejects(offsets, fragment):
    with pytest.raises(ChunkSpecError) as ei:
        parse_chunk_offsets(TEXT, offsets)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.field == "relaxkv_chunks"
    assert fragment in err.message
    assert "relaxkv_chunks" in str(err)


def test_parse_max_chunks_and_field_name():
    ok = parse_chunk_offsets("abcd", [0, 1, 1, 2], max_chunks=2)
    assert ok == [(0, 1), (1, 2)]
    with pytest.raises(ChunkSpecError) as ei:
        parse_chunk_offsets("abcd", [0, 1, 1, 2, 2, 3], max_chunks=2, field="docs")
    assert ei.value.field == "docs"
    assert "at most 2 chunks" in ei.value.message


def test_parse_huge_list_rejected_before_element_checks():
    # Elements are garbage, but the count check must fire first.
    with pytest.raises(ChunkSpecError, match="at most 1024 chunks"):
        parse_chunk_offsets("x", ["bad"] * 4000)


# ---------------------------------------------------------------- split_text


def test_split_text_parts_and_glue():
    seg = split_text(TEXT, [(9, 22), (24, 32)])
    assert [p.kind for p in seg.parts] == ["prefix", "chunk", "glue", "chunk", "query"]
    assert seg.prefix == "System.\n\n"
    assert seg.chunks == ("Doc one here.", "Doc two.")
    assert seg.parts[2] == Part("glue", "\n\n")
    assert seg.query == "\n\nQuestion?"
    assert seg.text == TEXT


def test_split_text_adjacent_chunks_have_no_glue_and_edges_are_empty():
    seg = split_text("abcdef", [(0, 3), (3, 6)])
    assert seg.parts == (
        Part("prefix", ""),
        Part("chunk", "abc"),
        Part("chunk", "def"),
        Part("query", ""),
    )


def test_split_text_no_spans_is_all_prefix():
    seg = split_text("hello", [])
    assert seg.parts == (Part("prefix", "hello"), Part("query", ""))
    assert seg.chunks == ()


@pytest.mark.parametrize("spans", [[(2, 2)], [(0, 3), (2, 5)], [(0, 99)], [(-1, 2)]])
def test_split_text_rejects_bad_spans(spans):
    with pytest.raises(ValueError):
        split_text("abcdef", spans)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40), st.data())
def test_split_text_roundtrip(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8, unique=True)))
    spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    seg = split_text(text, spans)
    assert seg.text == text
    assert seg.parts[0].kind == "prefix" and seg.parts[-1].kind == "query"
    assert list(seg.chunks) == [text[s:e] for s, e in spans]
    assert all(p.text for p in seg.parts if p.kind == "glue")
    # parse_chunk_offsets accepts exactly what split_text accepts here.
    flat = [x for span in spans for x in span]
    assert parse_chunk_offsets(text, flat) == spans


# ---------------------------------------------------------------- auto_chunk

LONG_A = "Alpha document. " * 6  # 96 chars, ends with a space
LONG_B = "Bravo text about cats and dogs, with a second sentence of filler."
SHORT = "Tiny."


def test_auto_chunk_basic_rule():
    text = f"You are helpful.\n\n{LONG_A.strip()}\n\n{SHORT}\n\n{LONG_B}\n\nWhat is it?\n"
    spans = auto_chunk(text)
    chunks = [text[s:e] for s, e in spans]
    assert chunks == [LONG_A.strip(), LONG_B]
    seg = split_text(text, spans)
    assert seg.prefix == "You are helpful.\n\n"
    assert [p.text for p in seg.parts if p.kind == "glue"] == [f"\n\n{SHORT}\n\n"]
    assert seg.query == "\n\nWhat is it?\n"


def test_auto_chunk_needs_three_paragraphs():
    assert auto_chunk(f"Sys\n\n{LONG_B}") == []
    assert auto_chunk(LONG_B) == []
    assert auto_chunk("") == []
    # Leading/trailing separators do not create empty paragraphs.
    assert auto_chunk(f"\n\n\nSys\n\n{LONG_B}\n\n\n") == []


def test_auto_chunk_separator_whitespace_goes_to_glue():
    # Spaces around the blank line and CRLF blank lines are separators too.
    text = f"Sys  \r\n \r\n  {LONG_B}\t\n\n\n   Q"
    spans = auto_chunk(text)
    assert [text[s:e] for s, e in spans] == [LONG_B]
    # One newline does not separate paragraphs.
    assert auto_chunk(f"Sys\n{LONG_B}\nQ") == []


def test_auto_chunk_min_chars():
    text = f"S\n\n{'x' * 10}\n\nQ"
    assert auto_chunk(text, min_chunk_chars=10) == [(3, 13)]
    assert auto_chunk(text, min_chunk_chars=11) == []
    with pytest.raises(ValueError):
        auto_chunk(text, min_chunk_chars=0)


def test_auto_chunk_is_linear_on_adversarial_whitespace():
    import time

    text = "a" + " \n" + " " * 200_000 + "b\n\n" + LONG_B + "\n\nq"
    # CPU time of this process, not wall time: time the test spends descheduled on a loaded
    # machine does not count. Linear takes ~1 ms of CPU here (measured); a quadratic scan is
    # ~2e10 character steps, far past 1 s.
    t0 = time.process_time()
    spans = auto_chunk(text)
    assert time.process_time() - t0 < 1.0
    assert [text[s:e] for s, e in spans] == [LONG_B]


_words = st.text(alphabet="abcdefgh.,", min_size=1, max_size=8)
_line = st.lists(_words, min_size=1, max_size=6).map(" ".join)
_para = st.lists(_line, min_size=1, max_size=3).map("\n".join)
_sep = st.sampled_from(["\n\n", "\n\n\n", " \n\n ", "\r\n\r\n", "\n \n"])


@settings(max_examples=100, deadline=None)
@given(
    doc=_para.filter(lambda p: len(p) >= 16),
    before=st.lists(_para, min_size=1, max_size=3),
    after=st.lists(_para, min_size=1, max_size=3),
    seps=st.lists(_sep, min_size=8, max_size=8),
)
def test_auto_chunk_same_paragraph_same_chunk_anywhere(doc, before, after, seps):
    paras = before + [doc] + after
    text = "".join(p + seps[i % len(seps)] for i, p in enumerate(paras[:-1])) + paras[-1]
    chunks = [text[s:e] for s, e in auto_chunk(text, min_chunk_chars=16)]
    assert doc in chunks
    # Chunks never carry surrounding whitespace, and are paragraphs of the prompt.
    assert all(c == c.strip() for c in chunks)
    assert set(chunks) <= set(paras[1:-1])


# ---------------------------------------------------------------- tokenize_parts


class FakeTokenizer:
    """Char-level tokenizer with a BOS, so every id is predictable."""

    BOS = 1

    def __init__(self):
        self.calls = []

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.calls.append((text, add_special_tokens))
        ids = [1000 + ord(c) for c in text]
        return ([self.BOS] + ids) if add_special_tokens else ids


def test_tokenize_parts_layout():
    tok = FakeTokenizer()
    seg = split_text("SYS|abc..de|Q?", [(4, 7), (9, 11)])
    layout = tokenize_parts(seg, tok.encode)
    ids = layout.input_ids
    assert ids[0] == FakeTokenizer.BOS
    assert ids[1:] == [1000 + ord(c) for c in "SYS|abc..de|Q?"]
    assert layout.chunk_spans == [(5, 8), (10, 12)]
    assert [ids[s:e] for s, e in layout.chunk_spans] == [
        [1000 + ord(c) for c in "abc"],
        [1000 + ord(c) for c in "de"],
    ]
    assert layout.prefix_len == 5  # BOS + "SYS|"
    assert layout.query_start == 12
    assert layout.part_spans == [
        ("prefix", 0, 5),
        ("chunk", 5, 8),
        ("glue", 8, 10),
        ("chunk", 10, 12),
        ("query", 12, 15),
    ]
    # Only the prefix gets special tokens.
    assert [flag for _, flag in tok.calls] == [True, False, False, False, False]


def test_tokenize_parts_empty_prefix_still_gets_bos():
    tok = FakeTokenizer()
    layout = tokenize_parts(split_text("abc", [(0, 3)]), tok.encode)
    assert tok.calls[0] == ("", True)
    assert layout.input_ids == [1, 1097, 1098, 1099]
    assert layout.chunk_spans == [(1, 4)]
    assert layout.prefix_len == 1 and layout.query_start == 4


def test_tokenize_parts_no_chunks():
    tok = FakeTokenizer()
    layout = tokenize_parts(split_text("hi", []), tok.encode)
    assert layout == TokenLayout(
        input_ids=[1, 1104, 1105],
        chunk_spans=[],
        prefix_len=3,
        query_start=3,
        part_spans=[("prefix", 0, 3), ("query", 3, 3)],
    )


def test_tokenize_parts_same_chunk_same_ids_in_any_context():
    tok = FakeTokenizer()
    doc = "shared doc"
    t1 = f"sys A\n\n{doc}\n\nq1"
    t2 = f"other system\n\nfirst\n\n{doc}\n\nq2"
    l1 = tokenize_parts(split_text(t1, [(7, 7 + len(doc))]), tok.encode)
    i2 = t2.index(doc)
    l2 = tokenize_parts(split_text(t2, [(14, 19), (i2, i2 + len(doc))]), tok.encode)
    (s1, e1), (s2, e2) = l1.chunk_spans[0], l2.chunk_spans[1]
    assert l1.input_ids[s1:e1] == l2.input_ids[s2:e2]
    assert s1 != s2  # it really is at a different position


def test_tokenize_parts_accepts_part_list_and_word_tokenizer():
    """A tokenizer whose ids depend on word boundaries still yields context-free chunk ids."""

    def encode(text, add_special):
        # Word-level: merges depend on neighbours when the text is encoded whole.
        ids = [hash(w) % 997 + 10 for w in text.split(" ") if w]
        return ([2] + ids) if add_special else ids

    seg = split_text("a b c d e", [(2, 5)])
    layout = tokenize_parts(seg.parts, encode)  # a plain list of parts works too
    s, e = layout.chunk_spans[0]
    assert layout.input_ids[s:e] == encode("b c", False)
    assert layout.input_ids[0] == 2


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [Part("chunk", "x")],
        [Part("prefix", ""), Part("prefix", "")],
        [Part("prefix", ""), Part("query", "q"), Part("chunk", "x")],
        [Part("prefix", ""), Part("bogus", "x")],
    ],
)
def test_tokenize_parts_rejects_bad_structure(parts):
    with pytest.raises(ValueError):
        tokenize_parts(parts, FakeTokenizer().encode)


def test_tokenize_parts_rejects_chunk_with_no_tokens():
    def encode(text, add_special):
        return [1] if add_special else [ord(c) for c in text if not c.isspace()]

    with pytest.raises(ValueError, match="encodes to no tokens"):
        tokenize_parts(split_text("a   b", [(1, 4)]), encode)


def test_text_segments_is_frozen():
    seg = TextSegments((Part("prefix", "a"), Part("query", "")))
    with pytest.raises(Exception):
        seg.parts = ()  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=8), st.lists(st.integers(0, 2), max_size=8))
def test_common_prefix_len_counts_the_shared_leading_items_of_lists_and_texts(a, b):
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_len(a, b) == shared
    assert common_prefix_len("".join(map(str, a)), "".join(map(str, b))) == shared
