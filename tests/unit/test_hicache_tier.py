"""The HiCache chunk tier without a network store: the value's checks, its pages, the store failing,
and the adapter over SGLang's own ``file`` and ``sim`` backends and a zero-copy stand-in.

* a value of the wrong size, layout, dtype, model, key or checksum is a counted miss, never served;
* a value over several pages: a missing page is ``incomplete``, a flipped byte ``corrupt``; two
  writers whose bytes differ never mix their pages;
* a store that raises or is slow takes the tier out of service for a while (lookups are misses
  without asking it), then it is asked again;
* the adapter moves pages through SGLang's generic calls (``file``: real files; ``sim``: a backend
  that keeps no bytes, so every load fails its checks) and through the v1 zero-copy calls by the
  staging pool's K/V half pointers (a store down at start, or lost, and reconnected:
  ``test_hicache_reconnect.py``);
* the ``RELAXKV_HICACHE_*`` variables, and a bad one as one line.
"""

from __future__ import annotations

import ctypes
import json
import socket
import time

import pytest
import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.tiers import (
    ChunkRecord, Damaged, ModelIdentity, PagedTier, PageStore, TierContext, TieredChunkStore, TierName, ValueLayout,
    decode_value, encode_value,
)
from relaxkv_sglang.cache.tiers.paged import SLOTS, page_keys, value_key
from relaxkv_sglang.cache.tiers.value import value_info
from relaxkv_sglang.cache.sglang.hicache_tier import HiCachePageStore, HiCacheTierConfig, StagingPool
from relaxkv_sglang.cache.sglang.tier_configs import tier_configs_from_env


def hicache_config_from_env(env):
    """The HiCache tier the environment asks for (None: none), through the server's table."""
    return next((c for c in tier_configs_from_env(env) if isinstance(c, HiCacheTierConfig)), None)

SHAPE = (2, 2, 2, 4)  # layers, K/V, kv heads, head dim: 128 bytes a token in float32
IDENT = ModelIdentity("tiny@cfg1", "tok1", "torch.float32", "L2 H2 D4 rope10000")
LAYOUT = ValueLayout.of(IDENT, SHAPE, torch.float32)
PAGE = 2048


def record(seed: int, n: int, start: int = 0) -> ChunkRecord:
    g = torch.Generator().manual_seed(seed)
    return ChunkRecord(torch.randn((n, *SHAPE), generator=g), start)


def chunk(i: int, ns: str | None = None) -> ChunkKey:
    return ChunkKey(ns, (i, i + 1, i + 2))


def key(i: int, ns: str | None = None) -> str:
    """The content key a tier stores ``chunk(i, ns)`` under."""
    return chunk(i, ns).content_key(IDENT.digest)


class DictPages(PageStore):
    """Pages in a dict (a key written once, as Mooncake keeps it); ``fail`` raises on every call,
    ``hang`` (an Event) makes every call wait for it (a store that stalls)."""

    def __init__(self, page_bytes: int = PAGE) -> None:
        self.page_bytes, self.pages, self.fail, self.calls, self.hang = page_bytes, {}, False, 0, None

    def _called(self) -> None:
        self.calls += 1
        if self.hang is not None:
            self.hang.wait(30)
        if self.fail:
            raise ConnectionError("store down")

    def exists(self, keys):
        self._called()
        return [k in self.pages for k in keys]

    def get(self, keys):
        self._called()
        return [self.pages.get(k) for k in keys]

    def put(self, keys, pages):
        self._called()
        for k, p in zip(keys, pages):
            assert len(p) == self.page_bytes
            self.pages.setdefault(k, bytes(p))
        return [True] * len(keys)


# ---------------------------------------------------------------- the value and its checks


