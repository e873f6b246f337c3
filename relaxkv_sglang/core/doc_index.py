"""Chunk discovery in unmarked prompts: documents seen before, found anywhere, and new ones.

A prompt that marks no documents is split into chunks by :func:`discover_chunks`:

1. **Known documents.** :class:`DocumentIndex` holds the texts the server has planned as chunks
   (bounded, least recently used first out, one namespace per tenant). Each document ``D`` is
   filed under one *anchor window*: with ``a`` the first offset ``>= 1`` right after a *boundary*
   character (whitespace or punctuation, :data:`BOUNDARY`), the key is ``D[a : a + W]``
   (``W`` = ``window`` code points). If ``D`` occurs in a prompt ``T`` at ``s``, then
   ``T[s + a - 1] = D[a - 1]`` is a boundary character, so ``s + a`` is one of the positions
   right after a boundary character in ``T``, whatever surrounds ``D``. A search visits exactly
   those positions ``p``, looks ``T[p : p + W]`` up in the namespace's table and checks every
   candidate ``(D, a)`` exactly: ``T[p - a : p - a + len(D)] == D``. So a hit is always the
   stored text, character for character, and the same text tokenizes to the same ids (each
   chunk is tokenized on its own), which are the chunk store's key. Of overlapping hits the
   longest are kept (greedy, longest first); with regions given, a hit must lie inside one.
   Cost: one pass of a compiled regex and one dict lookup per boundary position, plus one
   string comparison per candidate: linear in the prompt for a bounded number of documents per
   key (:attr:`DocumentIndex.max_per_key`).
2. **New documents.** :mod:`relaxkv_sglang.core.doc_blocks` cuts the prompt into blocks along the
   structures frameworks write and names the blocks that are documents. A candidate block that
   overlaps a known document gives up the overlap; what is left of it (trimmed) stays a
   candidate if still ``min_chunk_chars`` long.

The caller remembers the chunks it finally plans (:meth:`DocumentIndex.remember`), so the next
prompt that holds one of them is split at it, wherever it sits. Documents shorter than
``min_doc_chars`` or with no boundary character early enough are not filed (they are still found
by the block rules).

Standard library only.
"""

from __future__ import annotations

import bisect
import collections
import re
import threading
from typing import Iterable, Optional, Sequence

from relaxkv_sglang.core.doc_blocks import candidate_spans, find_blocks

__all__ = ["BOUNDARY", "DocumentIndex", "discover_chunks"]

Span = tuple[int, int]
BOUNDARY = re.compile(r"[\s.,;:!?)\]}>\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f]")


def _anchor(doc: str, window: int) -> Optional[int]:
    """Offset of ``doc``'s anchor window (module doc, step 1), or None if it has none."""
    m = BOUNDARY.search(doc, 0, max(0, len(doc) - window))
    return m.end() if m is not None else None


class DocumentIndex:
    """Document texts planned as chunks, per namespace, found again by :meth:`find`. Thread-safe.

    Bounded: at most ``max_docs`` documents and ``max_chars`` code points in all (least recently
    used or found first out); at most ``max_per_key`` documents share one anchor window (the
    oldest leaves), so one search costs at most that many comparisons per position.
    """

    def __init__(self, *, max_docs: int = 8192, max_chars: int = 16_000_000, window: int = 24,
                 max_per_key: int = 8, min_doc_chars: int = 64) -> None:
        if window < 1 or max_per_key < 1:
            raise ValueError("window and max_per_key must be >= 1")
        self.max_docs, self.max_chars, self.window = max_docs, max_chars, window
        self.max_per_key, self.min_doc_chars = max_per_key, min_doc_chars
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

    def remember(self, namespace: Optional[str], texts: Iterable[str]) -> None:
        """File each text (a chunk just planned) under ``namespace``; a known one becomes most recent."""
        with self._lock:
            for doc in texts:
                key = (namespace, doc)
                if key in self._docs:
                    self._docs.move_to_end(key)
                    continue
                a = _anchor(doc, self.window) if len(doc) >= self.min_doc_chars else None
                if a is None or len(doc) > self.max_chars:
                    continue
                self._docs[key] = a
                self._chars += len(doc)
                bucket = self._keys.setdefault(namespace, {}).setdefault(doc[a:a + self.window], [])
                bucket.append((doc, a))
                if len(bucket) > self.max_per_key:
                    self._forget((namespace, bucket[0][0]))
                self._shrink()

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

    def find(self, text: str, namespace: Optional[str],
             regions: Optional[Sequence[Span]] = None) -> list[Span]:
        """Non-overlapping spans of ``text`` that are documents filed under ``namespace``, sorted.

        ``regions``: sorted, non-overlapping spans a hit must lie inside one of (None: anywhere).
        """
        with self._lock:
            table = self._keys.get(namespace)
            if not table:
                return []
            hits = []
            w = self.window
            for m in BOUNDARY.finditer(text):
                p = m.end()
                bucket = table.get(text[p:p + w])
                if bucket:
                    for doc, a in bucket:
                        s = p - a
                        if s >= 0 and text.startswith(doc, s):
                            hits.append((s, s + len(doc)))
            chosen = _longest_disjoint(hits, regions)
            for s, e in chosen:
                self._docs.move_to_end((namespace, text[s:e]))
            return chosen


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


def _minus(text: str, span: Span, known: Sequence[Span], min_chars: int) -> list[Span]:
    """What is left of ``span`` outside the ``known`` spans: trimmed pieces of ``min_chars`` or more."""
    pieces, pos = [], span[0]
    for ks, ke in known:
        if ke <= span[0] or ks >= span[1]:
            continue
        pieces.append((pos, min(ks, span[1])))
        pos = max(pos, ke)
    pieces.append((pos, span[1]))
    out = []
    for s, e in pieces:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e - s >= min_chars:
            out.append((s, e))
    return out


def discover_chunks(text: str, index: Optional[DocumentIndex], namespace: Optional[str], *,
                    regions: Optional[Sequence[Span]] = None, min_chunk_chars: int = 64,
                    max_chunks: int = 1024) -> list[Span]:
    """The chunks of an unmarked prompt: known documents, then new ones (module doc).

    Args:
        text: the prompt.
        index: the documents planned before (None: only the block rules).
        namespace: the request's tenant namespace; only its documents are found.
        regions: sorted, non-overlapping spans searched (a chat message's content each); None: all.
        min_chunk_chars: shortest new document, in code points.
        max_chunks: most chunks returned (the first ones in the prompt).

    Returns:
        Sorted, non-overlapping, non-empty ``(start, end)`` spans, usable by ``split_text``.
    """
    known = index.find(text, namespace, regions) if index is not None else []
    spans = list(known)
    for span in candidate_spans(find_blocks(text, regions, min_chunk_chars=min_chunk_chars),
                                min_chunk_chars=min_chunk_chars):
        spans.extend(_minus(text, span, known, min_chunk_chars))
    return sorted(spans)[:max_chunks]
