"""Chunk discovery in unmarked prompts: new documents by their structure, at token boundaries.

1. **By structure** (always): :mod:`relaxkv_sglang.request.doc_blocks` names the blocks that are documents.
2. **Token boundaries** (in the server): a span is trimmed and moved inward to offsets no token of the
   prompt's own tokenization straddles (:func:`token_boundaries`), so a chunk tokenized alone has the
   prompt's tokens there (for tokenizers whose pieces do not depend on what precedes them). Where the
   first word's token takes the space before it (``"ĠThe"``, ``"▁The"``), the start moves back over
   that space instead, so the chunk keeps its first word.
3. **Seen before** (opt-in, ``RELAXKV_DISCOVERY_INDEX=1``): :class:`DocumentIndex`. A document ``D`` is
   filed under a window ``D[a : a + W]`` right after a :data:`BOUNDARY` character; if ``D`` occurs in
   ``T`` at ``s``, ``T[s + a - 1]`` is one, so looking up ``T[p : p + W]`` after every such character
   and comparing the text finds it. Overlapping hits: longest first; a block keeps what no hit covers.

Without the index a prompt's chunks depend on the prompt and tokenizer alone (the same on every replica
and restart). Linear in the prompt (with the index, comparisons bounded by ``compare_factor`` times it).
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
    """Documents discovered before, per namespace, found again by :meth:`find`. Thread-safe; LRU
    within ``max_docs`` and ``max_chars``. At most ``max_per_key`` documents share an anchor window
    (the comparisons per position); a document takes its first window no other uses (documents
    opening alike, e.g. one ``file_path:`` line, are filed apart), else the least used one."""

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
        return self._chars

    def clear(self) -> None:
        """The server's ``/flush_cache``: every namespace."""
        with self._lock:
            self._docs.clear()
            self._keys.clear()
            self._chars = 0

    def remember(self, namespace: Optional[str], texts: Iterable[str]) -> None:
        """File each chunk just discovered; a known one becomes most recent."""
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
        """Sorted, disjoint hits inside ``regions``, on ``boundaries``. Linear: a candidate overlapping an earlier
        hit of its document is skipped, and the search stops after ``compare_factor * len(text)`` characters."""
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
    """The sorted offsets no token straddles: 0, ``length`` and every token end inside no other token.
    ``token_spans``: a fast tokenizer's offset mapping, in token order (empty spans, added special
    tokens, skipped). O(tokens) when the spans follow each other, as a tokenizer's do."""
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
    """None: every offset is."""
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
    """The nearest boundary before ``start``, not before ``floor``, with only whitespace between; or None."""
    w = start
    while w > floor and text[w - 1].isspace():
        w -= 1
    i = bisect.bisect_left(boundaries, start) - 1
    return boundaries[i] if i >= 0 and boundaries[i] >= w else None


def _new_chunks(text: str, candidates: Sequence[Span], known: Sequence[Span],
                boundaries: Optional[Sequence[int]], min_chars: int,
                regions: Optional[Sequence[Span]] = None) -> list[Span]:
    """Step 2 (module doc): the candidates less the ``known`` spans (both sorted and disjoint), trimmed,
    on ``boundaries``, kept if ``min_chars`` long; a start moved back never passes the last known span
    or piece, nor its region's start, so the chunks stay sorted, disjoint and inside. One pass: two
    families of disjoint spans overlap at most ``len(a) + len(b)`` times."""
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
    """An unmarked prompt's chunks (module doc), the first ``max_chunks``, for ``split_text``. ``index``
    None (the server's default): the block rules only. ``boundaries`` None: a client without the
    tokenizer (the routing key). Two documents between blank lines; the question stays out:

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
