"""SGLang's ``stop_regex`` matching bounded by work: Google RE2 (linear time) instead of Python's ``re``,
whose backtracking can hold the scheduler's one thread for ever (docs/reliability.md). :class:`BoundedRe`,
bound as ``schedule_batch``'s ``re``, searches with RE2 (:mod:`relaxkv_sglang.request.linear_regex`), never
cut short, so the answer does not depend on the load. A pattern without a linear-time matcher gets HTTP 400
before it runs (``sglang_fields``); one that reached the scheduler anyway raises ``re.error`` (a 400 abort).

SGLang file touched: ``managers/schedule_batch.py`` (its module global ``re``)."""

from __future__ import annotations

import re
from typing import Any

from relaxkv_sglang.request.linear_regex import Unsupported, compile_re2

__all__ = ["BoundedRe", "install"]

SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"


class BoundedRe:
    """The ``re`` module inside ``schedule_batch.py``, with an RE2 ``search``."""

    error = re.error

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: str, string: str, flags: int = 0) -> Any:
        """The whole match's span as ``re`` gives it; ``re.error`` if ``re`` or RE2 cannot compile it.

        >>> BoundedRe.search("[0-9]+", "answer: 42").span()
        (8, 10)
        """
        if flags:
            raise re.error("relaxkv-sglang: stop_regex matching takes no flags (SGLang passes none)")
        try:
            compiled = compile_re2(pattern)
        except Unsupported as exc:  # not refused by the HTTP check: SGLang aborts the request (400)
            raise re.error(f"uses a construct with no linear-time matcher: {exc}") from None
        try:
            return compiled.search(string)
        except UnicodeEncodeError:  # lone surrogates: not UTF-8; one U+FFFD each keeps the offsets
            return compiled.search(re.sub("[\ud800-\udfff]", "\ufffd", string))


def install() -> None:
    """Rebind ``re`` in ``schedule_batch`` to :class:`BoundedRe` (idempotent); stops on a mismatch."""
    import importlib
    import inspect

    module = importlib.import_module(SCHEDULE_BATCH)
    current = getattr(module, "re", None)
    if isinstance(current, BoundedRe):
        return
    source = inspect.getsource(module)
    if current is not re or "re.search(stop_regex_str, tail_str)" not in source:
        raise SystemExit(f"relaxkv-sglang: {module.__file__} no longer matches stop_regex with re.search; the "
                         "RE2 matching of relaxkv_sglang/request/sglang/stop_regex.py was written for sglang 0.5.23")
    setattr(module, "re", BoundedRe())
