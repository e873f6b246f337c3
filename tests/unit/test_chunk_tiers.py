"""Unit tests for relaxkv_sglang.cache.tiers: keys, host tier, disk tier, faults, admission, the tiered store."""

from __future__ import annotations

import errno
import multiprocessing
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import types

import pytest
import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.sglang.tier_configs import build_tiers
from relaxkv_sglang.cache.tiers import (
    AsyncWriter, ChunkRecord, DiskTier, DiskTierConfig, FrequencySketch, HostTier, HostTierConfig, ModelIdentity,
    TieredChunkStore, TierName, disk as disk_module, simulate_tier,
)
from relaxkv_sglang.cache.tiers.value import DEFAULT_MAX_TOKENS

SHAPE = (2, 2, 2, 4)  # layers, K/V, kv heads, head dim
TOKEN_BYTES = 2 * 2 * 2 * 4 * 4
IDENT = ModelIdentity("tiny@cfg1", "tok1", "torch.float32", "L2 H2 D4 rope10000")
OTHER = ModelIdentity("other@cfg2", "tok1", "torch.float32", "L2 H2 D4 rope10000")


def record(seed: int, n: int, start: int = 0) -> ChunkRecord:
    g = torch.Generator().manual_seed(seed)
    return ChunkRecord(torch.randn((n, *SHAPE), generator=g), start)


def chunk(i: int, ns: str | None = None) -> ChunkKey:
    return ChunkKey(ns, (i, i + 1, i + 2))


def key(i: int, ns: str | None = None) -> str:
    """The content key a tier stores ``chunk(i, ns)`` under."""
    return chunk(i, ns).content_key(IDENT.digest)


def content_key(identity: ModelIdentity, ns: str | None, tokens) -> str:
    return ChunkKey(ns, tokens).content_key(identity.digest)


def disk(tmp_path, capacity=1 << 20, identity=IDENT, **kw) -> DiskTier:
    return DiskTier(tmp_path / "chunks", capacity, identity, SHAPE, torch.float32, **kw)


def tiered(host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0, **kw) -> TieredChunkStore:
    """The store the server builds from its configuration: a host tier above a disk tier."""
    configs = [HostTierConfig(host_bytes), DiskTierConfig(disk_dir, disk_bytes)]
    pool_kv = types.SimpleNamespace(token_shape=SHAPE, dtype=torch.float32)
    return build_tiers(configs, pool_kv, IDENT, DEFAULT_MAX_TOKENS, **kw)


# ---------------------------------------------------------------- keys


def test_chunk_key_covers_identity_namespace_and_tokens():
    base = content_key(IDENT, None, [1, 2, 3])
    assert base == ChunkKey(None, torch.tensor([1, 2, 3])).content_key(IDENT.digest)  # deterministic
    assert len(base) == 64 and int(base, 16) >= 0
    # what is on disk and in Mooncake stays readable: the content key's bytes never change
    assert IDENT.digest == "25627f1388b7566a83eadeccbdd83183"
    assert base == "0ea423b1944c7fcadeec773e7de5f232a140ac8a3fb57d06470884b1fda29482"
    tenant = content_key(IDENT, "tenant-a", [1, 2, 3])
    assert tenant == "c9465de9cfa72eddf9f2f03817636f7563a3bf13f68e995f466af8b660fd5ad1"
    others = {
        content_key(IDENT, "", [1, 2, 3]),  # "" is not the default namespace
        content_key(IDENT, "tenant-a", [1, 2, 3]),
        content_key(IDENT, None, [1, 2, 4]),
        content_key(IDENT, None, [1, 2]),
        content_key(OTHER, None, [1, 2, 3]),
        content_key(ModelIdentity("tiny@cfg1", "tok2", "torch.float32", IDENT.kv_layout), None, [1, 2, 3]),
        content_key(ModelIdentity("tiny@cfg1", "tok1", "torch.bfloat16", IDENT.kv_layout), None, [1, 2, 3]),
        content_key(ModelIdentity("tiny@cfg1", "tok1", "torch.float32", "L2 H2 D4 rope500000"), None, [1, 2, 3]),
    }
    assert base not in others and len(others) == 8
    # token boundaries are unambiguous (length-prefixed 64-bit ids)
    assert content_key(IDENT, None, [256]) != content_key(IDENT, None, [0, 1])


