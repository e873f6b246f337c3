"""A HiCache store that is down, stalls or comes back (issue 48 item 4): the chunk tier reconnects.

* a store down at start is a tier that is down (lookups are misses without asking it, one log
  line), reconnected with backoff and used within seconds once it answers: through SGLang's
  factory with a ``dynamic`` backend stand-in that cannot be built, then can; the same store
  failing mid-run is lost once and used again when it comes back;
* a store that stalls costs a caller at most the call bound (``RELAXKV_HICACHE_CALL_TIMEOUT_S``),
  once; then misses at once until a reconnected store answers;
* the backoff doubles from its first wait up to its bound; the variables, and a bad one as one line.

The Mooncake store started after the server, and its master killed and restarted:
``tests/e2e/test_mooncake_reconnect.py`` (``RELAXKV_MOONCAKE_TESTS=1``).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from test_hicache_tier import IDENT, LAYOUT, PAGE, DictPages, _ctx, key, record

from relaxkv_sglang.cache.tiers import PagedTier, ReconnectingPageStore, StoreUnavailable, TieredChunkStore
from relaxkv_sglang.cache.sglang.hicache_tier import HiCacheTierConfig
from relaxkv_sglang.cache.sglang.tier_configs import tier_configs_from_env


def _wait_until(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` holds; fails the test past ``timeout_s``."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout_s, "not within the bound"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_store_down_at_start_is_a_tier_that_is_down_in_one_line(caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    cfg = HiCacheTierConfig("mooncake", {"master_server_address": f"127.0.0.1:{port}", "protocol": "tcp"},
                            reconnect_max_s=60.0)
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        tier = cfg.build(_ctx())
    try:
        assert time.monotonic() - t0 < 5
        assert tier is not None and tier.describe()["store_connected"] == 0 and tier.describe()["backend"] == "mooncake"
        assert tier.get(key(1)) is None and not tier.set(key(1), record(1, 3))  # misses, without asking
        assert tier.stats()["unavailable"] == 2 and tier.stats()["errors"] == 0
        lines = [r.getMessage() for r in caplog.records if "hicache chunk tier" in r.getMessage()]
        assert len(lines) == 1 and "(backend mooncake) is unavailable" in lines[0] and str(port) in lines[0]
        assert "serving without it, reconnecting every 1 to 60 s" in lines[0]
    finally:
        tier.store.close()


class FlakyBackend(HiCacheStorage):
    """A ``dynamic`` backend stand-in whose pages live in this process: it cannot be built while
    ``DOWN`` (a store not started yet), and each call raises while ``FAIL`` (a store that died)."""

    DOWN = True
    FAIL = False
    PAGES: dict = {}
    BUILT = 0

    def __init__(self, storage_config, kwargs) -> None:
        if FlakyBackend.DOWN:
            raise ConnectionError("connection refused")
        FlakyBackend.BUILT += 1

    def register_mem_pool_host(self, pool) -> None:
        pass

    def on_host_pools_registered(self) -> None:
        pass

    def _check(self) -> None:
        if FlakyBackend.FAIL:
            raise RuntimeError("master gone")  # not an OSError: the adapter takes those for a damaged page

    def get(self, key, target_location=None, target_sizes=None):
        self._check()
        page = FlakyBackend.PAGES.get(key)
        if page is None:
            return None
        target_location.copy_(torch.frombuffer(bytearray(page), dtype=torch.uint8))
        return target_location

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        self._check()
        FlakyBackend.PAGES[key] = value.numpy().tobytes()
        return True

    def batch_exists(self, keys, extra_info=None) -> int:
        self._check()
        return next((i for i, k in enumerate(keys) if k not in FlakyBackend.PAGES), len(keys))

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    batch_get = batch_set = None  # SGLang's deprecated batch calls: the tier never makes them


def _hanging_backend() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class HangingBackend(HiCacheStorage):
        """A ``dynamic`` backend whose constructor never returns in time (a store that does not answer)."""

        def __init__(self, storage_config, kwargs) -> None:
            time.sleep(30)

        get = batch_get = set = batch_set = exists = None  # never reached

    return HangingBackend


def __getattr__(name: str):  # the factory imports the class by name from this module
    if name == "HangingBackend":
        return _hanging_backend()
    raise AttributeError(name)


def test_a_backend_that_hangs_at_start_is_given_up_after_the_timeout(caplog):
    extra = {"backend_name": "hang", "module_path": __name__, "class_name": "HangingBackend"}
    cfg = HiCacheTierConfig("dynamic", extra, connect_timeout_s=0.5)
    with caplog.at_level("WARNING"):
        tier = cfg.build(_ctx())
    tier.store.close()
    assert tier.describe()["store_connected"] == 0
    assert any("not ready after" in r.getMessage() for r in caplog.records)


def test_a_store_started_after_the_server_is_used_within_seconds(caplog):
    """Issue 48 item 4: a store down at start (SGLang's factory fails to build the backend) is
    reconnected with backoff and used once it answers, with one log line per change of state."""
    FlakyBackend.DOWN, FlakyBackend.FAIL, FlakyBackend.PAGES, FlakyBackend.BUILT = True, False, {}, 0
    extra = {"backend_name": "flaky", "module_path": __name__, "class_name": "FlakyBackend"}
    cfg = HiCacheTierConfig("dynamic", extra, page_bytes=PAGE, reconnect_max_s=0.2)
    with caplog.at_level("WARNING"):
        tier = cfg.build(_ctx())
        try:
            assert tier is not None and tier.describe()["store_connected"] == 0
            assert not tier.set(key(1), record(1, 70)) and tier.get(key(1)) is None
            # attempts keep failing while it is down (0.2 s apart at most; waited for, not slept on:
            # a loaded machine runs the reconnect thread late)
            _wait_until(lambda: tier.describe()["store_reconnect_attempts"] >= 2, timeout_s=10)
            assert tier.describe()["store_reconnects"] == 0 and tier.describe()["store_connected"] == 0
            FlakyBackend.DOWN = False  # the store starts
            took = _wait_until(lambda: tier.describe()["store_connected"] == 1, timeout_s=5)
            assert took < 2.0  # within one wait of the bound (0.2 s) and a build, on a busy machine
            r = record(1, 70)
            assert tier.set(key(1), r) and torch.equal(tier.get(key(1)).kv, r.kv)  # used: written, read back
            assert FlakyBackend.BUILT == 1 and len(FlakyBackend.PAGES) == 5
            d = tier.describe()
            assert d["store_reconnects"] == 1 and d["store_lost"] == 0 and d["backend"] == "dynamic"

            FlakyBackend.FAIL = True  # the store dies mid-run: lost once, misses meanwhile
            assert tier.get(key(1)) is None and tier.get(key(1)) is None
            assert tier.describe()["store_lost"] == 1 and tier.stats()["hits"] == 1
            FlakyBackend.FAIL = False  # ... and comes back: a new backend, used again
            _wait_until(lambda: tier.describe()["store_connected"] == 1, timeout_s=5)
            assert torch.equal(tier.get(key(1)).kv, r.kv) and FlakyBackend.BUILT == 2
            assert tier.describe()["store_reconnects"] == 2
        finally:
            tier.store.close()
    lines = [r.getMessage() for r in caplog.records if "hicache chunk tier (backend dynamic)" in r.getMessage()]
    assert len(lines) == 4, lines  # down at start, back, failed, back: one line each, none per attempt
    assert "is unavailable" in lines[0] and "is back" in lines[1] and "failed" in lines[2] and "is back" in lines[3]


def test_no_call_waits_on_a_stalled_store_past_the_bound():
    """A store that stalls (a dead Mooncake master: about 4 s a call) costs a caller at most the
    bound, once; then lookups are misses at once until the reconnected store answers."""
    first, second = DictPages(), DictPages()
    built = []

    def connect():
        built.append(1)
        return second

    store = ReconnectingPageStore(connect, PAGE, name="test store", store=first, call_timeout_s=0.3,
                                  backoff_min_s=0.05, backoff_max_s=0.05)
    tier = PagedTier(store, LAYOUT, slow_s=0.3)
    try:
        r = record(2, 40)
        assert tier.set(key(2), r)
        first.hang = threading.Event()  # the store stalls
        t0 = time.monotonic()
        assert tier.get(key(2)) is None
        assert 0.25 < time.monotonic() - t0 < 1.5  # the bound, not the stall (30 s)
        d = store.describe()
        assert d["store_timeouts"] == 1 and d["store_lost"] == 1 and tier.stats()["errors"] == 0
        _wait_until(lambda: store.connected, timeout_s=5)  # reconnected: the new store answers
        second.pages.update(first.pages)
        assert torch.equal(tier.get(key(2)).kv, r.kv) and len(built) == 1
        down = ReconnectingPageStore(connect, PAGE, backoff_min_s=60, backoff_max_s=60)
        with pytest.raises(StoreUnavailable):
            down.get([key(2)])  # down: no call made
        down.close()
        assert len(built) == 1
    finally:
        first.hang.set()
        store.close()


def test_reconnect_backoff_doubles_up_to_its_bound():
    class Waits:
        """``closed.wait`` recorded: returns at once, and ends the loop after 6 waits."""

        def __init__(self) -> None:
            self.delays = []

        def wait(self, delay):
            self.delays.append(delay)
            return len(self.delays) > 6

        def set(self):
            pass

        def is_set(self):
            return False

    def down():
        raise ConnectionError("refused")

    store = ReconnectingPageStore(down, PAGE, store=DictPages(), backoff_min_s=1.0, backoff_max_s=8.0)  # up: no thread
    store.closed = Waits()
    store._reconnect()  # the reconnect thread's loop, on this thread
    assert store.closed.delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert store.describe()["store_reconnect_attempts"] == 6 and store.describe()["store_reconnects"] == 0


def test_the_tiered_store_reports_the_connection():
    store = ReconnectingPageStore(lambda: DictPages(), PAGE, info={"backend": "x"}, store=DictPages())
    t = TieredChunkStore([PagedTier(store, LAYOUT)], IDENT, async_writes=False)
    stats = t.stats()
    assert stats["tier_hicache_store_connected"] == 1 and stats["tier_hicache_backend"] == "x"
    assert stats["tier_hicache_store_lost"] == stats["tier_hicache_store_reconnects"] == 0
    t.close()
    store.close()


def test_reconnect_env():
    base = {"RELAXKV_HICACHE_STORAGE_BACKEND": "file"}
    c = HiCacheTierConfig.from_env(base)
    assert c.call_timeout_s == 2.0 and c.reconnect_max_s == 30.0
    c = HiCacheTierConfig.from_env({**base, "RELAXKV_HICACHE_CALL_TIMEOUT_S": "0.5",
                                    "RELAXKV_HICACHE_RECONNECT_MAX_S": "5"})
    assert c.call_timeout_s == 0.5 and c.reconnect_max_s == 5.0
    for name, raw, message in [("RELAXKV_HICACHE_CALL_TIMEOUT_S", "0", "must be > 0"),
                               ("RELAXKV_HICACHE_RECONNECT_MAX_S", "soon", "not a number of seconds")]:
        with pytest.raises(SystemExit) as exc:
            tier_configs_from_env({**base, name: raw})
        text = str(exc.value)
        assert text.startswith(f"relaxkv-sglang: {name}=") and message in text and "\n" not in text
