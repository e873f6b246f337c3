"""Chunk discovery in unmarked prompts: new documents by their structure, at token boundaries.

:func:`discover_chunks` splits a prompt that marks no documents:

1. **By structure** (always): :mod:`relaxkv_sglang.request.doc_blocks` names the blocks that are documents.
2. **Token boundaries** (in the server): a span is trimmed of whitespace, moved inward to the
   nearest *boundaries* of the prompt's own tokenization (:func:`token_boundaries`: offsets no
   token straddles), and kept if still ``min_chunk_chars`` long; so a chunk tokenized alone has the
   tokens the whole prompt has there (for tokenizers whose pieces do not depend on what precedes
   them). Where the first word's token takes the space before it (byte-level BPE's ``"ĠThe"``,
   SentencePiece's ``"▁The"``: after ``"[3] "`` no boundary lies right before ``"The"``), the start
   moves back instead, over the whitespace right before it (never past anything else, the end of a
   known or earlier chunk or the start of the chunk's region) to the nearest boundary there: the
   chunk starts with that space (``" The ..."``) and keeps its first word.
3. **Seen before** (opt-in, ``RELAXKV_DISCOVERY_INDEX=1``): :class:`DocumentIndex` holds chunks
   discovered in earlier unmarked prompts, LRU-bounded, one namespace per tenant. A document ``D``
   is filed under one window ``D[a : a + W]``, ``a >= 1`` right after a boundary character
   (:data:`BOUNDARY`). If ``D`` occurs in ``T`` at ``s``, ``T[s + a - 1]`` is a boundary character,
   so visiting every position ``p`` right after one, looking ``T[p : p + W]`` up and checking
   ``T[p - a : p - a + len(D)] == D`` on token boundaries finds it: a hit is always the stored text.
   Overlapping hits: longest first; a block overlapping a hit keeps what is left (step 2).

Without the index a prompt's chunks are a function of the prompt and tokenizer alone (the same on
every replica and restart); the index trades that for reuse where the block rules do not cut.
Cost, linear in the prompt: the block rules, one ``bisect`` per chunk end (and a look back over the
whitespace before a chunk's start, each character at most once); with the index one regex
pass and one dict lookup per boundary character, comparisons bounded by ``compare_factor`` times
the prompt's length. Standard library only.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import operator
import re
import threading
from typing import Iterable, Optional, Sequence

from relaxkv_sglang.request.doc_blocks import candidate_spans, find_blocks, trim_span

__all__ = ["BOUNDARY", "DocumentIndex", "discover_chunks", "token_boundaries"]

Span = tuple[int, int]
BOUNDARY = re.compile(r"[\s.,;:!?)\]}>\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f]")


class DocumentIndex:
    """Document texts discovered before, per namespace, found again by :meth:`find`. Thread-safe.

    Bounded: at most ``max_docs`` documents and ``max_chars`` code points in all (least recently
    used or found first out); at most ``max_per_key`` documents share one anchor window (the
    oldest leaves), so one search costs at most that many comparisons per position. A document
    is filed under the first of its anchor windows that no other document uses (documents that
    open alike, e.g. under the same ``file_path: /data/folder/`` line, are filed apart), else
    under the least used one.
    """

    def __init__(self, *, max_docs: int = 8192, max_chars: int = 16_000_000, window: int = 24,
                 max_per_key: int = 8, min_doc_chars: int = 64, compare_factor: int = 16) -> None:
        if window < 1 or max_per_key < 1 or compare_factor < 1:
            raise ValueError("window, max_per_key and compare_factor must be >= 1")
        self.max_docs, self.max_chars, self.window = max_docs, max_chars, window
        self.max_per_key, self.min_doc_chars = max_per_key, min_doc_chars
        self.compare_factor = compare_factor
        self._lock = threading.Lock()
        # (namespace, document) -> anchor offset, least recently used first
        self._docs: collections.OrderedDict[tuple[Optional[str], str], int] = collections.OrderedDict()
        self._chars = 0
        # namespace -> anchor window -> documents filed under it, oldest first
        self._keys: dict[Optional[str], dict[str, list[tuple[str, int]]]] = {}

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def chars(self) -> int:
        """Code points held."""
        return self._chars

    def clear(self) -> None:
        """Forget every document of every namespace (the server's ``/flush_cache``)."""
        with self._lock:
            self._docs.clear()
            self._keys.clear()
            self._chars = 0

    def remember(self, namespace: Optional[str], texts: Iterable[str]) -> None:
        """File each text (a chunk just discovered) under ``namespace``; a known one becomes most recent."""
        with self._lock:
            for doc in texts:
                key = (namespace, doc)
                if key in self._docs:
                    self._docs.move_to_end(key)
                    continue
                if len(doc) < self.min_doc_chars or len(doc) > self.max_chars:
                    continue
                table = self._keys.setdefault(namespace, {})
                a = self._anchor(doc, table)
                if a is None:
                    if not table:
                        del self._keys[namespace]
                    continue
                self._docs[key] = a
                self._chars += len(doc)
                bucket = table.setdefault(doc[a:a + self.window], [])
                bucket.append((doc, a))
                if len(bucket) > self.max_per_key:
                    self._forget((namespace, bucket[0][0]))
                self._shrink()

    def _anchor(self, doc: str, table: dict[str, list[tuple[str, int]]]) -> Optional[int]:
        """The offset of the anchor window ``doc`` is filed under (class doc), None if it has none.
        Reads each of ``doc``'s anchor windows at most once: O(len(doc))."""
        w, best, best_size = self.window, None, 0
        for m in BOUNDARY.finditer(doc, 0, max(0, len(doc) - w)):
            a = m.end()
            size = len(table.get(doc[a:a + w], ()))
            if size == 0:
                return a
            if best is None or size < best_size:
                best, best_size = a, size
        return best

    def _shrink(self) -> None:
        while self._docs and (len(self._docs) > self.max_docs or self._chars > self.max_chars):
            self._forget(next(iter(self._docs)))

    def _forget(self, key: tuple[Optional[str], str]) -> None:
        namespace, doc = key
        a = self._docs.pop(key)
        self._chars -= len(doc)
        table = self._keys[namespace]
        window = doc[a:a + self.window]
        table[window] = [entry for entry in table[window] if entry[0] != doc]
        if not table[window]:
            del table[window]
        if not table:
            del self._keys[namespace]

    def find(self, text: str, namespace: Optional[str], regions: Optional[Sequence[Span]] = None,
             boundaries: Optional[Sequence[int]] = None) -> list[Span]:
        """Non-overlapping spans of ``text`` that are documents filed under ``namespace``, sorted.

        ``regions``: sorted, non-overlapping spans a hit must lie inside one of (None: anywhere).
        ``boundaries``: sorted character offsets a hit must start and end on (the prompt's token
        boundaries, :func:`token_boundaries`; None: any offset).

        Linear: a candidate whose document overlaps an earlier hit of the same document is not
        compared (it would lose to it), and the characters compared are bounded by
        ``compare_factor * len(text)`` (past that, the search stops where it is: a prompt built so
        that windows match everywhere costs no more).
        """
        with self._lock:
            table = self._keys.get(namespace)
            if not table:
                return []
            hits = []
            w = self.window
            budget = self.compare_factor * len(text)
            last_end: dict[str, int] = {}  # document -> end of its last hit
            for m in BOUNDARY.finditer(text):
                p = m.end()
                bucket = table.get(text[p:p + w])
                if not bucket:
                    continue
                for doc, a in bucket:
                    s = p - a
                    e = s + len(doc)
                    if s < 0 or e > len(text) or last_end.get(doc, -1) > s:
                        continue
                    budget -= len(doc)
                    if text.startswith(doc, s) and _on(boundaries, s) and _on(boundaries, e):
                        hits.append((s, e))
                        last_end[doc] = e
                if budget < 0:
                    break
            chosen = _longest_disjoint(hits, regions)
            for s, e in chosen:
                self._docs.move_to_end((namespace, text[s:e]))
            return chosen


def token_boundaries(token_spans: Iterable[tuple[int, int]], length: int) -> list[int]:
    """The character offsets of a text (``length`` code points) that no token of its tokenization
    straddles: 0, ``length``, and every token's start and end that lies inside no other token.

    ``token_spans``: each token's ``(start, end)`` character span, in token order (a fast
    tokenizer's offset mapping); empty spans (special tokens the tokenizer added) are skipped.
    Returns them sorted. O(tokens) when the spans follow each other, as a tokenizer's do.
    """
    spans = [span for span in token_spans if span[0] < span[1]]
    flat = list(itertools.chain.from_iterable(spans))
    if (all(map(operator.le, flat, itertools.islice(flat, 1, None)))  # each token after the one before
            and (not flat or (flat[0] >= 0 and flat[-1] <= length))):
        return list(dict.fromkeys(itertools.chain((0,), flat, (length,))))  # sorted already: drop repeats
    points = sorted({0, length, *(x for x in flat if 0 <= x <= length)})
    spans.sort()
    out, i, reach = [], 0, -1  # reach: the furthest end of the tokens starting before p
    for p in points:
        while i < len(spans) and spans[i][0] < p:
            reach = max(reach, spans[i][1])
            i += 1
        if reach <= p:
            out.append(p)
    return out


def _on(boundaries: Optional[Sequence[int]], offset: int) -> bool:
    """Whether ``offset`` is one of the sorted ``boundaries`` (None: every offset is)."""
    if boundaries is None:
        return True
    i = bisect.bisect_left(boundaries, offset)
    return i < len(boundaries) and boundaries[i] == offset


def _inward(span: Span, boundaries: Optional[Sequence[int]]) -> Span:
    """``span`` shrunk to the nearest boundaries inside it (``(s, s)`` if none fits)."""
    if boundaries is None:
        return span
    s, e = span
    i = bisect.bisect_left(boundaries, s)
    j = bisect.bisect_right(boundaries, e) - 1
    if i >= len(boundaries) or j < 0 or boundaries[i] >= boundaries[j]:
        return s, s
    return boundaries[i], boundaries[j]


def _inside(span: Span, regions: Optional[Sequence[Span]]) -> bool:
    if regions is None:
        return True
    i = bisect.bisect_right(regions, (span[0], float("inf"))) - 1
    return i >= 0 and regions[i][0] <= span[0] and span[1] <= regions[i][1]


def _longest_disjoint(hits: list[Span], regions: Optional[Sequence[Span]]) -> list[Span]:
    """Greedy, longest first (then leftmost): spans that overlap no longer one, sorted."""
    chosen: list[Span] = []
    for s, e in sorted(set(hits), key=lambda h: (h[0] - h[1], h[0])):
        if not _inside((s, e), regions):
            continue
        i = bisect.bisect_left(chosen, (s, e))
        if (i > 0 and chosen[i - 1][1] > s) or (i < len(chosen) and chosen[i][0] < e):
            continue
        chosen.insert(i, (s, e))
    return chosen


def _back_over_space(text: str, start: int, floor: int, boundaries: Sequence[int]) -> Optional[int]:
    """The nearest boundary before ``start`` that only whitespace separates from it, not before
    ``floor``; None if there is none. Reads the whitespace run before ``start`` (down to ``floor``) once."""
    w = start
    while w > floor and text[w - 1].isspace():
        w -= 1
    i = bisect.bisect_left(boundaries, start) - 1
    return boundaries[i] if i >= 0 and boundaries[i] >= w else None


def _new_chunks(text: str, candidates: Sequence[Span], known: Sequence[Span],
                boundaries: Optional[Sequence[int]], min_chars: int,
                regions: Optional[Sequence[Span]] = None) -> list[Span]:
    """The candidates less the ``known`` spans (both sorted and disjoint), trimmed, moved inward to
    the nearest ``boundaries`` (then trimmed of what whitespace still ends on a boundary), kept if
    ``min_chars`` long. A start that is no boundary (the first word's token takes the space before
    it) moves back over the whitespace right before it to the nearest boundary there, if any, instead
    of past the word (module doc, step 2); never before the end of the last known span or candidate
    piece before it, nor before the start of its region (``regions``: sorted and disjoint, each
    candidate inside one; None: the whole text), so the chunks stay sorted, disjoint and inside.
    One pass over the three lists: a known span is visited once per candidate it overlaps (two
    families of disjoint spans overlap at most ``len(a) + len(b)`` times), and the whitespace looked
    back over lies between a piece's floor and its start, apart for each piece."""
    out: list[Span] = []
    k = r = 0
    floor = 0  # no chunk starts before it: the end of the last candidate piece or known span passed
    for cs, ce in candidates:
        while k < len(known) and known[k][1] <= cs:
            k += 1
        floor = max(floor, known[k - 1][1] if k else 0)
        if regions is not None:
            while r < len(regions) and regions[r][1] <= cs:
                r += 1
            floor = max(floor, regions[r][0] if r < len(regions) and regions[r][0] <= cs else cs)
        pieces, pos, j = [], cs, k
        while j < len(known) and known[j][0] < ce:
            pieces.append((pos, max(pos, known[j][0])))
            pos = max(pos, known[j][1])
            j += 1
        pieces.append((pos, ce))
        for s, e in pieces:
            floor = max(floor, s) if s > cs else floor  # a piece after a known span: not into it
            ts, te = trim_span(text, s, e)
            s, e = _inward((ts, te), boundaries)
            if boundaries is not None and s != ts and ts < te:
                back = _back_over_space(text, ts, floor, boundaries)
                if back is not None:
                    s, e = back, _inward((back, te), boundaries)[1]
            if e - s >= min_chars:
                ts, te = trim_span(text, s, e)
                s, e = (ts if _on(boundaries, ts) else s), (te if _on(boundaries, te) else e)
            if e - s >= min_chars:
                out.append((s, e))
        floor = max(floor, ce)
    return out


def discover_chunks(text: str, index: Optional[DocumentIndex], namespace: Optional[str], *,
                    regions: Optional[Sequence[Span]] = None, boundaries: Optional[Sequence[int]] = None,
                    min_chunk_chars: int = 64, max_chunks: int = 1024) -> list[Span]:
    """The chunks of an unmarked prompt: known documents, then new ones (module doc).

    Args:
        text: the prompt.
        index: the documents discovered before (None, the server's default: only the block rules,
            so the chunks are a function of the prompt alone).
        namespace: the request's tenant namespace; only its documents are found.
        regions: sorted, non-overlapping spans searched (a chat message's content each); None: all.
        boundaries: sorted character offsets every chunk starts and ends on: the prompt's token
            boundaries (:func:`token_boundaries` of its tokenization with the server's tokenizer);
            None: any offset (a client without the tokenizer, e.g. the routing key).
        min_chunk_chars: shortest new document, in code points.
        max_chunks: most chunks returned (the first ones in the prompt).

    Returns:
        Sorted, non-overlapping, non-empty ``(start, end)`` spans, usable by ``split_text``.
    
    Example (two documents between blank lines; the system line and the question stay out):

    >>> text = ("Answer from the documents.\\n\\n"
    ...         "The first document is about the sea and the ships that sail on it every day.\\n\\n"
    ...         "The second document is about mountains and the people who climb them.\\n\\n"
    ...         "Question: which one mentions ships?")
    >>> [text[s:e][:30] for s, e in discover_chunks(text, None, None)]
    ['The first document is about th', 'The second document is about m']
    """
    known = index.find(text, namespace, regions, boundaries) if index is not None else []
    candidates = candidate_spans(find_blocks(text, regions, min_chunk_chars=min_chunk_chars),
                                 min_chunk_chars=min_chunk_chars)
    spans = known + _new_chunks(text, candidates, known, boundaries, min_chunk_chars, regions)
    return sorted(spans)[:max_chunks]
