"""Unit tests for relaxkv_sglang.cache.pool_index (and the key it maps, relaxkv_sglang.cache.chunk_key)."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaxkv_sglang.cache.chunk_key import ChunkKey as K
from relaxkv_sglang.cache.pool_index import ChunkEntry, PoolChunkIndex, PoolChunkIndexStats


class FakeAllocator:
    """Slot allocator that catches double frees and frees of slots it never handed out.

    Slots are never reused, so "freed exactly once" can be checked per slot.
    """

    def __init__(self):
        self.next_slot = 0
        self.out: set[int] = set()
        self.free_calls = 0
        self.freed_count: Counter[int] = Counter()

    def alloc(self, n: int) -> torch.Tensor:
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        self.out.update(slots)
        return torch.tensor(slots, dtype=torch.int64)

    def free_slots(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1
        self.free_calls += 1
        for s in slots.tolist():
            assert s in self.out, f"slot {s} freed twice or never allocated"
            self.out.remove(s)
            self.freed_count[s] += 1


@pytest.fixture
def alloc():
    return FakeAllocator()


@pytest.fixture
def store(alloc):
    return PoolChunkIndex(alloc.free_slots)


def _ins(store, alloc, ns, toks, canonical_start=0):
    return store.insert(K(ns, toks), alloc.alloc(len(toks)), canonical_start)


# ---------------------------------------------------------------- basics


def test_insert_lookup_peek(store, alloc):
    e = _ins(store, alloc, None, [5, 6, 7])
    assert isinstance(e, ChunkEntry)
    assert e.key == K(None, (5, 6, 7)) and e.key.tokens == (5, 6, 7) and e.canonical_start == 0
    assert e.slots.tolist() == [0, 1, 2] and e.lock_ref == 0 and e.hits == 0
    assert store.peek(K(None, (5, 6, 7))) is e
    assert store.stats().lookups == 0  # peek does not count
    assert store.lookup(K(None, [5, 6, 7])) is e
    assert store.lookup(K(None, torch.tensor([5, 6, 7]))) is e  # tensor keys work too
    assert store.lookup(K(None, [5, 6])) is None
    assert e.hits == 2
    st_ = store.stats()
    assert (st_.lookups, st_.hits, st_.misses, st_.hit_tokens, st_.miss_tokens) == (3, 2, 1, 6, 2)
    assert st_.hit_rate == pytest.approx(2 / 3)
    assert st_.token_hit_rate == pytest.approx(6 / 8)
    assert (st_.inserts, st_.entries, st_.tokens_held) == (1, 1, 3)
    assert len(store) == 1 and store.total_tokens() == 3


def test_namespaces_never_share(store, alloc):
    a = _ins(store, alloc, None, [1, 2])
    b = _ins(store, alloc, "tenant", [1, 2])
    assert a is not b
    assert store.lookup(K("tenant", [1, 2])) is b
    assert store.lookup(K("other", [1, 2])) is None
    assert store.total_tokens() == 4


def test_duplicate_insert_frees_new_slots(store, alloc):
    e = _ins(store, alloc, None, [1, 2, 3])
    new_slots = alloc.alloc(3)
    got = store.insert(K(None, [1, 2, 3]), new_slots)
    assert got is e
    assert not torch.equal(got.slots, new_slots)
    assert all(alloc.freed_count[s] == 1 for s in new_slots.tolist())
    assert store.total_tokens() == 3
    s = store.stats()
    assert (s.inserts, s.duplicate_inserts) == (1, 1)


def test_insert_validation(store, alloc):
    with pytest.raises(ValueError):
        store.insert(K(None, []), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(TypeError):
        store.insert(K(None, [1, 2]), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        store.insert(K(None, [1, 2]), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError):
        store.insert(K(None, [1, 2]), torch.zeros(2, dtype=torch.int64), canonical_start=-1)
    with pytest.raises(TypeError):
        K(3, [1, 2])  # type: ignore[arg-type]
    assert len(store) == 0 and alloc.free_calls == 0


def test_canonical_start_kept(store, alloc):
    e = _ins(store, alloc, None, [9], canonical_start=17)
    assert store.peek(K(None, [9])).canonical_start == 17 and e.canonical_start == 17


# ---------------------------------------------------------------- locks and eviction


def test_lru_eviction_order_and_locks(store, alloc):
    a = _ins(store, alloc, None, [1] * 4)
    b = _ins(store, alloc, None, [2] * 3)
    c = _ins(store, alloc, None, [3] * 5)
    store.lookup(K(None, [1] * 4))  # a is now most recent: order b, c, a
    store.lock(c)
    assert store.locked_tokens() == 5 and store.evictable_tokens() == 7
    freed = store.evict(1)
    assert freed == 3  # whole entry b
    assert store.peek(K(None, [2] * 3)) is None and store.peek(K(None, [1] * 4)) is a
    # c is locked, so only a can go, and the request for 100 stops when nothing is left.
    assert store.evict(100) == 4
    assert store.peek(K(None, [3] * 5)) is c
    assert store.evict(100) == 0
    store.unlock(c)
    assert store.evictable_tokens() == 5 and store.locked_tokens() == 0
    assert store.evict(0) == 0 and store.evict(-5) == 0
    assert store.evict(5) == 5
    s = store.stats()
    assert (s.evictions, s.evicted_tokens, s.tokens_held, s.entries) == (3, 12, 0, 0)
    assert alloc.out == set()
    assert b.slots.tolist()[0] in alloc.freed_count


def test_lock_is_counted(store, alloc):
    a = _ins(store, alloc, None, [1, 1])
    store.lock(a)
    store.lock(a)
    assert a.lock_ref == 2 and store.locked_tokens() == 2  # tokens counted once
    store.unlock(a)
    assert store.evict(10) == 0
    store.unlock(a)
    assert store.evict(10) == 2
    with pytest.raises(ValueError):
        store.lock(a)  # evicted entries cannot be locked


def test_unlock_below_zero_raises(store, alloc):
    a = _ins(store, alloc, None, [1])
    with pytest.raises(ValueError, match="negative"):
        store.unlock(a)
    assert a.lock_ref == 0


def test_unlock_makes_entry_most_recent(store, alloc):
    a = _ins(store, alloc, None, [1])
    b = _ins(store, alloc, None, [2])
    store.lock(a)
    store.unlock(a)  # a just finished a request: b is now the LRU one
    assert store.evict(1) == 1
    assert store.peek(K(None, [2])) is None and store.peek(K(None, [1])) is a
    assert b.last_access < a.last_access


def test_locked_entries_counted_and_oldest_is_next_victim(store, alloc):
    a = _ins(store, alloc, None, [1])
    b = _ins(store, alloc, None, [2, 2])
    assert store.oldest() is a and store.stats().locked_entries == 0
    store.lock(a)
    store.lock(a)
    store.lock(b)
    s = store.stats()
    assert (s.locked_entries, s.locked_tokens) == (2, 3)  # an entry counts once however often locked
    assert store.oldest() is None  # nothing evictable
    store.unlock(b)
    assert store.oldest() is b and store.stats().locked_entries == 1
    store.unlock(a)
    assert store.stats().locked_entries == 1  # still one reference on a
    store.unlock(a)
    assert store.stats().locked_entries == 0
    assert store.oldest() is b  # a was unlocked last: most recent
    store.evict(1)
    assert store.oldest() is a


def test_clock_is_injected_and_never_goes_back(alloc):
    readings = iter([10.0, 12.5, 11.0, 20.0])
    store = PoolChunkIndex(alloc.free_slots, clock=lambda: next(readings))
    a = store.insert(K(None, [1]), alloc.alloc(1))
    b = store.insert(K(None, [2]), alloc.alloc(1))
    assert (a.last_access, b.last_access) == (10.0, 12.5)
    store.lookup(K(None, [1]))  # the clock read 11.0: kept at 12.5, and a is now the most recent
    assert a.last_access == 12.5 and store.oldest() is b
    store.lookup(K(None, [2]))
    assert b.last_access == 20.0 and store.oldest() is a


def test_target_learns_from_lost_hits_and_forgotten_ghosts(alloc):
    store = PoolChunkIndex(alloc.free_slots, ghost_capacity=6)
    store.insert(K(None, [1, 1, 1]), alloc.alloc(3))
    store.insert(K(None, [2, 2]), alloc.alloc(2))
    assert store.evict(5) == 5  # both become ghosts (5 tokens remembered)
    assert store.lookup(K(None, [1, 1, 1])) is None  # a hit lost to eviction
    assert store.lookup(K(None, [1, 1, 1])) is None  # counted once: the ghost is consumed
    s = store.stats()
    assert (s.ghost_hits, s.ghost_hit_tokens, s.target_tokens, s.ghost_expired_tokens) == (1, 3, 3, 0)
    assert store.lookup(K(None, [9])) is None and store.stats().ghost_hits == 1  # never stored: no ghost
    for t in (3, 4, 5):  # three more evicted 2-token chunks: [2, 2] is forgotten unused
        store.insert(K(None, [t, t]), alloc.alloc(2))
        store.evict(2)
    s = store.stats()
    assert (s.ghost_expired_tokens, s.target_tokens) == (2, 1)
    assert store.lookup(K(None, [2, 2])) is None and store.stats().ghost_hits == 1
    store.insert(K(None, [4, 4]), alloc.alloc(2))  # re-inserted: no longer a ghost
    assert store.lookup(K(None, [4, 4])) is not None
    store.reset()
    assert store.stats().target_tokens == 0
    assert store.lookup(K(None, [5, 5])) is None and store.stats().ghost_hits == 1  # reset forgets the ghosts


def test_target_is_bounded_by_the_ghost_capacity(alloc):
    store = PoolChunkIndex(alloc.free_slots, ghost_capacity=4)
    for t in range(6):
        store.insert(K(None, [t, t]), alloc.alloc(2))
    store.evict(100)  # six 2-token ghosts, only the last two (4 tokens) kept
    assert [store.lookup(K(None, [t, t])) for t in range(6)] == [None] * 6
    s = store.stats()
    assert (s.ghost_hits, s.ghost_expired_tokens, s.target_tokens) == (2, 8, 4)
    for t in (6, 7, 8):
        store.insert(K(None, [t, t]), alloc.alloc(2))
        store.evict(2)
        store.lookup(K(None, [t, t]))
    assert store.stats().target_tokens == 4  # never above the capacity
    plain = PoolChunkIndex(alloc.free_slots)  # ghost_capacity 0: learns nothing
    plain.insert(K(None, [7]), alloc.alloc(1))
    plain.evict(1)
    assert plain.lookup(K(None, [7])) is None and plain.stats().ghost_hits == plain.stats().target_tokens == 0


def test_reset(store, alloc):
    a = _ins(store, alloc, None, [1, 2])
    _ins(store, alloc, "x", [3])
    store.lock(a)
    with pytest.raises(RuntimeError, match="1 entries are locked"):
        store.reset()
    assert store.total_tokens() == 3 and alloc.free_calls == 0  # unchanged
    store.unlock(a)
    store.lookup(K(None, [1, 2]))
    store.reset()
    assert len(store) == 0 and store.total_tokens() == 0 and alloc.out == set()
    s = store.stats()
    assert s.lookups == 1 and s.evictions == 0  # counters survive, reset is not eviction


def test_free_callback_failure_keeps_entry(alloc):
    calls = []

    def failing(slots):
        calls.append(slots)
        raise RuntimeError("allocator busy")

    store = PoolChunkIndex(failing)
    e = store.insert(K(None, [1, 2]), alloc.alloc(2))
    with pytest.raises(RuntimeError):
        store.evict(1)
    assert store.peek(K(None, [1, 2])) is e and store.total_tokens() == 2 and len(calls) == 1


def test_entries_compare_by_identity(store, alloc):
    a = _ins(store, alloc, None, [1])
    b = _ins(store, alloc, "n", [1])
    assert a != b and a == a  # no tensor comparison inside __eq__


# ---------------------------------------------------------------- property test against a model

KEYS = [K(ns, toks) for ns in (None, "t1") for toks in ((1,), (1, 2), (2, 1), (3, 3, 3), (4,) * 7)]

op_strategy = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("lookup"), st.sampled_from(KEYS)),
    st.tuples(st.just("lock"), st.sampled_from(KEYS)),
    st.tuples(st.just("unlock"), st.sampled_from(KEYS)),
    st.tuples(st.just("evict"), st.integers(-1, 12)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=250, deadline=None)
@given(st.lists(op_strategy, max_size=60))
def test_index_matches_model(ops):
    alloc = FakeAllocator()
    store = PoolChunkIndex(alloc.free_slots)
    handed_in: set[int] = set()
    # Model: key -> [n_tokens, lock_ref]; lru holds unlocked keys, least recent first.
    model: dict = {}
    lru: OrderedDict = OrderedDict()
    lookups = hits = 0

    def touch(key):
        if model[key][1] == 0:
            lru.move_to_end(key)

    for op in ops:
        kind = op[0]
        if kind == "insert":
            key, cstart = op[1], op[2]
            slots = alloc.alloc(len(key.tokens))
            handed_in.update(slots.tolist())
            e = store.insert(key, slots, cstart)
            if key in model:
                touch(key)
                assert not torch.equal(e.slots, slots)
            else:
                model[key] = [len(key.tokens), 0]
                lru[key] = None
                assert e.slots is slots and e.canonical_start == cstart
        elif kind == "lookup":
            key = op[1]
            e = store.lookup(key)
            lookups += 1
            if key in model:
                hits += 1
                touch(key)
                assert e is not None and e.key == key
            else:
                assert e is None
        elif kind == "lock":
            key = op[1]
            e = store.peek(key)
            assert (e is not None) == (key in model)
            if e is not None:
                store.lock(e)
                if model[key][1] == 0:
                    del lru[key]
                model[key][1] += 1
        elif kind == "unlock":
            key = op[1]
            e = store.peek(key)
            if e is None:
                continue
            if model[key][1] == 0:
                with pytest.raises(ValueError):
                    store.unlock(e)
            else:
                store.unlock(e)
                model[key][1] -= 1
                if model[key][1] == 0:
                    lru[key] = None
        elif kind == "evict":
            want = op[1]
            locked_before = {k for k, v in model.items() if v[1] > 0}
            expected_freed = 0
            while expected_freed < want and lru:
                key, _ = lru.popitem(last=False)
                expected_freed += model.pop(key)[0]
            assert store.evict(want) == expected_freed
            assert locked_before <= {k for k in model}  # locked entries survive
        elif kind == "reset":
            if any(v[1] for v in model.values()):
                with pytest.raises(RuntimeError):
                    store.reset()
            else:
                store.reset()
                model.clear()
                lru.clear()
                assert alloc.out == set()

        # Invariants after every operation.
        entries = [store.peek(k) for k in KEYS]
        held = [e for e in entries if e is not None]
        assert {e.key for e in held} == set(model)
        assert all(e.lock_ref == model[e.key][1] for e in held)
        held_slots = [s for e in held for s in e.slots.tolist()]
        assert len(held_slots) == len(set(held_slots))  # no slot in two entries
        assert set(held_slots) == alloc.out  # handed in and not freed == held
        freed = handed_in - alloc.out
        assert all(alloc.freed_count[s] == 1 for s in freed)  # freed exactly once
        assert all(alloc.freed_count[s] == 0 for s in held_slots)
        s = store.stats()
        assert isinstance(s, PoolChunkIndexStats)
        assert s.hits + s.misses == s.lookups == lookups and s.hits == hits
        assert s.tokens_held == store.total_tokens() == sum(v[0] for v in model.values())
        assert store.locked_tokens() == sum(v[0] for v in model.values() if v[1] > 0)
        assert store.evictable_tokens() == sum(model[k][0] for k in lru)
        assert s.entries == len(store) == len(model)
        assert s.locked_entries == sum(v[1] > 0 for v in model.values())

    # Releasing every lock then resetting gives every slot back.
    for k, (n, refs) in list(model.items()):
        for _ in range(refs):
            store.unlock(store.peek(k))
    store.reset()
    assert alloc.out == set()
    assert all(alloc.freed_count[s] == 1 for s in handed_in)
