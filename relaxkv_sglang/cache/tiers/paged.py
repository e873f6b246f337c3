"""A tier over a store of fixed-size pages: how chunk values live in a HiCache storage backend.

HiCache backends (Mooncake, 3FS, NIXL, a folder, ...) store one object of a fixed size per key. A
chunk's value (:mod:`.value`) is laid over ``ceil(len(value) / P)`` pages of ``P = page_bytes``, the
last zero-padded::

    page 0 under  V = <key>-p<P>[-r<s>]      value[0 : P]      (the header and the start of the KV)
    page i under  V.<tag>.<i>               value[i*P : (i+1)*P],   i = 1 .. n-1
    tag = the header's crc32 of the KV, 8 hex chars; s = the slot (below), absent for slot 0

Page 0 is written last (present = complete when written); writers of different KV bytes have
different tags, so a header never meets another writer's KV. A load checks page 0's header alone
(:func:`~.value.check_header`) before asking for the rest in one batch; ``incomplete``, ``corrupt`` or
``foreign`` is a counted, logged miss.

HiCache has no delete and a backend may keep a damaged key, so a chunk has ``SLOTS`` places: damage
in slot ``s`` sends this server to ``s + 1``, all damaged makes the chunk absent for ``bad_ttl_s``. A
store call raising or slower than ``slow_s`` takes the tier out of service for ``backoff_s``
(docs/reliability.md, "Lower tiers: faults and restarts").
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Optional, Sequence, TypeVar

from relaxkv_sglang.cache.tiers.names import TierName
from relaxkv_sglang.cache.tiers.record import ChunkRecord
from relaxkv_sglang.cache.tiers.storage import StoreUnavailable
from relaxkv_sglang.cache.tiers.tier import Tier, TierRole
from relaxkv_sglang.cache.tiers.value import (
    PREFIX_BYTES, Damaged, ValueLayout, check_header, decode_value, encode_value, value_info,
)

__all__ = ["PageStore", "PagedTier", "page_keys", "split_pages", "value_key"]

logger = logging.getLogger(__name__)

BAD_KEYS_KEPT = 4096
SLOTS = 2  # places a chunk's value may be written in (module doc)
_T = TypeVar("_T")


class PageStore(ABC):
    """Pages of ``page_bytes`` bytes by string key (a HiCache backend, or a dict in tests): methods raise
    when the store fails; an absent or unreadable key is ``False`` / ``None`` in the answer."""

    page_bytes: int

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each page is stored."""

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """Each page's bytes, or None."""

    @abstractmethod
    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> list[bool]:
        """Store each page; False where it was not stored."""

    def describe(self) -> dict:
        return {}


def value_key(key: str, page_bytes: int, slot: int = 0) -> str:
    """The store key of page 0 of chunk ``key``'s value (module doc)."""
    return f"{key}-p{page_bytes}" if slot == 0 else f"{key}-p{page_bytes}-r{slot}"


def page_keys(head_key: str, crc: int, n_pages: int) -> list[str]:
    """The store keys of a value's pages 1..n-1 (module doc)."""
    return [f"{head_key}.{crc:08x}.{i}" for i in range(1, n_pages)]


def split_pages(value: bytes, page_bytes: int) -> list[bytes]:
    pages = [value[i: i + page_bytes] for i in range(0, len(value), page_bytes)]
    pages[-1] = pages[-1].ljust(page_bytes, b"\0")
    return pages