# ---------------------------------------------------------------- host tier


def test_host_tier_round_trip_and_bound():
    tier = HostTier(10 * TOKEN_BYTES + 7, SHAPE, torch.float32, policy="lru")
    assert tier.capacity_tokens == 10 and tier.capacity_bytes == 10 * TOKEN_BYTES
    r = record(1, 4, start=3)
    assert tier.set(key(1), r)
    got = tier.get(key(1))
    assert torch.equal(got.kv, r.kv) and got.canonical_start == 3
    assert tier.set(key(2), record(2, 4)) and tier.used_bytes == 8 * TOKEN_BYTES
    tier.get(key(1))  # key(2) is now the least recently used
    assert tier.set(key(3), record(3, 4))  # evicts key(2)
    assert tier.batch_exists([key(1), key(2), key(3)]) == [True, False, True]
    assert torch.equal(tier.get(key(3)).kv, record(3, 4).kv) and torch.equal(tier.get(key(1)).kv, r.kv)
    assert tier.used_bytes <= tier.capacity_bytes
    assert not tier.set(key(4), record(4, 11))  # larger than the tier
    s = tier.stats()
    assert (s["evictions"], s["rejected"], s["entries"]) == (1, 1, 2)
    tier.clear()
    assert tier.used_bytes == 0 and tier.get(key(1)) is None


def test_tinylfu_rejects_a_one_shot_key_but_admits_a_frequent_one():
    tier = HostTier(8 * TOKEN_BYTES, SHAPE, torch.float32, policy="tinylfu")
    for i in (1, 2):
        for _ in range(3):
            tier.record_access(key(i))
        assert tier.set(key(i), record(i, 4))
    tier.record_access(key(9))  # seen once
    assert not tier.would_admit(key(9), 4) and not tier.set(key(9), record(9, 4))
    for _ in range(5):
        tier.record_access(key(8))
    assert tier.set(key(8), record(8, 4))  # more frequent than the victim
    assert tier.batch_exists([key(1), key(2), key(8), key(9)]) == [False, True, True, False]


def test_frequency_sketch_counts_and_forgets():
    sketch = FrequencySketch(width=64, sample_size=100)
    for _ in range(7):
        sketch.increment("a")
    assert sketch.estimate("a") >= 7 and sketch.estimate("zz-never") <= 1
    for i in range(200):
        sketch.increment(f"noise{i}")
    assert sketch.estimate("a") < 7  # halved at least once


def _flood_trace(seed: int, warm: int, requests: int, per_request: int, one_shots: int) -> list[str]:
    """Each request: ``per_request`` Zipf-popular warm documents and ``one_shots`` never-again keys."""
    rng = random.Random(seed)
    weights = [1 / (r + 1) for r in range(warm)]
    trace, fresh = [], 0
    for _ in range(requests):
        trace += [f"warm{d}" for d in rng.choices(range(warm), weights, k=per_request)]
        for _ in range(one_shots):
            trace.append(f"once{fresh}")
            fresh += 1
    return trace


def test_tinylfu_resists_one_shot_floods_better_than_lru():
    # 100 warm documents, a tier of 40; every request also brings 3 keys never seen again.
    trace = _flood_trace(0, warm=100, requests=400, per_request=5, one_shots=3)
    lru = simulate_tier(trace, 40, "lru")
    tlfu = simulate_tier(trace, 40, "tinylfu")
    warm_lookups = sum(k.startswith("warm") for k in trace)
    assert tlfu["hits"] / warm_lookups > lru["hits"] / warm_lookups + 0.15, (lru, tlfu)
    # without a flood it costs little against LRU
    calm = _flood_trace(1, warm=100, requests=400, per_request=5, one_shots=0)
    lru_c, tlfu_c = simulate_tier(calm, 40, "lru"), simulate_tier(calm, 40, "tinylfu")
    assert tlfu_c["hit_rate"] >= lru_c["hit_rate"] - 0.02, (lru_c, tlfu_c)


