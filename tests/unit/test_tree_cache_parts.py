"""The tree cache's parts, each without SGLang: the pool-KV accessor, chunk reuse and publish,
the movement between tiers, admission pins and hold, and the one eviction order.

The whole cache, with SGLang's real pools, is tests/unit/test_tree_cache_property.py.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import PoolChunkIndex
from relaxkv_sglang.model.rope import RopeSpec, rotate_keys
from relaxkv_sglang.cache.tiers import DiskTierConfig, HostTierConfig, ModelIdentity, TieredChunkStore, TierName
from relaxkv_sglang.cache.tiers.value import DEFAULT_MAX_TOKENS
from relaxkv_sglang.cache.sglang.tier_configs import build_tiers
from relaxkv_sglang.request.schema import PLAN_KEY
from relaxkv_sglang.cache.sglang.chunk_reuse import ChunkReuse
from relaxkv_sglang.cache.sglang.eviction import EvictionOrder
from relaxkv_sglang.cache.sglang.pins import AdmissionHold, AdmissionPins
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV
from relaxkv_sglang.request.plan import RequestPlan
from relaxkv_sglang.cache.sglang.tier_movement import TierMovement

ROPE = RopeSpec(head_dim=4)
SLOTS = 32


class _Pool:
    """The KV pool surface PoolKV reads: per-layer K/V buffers [slots, heads, dim]."""

    def __init__(self, slots: int = SLOTS, layers: int = 2, heads: int = 2, dim: int = 4, v_dim: int = 4):
        self.start_layer, self.layer_num = 0, layers
        self.k = [torch.randn(slots, heads, dim) for _ in range(layers)]
        self.v = [torch.randn(slots, heads, v_dim) for _ in range(layers)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


class _Slots:
    """A free list of pool slots (SGLang's allocator, reduced to alloc and free)."""

    def __init__(self, n: int = SLOTS):
        self.free_list = list(range(1, n))

    def alloc(self, n: int):
        if len(self.free_list) < n:
            return None
        out, self.free_list = self.free_list[:n], self.free_list[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.free_list += slots.tolist()


def _req(rid: str, tokens: list[int], spans: list[int], prefix_len: int = 0, policy: str = "pic"):
    """A stand-in for SGLang's Req with the fields the plan and the pins read."""
    params = {PLAN_KEY: RequestPlan(policy, tuple(zip(spans[::2], spans[1::2])))}
    return SimpleNamespace(rid=rid, origin_input_ids=tokens, prefix_len=prefix_len, extra_key=None,
                           cache_salt=None, sampling_params=SimpleNamespace(custom_params=params))


# ------------------------------------------------------------------ PoolKV


def test_pool_kv_round_trip_and_rotation():
    pool, rope = _Pool(), RopeSpec(head_dim=4)
    io = PoolKV(pool, rope)
    assert io.token_shape == (2, 2, 2, 4) and "layers=2" in io.layout()
    src, dst = torch.tensor([1, 3, 5]), torch.tensor([10, 11, 12])
    record = io.read(src, canonical_start=7)
    assert record.canonical_start == 7 and record.kv.shape == (3, 2, 2, 2, 4)
    io.write(dst, record, delta=4)
    for layer in range(2):
        torch.testing.assert_close(pool.k[layer][dst], rotate_keys(pool.k[layer][src], 4, rope))
        assert torch.equal(pool.v[layer][dst], pool.v[layer][src])
    io.write(dst, record)
    assert torch.equal(pool.k[1][dst], pool.k[1][src])


def test_pool_kv_copy_is_read_then_write_and_rotates_only_k():
    pool = _Pool()
    kv = PoolKV(pool, ROPE)
    src, dst, other = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 12]), torch.tensor([20, 21, 22])
    kv.copy(src, dst, 5)
    kv.write(other, kv.read(src, canonical_start=0), delta=5)
    for layer in range(2):
        torch.testing.assert_close(pool.k[layer][dst], rotate_keys(pool.k[layer][src], 5, ROPE))
        assert torch.equal(pool.k[layer][dst], pool.k[layer][other])
        assert torch.equal(pool.v[layer][dst], pool.v[layer][src])
    kv.copy(src, dst, 0)  # no move: an exact copy
    assert all(torch.equal(pool.k[layer][dst], pool.k[layer][src]) for layer in range(2))


