"""Parallel-encoding joins matched by content: which branches a joined request starts with.

SGLang's frontend joins forks with ids no server request carries (:mod:`.parallel_encoding`), so
:class:`JoinRegistry` ties commits, pending joins and the joined request by text: a text
``P + b_0 + ... + b_{n-1} + rest`` whose every ``P + b_i`` is a recent commit consumes the join
(the rules: ``docs/api.md`` section 5). All state is bounded (the ``MAX_*`` constants, LRU) and
lives in one HTTP process."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Iterator, Optional

from relaxkv_sglang.request.segments import common_prefix_len

__all__ = ["JoinRegistry"]

MAX_COMMITS = 512
MAX_COMMIT_CHARS = 8_000_000
RECENT_COMMITS = 64  # commits a join may take its branches from (the last ones before it)
MAX_PENDING = 64
PENDING_TTL_S = 300.0
MAX_JOINED = 256
MAX_JOINED_CHARS = 4_000_000
MAX_MATCH_STEPS = 20_000  # branch comparisons one request may cost while joins are pending


@dataclasses.dataclass(eq=False)
class _PendingJoin:
    n: int
    deadline: float
    candidates: list[tuple[str, str]]  # (branch commit, its fork point), most recent first


class JoinRegistry:
    """Commits, pending joins and joined prefixes, matched by content. Thread-safe."""

    def __init__(
        self,
        *,
        max_commits: int = MAX_COMMITS,
        max_commit_chars: int = MAX_COMMIT_CHARS,
        recent_commits: int = RECENT_COMMITS,
        max_pending: int = MAX_PENDING,
        pending_ttl_s: float = PENDING_TTL_S,
        max_joined: int = MAX_JOINED,
        max_joined_chars: int = MAX_JOINED_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_commits = max_commits
        self.max_commit_chars = max_commit_chars
        self.max_pending = max_pending
        self.pending_ttl_s = pending_ttl_s
        self.max_joined = max_joined
        self.max_joined_chars = max_joined_chars
        self._clock = clock
        self._lock = threading.Lock()
        # commit text -> its fork point (the same str object as that commit's key, or "")
        self._commits: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._commit_chars = 0
        self._recent: collections.deque[str] = collections.deque(maxlen=recent_commits)
        self._pending: collections.deque[_PendingJoin] = collections.deque()
        # joined prefix -> branch spans inside it
        self._joined: collections.OrderedDict[str, tuple[tuple[int, int], ...]] = collections.OrderedDict()
        self._joined_chars = 0

    def commit(self, text: str) -> None:
        """Remember a committed text (a fork point or a branch)."""
        if not text or len(text) > self.max_commit_chars:
            return
        with self._lock:
            if text in self._commits:
                self._commits.move_to_end(text)
                parent = self._commits[text]
            else:
                parent = ""
                for key in self._commits:
                    if len(parent) < len(key) < len(text) and text.startswith(key):
                        parent = key
                self._commits[text] = parent
                self._commit_chars += len(text)
            if parent in self._commits:
                self._commits.move_to_end(parent)  # a fork point outlives its branches
            self._recent.append(text)
            while len(self._commits) > self.max_commits or self._commit_chars > self.max_commit_chars:
                old, _ = self._commits.popitem(last=False)
                self._commit_chars -= len(old)
                for join in self._pending:  # hold no text the LRU has dropped
                    join.candidates = [c for c in join.candidates if c[0] is not old and c[1] is not old]

    def join(self, n_branches: int) -> None:
        """Record a pending join of ``n_branches`` branches (the route)."""
        if n_branches < 1:
            return
        with self._lock:
            now = self._clock()
            self._expire(now)
            seen: set[str] = set()
            candidates = []
            for text in reversed(self._recent):
                if text not in seen and text in self._commits:
                    seen.add(text)
                    candidates.append((text, self._commits[text]))
            self._pending.append(_PendingJoin(n_branches, now + self.pending_ttl_s, candidates))
            while len(self._pending) > self.max_pending:
                self._pending.popleft()

    def _expire(self, now: float) -> None:
        if any(p.deadline <= now for p in self._pending):
            self._pending = collections.deque(p for p in self._pending if p.deadline > now)

    def spans_for(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the joined branches at the start of ``text``, or []."""
        if not text:
            return []
        with self._lock:
            if self._pending:
                self._expire(self._clock())
                spans = self._match_pending(text)
                if spans:
                    return spans
            for key in reversed(self._joined):
                if text.startswith(key):
                    self._joined.move_to_end(key)
                    return list(self._joined[key])
            return []

    def _match_pending(self, text: str) -> list[tuple[int, int]]:
        budget = [MAX_MATCH_STEPS]
        for join in reversed(self._pending):  # the most recent join first
            spans = _match_join(text, join, budget)
            if spans:
                self._pending.remove(join)
                self._remember_joined(text[: spans[-1][1]], spans)
                return spans
            if budget[0] <= 0:
                break
        return []

    def _remember_joined(self, key: str, spans: list[tuple[int, int]]) -> None:
        if key in self._joined:
            self._joined.move_to_end(key)
            return
        if len(key) > self.max_joined_chars:
            return
        self._joined[key] = tuple(spans)
        self._joined_chars += len(key)
        while len(self._joined) > self.max_joined or self._joined_chars > self.max_joined_chars:
            old, _ = self._joined.popitem(last=False)
            self._joined_chars -= len(old)

    def stats(self) -> dict:
        """Sizes of the registry's state (commits, pending joins, joined prefixes)."""
        with self._lock:
            return {
                "commits": len(self._commits), "commit_chars": self._commit_chars,
                "pending_joins": len(self._pending), "joined_prefixes": len(self._joined),
                "joined_chars": self._joined_chars,
            }