def test_host_tier_resident_memory_stays_within_its_bound():
    """RSS of a process that pushes 4x the bound through a 128 MiB tier grows by at most 10% over it."""
    script = textwrap.dedent("""
        import torch
        from relaxkv_sglang.cache.tiers import ChunkRecord, HostTier
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        shape = (2, 2, 2, 32)
        chunk = torch.randn(128, *shape)  # 128 tokens, 128 KiB
        bound = 128 << 20
        before = rss()
        tier = HostTier(bound, shape, torch.float32, policy="lru")
        for i in range(4 * bound // (chunk.numel() * 4)):
            tier.set(f"{i:064x}", ChunkRecord(chunk + i))
            if i % 7 == 0:
                tier.get(f"{i // 2:064x}")
        print(rss() - before, tier.used_bytes, bound)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    growth, used, bound = map(int, out)
    assert used > 0.95 * bound
    assert growth <= 1.10 * bound, f"RSS grew {growth / 2**20:.1f} MiB over a {bound / 2**20:.0f} MiB tier"


# ---------------------------------------------------------------- disk tier


def test_disk_round_trip_layout_and_recency(tmp_path):
    d = disk(tmp_path)
    r = record(5, 6, start=17)
    assert d.set(key(5), r)
    path = pathlib.Path(d.path(key(5)))
    assert path.is_file() and path.parent.name == key(5)[:2]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp.")]
    got = d.get(key(5))
    assert torch.equal(got.kv, r.kv) and got.canonical_start == 17
    assert d.batch_exists([key(5), key(6)]) == [True, False]
    # a new process view (restart) finds it
    d2 = disk(tmp_path)
    assert d2.stats()["entries"] == 1 and torch.equal(d2.get(key(5)).kv, r.kv)


@pytest.mark.parametrize("damage", ["truncate_payload", "truncate_header", "flip_byte", "garbage", "empty"])
def test_damaged_file_is_a_miss_removed_and_counted(tmp_path, damage):
    d = disk(tmp_path)
    d.set(key(1), record(1, 5))
    path = pathlib.Path(d.path(key(1)))
    data = bytearray(path.read_bytes())
    if damage == "truncate_payload":
        data = data[:-10]
    elif damage == "truncate_header":
        data = data[:20]
    elif damage == "flip_byte":
        data[-3] ^= 0x40
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert d.get(key(1)) is None
    assert not path.exists()
    s = d.stats()
    assert s["corrupt"] == 1 and s["misses"] == 1 and s["entries"] == 0 and s["bytes_held"] == 0


def test_foreign_model_file_is_a_miss_removed_and_counted(tmp_path):
    theirs = disk(tmp_path / "a", identity=OTHER)
    other_key = content_key(OTHER, None, [1, 2, 3])
    theirs.set(other_key, record(1, 5))
    ours = disk(tmp_path / "b")
    mine = content_key(IDENT, None, [1, 2, 3])
    dst = pathlib.Path(ours.path(mine))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(pathlib.Path(theirs.path(other_key)).read_bytes())  # renamed into our key
    assert ours.get(mine) is None and not dst.exists()
    assert ours.stats()["foreign"] == 1
    # another layout (same identity) is foreign too
    wide = DiskTier(tmp_path / "c", 1 << 20, IDENT, (2, 2, 2, 8), torch.float32)
    wide.set(mine, ChunkRecord(torch.zeros(3, 2, 2, 2, 8)))
    dst.write_bytes(pathlib.Path(wide.path(mine)).read_bytes())
    assert ours.get(mine) is None and ours.stats()["foreign"] == 2


def test_disk_bound_evicts_least_recently_used_and_refuses_oversized(tmp_path):
    one = len(disk(tmp_path / "probe").encode(key(0), record(0, 8)))
    d = disk(tmp_path, capacity=3 * one + 10, rescan_s=0.0)
    now_ns = time.time_ns()
    for i in range(3):
        assert d.set(key(i), record(i, 8))
        # Distinct mtimes set, not slept for: 30, 20, 10 s ago (a file system's timestamp
        # granularity can be a second or more).
        stamp = now_ns - (3 - i) * 10_000_000_000
        os.utime(d.path(key(i)), ns=(stamp, stamp))
    d.get(key(0))  # touched now: key(1) is the oldest
    assert d.set(key(3), record(3, 8))
    assert d.batch_exists([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    s = d.stats()
    assert s["bytes_held"] <= d.capacity_bytes and s["evictions"] == 1
    total = sum(p.stat().st_size for p in pathlib.Path(d.root).rglob("*.kv"))
    assert total <= d.capacity_bytes
    assert not d.set(key(9), record(9, 40))  # larger than the bound: refused, nothing evicted
    assert d.stats()["rejected"] == 1 and d.get(key(9)) is None and d.stats()["entries"] == 3


def test_write_error_leaves_no_file_and_is_counted(tmp_path, monkeypatch):
    d = disk(tmp_path)

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "fsync", no_space)
    assert not d.set(key(1), record(1, 4))
    monkeypatch.undo()
    assert d.stats()["write_errors"] == 1 and d.get(key(1)) is None
    assert not list(pathlib.Path(d.root).rglob("*"))  or not [p for p in pathlib.Path(d.root).rglob("*") if p.is_file()]


def test_stale_temp_files_of_dead_writers_are_removed_at_startup(tmp_path):
    d = disk(tmp_path)
    d.set(key(1), record(1, 4))
    folder = pathlib.Path(d.path(key(1))).parent
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = folder / f".tmp.{key(2)}.{proc.pid}.abcd1234"
    live = folder / f".tmp.{key(3)}.{os.getpid()}.abcd1234"
    dead.write_bytes(b"partial")
    live.write_bytes(b"in flight")
    d2 = disk(tmp_path)
    assert not dead.exists() and live.exists() and d2.stats()["stale_tmp_removed"] == 1
    assert d2.stats()["entries"] == 1


def _writer_process(root: str, seed: int, n: int, capacity: int) -> None:
    d = DiskTier(root, capacity, IDENT, SHAPE, torch.float32, rescan_s=0.0)
    rng = random.Random(seed)
    for _ in range(n):
        i = rng.randrange(40)
        d.set(key(i), record(i, 3 + i % 5))
        j = rng.randrange(40)
        got = d.get(key(j))
        if got is not None and not torch.equal(got.kv, record(j, 3 + j % 5).kv):
            raise SystemExit(f"wrong record served for {j}")
    sys.exit(0)


def test_two_processes_sharing_a_directory_under_concurrent_writes(tmp_path):
    root = str(tmp_path / "shared")
    one = len(disk(tmp_path / "probe").encode(key(0), record(0, 7)))
    capacity = 15 * one  # about a third of the 40 keys fit: both evict all the time
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(root, s, 150, capacity)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)  # a hang guard: each spawned process imports torch (23 s in all on a loaded 2-core machine)
    assert [p.exitcode for p in procs] == [0, 0]
    d = DiskTier(root, capacity, IDENT, SHAPE, torch.float32)
    files = list(pathlib.Path(root).rglob("*.kv"))
    assert files and not list(pathlib.Path(root).rglob(".tmp.*"))
    for f in files:  # every file that survived is whole and correct
        i = next(i for i in range(40) if key(i) == f.stem)
        assert torch.equal(d.get(key(i)).kv, record(i, 3 + i % 5).kv)
    assert d.stats()["corrupt"] == 0 and d.stats()["foreign"] == 0
    # each process kept its own view under the bound; both together may overshoot by what the other wrote
    assert sum(f.stat().st_size for f in files) <= 2 * capacity


def test_kill_9_during_writes_leaves_only_complete_chunks(tmp_path):
    root = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        from test_chunk_tiers import IDENT, SHAPE, key, record
        from relaxkv_sglang.cache.tiers import DiskTier
        d = DiskTier({str(root)!r}, 1 << 30, IDENT, SHAPE, torch.float32)
        i = 0
        while True:
            d.set(key(i), record(i, 200))
            print(i, flush=True)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(30):  # let it write a while
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # a write cut short (a temp file, as a killed writer leaves it) must not be served
    partial = root / key(10_000)[:2] / f".tmp.{key(10_000)}.{proc.pid}.dead0000"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"RKVCHNK1 partial")
    d = DiskTier(root, 1 << 30, IDENT, SHAPE, torch.float32)
    files = list(root.rglob("*.kv"))
    assert len(files) >= 30 and not list(root.rglob(".tmp.*"))
    for f in files:
        i = next(i for i in range(len(files) + 5) if key(i) == f.stem)
        assert torch.equal(d.get(key(i)).kv, record(i, 200).kv)
    assert d.get(key(10_000)) is None and d.stats()["corrupt"] == 0


# ---------------------------------------------------------------- writer and the tiered store


def test_async_writer_drains_and_drops_when_full(tmp_path):
    d = disk(tmp_path)
    w = AsyncWriter(d, max_queued_bytes=10 * 4 * TOKEN_BYTES)
    for i in range(5):
        assert w.submit(key(i), record(i, 4))
    assert w.drain(10) and w.pending() == 0
    assert all(d.batch_exists([key(i) for i in range(5)]))
    small = AsyncWriter(d, max_queued_bytes=TOKEN_BYTES)
    assert not small.submit(key(7), record(7, 4)) and small.dropped == 1
    w.close()
    small.close()


def test_tiered_store_spill_publish_load_and_isolation(tmp_path):
    t = tiered(host_bytes=8 * TOKEN_BYTES, disk_dir=str(tmp_path / "d"),
                         disk_bytes=1 << 20)
    ka, kb = ChunkKey("tenant-a", (1, 2, 3)), ChunkKey("tenant-b", (1, 2, 3))
    assert ka != kb
    r = record(1, 3, start=4)
    assert t.publish_wanted(ka) and t.publish(ka, r)
    assert not t.publish_wanted(ka)  # queued or on disk
    assert t.writers[TierName.DISK].drain(10)
    got, tier = t.get(ka)
    assert tier == "disk" and torch.equal(got.kv, r.kv) and got.canonical_start == 4
    assert t.get(kb) == (None, None)  # another namespace never loads it
    assert t.spill_wanted(ka) == "host" and t.spill(ka, got, "host")
    got, tier = t.get(ka)
    assert tier == "host" and torch.equal(got.kv, r.kv)
    t.clear_exclusive()
    assert t.get(ka)[1] == "disk"
    s = t.stats()
    assert s["tier_host_loads"] == 1 and s["tier_disk_loads"] == 2 and s["tier_host_spills"] == 1
    assert s["tier_disk_loaded_tokens"] == 6 and s["tier_disk_load_seconds"] > 0
    assert s["tier_disk_pending_writes"] == 0
    t.close()


def test_tiered_store_without_host_spills_to_disk(tmp_path):
    t = tiered(disk_dir=str(tmp_path / "d"), disk_bytes=1 << 20,
                         async_writes=False)
    k = ChunkKey(None, (4, 5))
    assert t.names == [TierName.DISK] and t.spill_wanted(k) == "disk"
    assert t.spill(k, record(4, 2), "disk")
    assert t.spill_wanted(k) is None
    assert torch.equal(t.get(k)[0].kv, record(4, 2).kv)


def test_prefetch_stages_disk_reads_for_a_later_get(tmp_path):
    t = tiered(host_bytes=8 * TOKEN_BYTES, disk_dir=str(tmp_path / "d"),
                         disk_bytes=1 << 20, async_writes=False, max_staged_bytes=2 * 4 * TOKEN_BYTES)
    keys = [chunk(i) for i in range(4)]
    for i, k in enumerate(keys):
        t.publish(k, record(i, 4))
    # Queued under the stage lock: the prefetch thread can read but not stage until all are
    # queued. Otherwise it may stage two records while prefetch() is still looping, and then
    # prefetch() sees the stage full and queues fewer than 4 (thread scheduling).
    with t.stage.lock:
        assert t.prefetch(keys + [chunk(99)]) == 4  # chunk(99) is on no tier
    deadline = time.monotonic() + 60
    while (t.stage.inflight or t.stage.q.qsize()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not t.stage.inflight and t.stage.q.qsize() == 0, "the prefetch thread did not finish in 60 s"
    s = t.stats()
    assert s["tier_disk_prefetched"] == 4 and s["tier_disk_prefetch_dropped"] == 2  # bound: two staged
    assert s["tier_disk_staged_bytes"] == 2 * 4 * TOKEN_BYTES
    got, tier = t.get(keys[3])
    assert tier == "disk" and torch.equal(got.kv, record(3, 4).kv)
    assert t.stats()["tier_disk_prefetch_used"] == 1 and t.stats()["tier_disk_hits"] == 4  # no second read
    got, tier = t.get(keys[0])  # dropped from the stage: read again
    assert tier == "disk" and t.stats()["tier_disk_hits"] == 5 and torch.equal(got.kv, record(0, 4).kv)
    t.clear_staged()
    assert t.stats()["tier_disk_staged_bytes"] == 0
    t.close()


# ---------------------------------------------------------------- one vocabulary, tiers as a list


def test_tier_names_are_one_vocabulary_and_map_once_to_sglang():
    from relaxkv_sglang.cache.tiers import LOWER_TIERS, split_hits
    from relaxkv_sglang.cache.sglang.cache_source import by_cache_source, sglang_cache_source

    assert [str(t) for t in TierName] == ["device", "host", "disk", "hicache"]
    assert LOWER_TIERS == (TierName.HOST, TierName.DISK, TierName.HICACHE)
    assert TierName.DISK == "disk" and {"disk": 1}[TierName.DISK] == 1 and f"tier_{TierName.HOST}_x" == "tier_host_x"
    # a window's hits: each lower tier capped by what is left, the device gets the rest
    assert split_hits(10, {TierName.HOST: 3, TierName.DISK: 4}) == {"device": 3, "host": 3, "disk": 4, "hicache": 0}
    assert split_hits(5, {"host": 4, "disk": 4}) == {"device": 0, "host": 4, "disk": 1, "hicache": 0}
    assert split_hits(9, {"hicache": 5}) == {"device": 4, "host": 0, "disk": 0, "hicache": 5}
    assert [sglang_cache_source(t) for t in TierName] == ["device", "host", "storage", "storage"]
    assert by_cache_source(split_hits(6, {"disk": 2})) == {"device": 4, "host": 0, "storage": 2}
    assert HostTier.role.exclusive and not HostTier.role.write_through
    assert DiskTier.role.write_through and DiskTier.role.prefetchable and not DiskTier.role.exclusive


def test_a_tier_added_to_the_list_is_used_by_its_role(tmp_path):
    """Adding a tier is one class: a write-through dict tier below the disk gets every publish and
    the loads the tiers above it miss, counted under its own name."""
    from relaxkv_sglang.cache.tiers import Tier, TierRole

    class DictTier(Tier):
        name = TierName.DEVICE  # any distinct member; a real tier adds its own to TierName
        role = TierRole(write_through=True)

        def __init__(self):
            self.data, self.counters = {}, dict(rejected=0)

        def batch_exists(self, keys):
            return [k in self.data for k in keys]

        def batch_get(self, keys):
            return [self.data.get(k) for k in keys]

        def batch_set(self, keys, records):
            self.data.update(zip(keys, records))
            return [True] * len(keys)

        def delete(self, key):
            return self.data.pop(key, None) is not None

        def stats(self):
            return dict(entries=len(self.data))

    host = HostTier(8 * TOKEN_BYTES, SHAPE, torch.float32)
    remote = DictTier()
    t = TieredChunkStore([host, disk(tmp_path), remote], IDENT, async_writes=False)
    assert t.names == ["host", "disk", "device"] and t.can_prefetch
    k = chunk(1)
    assert t.publish_wanted(k) and t.publish(k, record(1, 3))
    assert key(1) in remote.data and not t.publish_wanted(k)
    t.tier(TierName.DISK).delete(key(1))
    got, tier = t.get(k)
    assert tier is remote.name and torch.equal(got.kv, record(1, 3).kv)
    assert t.spill_wanted(k) == "host" and t.spill(k, got, "host") and t.where(k) == "host"
    t.taken(k, "host")  # loaded into the pool: the exclusive host tier gives its copy up
    assert not host.exists(key(1)) and key(1) in remote.data  # the write-through copy stays
    s = t.stats()
    assert s["tier_device_publishes"] == 1 and s["tier_device_loads"] == 1 and s["tier_device_entries"] == 1
    assert "tier_device_prefetched" not in s and s["tier_host_spills"] == 1
    with pytest.raises(ValueError):
        TieredChunkStore([host, HostTier(8 * TOKEN_BYTES, SHAPE, torch.float32)], IDENT)
    t.close()