def test_pool_kv_copies_without_a_record_shape_but_tiers_need_one():
    kv = PoolKV(_Pool(v_dim=3), ROPE)  # V narrower than K: copies work, records cannot stack K and V
    kv.copy(torch.tensor([1]), torch.tensor([2]), 3)
    with pytest.raises(ValueError, match="differ per token"):
        kv.layout()


# ------------------------------------------------------------------ ChunkReuse (+ TierMovement)


def _reuse(tiers: TieredChunkStore | None = None):
    pool, slots = _Pool(), _Slots()
    kv = PoolKV(pool, ROPE)
    movement = TierMovement(tiers, kv) if tiers is not None else None
    chunks = PoolChunkIndex(free_slots=slots.free, on_evict=movement.spill if movement is not None else None)
    return pool, slots, chunks, ChunkReuse(chunks, kv, movement)


def _tiers(tmp_path, host_tokens: int = 16) -> TieredChunkStore:
    token_bytes = 2 * 2 * 2 * 4 * 4  # layers, K/V, heads, dim, float32
    kv = PoolKV(_Pool(), ROPE)
    return build_tiers([HostTierConfig(host_tokens * token_bytes), DiskTierConfig(str(tmp_path), 1 << 20)], kv,
                       ModelIdentity("m", "t", "float32", kv.layout()), DEFAULT_MAX_TOKENS, async_writes=False)


K789 = ChunkKey(None, (7, 8, 9))


def test_publish_then_reuse_moves_the_chunk_to_its_new_position():
    pool, slots, chunks, reuse = _reuse()
    src, dst = slots.alloc(3), slots.alloc(3)
    assert reuse.publish(K789, src, 4, slots.alloc)
    entry = chunks.peek(K789)
    assert entry.canonical_start == 4 and not torch.equal(entry.slots, src)
    assert reuse.reuse(K789, dst, 10) == TierName.DEVICE
    torch.testing.assert_close(pool.k[0][dst], rotate_keys(pool.k[0][src], 6, ROPE))
    assert entry.lock_ref == 0  # locked only while read
    assert reuse.reuse(ChunkKey(None, (1, 2)), dst[:2], 0) is None  # a miss
    # a second publish of a held chunk is a duplicate compute, not a second copy
    assert not reuse.publish(K789, src, 4, slots.alloc)
    assert (reuse.duplicate_computes, reuse.duplicate_compute_tokens) == (1, 3)
    assert not reuse.publish(ChunkKey(None, (5,)), src[:1], 0, lambda n: None)  # no room: not stored


def test_an_evicted_chunk_spills_and_comes_back_from_its_tier(tmp_path):
    tiers = _tiers(tmp_path)
    pool, slots, chunks, reuse = _reuse(tiers)
    try:
        src = slots.alloc(3)
        reuse.publish(K789, src, 0, slots.alloc)  # written through to disk too
        assert chunks.evict(3) == 3  # spilled to the host tier
        assert tiers.where(K789) == TierName.HOST
        dst = slots.alloc(3)
        assert reuse.reuse(K789, dst, 2) == TierName.HOST  # a pool miss from the tier
        torch.testing.assert_close(pool.k[1][dst], rotate_keys(pool.k[1][src], 2, ROPE))
        # at admission a lower-tier hit is loaded into the pool, origin named until its first hit
        entry = reuse.movement.load(chunks, K789, slots.alloc)
        assert entry is not None and entry.origin == TierName.HOST and chunks.peek(K789) is entry
        assert reuse.reuse(K789, dst, 0) == TierName.HOST
        assert reuse.reuse(K789, dst, 0) == TierName.DEVICE
        assert reuse.movement.load(chunks, ChunkKey(None, (1,)), slots.alloc) is None  # no tier holds it
        assert reuse.movement.stats()["tier_errors"] == 0
    finally:
        tiers.close()


def test_a_load_without_room_is_counted(tmp_path):
    tiers = _tiers(tmp_path)
    _, slots, chunks, reuse = _reuse(tiers)
    try:
        reuse.publish(ChunkKey(None, (7, 8)), slots.alloc(2), 0, slots.alloc)
        chunks.evict(2)
        assert reuse.movement.load(chunks, ChunkKey(None, (7, 8)), lambda n: None) is None
        assert reuse.movement.load_no_room == 1
    finally:
        tiers.close()


# ------------------------------------------------------------------ AdmissionPins, AdmissionHold


def _index_with(*docs: tuple[int, ...]):
    slots = _Slots()
    chunks = PoolChunkIndex(free_slots=slots.free)
    for doc in docs:
        chunks.insert(ChunkKey(None, doc), slots.alloc(len(doc)))
    return chunks


