"""Python ``re`` patterns matched by Google RE2 (``google-re2``): linear time, no backtracking.

``re`` backtracks (``(a|aa)+#`` is exponential on a text of ``a``s); RE2 does O(pattern x text) work.
Python's own parser (``re._parser``) reads the pattern and :func:`to_re2` writes the tree in RE2's
syntax, with ``re``'s meaning of ``$ \\Z ^ .`` under their flags and its Unicode ``\\d \\w \\s``.
What has no linear-time matcher (backreferences, lookaround, atomic groups, possessive quantifiers,
conditionals) or what RE2 refuses (a repetition over 1000, a program over :data:`MAX_MEM`) raises
:class:`Unsupported`. Differences from ``re``: ``\\b`` / ``\\B`` are ASCII word boundaries; a ``$``
without ``(?m)`` takes a final newline into the match (``$\\n`` does not match); groups are not captured.
Used by the HTTP process (``sglang_fields.py``, the check) and the scheduler (``stop_regex.py``).
"""

from __future__ import annotations

import functools
import re
import sys
from re import _constants as C  # noqa: N812  (Python 3.11+: sre_constants)
from re import _parser
from typing import Any, Iterable, List, Tuple

import re2

__all__ = ["CACHE_SIZE", "MAX_MEM", "Unsupported", "compile_re2", "to_re2"]

# Compiled patterns per process, each at most MAX_MEM (program and DFA cache; past it RE2's NFA, still
# linear): at most 512 MiB, in practice kilobytes (SGLang: at most 32 patterns of 256 bytes a request).
CACHE_SIZE = 128
MAX_MEM = 4 << 20  # bytes, RE2's max_mem (its default is 8 MiB): a larger program is refused (`pattern too large`)
MAX_CODEPOINT = sys.maxunicode
UNSUPPORTED = {C.GROUPREF: "a backreference", C.GROUPREF_EXISTS: "a conditional group (?(...)...)",
               C.ASSERT: "a lookahead or lookbehind", C.ASSERT_NOT: "a negative lookahead or lookbehind",
               C.ATOMIC_GROUP: "an atomic group (?>...)", C.POSSESSIVE_REPEAT: "a possessive quantifier"}
Ranges = List[Tuple[int, int]]


class Unsupported(ValueError):
    """The pattern uses a construct RE2 cannot match in linear time (or RE2 refuses it)."""


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # RE2 would log each refused pattern to stderr
    options.max_mem = MAX_MEM
    return options


OPTIONS = _options()


@functools.lru_cache(maxsize=None)
def _positive_categories(ascii_only: bool) -> dict:
    """``re``'s ``\\d \\s \\w`` as ranges, read off ``re`` on every code point but the surrogates (never
    in UTF-8 text), once per process."""
    spans = [(0, 0x7F)] if ascii_only else [(0, 0xD7FF), (0xE000, MAX_CODEPOINT)]
    tables: dict = {C.CATEGORY_DIGIT: [], C.CATEGORY_SPACE: [], C.CATEGORY_WORD: []}
    for lo, hi in spans:
        text = "".join(map(chr, range(lo, hi + 1)))
        for category, symbol in ((C.CATEGORY_DIGIT, r"\d+"), (C.CATEGORY_SPACE, r"\s+"), (C.CATEGORY_WORD, r"\w+")):
            tables[category] += [(lo + m.start(), lo + m.end() - 1)
                                 for m in re.finditer(symbol, text, re.ASCII if ascii_only else 0)]
    return tables


def _category(category: Any, ascii_only: bool) -> Ranges:
    """``\\d``/``\\w``/``\\s`` and their negations as ``re`` means them, as ranges."""
    negated = {C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT, C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE,
               C.CATEGORY_NOT_WORD: C.CATEGORY_WORD}
    if category in negated:
        return _complement(_positive_categories(ascii_only)[negated[category]])
    return _positive_categories(ascii_only)[category]


def _merge(ranges: Iterable[Tuple[int, int]]) -> Ranges:
    merged: Ranges = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return out


def _char(c: int) -> str:
    return chr(c) if chr(c).isascii() and chr(c).isalnum() else f"\\x{{{c:x}}}"


def _class(ranges: Ranges, negate: bool = False) -> str:
    """An RE2 class; a negated one stays ``[^...]`` (under ``(?i)`` RE2 folds, then negates, as ``re`` does)."""
    if not ranges:
        ranges, negate = [(0, MAX_CODEPOINT)], not negate  # `[]` is no RE2 syntax
    items = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)
    return f"[{'^' if negate else ''}{items}]"


