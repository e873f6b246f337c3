"""Where new documents lie in an unmarked prompt: the structures RAG frameworks write.

Frameworks put retrieved documents inline: joined by blank lines (LangChain's tutorials), between
``---------------------`` rule lines (LlamaIndex's text-QA template), after ``[1]`` or
``Document 2:`` markers, under metadata lines (``file_path: ...``), inside markup tags, or one per
line. This module cuts a prompt into *blocks* along those structures; the caller
(:mod:`relaxkv_sglang.core.doc_index`) takes some blocks as chunks.

The rule, applied to each *region* on its own (a chat message's content in the rendered template;
the whole text for a plain prompt; text outside every region is template markup and never a block):

1. **Lines.** A region is cut into lines at ``"\\n"``. A line is

   * *blank* (whitespace only), a *rule* (three or more of one of ``- = * _ ~`` and nothing else),
     a *heading* (``#`` to ``######`` then text), a *metadata* line (``key: value`` with an
     identifier key, at most :data:`MAX_META_CHARS` long: ``file_path: /a.txt``, ``Query: ...``),
     a *tag line* (markup tags, optionally around a chat role word: ``<document>``,
     ``<|im_start|>system``): a separator;
   * otherwise text, less a leading *marker* (``[3]``, ``(3)``, ``Document 3:``, ``Source:``,
     ``Context:`` ...: a document label from :data:`DOC_LABELS`) and less leading and trailing
     markup tags (``<doc>...</doc>``), each of which is a separator piece of its own; the text
     after a marker ends at the line's end.

2. **Blocks.** Consecutive text pieces form one block; any separator ends it. Each block is
   trimmed of surrounding whitespace. Separator pieces are blocks of kind ``"label"`` (rules,
   headings, markers, XML-like tags: they introduce a document), ``"meta"`` (metadata lines: they
   introduce a document too, and belong to it, rule 4), ``"question"`` (a question line, rule 4)
   or ``"markup"`` (chat special tokens and role words).

3. **Finer cuts** inside a text block: a block whose every line ends a sentence
   (``. ! ?`` and CJK stops, closing quotes allowed) and which has two lines of at least
   ``min_chunk_chars`` is cut at every line (one document per line); otherwise a *title line*
   (at most :data:`MAX_TITLE_CHARS` and half the next line long, not starting in lower case, not
   ending a sentence nor in ``: , ;``, after a line that ends a sentence) starts a new block
   (``Title\\ntext\\nTitle\\ntext``).

4. **Candidates.** A text block of at least ``min_chunk_chars`` code points is a document, except
   the last text block (the question), unless a *question line* follows it (a metadata line keyed
   by one of :data:`QUESTION_KEYS`, with a value: ``Query: ...``), and the first text block unless
   a label or metadata block directly precedes it (the system prompt, but ``[1] doc`` opening a
   prompt is a document). A document's span starts at the metadata lines directly before it
   (``file_path: /a.txt``: the same for the same document in every prompt, so reused with it);
   markers (``[3]``, ``Document 3:``) stay outside, since their numbers change with the order.

Every rule looks only at a line, its neighbours and its block, so a document between the same kind of
structures yields the same block in every prompt. False cuts cost quality, never correctness: a
chunk is whatever text the span holds, tokenized on its own. Linear in the text's length.

Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

__all__ = ["Block", "BlockKind", "DOC_LABELS", "QUESTION_KEYS", "MAX_META_CHARS", "MAX_TITLE_CHARS", "find_blocks",
           "candidate_spans"]

BlockKind = Literal["text", "label", "meta", "question", "markup"]

# Words that label a document at a line's start ("Document 2:", "Sources:", "Context: ...").
DOC_LABELS = ("context", "contexts", "document", "documents", "doc", "docs", "source", "sources",
              "passage", "passages", "reference", "references", "excerpt", "excerpts", "snippet",
              "snippets", "chunk", "chunks", "evidence", "knowledge", "page_content", "content",
              "retrieved context", "retrieved documents")
MAX_TITLE_CHARS = 48  # a title line is at most this long and at most half the next line's length
QUESTION_KEYS = ("question", "query", "q", "input", "user question")  # metadata keys that hold the question
MAX_META_CHARS = 160  # a "key: value" line longer than this is text (e.g. "Title: <a whole document>")
_ROLES = r"(?:system|user|assistant|human|ai|model|developer|tool|bot)"
_LABEL_ALT = "|".join(re.escape(w) for w in sorted(DOC_LABELS, key=len, reverse=True))

_RULE = re.compile(r"[ \t]*(?:-{3,}|={3,}|\*{3,}|_{3,}|~{3,})[ \t]*")
_HEADING = re.compile(r"[ \t]*#{1,6}[ \t]+\S.*")
_META = re.compile(r"[ \t]*[A-Za-z_][\w.\-]{0,40}:(?:[ \t].*)?")
_QUESTION = re.compile(rf"[ \t]*(?:{'|'.join(QUESTION_KEYS)})[ \t]*:[ \t]*\S.*", re.I)
_TAG = r"<[^<>\n]{1,64}>"
_TAG_LINE = re.compile(rf"[ \t]*(?:{_TAG}[ \t]*)+(?:{_ROLES}[ \t]*(?:{_TAG}[ \t]*)*)?", re.I)
_LEAD_TAGS = re.compile(rf"[ \t]*(?:{_TAG}[ \t]*)+")
_TRAIL_TAGS = re.compile(rf"(?:[ \t]*{_TAG})+[ \t]*$")
_NUMBER = r"(?:#?\d{1,4}|\[\d{1,4}\])"
_MARKER = re.compile(  # "[3] ", "(3) ", "Document 3: ", "Document [3]. ", "Sources: "
    rf"[ \t]*(?:[\[(]\d{{1,4}}[\])](?=\s|$)|(?:{_LABEL_ALT})[ \t]*(?:{_NUMBER}[ \t]*(?:[:.)\]\-]|$)|:))[ \t]*", re.I)
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"'\u201d\u2019)\]]*\s*$")
_NOT_TITLE_END = re.compile(r"[:,;]\s*$")


@dataclass(frozen=True)
class Block:
    """A piece of a prompt: ``text[start:end]``, trimmed; ``kind`` "text", "label" or "markup"."""

    start: int
    end: int
    kind: BlockKind


def _special_tag(piece: str) -> bool:
    """Chat special tokens (``<|im_start|>``, ``<start_of_turn>``...) are markup, not labels."""
    return "|" in piece or "_of_" in piece or "header" in piece


def _line_pieces(text: str, s: int, e: int) -> list[tuple[int, int, str]]:
    """(start, end, kind) pieces of the line ``text[s:e]``; kind "text", "own" (text after a marker:
    a block of its own), "label", "question", "markup" or "blank"."""
    line = text[s:e]
    if not line.strip():
        return [(s, e, "blank")]
    if _RULE.fullmatch(line) or _HEADING.fullmatch(line):
        return [(s, e, "label")]
    if _TAG_LINE.fullmatch(line):
        return [(s, e, "markup" if _special_tag(line) or not _LEAD_TAGS.fullmatch(line) else "label")]
    pieces: list[tuple[int, int, str]] = []
    marker = _MARKER.match(line)
    if marker is None and len(line) <= MAX_META_CHARS and _META.fullmatch(line):
        return [(s, e, "question" if _QUESTION.fullmatch(line) else "meta")]
    lead = marker or _LEAD_TAGS.match(line)
    if lead is not None and lead.end() > 0:
        kind = "markup" if marker is None and _special_tag(lead.group()) else "label"
        pieces.append((s, s + lead.end(), kind))
        s += lead.end()
        line = text[s:e]
    text_kind = "own" if marker is not None else "text"
    trail = _TRAIL_TAGS.search(line)
    if trail is not None and trail.start() > 0:
        pieces.append((s, s + trail.start(), text_kind))
        pieces.append((s + trail.start(), e, "markup" if _special_tag(trail.group()) else "label"))
    elif line.strip():
        pieces.append((s, e, text_kind))
    return pieces


def _trim(text: str, s: int, e: int) -> tuple[int, int]:
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return s, e


def _region_blocks(text: str, start: int, end: int) -> list[Block]:
    """Rules 1-2 over ``text[start:end]``."""
    blocks: list[Block] = []
    run: Optional[list[int]] = None  # [start, end] of the text block being built

    def close() -> None:
        """End the current text block, if any."""
        nonlocal run
        if run is not None:
            s, e = _trim(text, run[0], run[1])
            if s < e:
                blocks.append(Block(s, e, "text"))
            run = None

    pos = start
    while pos < end:
        nl = text.find("\n", pos, end)
        line_end = end if nl < 0 else nl
        for s, e, kind in _line_pieces(text, pos, line_end):
            if kind == "text":
                run = [s, e] if run is None else [run[0], e]
                continue
            close()
            if kind == "own":
                run = [s, e]
                close()
            elif kind != "blank":
                s, e = _trim(text, s, e)
                if s < e:
                    blocks.append(Block(s, e, kind))  # type: ignore[arg-type]
        pos = line_end + 1
    close()
    return blocks


def _lines(text: str, block: Block) -> list[tuple[int, int]]:
    """The trimmed, non-empty lines of a text block."""
    out, pos = [], block.start
    while pos <= block.end:
        nl = text.find("\n", pos, block.end)
        line_end = block.end if nl < 0 else nl
        s, e = _trim(text, pos, line_end)
        if s < e:
            out.append((s, e))
        pos = line_end + 1
    return out


def _finer(text: str, block: Block, min_chunk_chars: int) -> list[Block]:
    """Rule 3: one document per line, or titled blocks."""
    lines = _lines(text, block)
    if len(lines) < 2:
        return [block]
    ends = [bool(_SENTENCE_END.search(text[s:e])) for s, e in lines]
    if all(ends) and sum(e - s >= min_chunk_chars for s, e in lines) >= 2:
        return [Block(s, e, "text") for s, e in lines]
    cuts = [0]
    for i in range(1, len(lines) - 1):
        s, e = lines[i]
        if (ends[i - 1] and not ends[i] and e - s <= min(MAX_TITLE_CHARS, min_chunk_chars)
                and 2 * (e - s) <= lines[i + 1][1] - lines[i + 1][0]
                and not text[s].islower() and not _NOT_TITLE_END.search(text[s:e])):
            cuts.append(i)
    if len(cuts) == 1:
        return [block]
    bounds = cuts + [len(lines)]
    return [Block(lines[a][0], lines[b - 1][1], "text") for a, b in zip(bounds, bounds[1:])]


def find_blocks(text: str, regions: Optional[Sequence[tuple[int, int]]] = None, *,
                min_chunk_chars: int = 64) -> list[Block]:
    """Rules 1-3: the prompt's blocks in order.

    Args:
        text: the prompt.
        regions: sorted, non-overlapping ``(start, end)`` spans searched (a chat message's content
            each); None: the whole text.
        min_chunk_chars: shortest document, in code points (rule 3's thresholds).

    Returns:
        Blocks in text order, each inside one region.
    """
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
