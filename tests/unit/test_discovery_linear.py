"""Chunk discovery takes time linear in the prompt, on any text (issue 46 item 6).

Discovery runs in SGLang's tokenizer manager, on the event loop every client shares, so one prompt
built to make a regex backtrack stalls every request. Three kinds of tests:

* the patterns of ``request/doc_blocks.py`` (possessive runs, trailing tags read from the reversed
  line) answer exactly as the patterns they replaced, on short lines where those are fast;
* named regressions: the inputs that took seconds before (a 24K-character line of tags took 2.2 s
  in ``_TRAIL_TAGS.search``), at 64K characters, each bounded in CPU time per character;
* a fuzz test: hypothesis draws a short unit from alphabets of tags, markers, labels, rules,
  whitespace and newlines, tiles it to ~16K characters and bounds discovery's CPU time per
  character, with and without token boundaries and the document index (derandomized: the same
  examples every run).

The bound, :data:`MAX_US_PER_CHAR`, is ~10x what discovery costs on this project's 2-core machine
when it is busy (0.1 to 0.4 us a character); a quadratic pattern at 64K characters costs 100 us a
character or more. Each timing is the best of :data:`REPEATS` runs of ``time.process_time``.
"""

from __future__ import annotations

import re
import time
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaxkv_sglang.request import doc_blocks
from relaxkv_sglang.request.doc_index import DocumentIndex, discover_chunks

MAX_US_PER_CHAR = 4.0
REPEATS = 3

# The patterns as they were before issue 46 (the reference on short lines only: _TRAIL_TAGS.search
# is quadratic in a line's length).
_TAG = r"<[^<>\n]{1,64}>"
OLD = {
    "_RULE": re.compile(r"[ \t]*(?:-{3,}|={3,}|\*{3,}|_{3,}|~{3,})[ \t]*"),
    "_HEADING": re.compile(r"[ \t]*#{1,6}[ \t]+\S.*"),
    "_META": re.compile(r"[ \t]*[A-Za-z_][\w.\-]{0,40}:(?:[ \t].*)?"),
    "_QUESTION": re.compile(rf"[ \t]*(?:{'|'.join(doc_blocks.QUESTION_KEYS)})[ \t]*:[ \t]*\S.*", re.I),
    "_TAG_LINE": re.compile(rf"[ \t]*(?:{_TAG}[ \t]*)+(?:{doc_blocks._ROLES}[ \t]*(?:{_TAG}[ \t]*)*)?", re.I),
    "_LEAD_TAGS": re.compile(rf"[ \t]*(?:{_TAG}[ \t]*)+"),
    "_MARKER": re.compile(
        rf"[ \t]*(?:[\[(]\d{{1,4}}[\])](?=\s|$)|(?:{doc_blocks._LABEL_ALT})[ \t]*(?:(?:#?\d{{1,4}}|\[\d{{1,4}}\])"
        rf"[ \t]*(?:[:.)\]\-]|$)|:))[ \t]*", re.I),
    "_SENTENCE_END": re.compile(r"[.!?\u3002\uff01\uff1f][\"'\u201d\u2019)\]]*\s*$"),
    "_NOT_TITLE_END": re.compile(r"[:,;]\s*$"),
}
OLD_TRAIL_TAGS = re.compile(rf"(?:[ \t]*{_TAG})+[ \t]*$")

PIECES = ("<a>", "</doc>", "<|im_start|>", "<doc id='1'>", "<", ">", "<" + "b" * 64 + ">", " ", "  ", "\t", "\n",
          "\n\n", "\r", "\u00a0", "user", "system", "[1]", "(2)", "Document 3:", "Source:", "file_path:", "Query:",
          "Q:", "---", "===", "***", "#", "## ", ".", "!", "?", "\u3002", '"', ")", "]", ":", ",", ";", "x", "Word",
          "the river stone", "ſource:", "\u212a")


def best_cpu_s(run: Callable[[], object]) -> float:
    """The least CPU time of :data:`REPEATS` runs, in seconds."""
    times = []
    for _ in range(REPEATS):
        t0 = time.process_time()
        run()
        times.append(time.process_time() - t0)
    return min(times)