def _set(items: list, flags: int) -> str:
    ranges, negate = [], False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            ranges.append((av, av))
        elif op is C.RANGE:
            ranges.append(av)
        elif op is C.CATEGORY:
            ranges.extend(_category(av, bool(flags & re.ASCII)))
        else:
            raise Unsupported(f"the set item {op}")
    return _class(_merge(ranges), negate)


def _repeat(body: str, lo: int, hi: int) -> str:
    if hi is C.MAXREPEAT or hi == C.MAXREPEAT:
        quantifier = {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    else:
        quantifier = "?" if (lo, hi) == (0, 1) else (f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")
    return f"(?:{body}){quantifier}"


def _write(items: Iterable, flags: int) -> str:
    """RE2 syntax for a parsed subpattern under Python's ``flags`` (case folding written as ``(?i:``)."""
    out = []
    for op, av in items:
        if op in UNSUPPORTED:
            raise Unsupported(UNSUPPORTED[op])
        if op is C.LITERAL:
            out.append(_char(av))
        elif op is C.NOT_LITERAL:
            out.append(_class([(av, av)], negate=True))
        elif op is C.ANY:
            out.append(r"(?s:.)" if flags & re.DOTALL else r"[^\n]")
        elif op is C.IN:
            out.append(_set(av, flags))
        elif op is C.BRANCH:
            out.append("(?:" + "|".join(_write(branch, flags) for branch in av[1]) + ")")
        elif op is C.SUBPATTERN:
            _group, add, delete, sub = av
            inner = (flags | add) & ~delete
            body = _write(sub, inner)
            if (inner ^ flags) & re.IGNORECASE:
                body = ("(?i:" if inner & re.IGNORECASE else "(?-i:") + body + ")"
            out.append(f"(?:{body})")  # not captured: SGLang reads only whether it matched
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, sub = av
            out.append(_repeat(_write(sub, flags), lo, hi) + ("?" if op is C.MIN_REPEAT else ""))
        elif op is C.AT:
            out.append(_at(av, flags))
        else:
            raise Unsupported(f"the construct {op}")
    return "".join(out)


def _at(code: Any, flags: int) -> str:
    multiline = bool(flags & re.MULTILINE)
    if code is C.AT_BEGINNING:
        return "(?m:^)" if multiline else r"\A"
    if code is C.AT_END:  # Python's `$`: at the end or before a newline that ends the text
        return "(?m:$)" if multiline else r"(?:\n?\z)"
    return {C.AT_BEGINNING_STRING: r"\A", C.AT_END_STRING: r"\z", C.AT_BOUNDARY: r"\b",
            C.AT_NON_BOUNDARY: r"\B"}[code]


def to_re2(pattern: str) -> str:
    """The RE2 pattern that matches what Python's ``re`` pattern matches; raises ``re.error`` (it does not
    compile with ``re``) or :class:`Unsupported`.

    >>> to_re2(r"(?i)end$")
    '(?i:end(?:\\\\n?\\\\z))'
    """
    parsed = _parser.parse(pattern)
    flags = parsed.state.flags
    body = _write(parsed.data, flags)
    return f"(?i:{body})" if flags & re.IGNORECASE else body


@functools.lru_cache(maxsize=CACHE_SIZE)
def compile_re2(pattern: str) -> Any:
    """``pattern`` (Python syntax) compiled with RE2; raises ``re.error`` or :class:`Unsupported` naming why."""
    try:
        translated = to_re2(pattern)
    except Unsupported as exc:
        try:  # RE2's own words when it refuses the pattern as written (`invalid escape sequence: \1`)
            re2.compile(pattern, OPTIONS)
        except (re2.error, UnicodeError) as re2_exc:
            raise Unsupported(f"{exc} ({_message(re2_exc)})") from None
        raise
    except RecursionError as exc:
        raise re.error(f"nested too deeply: {exc}") from None
    try:
        return re2._Regexp(translated, OPTIONS)  # noqa: SLF001  (re2.compile would also cache it, 128 more)
    except (re2.error, UnicodeError) as exc:
        raise Unsupported(_message(exc)) from None


def _message(exc: Exception) -> str:
    text = str(exc.args[0] if exc.args else exc)
    if isinstance(exc.args[0] if exc.args else None, bytes):
        text = exc.args[0].decode("utf-8", "replace")
    return f"RE2: {text}"
