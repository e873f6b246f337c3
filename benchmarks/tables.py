"""The one table printer of the evaluation: every table the demo and the benchmarks show.

Two renderings of the same thing, a header and rows of already-formatted cells:

* :func:`text_table`, for the terminal: each column padded to at least its ``Column.width``
  (wider when a cell or the header is), left- or right-aligned, the columns joined by ``gap``,
  a rule of dashes under the header, no trailing blanks. With ``gap=""`` the widths carry the spacing, as the
  benchmarks' fixed-width tables do.
* :func:`markdown_table`, for docs/performance.md (``benchmarks.run_all``) and the tables a
  benchmark prints to paste into it: ``| a | b |`` rows under a ``|---|---|`` rule.

Cells are strings: each caller formats its numbers (``benchmarks.common.fmt`` for the missing
values), so this module knows nothing of any result's fields.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a text table: its header, least width and alignment (``"<"`` or ``">"``)."""

    head: str
    width: int = 0
    align: str = ">"

    def __post_init__(self) -> None:
        if self.align not in ("<", ">"):
            raise ValueError(f"column {self.head!r}: align must be '<' or '>', got {self.align!r}")


def left(head: str, width: int = 0) -> Column:
    """A left-aligned column (names: policies, modes, routings)."""
    return Column(head, width, "<")


def right(head: str, width: int = 0) -> Column:
    """A right-aligned column (figures)."""
    return Column(head, width, ">")


def text_table(columns: Sequence[Column], rows: Iterable[Sequence[str]], gap: str = "") -> list[str]:
    """The lines of a plain-text table: header, rule, one line per row (``len(row) == len(columns)``)."""
    rows = [list(r) for r in rows]
    for r in rows:
        if len(r) != len(columns):
            raise ValueError(f"a row has {len(r)} cells for {len(columns)} columns: {r}")
    widths = [max(c.width, len(c.head), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        # No trailing blanks: a row may leave its last left-aligned cells empty.
        return gap.join(format(text, f"{c.align}{w}") for text, c, w in zip(cells, columns, widths)).rstrip()

    return [line([c.head for c in columns]), gap.join("-" * w for w in widths)] + [line(r) for r in rows]


def print_text_table(columns: Sequence[Column], rows: Iterable[Sequence[str]], gap: str = "") -> None:
    """Print :func:`text_table`'s lines."""
    print("\n".join(text_table(columns, rows, gap)))


def markdown_table(heads: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table: header, ``|---|`` rule, one line per row."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [line(heads), "|" + "---|" * len(heads)] + [line(r) for r in rows]
