"""A time bound on SGLang's ``stop_regex`` matching, which otherwise can hang its scheduler.

A catastrophically backtracking pattern (``(a|aa)+#`` on ``a``s) holds the scheduler's one thread
until a restart (docs/reliability.md), so ``re`` inside ``schedule_batch.py`` is rebound to
:class:`BoundedRe` (a time-bounded ``regex`` search); a timeout aborts that request with 400
(:func:`around_check_str_based_finish`).

SGLang file touched: ``sglang/srt/managers/schedule_batch.py`` (its module global ``re``, and
``Req._check_str_based_finish``, wrapped).
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any, Callable

import regex

__all__ = ["SEARCH_TIMEOUT_S", "BoundedRe", "StopRegexTimeout", "install", "around_check_str_based_finish"]

SEARCH_TIMEOUT_S = 0.1  # seconds, one stop-regex search on the output
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"


class StopRegexTimeout(Exception):
    """A stop_regex search ran out of its time bound (not an ``re.error``, so SGLang's handler skips it)."""

    def __init__(self, pattern: str, text_len: int) -> None:
        super().__init__(f"stop_regex {pattern!r}: matching it on {text_len} characters of output took more than "
                         f"{SEARCH_TIMEOUT_S} s (it backtracks catastrophically on this text); the request is aborted")
        self.pattern = pattern


class BoundedRe:
    """The ``re`` module inside ``schedule_batch.py``, with a time-bounded ``search``."""

    error = re.error

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: str, string: str, flags: int = 0) -> Any:
        """``re.search`` via ``regex`` (``VERSION0``) with :data:`SEARCH_TIMEOUT_S`; raises
        :class:`StopRegexTimeout` or ``re.error``.

        >>> BoundedRe.search("[0-9]+", "answer: 42").group()
        '42'
        """
        try:
            return regex.search(pattern, string, flags | regex.VERSION0, timeout=SEARCH_TIMEOUT_S)
        except TimeoutError as exc:
            raise StopRegexTimeout(pattern, len(string)) from exc
        except regex.error as exc:
            raise re.error(str(exc)) from exc


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
                         "time bound of relaxkv_sglang/request/sglang/stop_regex.py was written for sglang 0.5.23")
    setattr(module, "re", BoundedRe())


def around_check_str_based_finish(original: Callable[..., bool], req: Any, *args: Any, **kwargs: Any) -> bool:
    """Hook on ``Req._check_str_based_finish``: a timed-out search aborts with 400; SGLang's own abort ends it."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    try:
        finished = original(req, *args, **kwargs)
    except StopRegexTimeout as exc:
        req.finished_reason = FINISH_ABORT(str(exc), HTTPStatus.BAD_REQUEST, "BadRequestError")
        req.finished_len = None
        return True
    return finished or isinstance(req.finished_reason, FINISH_ABORT)
