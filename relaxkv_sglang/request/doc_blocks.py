"""Where new documents lie in an unmarked prompt: the structures RAG frameworks write.

Each *region* (a chat message's content; a plain prompt's whole text) is cut into *blocks*:

1. **Lines.** Separators: blank lines, rules (``---``), headings (``# x``), ``key: value`` metadata (at
   most :data:`MAX_META_CHARS`), tag lines; and, on a text line, a leading *marker* (:data:`DOC_LABELS`:
   ``[3]``, ``Document 3:``) and leading/trailing tags.
2. **Blocks.** Consecutive text lines form one block; separators are ``label``, ``meta``, ``question``
   or ``markup`` blocks (chat special tokens, role words), adjacent ones of one kind merged.
3. **Finer cuts.** A block whose every line ends a sentence, two of them ``min_chunk_chars`` long, is cut
   at every line; else a *title line* (short, after a sentence end, not one itself) starts a block.
4. **Candidates.** A text block of ``min_chunk_chars`` code points is a document, but the last (the
   question, unless a :data:`QUESTION_KEYS` line follows) and the first unless a label or metadata
   precedes it; with the metadata lines just before it, without markers (numbers change with the order).

Every rule reads a line, its neighbours and its block only, so a document between the same structures
yields the same block in every prompt; a false cut costs quality, never correctness. Linear in the text
(it runs on the tokenizer manager's event loop; docs/experiments/INDEX.md#discovery-linear-time).
"""

from __future__ import annotations

import itertools
import re
from typing import Iterator, Literal, NamedTuple, Optional, Sequence

__all__ = ["Block", "BlockKind", "DOC_LABELS", "QUESTION_KEYS", "MAX_META_CHARS", "MAX_TITLE_CHARS", "find_blocks",
           "trim_span", "candidate_spans"]

BlockKind = Literal["text", "label", "meta", "question", "markup"]

DOC_LABELS = ("context", "contexts", "document", "documents", "doc", "docs", "source", "sources",
              "passage", "passages", "reference", "references", "excerpt", "excerpts", "snippet",
              "snippets", "chunk", "chunks", "evidence", "knowledge", "page_content", "content",
              "retrieved context", "retrieved documents")
MAX_TITLE_CHARS = 48
QUESTION_KEYS = ("question", "query", "q", "input", "user question")
MAX_META_CHARS = 160  # longer "key: value" lines are text ("Title: <a whole document>")
_ROLES = r"(?:system|user|assistant|human|ai|model|developer|tool|bot)"
_LABEL_ALT = "|".join(re.escape(w) for w in sorted(DOC_LABELS, key=len, reverse=True))

# Anchored patterns with possessive runs: one match costs O(line), never a retry of every split.
_RULE = re.compile(r"[ \t]*+(?:-{3,}+|={3,}+|\*{3,}+|_{3,}+|~{3,}+)[ \t]*+")
_HEADING = re.compile(r"[ \t]*+#{1,6}+[ \t]++\S.*")
_META = re.compile(r"[ \t]*+[A-Za-z_][\w.\-]{0,40}+:(?:[ \t].*)?")
_QUESTION = re.compile(rf"[ \t]*+(?:{'|'.join(QUESTION_KEYS)})[ \t]*+:[ \t]*+\S.*", re.I)
_TAG = r"<[^<>\n]{1,64}+>"
_TAG_LINE = re.compile(rf"[ \t]*+(?:{_TAG}[ \t]*+)++(?:{_ROLES}[ \t]*+(?:{_TAG}[ \t]*+)*+)?", re.I)
_LEAD_TAGS = re.compile(rf"[ \t]*+(?:{_TAG}[ \t]*+)++")
# Matched on the reversed line, anchored (a ``$``-anchored ``search`` is quadratic on a line of tags).
_TRAIL_TAGS_REVERSED = re.compile(r"[ \t]*+(?:>[^<>\n]{1,64}+<[ \t]*+)++")
_NUMBER = r"(?:#?\d{1,4}|\[\d{1,4}\])"
_MARKER = re.compile(  # "[3] ", "(3) ", "Document 3: ", "Document [3]. ", "Sources: "
    rf"[ \t]*+(?:[\[(]\d{{1,4}}[\])](?=\s|$)|(?:{_LABEL_ALT})[ \t]*+(?:{_NUMBER}[ \t]*+(?:[:.)\]\-]|$)|:))[ \t]*+",
    re.I)
# Unanchored, but linear: every start is a stop and runs to the line's end (the runs do not overlap).
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"'\u201d\u2019)\]]*+\s*+$")
_NOT_TITLE_END = re.compile(r"[:,;]\s*+$")
_BLANK_LINES = re.compile(r"(?:[^\S\n]*+\n)++")
_RULE_CHARS = "-=*_~"
_META_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
# ASCII that starts no marker (non-ASCII is always tried: re.I folds some onto ASCII letters)
_NO_MARKER_START = frozenset(chr(i) for i in range(128)) - set("[(") - {
    x for w in DOC_LABELS for x in (w[0].lower(), w[0].upper())}