def test_value_round_trip_and_every_check():
    r = record(1, 5, start=9)
    value = encode_value(key(1), r, LAYOUT)
    got = decode_value(key(1), value, LAYOUT)
    assert torch.equal(got.kv, r.kv) and got.canonical_start == 9

    def kind(data, k=key(1), layout=LAYOUT):
        with pytest.raises(Damaged) as exc:
            decode_value(k, data, layout)
        return exc.value.kind

    flipped = bytearray(value)
    flipped[-3] ^= 0x01
    assert kind(bytes(flipped)) == "corrupt"  # checksum
    assert kind(value[:-1]) == "corrupt"  # size: one byte short
    assert kind(value + b"\0" * 128) == "corrupt"  # size: a token too many
    assert kind(b"RKVCHNK0" + value[8:]) == "corrupt"  # magic
    assert kind(value[:20]) == "corrupt"  # truncated header
    assert kind(value, k=key(2)) == "foreign"  # another key's value under this key
    assert kind(value, layout=ValueLayout.of(IDENT, (2, 2, 1, 8), torch.float32)) == "foreign"  # layout
    assert kind(value, layout=ValueLayout.of(IDENT, SHAPE, torch.bfloat16)) == "foreign"  # dtype
    other = ModelIdentity("other@cfg2", "tok1", "torch.float32", IDENT.kv_layout)
    assert kind(value, layout=ValueLayout.of(other, SHAPE, torch.float32)) == "foreign"  # model
    with pytest.raises(ValueError):  # a record of another layout is never written
        encode_value(key(1), ChunkRecord(torch.zeros(3, 2, 2, 1, 8)), LAYOUT)


# ---------------------------------------------------------------- pages


def test_values_over_pages_round_trip_and_page_zero_commits():
    store = DictPages()
    tier = PagedTier(store, LAYOUT)
    small, big = record(1, 3, start=4), record(2, 70)  # under one page; about 4.4 pages
    assert tier.batch_exists([key(1), key(2)]) == [False, False]
    assert tier.batch_set([key(1), key(2)], [small, big]) == [True, True]
    assert len(store.pages) == 1 + 5 and tier.batch_exists([key(1), key(2)]) == [True, True]
    got = tier.batch_get([key(1), key(2), key(3)])
    assert torch.equal(got[0].kv, small.kv) and got[0].canonical_start == 4 and torch.equal(got[1].kv, big.kv)
    assert got[2] is None
    s = tier.stats()
    assert s["hits"] == 2 and s["misses"] == 1 and s["writes"] == 2 and s["corrupt"] == s["incomplete"] == 0
    assert tier.set(key(2), big) and tier.stats()["already_present"] == 1  # not written twice
    assert TierName(tier.name) == "hicache" and tier.role.write_through and tier.role.prefetchable


HEAD = value_key(key(1), PAGE)  # page 0 of key(1)'s value, slot 0


def _damaged_tier(damage) -> tuple[PagedTier, DictPages]:
    store = DictPages()
    tier = PagedTier(store, LAYOUT)
    assert tier.set(key(1), record(1, 70))
    damage(store.pages, [k for k in store.pages if k != HEAD])
    return tier, store


@pytest.mark.parametrize("damage, kind", [
    (lambda pages, tail: pages.pop(tail[1]), "incomplete"),  # a page evicted by the store
    (lambda pages, tail: pages.__setitem__(tail[0], bytes(PAGE)), "corrupt"),  # a page of zeros
    (lambda pages, tail: pages.__setitem__(HEAD, b"\xff" * PAGE), "corrupt"),  # page 0 is garbage
    (lambda pages, tail: pages.__setitem__(HEAD, pages[HEAD][:-10] + b"X" + pages[HEAD][-9:]), "corrupt"),
    (lambda pages, tail: pages.__setitem__(HEAD, pages[HEAD].replace(b'"n_tokens": 70', b'"n_tokens": 71')),
     "corrupt"),  # a header that claims another size
])
def test_a_damaged_value_is_a_counted_miss_never_served_and_rewritten_in_the_next_slot(damage, kind, caplog):
    tier, store = _damaged_tier(damage)
    with caplog.at_level("WARNING"):
        assert tier.get(key(1)) is None
    s = tier.stats()
    assert s[kind] == 1 and s["misses"] == 1 and s["hits"] == 0 and s["damaged_slots"] == 1
    assert sum(f"{kind} value" in r.getMessage() for r in caplog.records) == 1  # logged
    damaged = dict(store.pages)
    # never skipped as already present: the chunk, computed again, is written to slot 1 and served
    assert tier.batch_exists([key(1)]) == [False] and tier.get(key(1)) is None and tier.stats()[kind] == 1
    assert tier.set(key(1), record(1, 70)) and tier.stats()["rewrites"] == 1
    assert value_key(key(1), PAGE, 1) in store.pages and all(store.pages[k] == v for k, v in damaged.items())
    assert tier.batch_exists([key(1)]) == [True] and torch.equal(tier.get(key(1)).kv, record(1, 70).kv)
    other = PagedTier(store, LAYOUT)  # another server reads slot 0 damaged, then slot 1
    assert other.get(key(1)) is None and torch.equal(other.get(key(1)).kv, record(1, 70).kv)
    assert other.stats()[kind] == 1 and other.stats()["hits"] == 1