class PagedTier(Tier):
    name = TierName.HICACHE
    role = TierRole(write_through=True, prefetchable=True)

    def __init__(self, store: PageStore, layout: ValueLayout, *, slow_s: float = 2.0, backoff_s: float = 10.0,
                 bad_ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``layout``: this server's (its page size taken from the store); the times: module doc."""
        if store.page_bytes < PREFIX_BYTES + 1024:
            raise ValueError(f"page_bytes {store.page_bytes} cannot hold a value's header")
        self.store = store
        self.layout = dataclasses.replace(layout, page_bytes=store.page_bytes)
        self.slow_s, self.backoff_s, self.bad_ttl_s, self.clock = slow_s, backoff_s, bad_ttl_s, clock
        self.lock = threading.Lock()  # counters and state: the scheduler, writer and prefetch threads
        self.down_until = 0.0
        # chunk key -> (slots found damaged, when the last was): the slot used is the next one
        self.bad: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.counters = dict(hits=0, misses=0, hit_bytes=0, writes=0, written_bytes=0, already_present=0,
                             rejected=0, write_errors=0, corrupt=0, foreign=0, incomplete=0, errors=0,
                             unavailable=0, rewrites=0)


    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def count_write_error(self) -> None:
        self._count("write_errors")

    def _call(self, what: str, fn: Callable[[], _T], default: _T) -> _T:
        """``fn()`` unless the tier is out of service; a raise or a slow call takes it out (module doc)."""
        now = self.clock()
        with self.lock:
            if now < self.down_until:
                self.counters["unavailable"] += 1
                return default
            back = self.down_until > 0.0
            self.down_until = 0.0
        if back:
            logger.warning("relaxkv: asking the %s tier's store again", self.name)
        try:
            out = fn()
        except StoreUnavailable:  # down and reconnecting on its own (reconnect.py), which logs it
            self._count("unavailable")
            return default
        except Exception as exc:  # noqa: BLE001 - the store failing is a miss, never a request error
            self._out_of_service(f"{what} raised {type(exc).__name__}: {exc}")
            return default
        seconds = self.clock() - now
        if seconds > self.slow_s:
            self._out_of_service(f"{what} took {seconds:.1f} s")
        return out

    def _out_of_service(self, why: str) -> None:
        with self.lock:
            self.counters["errors"] += 1
            self.down_until = self.clock() + self.backoff_s
        logger.warning("relaxkv: the %s tier's store failed (%s); lookups are misses for %.0f s",
                       self.name, why, self.backoff_s)


    def _slot(self, key: str) -> int:
        """The slot this server reads and writes ``key`` in; ``SLOTS`` when every one is damaged."""
        with self.lock:
            found = self.bad.get(key)
            if found is None:
                return 0
            slots, since = found
            if slots >= SLOTS and self.clock() - since > self.bad_ttl_s:
                del self.bad[key]  # ask slot 0 again: the store may have evicted the damaged values
                return 0
            return slots

    def _value_key(self, key: str, slot: int) -> str:
        return value_key(key, self.store.page_bytes, slot)

    def _mark_bad(self, key: str, slot: int, kind: str, why: str) -> None:
        with self.lock:
            self.counters[kind] += 1
            self.counters["misses"] += 1
            seen = self.counters[kind]
            slots = max(self.bad.get(key, (0, 0.0))[0], slot + 1)
            self.bad[key] = (slots, self.clock())
            self.bad.move_to_end(key)
            while len(self.bad) > BAD_KEYS_KEPT:
                self.bad.popitem(last=False)
        if math.log10(seen).is_integer():  # the 1st, 10th, 100th, ... of each kind
            logger.warning("relaxkv: %s value in the %s tier's store (%s) under %s; a miss, never served "
                           "(%d so far)%s", kind, self.name, why, self._value_key(key, slot), seen,
                           f"; slot {slot + 1} next" if slot + 1 < SLOTS else "; the chunk is absent here for a while")


    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        asked = {k: self._value_key(k, slot) for k in keys if (slot := self._slot(k)) < SLOTS}
        heads = list(asked.values())
        found = dict(zip(heads, self._call("exists", lambda: self.store.exists(heads), [False] * len(heads))
                         if heads else []))
        return [k in asked and found.get(asked[k], False) for k in keys]

    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        keys = list(keys)
        slots = {k: slot for k in keys if (slot := self._slot(k)) < SLOTS}
        asked = [self._value_key(k, slot) for k, slot in slots.items()]
        got = self._call("get", lambda: self.store.get(asked), [None] * len(asked)) if asked else []
        heads = dict(zip(slots, got))
        page_lists: dict[str, tuple[int, list[str]] | Damaged] = {}
        for key, head in heads.items():
            if head is None:
                continue
            try:  # the header alone, before any other page is asked for (module doc)
                length, crc = check_header(key, head, self.layout)
            except Damaged as exc:
                page_lists[key] = exc
                continue
            n_pages = -(-length // self.store.page_bytes)
            page_lists[key] = (length, page_keys(self._value_key(key, slots[key]), crc, n_pages))
        wanted = [k for listed in page_lists.values() if not isinstance(listed, Damaged) for k in listed[1]]
        got = self._call("get", lambda: self.store.get(wanted), [None] * len(wanted)) if wanted else []
        pages = dict(zip(wanted, got))
        return [self._assemble(k, slots.get(k, SLOTS), heads.get(k), page_lists.get(k), pages) for k in keys]

    def _assemble(self, key: str, slot: int, head: Optional[bytes],
                  page_list: tuple[int, list[str]] | Damaged | None,
                  pages: dict[str, Optional[bytes]]) -> Optional[ChunkRecord]:
        """One key's record from its pages, checked; None (counted) if absent, incomplete or damaged."""
        if head is None or page_list is None:
            self._count("misses")
            return None
        if isinstance(page_list, Damaged):
            self._mark_bad(key, slot, page_list.kind, str(page_list))
            return None
        length, tail = page_list
        rest = [pages.get(k) for k in tail]
        if any(p is None for p in rest):
            self._mark_bad(key, slot, "incomplete", f"{sum(p is None for p in rest)} of {len(rest) + 1} pages missing")
            return None
        data = b"".join([head, *rest])[:length]
        try:
            record = decode_value(key, data, self.layout)
        except Damaged as exc:
            self._mark_bad(key, slot, exc.kind, str(exc))
            return None
        with self.lock:
            self.counters["hits"] += 1
            self.counters["hit_bytes"] += len(data)
        return record

    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        return [self._set(k, r) for k, r in zip(keys, records)]

    def _set(self, key: str, record: ChunkRecord) -> bool:
        slot = self._slot(key)
        if slot >= SLOTS:
            return False  # every slot holds a damaged value: absent here for a while (module doc)
        head_key = self._value_key(key, slot)
        present = self._call("exists", lambda: self.store.exists([head_key]), None)
        if present is None:  # out of service, or the store failed: not written
            return False
        if present[0]:
            self._count("already_present")
            return True
        try:
            value = encode_value(key, record, self.layout)
        except ValueError:
            self._count("rejected")
            return False
        pages = split_pages(value, self.store.page_bytes)
        keys = page_keys(head_key, value_info(value)[1], len(pages)) + [head_key]  # page 0 last: it commits
        pages = pages[1:] + pages[:1]
        ok = self._call("put", lambda: self.store.put(keys, pages), [False] * len(keys))
        if not all(ok):
            self._count("write_errors")
            return False
        with self.lock:
            self.counters["writes"] += 1
            self.counters["written_bytes"] += len(value)
            self.counters["rewrites"] += int(slot > 0)
        return True

    def delete(self, key: str) -> bool:
        """HiCache's interface has no delete: the key is only forgotten here (module doc)."""
        return False

    def stats(self) -> dict:
        with self.lock:
            out = dict(self.counters, bad_keys=sum(slots >= SLOTS for slots, _ in self.bad.values()),
                       damaged_slots=len(self.bad), out_of_service=int(self.clock() < self.down_until))
        return out

    def describe(self) -> dict:
        return {**self.store.describe(), "page_bytes": self.store.page_bytes}