_STOPS = frozenset(".!?\u3002\uff01\uff1f")
_CLOSERS = frozenset("\"'\u201d\u2019)]")  # a line ending in one may end a sentence (quotes after the stop)
# A superset of the lines that may be separators or carry a marker or tags; each alternative reads one line.
_MAYBE_SEPARATOR = re.compile(
    rf"^(?:[^\S\n]*+$|[ \t]*+(?:[-=*_~#<\[(]|(?:{_LABEL_ALT})|[A-Za-z_][\w.\-]{{0,40}}+:)|[^\n]*?>[ \t]*+$)",
    re.I | re.M)


class Block(NamedTuple):
    """``text[start:end]``, trimmed. A named tuple: one is made per separator line, cheaply."""

    start: int
    end: int
    kind: BlockKind


def _special_tag(piece: str) -> bool:
    """Chat special tokens (``<|im_start|>``, ``<start_of_turn>``...) are markup, not labels."""
    return "|" in piece or "_of_" in piece or "header" in piece


def _trailing_tags(line: str) -> int:
    """Where the tags (and spaces) that end ``line`` start; ``len(line)`` if none."""
    m = _TRAIL_TAGS_REVERSED.match(line[::-1])
    return len(line) - m.end() if m is not None else len(line)


def _line_pieces(text: str, s: int, e: int) -> Optional[list[tuple[int, int, str]]]:
    """(start, end, kind) pieces of ``text[s:e]`` ("own": text after a marker, a block of its own); None:
    all text (the common case). A pattern is tried only where the line's first character can start it."""
    line = text[s:e]
    body = line.lstrip(" \t")
    if not body.strip():
        return [(s, e, "blank")]
    c = body[0]
    kind = None
    if (c in _RULE_CHARS and _RULE.fullmatch(line)) or (c == "#" and _HEADING.fullmatch(line)):
        kind = "label"
    elif c == "<" and _TAG_LINE.fullmatch(line):
        kind = "markup" if _special_tag(line) or not _LEAD_TAGS.fullmatch(line) else "label"
    marker = _MARKER.match(line) if kind is None and c not in _NO_MARKER_START else None
    if (kind is None and marker is None and len(line) <= MAX_META_CHARS and c in _META_START
            and _META.fullmatch(line)):
        kind = "question" if _QUESTION.fullmatch(line) else "meta"
    if kind is not None:
        trimmed_start = s + len(line) - len(line.lstrip())
        return [(trimmed_start, s + len(line.rstrip()), kind)]
    lead = marker or (_LEAD_TAGS.match(line) if c == "<" else None)
    trailing = body.rstrip(" \t").endswith(">")
    if lead is None and not trailing:
        return None
    pieces: list[tuple[int, int, str]] = []
    if lead is not None and lead.end() > 0:  # a marker or tags: no whitespace but spaces and tabs around
        lead_text = lead.group()
        kind = "markup" if marker is None and _special_tag(lead_text) else "label"
        pieces.append((s + len(line) - len(body), s + len(lead_text.rstrip()), kind))
        s += lead.end()
        line = text[s:e]
    text_kind = "own" if marker is not None else "text"
    trail = _trailing_tags(line) if trailing else len(line)
    if 0 < trail < len(line):
        pieces.append((*trim_span(text, s, s + trail), text_kind) if marker is not None else (s, s + trail, text_kind))
        pieces.append((*trim_span(text, s + trail, e), "markup" if _special_tag(line[trail:]) else "label"))
    elif marker is not None:
        kept = line.strip()
        if kept:
            own_start = s + len(line) - len(line.lstrip())
            pieces.append((own_start, own_start + len(kept), "own"))
    elif line.strip():
        pieces.append((s, e, text_kind))
    return pieces


def trim_span(text: str, s: int, e: int) -> tuple[int, int]:
    """``(s, e)`` less the whitespace at both ends (``(e, e)`` if all of it is)."""
    piece = text[s:e]
    kept = piece.strip()
    if not kept:
        return e, e
    s += len(piece) - len(piece.lstrip())
    return s, s + len(kept)