def test_every_slot_damaged_is_absent_for_a_while_then_asked_again():
    now = [0.0]
    store = DictPages()
    tier = PagedTier(store, LAYOUT, bad_ttl_s=60.0, clock=lambda: now[0])
    for slot in range(SLOTS):
        store.pages[value_key(key(1), PAGE, slot)] = b"\xff" * PAGE
        assert tier.get(key(1)) is None
    assert tier.stats()["corrupt"] == SLOTS and tier.stats()["bad_keys"] == 1
    calls = store.calls
    assert tier.batch_exists([key(1)]) == [False] and tier.get(key(1)) is None and not tier.set(key(1), record(1, 3))
    assert store.calls == calls  # absent here: the store is not asked
    for slot in range(SLOTS):
        del store.pages[value_key(key(1), PAGE, slot)]  # the store evicts them
    now[0] = 61.0
    assert tier.set(key(1), record(1, 3)) and torch.equal(tier.get(key(1)).kv, record(1, 3).kv)
    assert value_key(key(1), PAGE, 0) in store.pages and tier.stats()["bad_keys"] == 0


def test_a_header_claiming_2_40_bytes_is_rejected_after_one_page_read():
    """The header's length is bounded by the layout's max_tokens before any other page is asked for."""
    layout = ValueLayout.of(IDENT, SHAPE, torch.float32, max_tokens=4096)
    for n_tokens, payload in [((1 << 40) // 128, 1 << 40), (70, 1 << 40), (-1, 0)]:
        store = DictPages()
        tier = PagedTier(store, layout)
        assert tier.set(key(1), record(1, 70))
        head = store.pages[HEAD]
        forged = head.replace(b'"n_tokens": 70', b'"n_tokens": %d' % n_tokens).replace(
            b'"payload_bytes": 8960', b'"payload_bytes": %d' % payload)
        hlen = int.from_bytes(head[8:12], "little") + len(forged) - len(head)
        store.pages[HEAD] = (forged[:8] + hlen.to_bytes(4, "little") + forged[12:])[:PAGE]
        asked = []
        get = store.get
        store.get = lambda keys: asked.append(len(keys)) or get(keys)
        t0 = time.monotonic()
        assert tier.get(key(1)) is None
        assert asked == [1] and time.monotonic() - t0 < 10  # page 0 only (before: ~4M keys sized by the header)
        assert tier.stats()["corrupt"] == 1 and tier.stats()["misses"] == 1


def test_two_page_sizes_on_one_store_each_share_with_its_own_kind():
    """RELAXKV_HICACHE_PAGE_KB differing between servers on one store: never mis-assembled, never
    skipped as present; each configuration reads what its own kind wrote."""
    pages: dict = {}
    small, big = DictPages(PAGE), DictPages(2 * PAGE)
    small.pages = big.pages = pages  # one store, two page sizes
    a, b = PagedTier(small, LAYOUT), PagedTier(big, LAYOUT)
    ra, rb = record(1, 70), record(1, 70)
    assert a.set(key(1), ra)
    assert b.batch_exists([key(1)]) == [False] and b.get(key(1)) is None  # not another page size's value
    assert b.set(key(1), rb) and b.stats()["writes"] == 1 and b.stats()["already_present"] == 0
    assert torch.equal(b.get(key(1)).kv, rb.kv) and torch.equal(a.get(key(1)).kv, ra.kv)
    a2, b2 = PagedTier(small, LAYOUT), PagedTier(big, LAYOUT)  # two more servers, one of each kind
    assert torch.equal(a2.get(key(1)).kv, ra.kv) and torch.equal(b2.get(key(1)).kv, rb.kv)
    for t in (a, b, a2, b2):
        s = t.stats()
        assert s["corrupt"] == s["foreign"] == s["incomplete"] == s["damaged_slots"] == 0, s
    # and a value of another page size under this one's key (a writer of an older format) is foreign
    pages[value_key(key(2), 2 * PAGE)] = pages[value_key(key(1), PAGE)].replace(key(1).encode(), key(2).encode())
    assert b.get(key(2)) is None and b.stats()["foreign"] == 1


def test_a_value_of_another_layout_is_foreign():
    store = DictPages()
    theirs = PagedTier(store, ValueLayout.of(IDENT, SHAPE, torch.float16))
    assert theirs.set(key(1), ChunkRecord(torch.zeros(5, *SHAPE, dtype=torch.float16)))
    ours = PagedTier(store, LAYOUT)
    assert ours.get(key(1)) is None and ours.stats()["foreign"] == 1


def test_two_writers_whose_bytes_differ_never_mix_pages():
    """Both write the same key at once (page 0 last): the reader gets one writer's whole value."""
    store = DictPages()
    a, b = record(1, 40), record(2, 40)  # the same chunk, computed with different bytes
    va, vb = encode_value(key(1), a, LAYOUT), encode_value(key(1), b, LAYOUT)
    tail_a = page_keys(key(1), value_info(va)[1], 3)
    tail_b = page_keys(key(1), value_info(vb)[1], 3)
    assert not set(tail_a) & set(tail_b)
    w1, w2 = PagedTier(store, LAYOUT), PagedTier(store, LAYOUT)
    store.exists = lambda keys: [False] * len(keys)  # both see it absent and write everything
    assert w1.set(key(1), a) and w2.set(key(1), b)
    got = PagedTier(store, LAYOUT).get(key(1))
    assert torch.equal(got.kv, a.kv)  # page 0 is the first writer's; so are the pages it names


# ---------------------------------------------------------------- the store failing


def test_a_failing_store_is_out_of_service_then_asked_again():
    now = [0.0]
    store = DictPages()
    tier = PagedTier(store, LAYOUT, backoff_s=10.0, clock=lambda: now[0])
    assert tier.set(key(1), record(1, 3))
    store.fail = True
    assert tier.get(key(1)) is None and tier.stats()["errors"] == 1 and tier.stats()["out_of_service"] == 1
    calls = store.calls
    assert tier.batch_exists([key(1)]) == [False] and not tier.set(key(2), record(2, 3))
    assert tier.get(key(1)) is None and store.calls == calls  # not asked while out of service
    assert tier.stats()["unavailable"] == 3 and tier.stats()["hits"] == 0
    store.fail = False
    now[0] = 11.0
    assert tier.get(key(1)) is not None and tier.stats()["out_of_service"] == 0


def test_a_slow_store_is_out_of_service():
    now = [0.0]
    store = DictPages()
    slow_get = store.get

    def get(keys):
        now[0] += 5.0  # every read takes 5 s
        return slow_get(keys)

    store.get = get
    tier = PagedTier(store, LAYOUT, slow_s=2.0, backoff_s=10.0, clock=lambda: now[0])
    assert tier.set(key(1), record(1, 3))
    assert tier.get(key(1)) is not None  # served, but the tier goes out of service
    assert tier.stats()["errors"] == 1 and tier.get(key(1)) is None and tier.stats()["unavailable"] == 1


def test_the_tiered_store_uses_it_by_its_role():
    t = TieredChunkStore([PagedTier(DictPages(), LAYOUT)], IDENT, async_writes=False)
    assert t.names == ["hicache"] and t.can_prefetch
    assert t.publish_wanted(chunk(1)) and t.publish(chunk(1), record(1, 4)) and not t.publish_wanted(chunk(1))
    got, name = t.get(chunk(1))
    assert name == "hicache" and torch.equal(got.kv, record(1, 4).kv)
    stats = t.stats()
    assert stats["tier_hicache_loads"] == 1 and stats["tier_hicache_writes"] == 1
    assert stats["tier_hicache_publishes"] == 1 and stats["tier_hicache_page_bytes"] == PAGE
    t.close()


# ---------------------------------------------------------------- the SGLang adapter


def _ctx() -> TierContext:
    return TierContext(IDENT, SHAPE, torch.float32)


def test_sglang_file_backend_round_trip_and_a_damaged_file(tmp_path):
    cfg = HiCacheTierConfig("file", {"file_storage_path": str(tmp_path)}, page_bytes=PAGE)
    tier = cfg.build(_ctx())
    assert tier is not None and tier.describe() == {
        "backend": "file", "page_bytes": PAGE, "store_connected": 1, "store_lost": 0, "store_timeouts": 0,
        "store_reconnect_attempts": 0, "store_reconnects": 0}
    assert not tier.store.inner.zero_copy
    r = record(3, 70, start=2)
    assert tier.set(key(3), r) and tier.batch_exists([key(3), key(4)]) == [True, False]
    other = cfg.build(_ctx())  # another server on the same store
    got = other.get(key(3))
    assert torch.equal(got.kv, r.kv) and got.canonical_start == 2
    files = sorted(tmp_path.glob("*.bin"))
    assert len(files) == 5 and all(f.stat().st_size == PAGE for f in files)
    tail = next(f for f in files if f".{2}_" in f.name)
    tail.write_bytes(tail.read_bytes()[:100])  # a torn page: the backend's short read
    third = cfg.build(_ctx())
    assert third.get(key(3)) is None and third.stats()["incomplete"] == 1


def test_sglang_sim_backend_keeps_no_bytes_so_nothing_is_served():
    tier = HiCacheTierConfig("sim", {}, page_bytes=PAGE).build(_ctx())
    assert tier.set(key(1), record(1, 3)) and tier.batch_exists([key(1)]) == [True]
    fresh = HiCacheTierConfig("sim", {}, page_bytes=PAGE).build(_ctx())
    fresh.store.inner.backend = tier.store.inner.backend  # the keys are there, the bytes never were
    assert fresh.get(key(1)) is None and fresh.stats()["corrupt"] == 1


class ZeroCopyBackend:
    """A v1 backend as Mooncake drives the pool: two objects per page, the K and V halves, by pointer."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def register_mem_pool_host(self, pool: StagingPool) -> None:
        self.pool = pool

    def batch_exists(self, keys, extra_info=None) -> int:
        return next((i for i, k in enumerate(keys) if f"{k}_k" not in self.objects), len(keys))

    def _halves(self, keys, indices):
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        names = [f"{k}_{h}" for k in keys for h in "kv"]
        assert len(ptrs) == len(names) == 2 * len(keys)
        return zip(names, ptrs, sizes)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        for name, ptr, size in self._halves(keys, host_indices):
            self.objects[name] = ctypes.string_at(ptr, size)
        return [True] * len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        ok = []
        for name, ptr, size in self._halves(keys, host_indices):
            if name in self.objects:
                ctypes.memmove(ptr, self.objects[name], size)
            ok.append(name in self.objects)
        return [all(ok[i: i + 2]) for i in range(0, len(ok), 2)]


def test_zero_copy_convention_moves_pages_by_their_halves_in_turns():
    backend = ZeroCopyBackend()
    pool = StagingPool(2, PAGE)  # two pages a call: a 5-page value moves in three turns
    backend.register_mem_pool_host(pool)
    tier = PagedTier(HiCachePageStore(backend, "mooncake", True, pool), LAYOUT)
    r = record(5, 70)
    assert tier.set(key(5), r) and len(backend.objects) == 10
    pool.kv_buffer.fill_(0xAB)  # stale bytes in the buffer are never taken for a page
    got = tier.get(key(5))
    assert torch.equal(got.kv, r.kv) and tier.get(key(6)) is None


# ---------------------------------------------------------------- configuration


def test_hicache_env(tmp_path):
    extra = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}
    c = hicache_config_from_env({"RELAXKV_HICACHE_STORAGE_BACKEND": "mooncake",
                              "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": json.dumps(extra)})
    assert c.backend == "mooncake" and c.extra_config == {**extra, "local_hostname": "127.0.0.1"}
    assert c.page_bytes == 256 << 10 and c.connect_timeout_s == 30.0
    (tmp_path / "mc.toml").write_text('master_server_address = "127.0.0.1:1"\nprotocol = "tcp"\n')
    c = hicache_config_from_env({"RELAXKV_HICACHE_STORAGE_BACKEND": "mooncake", "RELAXKV_HICACHE_PAGE_KB": "64",
                              "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": f"@{tmp_path}/mc.toml",
                              "RELAXKV_HICACHE_CONNECT_TIMEOUT_S": "5"})
    assert c.extra_config["master_server_address"] == "127.0.0.1:1" and c.page_bytes == 64 << 10
    assert c.connect_timeout_s == 5.0
    assert hicache_config_from_env({}) is None


def test_a_mooncake_client_advertises_its_own_hosts_address_on_the_route_to_the_master():
    """SGLang's default ``localhost`` is unreachable from other hosts (SGLang #23457): the address the kernel
    sends from to the master is advertised, unless the config or the environment names one."""
    from relaxkv_sglang.cache.sglang.hicache_tier import with_local_hostname

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this machine's address on its default route
        s.connect(("192.0.2.77", 9))
        outward = s.getsockname()[0]
    assert outward != "127.0.0.1"
    config = {"master_server_address": "192.0.2.77:50051"}
    assert with_local_hostname("mooncake", config, {}) == {**config, "local_hostname": outward}
    assert with_local_hostname("mooncake", {"master_server_address": "127.0.0.1:50051"}, {})["local_hostname"] \
        == "127.0.0.1"
    named = {**config, "local_hostname": "10.0.0.9"}
    assert with_local_hostname("mooncake", named, {}) is named
    assert with_local_hostname("mooncake", config, {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.8"}) is config
    assert with_local_hostname("file", config, {}) is config
    c = hicache_config_from_env({"RELAXKV_HICACHE_STORAGE_BACKEND": "mooncake",
                                 "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": json.dumps(config)})
    assert c.summary().endswith(f"this host advertised as {outward})")


@pytest.mark.parametrize("env, message", [
    ({"RELAXKV_HICACHE_STORAGE_BACKEND": "mooncake", "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG":
      '{"master_server_address": "50051"}'}, "master_server_address '50051': must be HOST:PORT"),
    ({"RELAXKV_HICACHE_STORAGE_BACKEND": "redis"}, "RELAXKV_HICACHE_STORAGE_BACKEND='redis': must be one of"),
    ({"RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": "{not json"}, "RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG="),
    ({"RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": "[1]"}, "not an object"),
    ({"RELAXKV_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG": "@/no/such.json"}, "No such file"),
    ({"RELAXKV_HICACHE_PAGE_KB": "2"}, "RELAXKV_HICACHE_PAGE_KB='2': must be a whole number >= 4"),
    ({"RELAXKV_HICACHE_CONNECT_TIMEOUT_S": "soon"}, "not a number of seconds"),
])
def test_bad_hicache_env_is_one_line(env, message):
    env = {"RELAXKV_HICACHE_STORAGE_BACKEND": "file", **env}
    with pytest.raises(SystemExit) as exc:
        hicache_config_from_env(env)
    text = str(exc.value)
    assert text.startswith("relaxkv-sglang: ") and message in text and "\n" not in text