def test_pins_lock_the_held_chunks_of_the_window_and_trim_to_it():
    chunks = _index_with((10, 11), (20, 21, 22))
    pins = AdmissionPins(chunks)
    req = _req("a", [1, 10, 11, 20, 21, 22, 10, 11, 5], [1, 3, 3, 6, 6, 8])
    assert pins.pin(req) == 5  # (10, 11) twice counted once
    assert chunks.locked_tokens() == 5 and len(pins.by_request["a"]) == 3
    pins.trim(req, 6)  # the window ends at 6: the last chunk (ends at 8) is dropped
    assert [ce for ce, _ in pins.by_request["a"]] == [3, 6]
    assert pins.pin(req) == 5  # idempotent: earlier pins dropped first
    pins.unpin_all([req])
    assert chunks.locked_tokens() == 0 and not pins.by_request


def test_pins_skip_settled_chunks_load_missing_ones_and_flush_counts():
    chunks = _index_with((10, 11))
    loaded = []

    def load(key):
        loaded.append(key.tokens)
        return None

    pins = AdmissionPins(chunks)
    assert pins.pin(_req("a", [10, 11, 20, 5], [0, 2, 2, 3], prefix_len=4), load) == 0  # both settled
    assert pins.pin(_req("b", [10, 11, 20, 5], [0, 2, 2, 3]), load) == 2
    assert loaded == [(20,)]
    assert pins.pin(_req("c", [10, 11, 5], [0, 2], policy="full")) == 0  # reuses nothing
    assert pins.drop_all() == 1 and pins.dropped_at_reset == 1 and chunks.locked_tokens() == 0


def test_the_hold_locks_queued_chunks_and_reserves_the_learned_share():
    chunks = _index_with((10, 11), (20, 21, 22))
    hold = AdmissionHold(chunks)
    queued = _req("q", [10, 11, 5], [0, 2])
    hold.begin([queued])
    with hold.hold() as held:
        assert held == 2 + hold.reserve and chunks.locked_tokens() == 2
    assert chunks.locked_tokens() == 0 and hold.reserve == 0
    hold.end()
    with AdmissionHold(chunks, enabled=False).hold() as held:
        assert held == 0 and chunks.locked_tokens() == 0


# ------------------------------------------------------------------ EvictionOrder


class _Leaf:
    def __init__(self, t: float):
        self.last_access_time = t


def _drain(order: EvictionOrder, chunks: PoolChunkIndex) -> list:
    out = []
    while (victim := order.next()) is not None:
        if isinstance(victim, _Leaf):
            out.append(("leaf", victim.last_access_time))
        else:
            out.append(("chunk", victim.last_access))
            chunks.evict(1)
    return out


def test_one_order_by_last_use_leaf_first_on_ties():
    clock = iter([1.0, 3.0, 5.0]).__next__
    slots = _Slots()
    chunks = PoolChunkIndex(free_slots=slots.free, clock=clock)
    for doc in ((1,), (2,), (3,)):
        chunks.insert(ChunkKey(None, doc), slots.alloc(1))
    leaves = [_Leaf(t) for t in (4.0, 0.5, 3.0)]
    order = EvictionOrder(leaves, lambda leaf: leaf.last_access_time, chunks)
    assert _drain(order, chunks) == [("leaf", 0.5), ("chunk", 1.0), ("leaf", 3.0), ("chunk", 3.0),
                                     ("leaf", 4.0), ("chunk", 5.0)]


def test_a_parent_pushed_mid_eviction_takes_its_place_and_the_strategy_picks_the_leaf():
    counter = itertools.count(20)
    slots = _Slots()
    chunks = PoolChunkIndex(free_slots=slots.free, clock=lambda: float(next(counter)))
    chunks.insert(ChunkKey(None, (1,)), slots.alloc(1))  # last use 20
    # a strategy other than LRU picks the leaf (here: the most recent first); the merge with
    # the chunks still compares last use
    order = EvictionOrder([_Leaf(5.0), _Leaf(12.0)], lambda leaf: -leaf.last_access_time, chunks)
    first = order.next()
    assert first.last_access_time == 12.0
    order.push_leaf(_Leaf(15.0))  # a parent: the strategy ranks it first now
    assert order.next().last_access_time == 15.0
    assert order.next().last_access_time == 5.0
    assert order.next() is chunks.oldest()