def _region_blocks(text: str, start: int, end: int) -> list[Block]:
    """Rules 1-2 over ``text[start:end]``. Only the first line and those :data:`_MAYBE_SEPARATOR`
    finds are read one by one; the text lines between join the current text block at once."""
    blocks: list[Block] = []
    run_start = run_end = -1  # the text block being built (run_start < 0: none)
    sep_kind, sep_start, sep_end = "", 0, 0  # the separator block being built ("": none)

    def close() -> None:
        nonlocal run_start, sep_kind
        s, e = trim_span(text, run_start, run_end)
        if s < e:
            if sep_kind:
                blocks.append(Block(sep_start, sep_end, sep_kind))  # type: ignore[arg-type]
                sep_kind = ""
            blocks.append(Block(s, e, "text"))
        run_start = -1

    pos, line_start = start, start  # the first line is always looked at ("^" needs a newline before)
    while pos < end:
        if line_start < 0:
            m = _MAYBE_SEPARATOR.search(text, pos, end)
            line_start = end if m is None else m.start()
            if line_start > pos:  # text lines only, up to the newline before line_start (or the end)
                if run_start < 0:
                    run_start = pos
                run_end = line_start - 1 if m is not None else end
                if m is None:
                    break
        nl = text.find("\n", line_start, end)
        line_end = end if nl < 0 else nl
        pieces = _line_pieces(text, line_start, line_end)
        if pieces is None:
            if run_start < 0:
                run_start = line_start
            run_end = line_end
        pos, line_start = line_end + 1, -1
        if pieces is None:
            continue
        for s, e, kind in pieces:
            if kind == "text":
                if run_start < 0:
                    run_start = s
                run_end = e
                continue
            if run_start >= 0:
                close()
            if kind == "own":
                if s >= e:
                    continue
                if sep_kind:
                    blocks.append(Block(sep_start, sep_end, sep_kind))  # type: ignore[arg-type]
                    sep_kind = ""
                blocks.append(Block(s, e, "text"))
            elif kind == "blank":
                blank = _BLANK_LINES.match(text, pos, end)  # the blank lines after it, at once
                if blank is not None:
                    pos = blank.end()
            elif s >= e:
                continue
            elif kind == sep_kind:
                sep_end = e
            else:
                if sep_kind:
                    blocks.append(Block(sep_start, sep_end, sep_kind))  # type: ignore[arg-type]
                sep_kind, sep_start, sep_end = kind, s, e
    if run_start >= 0:
        close()
    if sep_kind:
        blocks.append(Block(sep_start, sep_end, sep_kind))  # type: ignore[arg-type]
    return blocks


def _finer(text: str, block: Block, min_chunk_chars: int) -> list[Block]:
    """Rule 3. A title line: at most :data:`MAX_TITLE_CHARS` and half the next line, not lower-case first,
    not ending a sentence or in ``: , ;``."""
    raw = text[block.start:block.end].split("\n")
    if len(raw) < 2:
        return [block]
    kept = [line.strip() for line in raw]
    if "" in kept:  # a text block holds no blank line (one ends it), but stay exact if it did
        keep = [i for i, k in enumerate(kept) if k]
        raw_starts = list(_line_starts(raw, block.start))
        raw, kept = [raw[i] for i in keep], [kept[i] for i in keep]
        starts = [raw_starts[i] for i in keep]
        if len(raw) < 2:
            return [block]
    else:
        starts = list(_line_starts(raw, block.start))

    def span(i: int) -> tuple[int, int]:
        s = starts[i] + len(raw[i]) - len(raw[i].lstrip())
        return s, s + len(kept[i])

    lens = [len(k) for k in kept]
    ends = [k[-1] in _STOPS or (k[-1] in _CLOSERS and _SENTENCE_END.search(k) is not None) for k in kept]
    if all(ends) and sum(n >= min_chunk_chars for n in lens) >= 2:
        return [Block(*span(i), "text") for i in range(len(kept))]
    limit = min(MAX_TITLE_CHARS, min_chunk_chars)
    cuts = [0] + [i for i in range(1, len(kept) - 1)
                  if ends[i - 1] and not ends[i] and lens[i] <= limit and 2 * lens[i] <= lens[i + 1]
                  and not kept[i][0].islower() and not _NOT_TITLE_END.search(kept[i])]
    if len(cuts) == 1:
        return [block]
    bounds = cuts + [len(kept)]
    return [Block(span(a)[0], span(b - 1)[1], "text") for a, b in zip(bounds, bounds[1:])]


def _line_starts(lines: list[str], start: int) -> Iterator[int]:
    return itertools.accumulate((len(line) + 1 for line in lines[:-1]), initial=start)


def find_blocks(text: str, regions: Optional[Sequence[tuple[int, int]]] = None, *,
                min_chunk_chars: int = 64) -> list[Block]:
    """Rules 1-3, in text order; ``regions``: sorted, disjoint spans (a chat message's content each; None:
    the whole text)."""
    if min_chunk_chars < 1:
        raise ValueError(f"min_chunk_chars must be >= 1, got {min_chunk_chars}")
    out: list[Block] = []
    for s, e in regions if regions is not None else [(0, len(text))]:
        for b in _region_blocks(text, s, e):
            out.extend(_finer(text, b, min_chunk_chars) if b.kind == "text" else [b])
    return out


def candidate_spans(blocks: Sequence[Block], *, min_chunk_chars: int = 64) -> list[tuple[int, int]]:
    """Rule 4: the ``(start, end)`` spans of the blocks that are documents, in order."""
    texts = [i for i, b in enumerate(blocks) if b.kind == "text"]
    if not texts:
        return []
    first, last = texts[0], texts[-1]
    if any(b.kind == "question" for b in blocks[last + 1:]):
        last = len(blocks)  # the question is a labelled line after every text block
    spans = []
    for i in texts:
        b = blocks[i]
        if i == last or b.end - b.start < min_chunk_chars:
            continue
        if i == first and not (i > 0 and blocks[i - 1].kind in ("label", "meta")):
            continue
        start = i
        while start > 0 and blocks[start - 1].kind == "meta":
            start -= 1
        spans.append((blocks[start].start, b.end))
    return spans
