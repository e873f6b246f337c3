"""A page store that may be down: calls bounded in time, reconnected with backoff when it is lost.

A network store (a HiCache backend such as Mooncake) can be down at start, die mid-run or stall a
call, and the scheduler thread waits for each lookup (docs/experiments/INDEX.md#store-call-timeout).
Up, each call runs on a worker thread, waited at most ``call_timeout_s``; one that raises or overruns
makes the store down (the overrunning call finishes unwaited). Down, every call raises
:class:`~.storage.StoreUnavailable` at once while one thread calls ``connect``, after ``backoff_min_s``
and then doubling up to ``backoff_max_s``; the first store built makes it up. One log line per change
of state. Standard library only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional, Sequence

from relaxkv_sglang.cache.tiers.paged import PageStore
from relaxkv_sglang.cache.tiers.storage import StoreUnavailable

__all__ = ["ReconnectingPageStore"]

logger = logging.getLogger(__name__)

CALL_WORKERS = 4  # the scheduler, the writer and the prefetch threads, and one spare


class ReconnectingPageStore(PageStore):
    def __init__(self, connect: Callable[[], PageStore], page_bytes: int, *, name: str = "store",
                 info: Optional[dict] = None, store: Optional[PageStore] = None, why_down: str = "not connected",
                 call_timeout_s: float = 2.0,
                 backoff_min_s: float = 1.0, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``connect`` builds a connected store or raises; ``info``: what :meth:`describe` reports while down;
        ``store``: connected already, or None (down: reconnecting starts now, ``why_down`` logged)."""
        if not (call_timeout_s > 0 and 0 < backoff_min_s <= backoff_max_s):
            raise ValueError("need call_timeout_s > 0 and 0 < backoff_min_s <= backoff_max_s")
        self.connect, self.page_bytes, self.name, self.info = connect, page_bytes, name, dict(info or {})
        self.call_timeout_s, self.backoff_min_s, self.backoff_max_s = call_timeout_s, backoff_min_s, backoff_max_s
        self.clock = clock
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.inner: Optional[PageStore] = None
        self.workers: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.generation = 0  # which connection a call ran on: only a failure of the current one counts
        self.reconnector: Optional[threading.Thread] = None
        self.down_since = clock()
        self.counters = dict(store_lost=0, store_timeouts=0, store_reconnect_attempts=0, store_reconnects=0)
        if store is not None:
            self._up(store)
        else:
            logger.warning("relaxkv: the %s is unavailable (%s); serving without it, reconnecting every "
                           "%g to %g s", name, why_down, backoff_min_s, backoff_max_s)
            self._start_reconnecting()


    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call("exists", keys)

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        return self._call("get", keys)

    def put(self, keys: Sequence[str], pages: Sequence[bytes]) -> list[bool]:
        return self._call("put", keys, pages)

    @property
    def connected(self) -> bool:
        with self.lock:
            return self.inner is not None

    def describe(self) -> dict:
        """``info``, the store's own description while up, ``store_connected`` and the counters."""
        with self.lock:
            inner, counters = self.inner, dict(self.counters)
        own = inner.describe() if inner is not None else {}
        return {**self.info, **own, "store_connected": int(inner is not None), **counters}

    def close(self) -> None:
        """Stop reconnecting; the workers finish what they run."""
        self.closed.set()
        with self.lock:
            workers, self.workers, self.inner = self.workers, None, None
        if workers is not None:
            workers.shutdown(wait=False)


    def _call(self, method: str, *args):
        """``inner.method(*args)`` on a worker, waited for at most ``call_timeout_s`` (module doc)."""
        with self.lock:
            inner, workers, generation = self.inner, self.workers, self.generation
        if inner is None or workers is None:
            raise StoreUnavailable(f"the {self.name} is down")
        try:
            future = workers.submit(getattr(inner, method), *args)
        except RuntimeError:  # the workers were shut down by a loss on another thread just now
            raise StoreUnavailable(f"the {self.name} is down") from None
        try:
            return future.result(timeout=self.call_timeout_s)
        except concurrent.futures.TimeoutError:
            self._lost(generation, f"{method} took longer than {self.call_timeout_s:g} s", timed_out=True)
        except Exception as exc:  # noqa: BLE001 - a store failing is a loss, never a request error
            self._lost(generation, f"{method} raised {type(exc).__name__}: {exc}")
        raise StoreUnavailable(f"the {self.name} is down")

    def _up(self, store: PageStore) -> None:
        with self.lock:
            self.inner = store
            self.workers = concurrent.futures.ThreadPoolExecutor(CALL_WORKERS, thread_name_prefix="relaxkv-store-call")
            self.generation += 1

    def _lost(self, generation: int, why: str, timed_out: bool = False) -> None:
        with self.lock:
            if timed_out:
                self.counters["store_timeouts"] += 1
            if generation != self.generation or self.inner is None:
                return  # another call noticed first, or it was reconnected since
            inner, workers = self.inner, self.workers
            self.inner, self.workers = None, None
            self.counters["store_lost"] += 1
            self.down_since = self.clock()
        if workers is not None:
            workers.shutdown(wait=False)  # a stuck call keeps its thread until it returns
        close = getattr(inner, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - it is being dropped
                pass
        logger.warning("relaxkv: the %s failed (%s); lookups are misses, reconnecting every %g to %g s",
                       self.name, why, self.backoff_min_s, self.backoff_max_s)
        self._start_reconnecting()

    def _start_reconnecting(self) -> None:
        with self.lock:
            if self.reconnector is not None and self.reconnector.is_alive():
                return
            self.reconnector = threading.Thread(target=self._reconnect, name="relaxkv-store-reconnect", daemon=True)
            self.reconnector.start()

    def _reconnect(self) -> None:
        """Call ``connect`` with backoff until it gives a store (module doc)."""
        delay, attempts = self.backoff_min_s, 0
        while not self.closed.wait(delay):
            attempts += 1
            with self.lock:
                self.counters["store_reconnect_attempts"] += 1
            try:
                store = self.connect()
            except Exception as exc:  # noqa: BLE001 - still down; the next attempt waits longer
                logger.debug("relaxkv: reconnecting the %s: %s: %s", self.name, type(exc).__name__, exc)
                delay = min(2 * delay, self.backoff_max_s)
                continue
            if self.closed.is_set():
                return
            with self.lock:
                self.counters["store_reconnects"] += 1
                seconds = self.clock() - self.down_since
                self.reconnector = None  # a loss after this starts a new thread
            self._up(store)
            logger.warning("relaxkv: the %s is back (attempt %d, %.1f s after it went down); using it again",
                           self.name, attempts, seconds)
            return
