"""A time bound on SGLang's ``stop_regex`` matching, which otherwise can hang its scheduler.

SGLang 0.5.23 matches each ``stop_regex`` with ``re.search`` on the decoded output at every decode
step, in the scheduler's one thread (``Req._check_str_based_finish``); a pattern that backtracks
catastrophically on the output it meets (``(a|aa)+#`` on ``a``s) holds that thread until a restart
(docs/reliability.md has the cases). Whether it blows up depends on the text, so the bound is
where the matching runs: inside ``schedule_batch.py`` the name ``re`` is rebound to
:class:`BoundedRe`, whose ``search`` runs the ``regex`` package (``VERSION0``, ``re``'s syntax)
with a timeout of :data:`SEARCH_TIMEOUT_S`; everything else is ``re``'s. A timeout raises
:class:`StopRegexTimeout`, which :func:`around_check_str_based_finish` turns into SGLang's abort
of that request (400 naming ``stop_regex``), so a step spends at most about that bound per bad
request, once; the hook also keeps SGLang's abort of a pattern that fails to compile. The HTTP side
(:func:`~relaxkv_sglang.request.sglang.sglang_fields.check_sglang_fields`) refuses patterns either
package cannot compile.

SGLang file touched: ``sglang/srt/managers/schedule_batch.py`` (its module global ``re``, and
``Req._check_str_based_finish``, wrapped).
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any, Callable

import regex

__all__ = ["SEARCH_TIMEOUT_S", "BoundedRe", "StopRegexTimeout", "install", "around_check_str_based_finish"]

SEARCH_TIMEOUT_S = 0.1  # one stop-regex search on the output; a decode step on a GPU is ~10-50 ms
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"


class StopRegexTimeout(Exception):
    """A stop_regex search ran out of its time bound (not an ``re.error``: SGLang's own handler of
    those must not see it; :func:`around_check_str_based_finish` does)."""

    def __init__(self, pattern: str, text_len: int) -> None:
        super().__init__(f"stop_regex {pattern!r}: matching it on {text_len} characters of output took more than "
                         f"{SEARCH_TIMEOUT_S} s (it backtracks catastrophically on this text); the request is aborted")
        self.pattern = pattern


class BoundedRe:
    """Stands in for the ``re`` module inside ``schedule_batch.py``: ``search`` is time-bounded,
    every other attribute is ``re``'s."""

    error = re.error

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: str, string: str, flags: int = 0) -> Any:
        """``re.search`` with the ``regex`` package (``VERSION0``) and a timeout of
        :data:`SEARCH_TIMEOUT_S`; raises :class:`StopRegexTimeout` when it runs out, ``re.error``
        when the pattern does not compile.

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
    """Rebind ``re`` in SGLang's ``schedule_batch`` module to :class:`BoundedRe` (idempotent); stops
    the server at startup when the module no longer matches with ``re`` as 0.5.23 does."""
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
    """Hook on ``Req._check_str_based_finish`` (whether a stop string or stop regex finished the
    request this step): a stop-regex search out of time aborts the request with status 400, and an
    abort SGLang set there (a pattern that failed to compile) ends the step's checks."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    try:
        finished = original(req, *args, **kwargs)
    except StopRegexTimeout as exc:
        req.finished_reason = FINISH_ABORT(str(exc), HTTPStatus.BAD_REQUEST, "BadRequestError")
        req.finished_len = None
        return True
    return finished or isinstance(req.finished_reason, FINISH_ABORT)