def assert_linear(text: str, run: Callable[[], object], what: str) -> None:
    seconds = best_cpu_s(run)
    assert seconds * 1e6 / max(1, len(text)) <= MAX_US_PER_CHAR, (
        f"{what}: {seconds * 1e3:.1f} ms CPU for {len(text)} characters "
        f"({seconds * 1e6 / len(text):.2f} us a character, bound {MAX_US_PER_CHAR})")


# ------------------------------------------------------------------ the same answers as before


@settings(derandomize=True, max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([p for p in PIECES if "\n" not in p]), max_size=14))
def test_the_patterns_answer_as_before_on_short_lines(pieces):
    line = "".join(pieces)
    for name, old in OLD.items():
        new = getattr(doc_blocks, name)
        for how in ("match", "fullmatch", "search"):
            a, b = getattr(old, how)(line), getattr(new, how)(line)
            assert (a and a.span()) == (b and b.span()), (name, how, line)
    trail = OLD_TRAIL_TAGS.search(line)
    assert doc_blocks._trailing_tags(line) == (trail.start() if trail else len(line)), line


# ------------------------------------------------------------------ named regressions: what used to be slow

N = 64_000
SLOW_BEFORE = {  # name -> a prompt of about N characters that took seconds before issue 46
    "text, then a line of tags, then text": "x" + "<a>" * (N // 3) + " x",
    "text, then spaced tags": "x" + "<a> " * (N // 4) + "x",
    "text, then tab-separated tags": "x" + "\t<a>" * (N // 4) + "x",
    "a line of spaces": " " * N + "x",
    "a tag line with a role word in it": "<a>" * (N // 6) + "user" + "<a>" * (N // 6) + " x",
    "long tags": "x" + ("<" + "b" * 64 + ">") * (N // 66) + "x",
    "one character lines": "x\n" * (N // 2),
    "rule lines": "---\n" * (N // 4),
    "markers": "[1] x\n" * (N // 6),
    "metadata lines": "a: b\n" * (N // 5),
    "tag lines": "<a>\n" * (N // 4),
    "separators of two kinds": "---\n<|a|>\n" * (N // 10),
    "title lines": "Ab.\nT\n" * (N // 6),
    "stops and closers": ".)" * (N // 4) + " " * (N // 2) + "x",
}


@pytest.mark.parametrize("name", sorted(SLOW_BEFORE))
def test_what_used_to_be_slow_is_linear(name):
    text = SLOW_BEFORE[name]
    assert_linear(text, lambda: discover_chunks(text, None, None), name)
    bounds = list(range(len(text) + 1))
    assert_linear(text, lambda: discover_chunks(text, None, None, boundaries=bounds), name + " (boundaries)")


def test_the_index_bounds_its_comparisons():
    """A document whose windows match everywhere in a periodic prompt: each candidate would compare
    the whole document (quadratic); the same document's overlapping candidates are skipped and
    the characters compared are bounded by ``compare_factor`` times the prompt."""
    index = DocumentIndex()
    doc = "a " * 2000 + "b"
    index.remember(None, [doc, "a " * 1500 + "c"])
    text = "a " * (N // 2)
    assert_linear(text, lambda: index.find(text, None), "periodic prompt")
    found = index.find("Sys. " + doc + " Q", None)
    assert found == [(5, 5 + len(doc))]


# ------------------------------------------------------------------ fuzz: any text tiled to ~16K characters


@settings(derandomize=True, max_examples=40, deadline=None)
@given(unit=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12),
       with_index=st.booleans(), with_boundaries=st.booleans())
def test_discovery_is_linear_on_any_tiled_text(unit, with_index, with_boundaries):
    piece = "".join(unit)
    text = piece * max(1, 16_000 // len(piece))
    index = None
    if with_index:
        index = DocumentIndex()
        index.remember(None, [text[:200], text[100:3000], (piece * 200)[:5000]])
    bounds = list(range(0, len(text) + 1, 2)) + ([len(text)] if len(text) % 2 else []) if with_boundaries else None
    assert_linear(text, lambda: discover_chunks(text, index, None, boundaries=bounds), repr(piece))