def _fork_points(
    text: str, first: str, parent: str, candidates: list[str], n: int, budget: list[int],
) -> Iterator[int]:
    """Lengths of the fork point ``P`` to try when ``first`` (= ``P + b_0``) starts ``text``: the recorded
    one, then (the interpreter often commits none) a common prefix of ``first`` and a branch ``D`` after
    which ``text`` continues past ``first`` with ``D[len(P):]``."""
    if parent:
        yield len(parent)
    if n < 2:
        return
    pos = len(first)
    for other in candidates:
        common = common_prefix_len(first, other)
        if common >= len(other) or common >= len(first):
            continue  # the same text, or one a prefix of the other: no sibling of `first`
        for plen in range(common, -1, -1):
            budget[0] -= 1
            if budget[0] < 0:
                return
            if text.startswith(other[plen : plen + 16], pos) and text.startswith(other[plen:], pos):
                yield plen
                break


def _match_join(text: str, join: _PendingJoin, budget: list[int]) -> list[tuple[int, int]]:
    """Spans of ``join.n`` branches at the start of ``text`` (after their fork point), or []."""
    candidates = [c for c, _ in join.candidates]
    for first, parent in join.candidates:
        if not text.startswith(first):
            continue
        tried: set[int] = set()
        for plen in _fork_points(text, first, parent, candidates, join.n, budget):
            if plen in tried or plen >= len(first):
                continue
            tried.add(plen)
            fork_point = first[:plen]
            branches = [c[plen:] for c in candidates if len(c) > plen and c.startswith(fork_point)]
            rest = _match_branches(text, len(first), branches, join.n - 1, budget)
            if rest is not None:
                return [(plen, len(first))] + rest
            if budget[0] <= 0:
                return []
    return []


def _match_branches(
    text: str, pos: int, branches: list[str], n: int, budget: list[int],
) -> Optional[list[tuple[int, int]]]:
    """Depth-first, iterative: ``n`` comes from the client and must not exhaust the recursion limit."""
    if n == 0:
        return []
    spans: list[tuple[int, int]] = []  # the branches matched so far, one per level below the top
    stack = [0]  # per level: index of the next branch to try
    while stack:
        i = stack[-1]
        if i == len(branches):  # this level is exhausted: backtrack
            stack.pop()
            if spans:
                spans.pop()
            continue
        stack[-1] = i + 1
        budget[0] -= 1
        if budget[0] < 0:
            return None
        start = spans[-1][1] if spans else pos
        if text.startswith(branches[i], start):
            spans.append((start, start + len(branches[i])))
            if len(spans) == n:
                return spans
            stack.append(0)
    return None
