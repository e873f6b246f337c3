"""How a prompt splits into prefix / chunks / glue / query, in text and in tokens.

A prompt is an ordered sequence of parts::

    prefix  chunk (glue chunk)* ... query

* ``prefix``: text before the first chunk (system prompt, template header).
  Always present, possibly empty; the only part tokenized with special tokens.
* ``chunk``: a document whose KV is cached and reused position-independently.
* ``glue``: non-empty text between two chunks (separators, short paragraphs).
  Prefilled normally with its request; never cached as a chunk.
* ``query``: text after the last chunk (question + generation suffix).  Always
  present, possibly empty.

Concatenating all parts' text gives back the original text exactly.  Each part
is tokenized on its own, so the same chunk text always yields the same token
ids wherever it appears (the price: ids at part boundaries can differ from
tokenizing the whole text at once; the full-prefill baseline must use the same
``input_ids`` to be comparable).

This module imports only the standard library (torch is not needed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Sequence

__all__ = [
    "ChunkSpecError",
    "parse_chunk_offsets",
    "Part",
    "PartKind",
    "TextSegments",
    "split_text",
    "auto_chunk",
    "TokenLayout",
    "tokenize_parts",
    "common_prefix_len",
]

PartKind = Literal["prefix", "chunk", "glue", "query"]


class ChunkSpecError(ValueError):
    """A client-supplied chunk specification is invalid (the server answers HTTP 400).

    Attributes:
        field: the request field at fault, e.g. ``"relaxkv_chunks"``.
        message: what is wrong, naming the offending pair/index.
    """

    def __init__(self, message: str, *, field: str = "relaxkv_chunks") -> None:
        super().__init__(f"invalid {field}: {message}")
        self.field = field
        self.message = message


def _short_repr(value: object, limit: int = 40) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def parse_chunk_offsets(
    text: str,
    offsets: object,
    *,
    field: str = "relaxkv_chunks",
    max_chunks: int = 1024,
) -> list[tuple[int, int]]:
    """Validate a flat list of character offsets ``[s0, e0, s1, e1, ...]`` into chunk spans.

    Offsets are Python ``str`` indices, i.e. Unicode code points (not bytes, not
    UTF-16 units).  Each pair is a half-open span ``text[s:e]``.

    Rules: a list (or tuple); even length; at most ``max_chunks`` pairs; every
    value an ``int`` (``bool`` and ``float`` rejected, even ``3.0``);
    ``0 <= s < e <= len(text)`` (no empty chunks); pairs sorted and
    non-overlapping (``e_i <= s_{i+1}``; touching chunks are allowed).

    Args:
        text: the prompt the offsets index into.
        offsets: the client's value (untrusted).
        field: request field name used in errors.
        max_chunks: largest number of pairs accepted.

    Returns:
        ``[(s0, e0), (s1, e1), ...]``; ``[]`` for an empty list.

    Raises:
        ChunkSpecError: on the first violation, naming the pair and the offsets' indices.
    """
    if not isinstance(offsets, (list, tuple)):
        raise ChunkSpecError(
            "must be a list of integer character offsets [start0, end0, start1, end1, ...], "
            f"got {type(offsets).__name__}",
            field=field,
        )
    if len(offsets) % 2:
        raise ChunkSpecError(
            f"must hold start/end pairs (an even number of offsets), got {len(offsets)} offsets",
            field=field,
        )
    # Check the count before touching elements so a huge list is rejected cheaply.
    if len(offsets) // 2 > max_chunks:
        raise ChunkSpecError(
            f"at most {max_chunks} chunks allowed, got {len(offsets) // 2}", field=field
        )
    for i, v in enumerate(offsets):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ChunkSpecError(
                f"offset at index {i} must be an integer, got {_short_repr(v)}", field=field
            )
    n = len(text)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for k in range(len(offsets) // 2):
        s, e = offsets[2 * k], offsets[2 * k + 1]
        where = f"chunk {k} (offsets[{2 * k}], offsets[{2 * k + 1}]) = ({s}, {e})"
        if s < 0:
            raise ChunkSpecError(f"{where}: start is negative", field=field)
        if e > n:
            raise ChunkSpecError(f"{where}: end is past the end of the text ({n} characters)", field=field)
        if s >= e:
            raise ChunkSpecError(f"{where}: start must be < end (empty or reversed chunk)", field=field)
        if s < prev_end:
            raise ChunkSpecError(
                f"{where}: overlaps or precedes chunk {k - 1}, which ends at {prev_end}; "
                "chunks must be sorted and non-overlapping",
                field=field,
            )
        spans.append((s, e))
        prev_end = e
    return spans


@dataclass(frozen=True)
class Part:
    """One piece of a prompt: ``kind`` is "prefix", "chunk", "glue" or "query"."""

    kind: PartKind
    text: str


@dataclass(frozen=True)
class TextSegments:
    """A prompt as ordered parts.

    Invariants: ``parts[0]`` is the (possibly empty) prefix, ``parts[-1]`` the
    (possibly empty) query, chunks and non-empty glue alternate in between
    (adjacent chunks have no glue between them), and ``"".join(p.text for p in
    parts)`` is the original text.
    """

    parts: tuple[Part, ...]

    @property
    def prefix(self) -> str:
        """Text before the first chunk."""
        return self.parts[0].text

    @property
    def query(self) -> str:
        """Text after the last chunk."""
        return self.parts[-1].text

    @property
    def chunks(self) -> tuple[str, ...]:
        """Chunk texts in prompt order."""
        return tuple(p.text for p in self.parts if p.kind == "chunk")

    @property
    def text(self) -> str:
        """The original prompt (all parts concatenated)."""
        return "".join(p.text for p in self.parts)


def _check_spans(n: int, spans: Sequence[tuple[int, int]]) -> None:
    prev = 0
    for k, (s, e) in enumerate(spans):
        if not (prev <= s < e <= n):
            raise ValueError(
                f"span {k} = ({s}, {e}) is empty, out of [0, {n}] or overlaps the previous one"
            )
        prev = e


def split_text(text: str, spans: Sequence[tuple[int, int]]) -> TextSegments:
    """Split ``text`` into prefix / chunk / glue / query parts.

    Args:
        text: the prompt.
        spans: sorted, non-overlapping, non-empty ``(start, end)`` code-point
            spans, e.g. from ``parse_chunk_offsets`` or ``auto_chunk``.

    Returns:
        The segments.  With no spans the whole text is the prefix and the query
        is empty, so tokenizing it equals an ordinary ``encode(text, True)``.

    Raises:
        ValueError: spans that are empty, unsorted, overlapping or out of range.
    """
    _check_spans(len(text), spans)
    if not spans:
        return TextSegments((Part("prefix", text), Part("query", "")))
    parts = [Part("prefix", text[: spans[0][0]])]
    for k, (s, e) in enumerate(spans):
        if k > 0 and s > spans[k - 1][1]:
            parts.append(Part("glue", text[spans[k - 1][1] : s]))
        parts.append(Part("chunk", text[s:e]))
    parts.append(Part("query", text[spans[-1][1] :]))
    return TextSegments(tuple(parts))


# A maximal whitespace run; it separates paragraphs when it holds >= 2 "\n".
# Matching runs and counting newlines keeps this linear on adversarial input.
_WS_RUN = re.compile(r"\s+")


def auto_chunk(text: str, *, min_chunk_chars: int = 64) -> list[tuple[int, int]]:
    """Content-defined chunking for prompts without explicit chunk marks.

    Rule:

    1. A *separator* is a maximal run of whitespace characters (``re`` ``\\s``,
       Unicode) containing at least two ``"\\n"`` (i.e. a blank line; ``"\\r\\n\\r\\n"``
       and lines holding only spaces count).
    2. *Paragraphs* are the non-empty pieces of text between separators (an empty
       piece before a leading / after a trailing separator is not a paragraph).
       Because separators are maximal whitespace runs, every paragraph except
       possibly the first and last starts and ends with non-whitespace.
    3. The first paragraph is the prefix and the last is the query; they are
       never chunks.  Each paragraph in between with at least ``min_chunk_chars``
       code points becomes one chunk, spanning exactly the paragraph (no
       surrounding whitespace).  Separators and shorter paragraphs become glue
       (or fall into the prefix/query when before the first / after the last chunk).
    4. Fewer than 3 paragraphs: no chunks, ``[]``.

    So a paragraph appearing between blank lines in two prompts yields the same
    chunk text in both, whatever precedes or follows it.  Documents not
    separated by blank lines from the system prompt or the question (e.g. glued
    to a chat-template header by a single newline) become part of the prefix or
    query and are not cached.

    Args:
        text: the prompt.
        min_chunk_chars: shortest paragraph (in code points) worth caching; >= 1.

    Returns:
        Sorted, non-overlapping ``(start, end)`` code-point spans, usable by ``split_text``.
    """
    if min_chunk_chars < 1:
        raise ValueError(f"min_chunk_chars must be >= 1, got {min_chunk_chars}")
    paragraphs: list[tuple[int, int]] = []
    pos = 0
    for m in _WS_RUN.finditer(text):
        if text.count("\n", m.start(), m.end()) < 2:
            continue
        if m.start() > pos:
            paragraphs.append((pos, m.start()))
        pos = m.end()
    if pos < len(text):
        paragraphs.append((pos, len(text)))
    if len(paragraphs) < 3:
        return []
    return [(s, e) for s, e in paragraphs[1:-1] if e - s >= min_chunk_chars]


@dataclass
class TokenLayout:
    """A prompt's token ids and where each part lies in them.

    Attributes:
        input_ids: the whole prompt's token ids.
        chunk_spans: ``[start, end)`` token index spans of each chunk in ``input_ids``,
            in prompt order.
        prefix_len: number of tokens before the first chunk (the prefix's tokens).
        query_start: index of the first token after the last chunk (the query's
            first token; equals ``len(input_ids)`` when the query is empty).  With
            no chunks it equals ``prefix_len``.
        part_spans: ``(kind, start, end)`` for every part, in order, covering
            ``input_ids`` exactly (empty spans possible for empty prefix/query).
    """

    input_ids: list[int]
    chunk_spans: list[tuple[int, int]]
    prefix_len: int = 0
    query_start: int = 0
    part_spans: list[tuple[str, int, int]] = field(default_factory=list)


def tokenize_parts(
    parts: TextSegments | Iterable[Part],
    encode: Callable[[str, bool], list[int]],
) -> TokenLayout:
    """Tokenize each part on its own and concatenate.

    The prefix is encoded with ``add_special_tokens=True`` (so a tokenizer's BOS
    is kept; an empty prefix still gets them, ``encode("", True)``); every
    other part with ``False``.  The same chunk text therefore always yields the
    same ids, which is what the chunk store keys on.

    Args:
        parts: a ``TextSegments`` or its parts; the first must be the only
            "prefix" part and a "query" part, if any, must be last.
        encode: ``encode(text, add_special_tokens) -> list[int]``, e.g.
            ``lambda t, s: tokenizer.encode(t, add_special_tokens=s)``.

    Returns:
        The layout.

    Raises:
        ValueError: malformed part order, or a chunk that encodes to no tokens
            (it could not be cached or located).
    """
    plist = list(parts.parts if isinstance(parts, TextSegments) else parts)
    if not plist or plist[0].kind != "prefix":
        raise ValueError("parts must start with a 'prefix' part")
    for i, p in enumerate(plist):
        if p.kind not in ("prefix", "chunk", "glue", "query"):
            raise ValueError(f"part {i} has unknown kind {p.kind!r}")
        if p.kind == "prefix" and i != 0:
            raise ValueError(f"part {i}: only the first part may be the prefix")
        if p.kind == "query" and i != len(plist) - 1:
            raise ValueError(f"part {i}: the query part must be last")
    input_ids: list[int] = []
    chunk_spans: list[tuple[int, int]] = []
    part_spans: list[tuple[str, int, int]] = []
    prefix_len = 0
    query_start = None
    for i, p in enumerate(plist):
        ids = list(encode(p.text, i == 0))
        start = len(input_ids)
        input_ids.extend(ids)
        end = len(input_ids)
        part_spans.append((p.kind, start, end))
        if p.kind == "prefix":
            prefix_len = end
        elif p.kind == "chunk":
            if end == start:
                raise ValueError(f"part {i}: chunk {_short_repr(p.text)} encodes to no tokens")
            chunk_spans.append((start, end))
        elif p.kind == "query":
            query_start = start
    if query_start is None:
        # No query part: "after the last chunk" is the end of the tokens after it.
        query_start = chunk_spans[-1][1] if chunk_spans else prefix_len
    return TokenLayout(
        input_ids=input_ids,
        chunk_spans=chunk_spans,
        prefix_len=prefix_len,
        query_start=query_start,
        part_spans=part_spans,
    )


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` share (two texts, two token id lists).

    A binary search over slice comparisons, so long texts compare at C speed.

        >>> common_prefix_len("Sys A.", "Sys B."), common_prefix_len([1, 2, 3], [1, 2])
        (4, 2)
    """
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
