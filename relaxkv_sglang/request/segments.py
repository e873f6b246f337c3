"""How a prompt splits into ``prefix chunk (glue chunk)* ... query``, in text and in tokens.

``prefix`` (system prompt, template header) and ``query`` (question, generation suffix) are always
present, maybe empty; only the prefix is tokenized with special tokens. A ``chunk`` is a document whose
KV is cached and reused position-independently; ``glue``, non-empty text between two chunks, is
prefilled with its request, never cached. The parts' texts concatenate to the prompt exactly. Each part
is tokenized alone, so a chunk's text yields the same ids wherever it appears (ids at part boundaries
may differ from the whole text's: the full-prefill baseline must use the same ``input_ids``).
Standard library only.
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
    """The server answers HTTP 400; ``message`` names the offending pair."""

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
    """The client's untrusted ``[s0, e0, s1, e1, ...]`` as spans ``text[s:e]``, in code points (not bytes
    or UTF-16 units). A list or tuple of at most ``max_chunks`` pairs of ``int`` (``bool``, ``3.0``
    rejected), ``0 <= s < e <= len(text)``, sorted, disjoint (touching allowed); else
    :class:`ChunkSpecError` on the first violation."""
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
    # The count before the elements: a huge list is rejected cheaply.
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
    kind: PartKind
    text: str


@dataclass(frozen=True)
class TextSegments:
    """Invariants: ``parts[0]`` the prefix, ``parts[-1]`` the query (both maybe empty), chunks and
    non-empty glue in between (none between adjacent chunks); the texts join to the prompt."""

    parts: tuple[Part, ...]

    @property
    def prefix(self) -> str:
        return self.parts[0].text

    @property
    def query(self) -> str:
        return self.parts[-1].text

    @property
    def chunks(self) -> tuple[str, ...]:
        return tuple(p.text for p in self.parts if p.kind == "chunk")

    @property
    def text(self) -> str:
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
    """``spans``: sorted, disjoint, non-empty code-point spans (else ValueError). With none the whole
    text is the prefix, so tokenizing it equals ``encode(text, True)``."""
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


# Paragraphs end at a run holding >= 2 "\n"; runs, not a newline pattern, keep this linear.
_WS_RUN = re.compile(r"\s+")


def auto_chunk(text: str, *, min_chunk_chars: int = 64) -> list[tuple[int, int]]:
    """Spans for ``split_text``: paragraphs between blank lines (whitespace runs holding two ``"\\n"``),
    each of ``min_chunk_chars`` code points, but the first (prefix) and the last (query). A paragraph
    between blank lines yields the same chunk in every prompt; one glued to the template by a single
    newline is not cached."""
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
    """A prompt's token ids and where each part lies in them: ``chunk_spans`` ``[start, end)`` per chunk;
    ``query_start`` the first token after the last chunk (``prefix_len`` without chunks);
    ``part_spans`` ``(kind, start, end)`` per part, covering ``input_ids`` exactly."""

    input_ids: list[int]
    chunk_spans: list[tuple[int, int]]
    prefix_len: int = 0
    query_start: int = 0
    part_spans: list[tuple[str, int, int]] = field(default_factory=list)


def tokenize_parts(
    parts: TextSegments | Iterable[Part],
    encode: Callable[[str, bool], list[int]],
) -> TokenLayout:
    """Each part encoded alone (``encode(text, add_special_tokens)``; special tokens for the prefix only,
    even empty) and concatenated, so a chunk's text always yields the ids the chunk store keys on.
    ValueError: a malformed part order, or a chunk of no tokens (it could not be cached or located)."""
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
        query_start = chunk_spans[-1][1] if chunk_spans else prefix_len
    return TokenLayout(
        input_ids=input_ids,
        chunk_spans=chunk_spans,
        prefix_len=prefix_len,
        query_start=query_start,
        part_spans=part_spans,
    )


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """A binary search over slice comparisons, so long texts compare at C speed.

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
