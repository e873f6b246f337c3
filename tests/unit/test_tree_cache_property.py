"""Property test of the whole relaxkv tree cache (radix tree + chunk tree) with SGLang's real pools.

A hypothesis state machine drives a real ``RelaxKVTreeCache`` built on SGLang's
``TokenToKVPoolAllocator``, ``MHATokenToKVPool`` and ``ReqToTokenPool`` (a
32-slot pool on the CPU) the way the scheduler does: requests are matched
(``Req.init_next_round_input``), locked, given slots (evicting through
``evict_from_tree_cache``), folded and published by the project's own
``fold_batch`` / ``set_up_forward`` / ``finish_forward`` around a fake forward, decoded, and released
with SGLang's ``release_kv_cache``; beside that come explicit evictions, chunk
pins (lookup + lock held across steps) and flushes (the scheduler's
``flush_cache`` sequence).

The fake forward writes, for every row it computes, a V fingerprint naming
the token sequence the row attended to (exact only if every key it read was
itself exact for that sequence) and a K rotated to the row's position. So the
invariants check both who owns each slot and what the slot holds:

* every slot 1..pool is owned by exactly one of the radix tree, the chunk
  tree, a live request (its row past ``cache_protected_len``) or the free list;
* the radix tree holds only exact causal KV at the positions it is keyed by,
  and every chunk entry holds its chunk's own KV rotated to ``canonical_start``;
* a live request's locked radix path is never evicted and still holds its row's
  prefix slots; a pinned chunk is never evicted;
* radix lock counts equal the live requests below each node, and the
  evictable / protected sizes equal what the nodes and entries add up to;
* chunk lookups, hits and misses match the model's prediction;
* a failed allocation only happens when nothing evictable is left.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from array import array
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.model.rope import RopeSpec, rotate_keys
from relaxkv_sglang.cache.tiers import TierName
from relaxkv_sglang.request.schema import PLAN_KEY
from relaxkv_sglang.request.plan import RequestPlan, request_namespace, request_plan

POOL = 32  # KV slots 1..POOL (slot 0 is SGLang's padding slot)
MAX_LIVE = 4  # requests holding KV at once
SPEC = RopeSpec(head_dim=2)
BASE_K = torch.tensor([1.0, 0.5])  # every token's K before RoPE: K at position p is BASE_K rotated by p

# Prompts are built from shared pieces so prefixes and chunks repeat.
SYSTEMS = [(), (1, 2, 3), (1, 2, 4)]
DOCS = [(10, 11, 12), (10, 11), (20, 21, 22, 23), (30,)]
QUERIES = [(7,), (8, 9)]
# Chunk policies and the default namespace are drawn more often, so chunks get reused.
POLICIES = [None, "prefix", "full", "pic", "pic", "relaxkv", "relaxkv"]
EXTRA_KEYS = [None, "t1"]
DRAWN_EXTRA_KEYS = [None, None, None, "t1"]


@functools.cache
def _sglang() -> SimpleNamespace:
    """SGLang modules, imported on first use (the import takes a few seconds)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache, release_kv_cache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SimpleNamespace(**locals())


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """What a drawn request asks for."""

    policy: str | None
    extra_key: str | None
    system: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    query: tuple[int, ...]

    def tokens_and_spans(self) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        tokens, spans = list(self.system), ()
        for doc in self.docs:
            spans += ((len(tokens), len(tokens) + len(doc)),)
            tokens += doc
        return tokens + list(self.query), spans


request_specs = st.builds(
    RequestSpec,
    st.sampled_from(POLICIES),
    st.sampled_from(DRAWN_EXTRA_KEYS),
    st.sampled_from(SYSTEMS),
    st.lists(st.sampled_from(DOCS), max_size=3).map(tuple),
    st.sampled_from(QUERIES),
)


@dataclasses.dataclass
class Live:
    """A request holding KV: admitted, and forwarded once its prefill ran."""

    req: object  # SGLang's Req
    forwarded: bool = False


class TreeCacheMachine(RuleBasedStateMachine):
    """One scheduler's tree cache, pools and live requests; see the module docstring."""

    def __init__(self):
        super().__init__()
        from relaxkv_sglang.cache.sglang.pool_kv import PoolKV
        from relaxkv_sglang.server.sglang.startup import build_cache_class

        sg = self.sg = _sglang()
        self.kv = sg.MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                                      layer_num=1, device="cpu", enable_memory_saver=False)
        self.allocator = sg.TokenToKVPoolAllocator(size=POOL, dtype=torch.float32, device="cpu",
                                                   kvcache=self.kv, need_sort=False)
        self.req_to_token = sg.ReqToTokenPool(size=MAX_LIVE, max_context_len=64, device="cpu",
                                              enable_memory_saver=False)
        params = sg.CacheInitParams(disable=False, req_to_token_pool=self.req_to_token,
                                    token_to_kv_pool_allocator=self.allocator, page_size=1)
        self.cache = self._build_cache(build_cache_class(), params, PoolKV(self.kv, SPEC))
        self._spy_chunk_allocations()
        self.live: list[Live] = []
        self.pins: list = []  # chunk entries this test holds a lock on
        self.lookups = self.hits = 0  # the model's chunk lookup counters
        self.rids = itertools.count()
        # V fingerprints: id -> (namespace, token sequence attended to), or a
        # unique "mixed" tag for a row that read non-exact keys.
        self.content_ids: dict[tuple, int] = {}
        self.contents: dict[int, tuple] = {}

    # ------------------------------------------------------------ helpers

    def _build_cache(self, cls, params, pool_kv):
        return cls(params, pool_kv)

    def _held(self, ns, tokens) -> bool:
        """Whether a chunk lookup of these tokens hits now."""
        return self.cache.chunks.peek(ChunkKey(ns, tokens)) is not None

    def _spy_chunk_allocations(self) -> None:
        """Wrap alloc_chunk_slots: it may give up only when nothing more can be freed."""
        original = self.cache.alloc_chunk_slots

        def spied(n: int, chunks_only: bool = False):
            reclaimable = self.cache.chunks.evictable_tokens() if chunks_only else self.cache.evictable_size()
            room = self.allocator.available_size() + reclaimable
            slots = original(n, chunks_only=chunks_only)
            assert slots is not None or room < n, f"chunk allocation of {n} failed with {room} reclaimable"
            return slots

        self.cache.alloc_chunk_slots = spied

    def _content_id(self, content: tuple) -> int:
        if content not in self.content_ids:
            self.content_ids[content] = len(self.content_ids) + 1
            self.contents[self.content_ids[content]] = content
        return self.content_ids[content]

    def _v(self, slots) -> list[int]:
        return [int(v) for v in self.kv.get_value_buffer(0)[slots, 0, 0].tolist()]

    def _write(self, slot: int, position: int, content: tuple) -> None:
        """What a forward stores for one computed row: K rotated to its position, V naming its content."""
        self.kv.get_key_buffer(0)[slot] = rotate_keys(BASE_K.view(1, 1, 2), position, SPEC)[0]
        self.kv.get_value_buffer(0)[slot] = float(self._content_id(content))

    def _assert_k_at(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        want = rotate_keys(BASE_K.expand(len(slots), 1, 2), positions.to(torch.int64), SPEC)
        torch.testing.assert_close(self.kv.get_key_buffer(0)[slots], want, atol=1e-4, rtol=0)

    def _compute_row(self, row: torch.Tensor, tokens: list[int], ns, position: int, scope: int) -> None:
        """Compute ``position`` attending to rows [scope, position]: exact for that
        sequence if every key it reads is exact for it, else a fresh "mixed" value."""
        exact = all(self.contents.get(v) == (ns, tuple(tokens[scope : q + 1]))
                    for q, v in zip(range(scope, position), self._v(row[scope:position])))
        content = (ns, tuple(tokens[scope : position + 1])) if exact else ("mixed", len(self.content_ids))
        self._write(int(row[position]), position, content)

    def _row(self, req) -> torch.Tensor:
        return self.req_to_token.req_to_token[req.kv.req_pool_idx].to(torch.int64)

    def _make_req(self, spec: RequestSpec):
        tokens, spans = spec.tokens_and_spans()
        custom = None if spec.policy is None else {PLAN_KEY: RequestPlan(spec.policy, spans)}
        sp = self.sg.SamplingParams(temperature=0, max_new_tokens=8, custom_params=custom)
        return self.sg.Req(rid=f"r{next(self.rids)}", origin_input_text="", origin_input_ids=array("q", tokens),
                           sampling_params=sp, extra_key=spec.extra_key)

    def _alloc(self, n: int):
        """Slots the way the scheduler gets them: evict for the shortfall, then allocate."""
        self.sg.evict_from_tree_cache(self.cache, n)
        slots = self.allocator.alloc(n)
        if slots is None:
            # Eviction stops short only when nothing evictable is left.
            assert self.cache.evictable_size() == 0
            assert self.allocator.available_size() < n
        return slots

    def _chunk_keys(self):
        """(extra_key, chunk key) of every document chunk in every namespace."""
        for extra in EXTRA_KEYS:
            ns = request_namespace(SimpleNamespace(extra_key=extra, cache_salt=None))
            for doc in DOCS:
                yield extra, ChunkKey(ns, doc)

    def _radix_nodes(self):
        """(node, extra_key, tokens on the path before it) for every radix node but the root."""
        stack = [(child, ()) for child in self.cache.root_node.children.values()]
        while stack:
            node, before = stack.pop()
            yield node, node.key.extra_key, before
            path = before + tuple(node.key)
            stack.extend((child, path) for child in node.children.values())

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(spec=request_specs)
    def admit(self, spec: RequestSpec):
        """Match, lock and allocate one request, as the scheduler's prefill admission does."""
        req = self._make_req(spec)
        req.init_next_round_input(self.cache)
        pinned = self.cache.pin_request(req)  # what the admission hook does before the budget check
        assert self.cache.evictable_size() + pinned <= POOL
        plan = request_plan(req)
        n = len(req.origin_input_ids)
        if plan is not None and plan.policy == "full":
            assert req.prefix_len == 0
        if plan is not None and plan.reuses_chunks:
            assert req.prefix_len <= plan.exact_len
        req.extend_end = n
        req.lock = self.cache.lock(req.last_node)
        self.req_to_token.alloc([req])
        slots = self._alloc(n - req.prefix_len)
        if slots is None:  # no room: not admitted
            self.cache.admission_pins.unpin(req)
            self.cache.unlock(req.lock)
            self.req_to_token.free(req)
            return
        prefix = self.cache.prefix_device_indices(req)
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
        self.req_to_token.write((req.kv.req_pool_idx, slice(req.prefix_len, n)), slots)
        req.kv.kv_allocated_len = n
        req.kv.kv_committed_len = req.prefix_len
        self.live.append(Live(req))

    @precondition(lambda self: any(not x.forwarded for x in self.live))
    @rule(k=st.integers(1, MAX_LIVE))
    def forward(self, k: int):
        """One extend batch of up to k admitted requests."""
        self._forward([x for x in self.live if not x.forwarded][:k])

    def _forward(self, todo: list[Live]) -> None:
        """The project's fold_batch and set_up_forward, a fake forward of the kept rows, finish_forward."""
        from relaxkv_sglang.forward.finish import finish_forward
        from relaxkv_sglang.forward.fold import fold_batch
        from relaxkv_sglang.forward.query_pass import set_up_forward

        if not todo:
            return
        reqs = [x.req for x in todo]
        extend = [len(r.origin_input_ids) - r.prefix_len for r in reqs]
        # A stand-in for SGLang's ScheduleBatch with the fields fold_batch and its
        # folded copy read; the fold itself runs unchanged.
        batch = SimpleNamespace(
            forward_mode=self.sg.ForwardMode.EXTEND, reqs=reqs, return_logprob=False,
            extend_logprob_start_lens=None, global_num_tokens=None, prefill_input_ids_cpu=None,
            req_pool_indices_cpu=torch.tensor([r.kv.req_pool_idx for r in reqs]),
            prefix_lens=[r.prefix_len for r in reqs], extend_lens=extend,
            input_ids=torch.tensor([t for r in reqs for t in r.origin_input_ids[r.prefix_len:]]),
            out_cache_loc=torch.cat([self._row(r)[r.prefix_len : len(r.origin_input_ids)] for r in reqs]),
        )
        # The model's hit prediction: a chunk hits iff the store holds it when
        # the batch starts (lookups do not evict; publishing comes after).
        expect_hits = [
            sum(self._held(plan.namespace, r.origin_input_ids[cs:ce]) for cs, ce in plan.chunk_spans)
            if (plan := request_plan(r)) is not None and plan.reuses_chunks else 0
            for r in reqs
        ]
        # Chunks pinned at admission survived every allocation since: they all hit.
        for r, hits in zip(reqs, expect_hits):
            assert len(self.cache.pins.get(r.rid, ())) <= hits
        fold = fold_batch(self.cache, batch)
        assert (fold is None) == all(request_plan(r) is None for r in reqs)
        setup = set_up_forward(self.cache, None, fold) if fold is not None else None
        folded = setup.batch if setup is not None else None
        start = 0
        for i, r in enumerate(reqs):
            row, tokens, plan = self._row(r), list(r.origin_input_ids), request_plan(r)
            ns = r.extra_key
            if fold is None:
                keep, scope = torch.arange(extend[i]), torch.zeros(extend[i], dtype=torch.int64)
            else:
                rf = fold.requests[i]
                keep, scope = rf.keep, rf.scope_start
                n_chunks = len(plan.chunk_spans) if plan is not None and plan.reuses_chunks else 0
                assert rf.chunks_seen == n_chunks and rf.chunks_hit == expect_hits[i]
                self.lookups += n_chunks
                self.hits += expect_hits[i]
                # The folded batch carries exactly the kept rows, in order.
                rows = slice(start, start + len(keep))
                assert torch.equal(folded.out_cache_loc[rows], row[r.prefix_len + keep])
                assert folded.input_ids[rows].tolist() == [tokens[r.prefix_len + j] for j in keep.tolist()]
                start += len(keep)
                # Reused chunk rows were copied before the forward: the chunk's
                # own KV, K re-rotated to where it now sits.
                dropped = sorted(set(range(extend[i])) - set(keep.tolist()))
                for j in dropped:
                    p = r.prefix_len + j
                    cs = max(s for s, _ in plan.chunk_spans if s <= p)
                    assert self.contents[self._v(row[p : p + 1])[0]] == (ns, tuple(tokens[cs : p + 1]))
                if dropped:
                    positions = torch.tensor(dropped) + r.prefix_len
                    self._assert_k_at(row[positions], positions)
            for j, s in zip(keep.tolist(), scope.tolist()):
                self._compute_row(row, tokens, ns, r.prefix_len + j, s)
        if fold is not None:
            finish_forward(self.cache, setup, None)
        self.cache.admission_pins.unpin_all(reqs)  # the forward hook's finally
        assert not any(r.rid in self.cache.pins for r in reqs)
        if fold is not None:
            for r, rf, hits in zip(reqs, fold.requests, expect_hits):
                if rf.plan is not None:  # meta_info.relaxkv reports what the model predicted
                    record = r.customized_info["relaxkv"][-1]
                    assert (record["chunks_seen"], record["chunks_hit"]) == (rf.chunks_seen, hits)
        for x in todo:
            x.forwarded = True
            x.req.kv.kv_committed_len = len(x.req.origin_input_ids)
            x.req.output_ids.append(5)  # the token this prefill sampled

    @precondition(lambda self: any(x.forwarded for x in self.live))
    @rule(data=st.data())
    def decode(self, data):
        """One decode step: compute the last sampled token's KV into a new slot."""
        x = self._pick_forwarded(data)
        req = x.req
        slot = self._alloc(1)
        if slot is None:
            return
        p = req.kv.kv_allocated_len
        self.req_to_token.write((req.kv.req_pool_idx, slice(p, p + 1)), slot)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = p + 1
        self._compute_row(self._row(req), list(req.origin_input_ids) + list(req.output_ids), req.extra_key, p, 0)
        req.output_ids.append(5 + len(req.output_ids) % 3)

    @precondition(lambda self: any(x.forwarded for x in self.live))
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data, abort: bool):
        """Release a request with SGLang's release_kv_cache (checkpointing unless aborted)."""
        self._finish(self._pick_forwarded(data), abort)

    @rule(specs=st.lists(request_specs, max_size=3))
    def admission_hold(self, specs):
        """While an admission check runs, stored chunks that queued requests need are not evictable."""
        queue = [self._make_req(spec) for spec in specs]
        self.cache.begin_admission(queue)
        need = {}
        for req in queue:
            plan = request_plan(req)
            if plan is not None and plan.reuses_chunks:
                for cs, ce in plan.chunk_spans:
                    e = self.cache.chunks.peek(ChunkKey(plan.namespace, req.origin_input_ids[cs:ce]))
                    if e is not None:
                        need[id(e)] = e
        before = self.cache.evictable_size()
        with self.cache.hold.hold() as held:
            # the store's learned share, less what is locked in it, is held back too
            reserve = max(0, self.cache.chunks.target_tokens() - self.cache.chunks.locked_tokens())
            assert self.cache.admission_reserve == reserve
            assert held == sum(e.num_tokens for e in need.values()) + reserve
            newly_locked = sum(e.num_tokens for e in need.values() if e.lock_ref == 1)
            assert self.cache.evictable_size() == before - newly_locked - reserve
            self.cache.evict(self.sg.EvictParams(num_tokens=POOL))  # as if admission allocated everything
            assert all(self.cache.chunks.peek(e.key) is e for e in need.values())
        assert self.cache.admission_reserve == 0
        self.cache.hold.end()
        # Released as the most recently used: the held chunks are evicted last
        # (everything else evictable went above, so only they are left unlocked).
        unlocked = [e for e in need.values() if e.lock_ref == 0]
        assert self.cache.chunks.evictable_tokens() == sum(e.num_tokens for e in unlocked)

    @precondition(lambda self: any(not x.forwarded for x in self.live))
    @rule(data=st.data())
    def abort_admitted(self, data):
        """An admitted request aborted before its forward: releasing it drops its chunk pins."""
        waiting = [x for x in self.live if not x.forwarded]
        x = waiting[data.draw(st.integers(0, len(waiting) - 1), label="request")]
        x.req.finished_reason = self.sg.FINISH_ABORT()
        x.req.kv.kv_committed_len = x.req.kv.kv_allocated_len  # SGLang frees only a whole row
        self.sg.release_kv_cache(x.req, self.cache, checkpoint=False)
        self.live.remove(x)
        assert x.req.rid not in self.cache.pins

    def _pick_forwarded(self, data) -> Live:
        forwarded = [x for x in self.live if x.forwarded]
        return forwarded[data.draw(st.integers(0, len(forwarded) - 1), label="request")]

    def _finish(self, x: Live, abort: bool) -> None:
        req, sg = x.req, self.sg
        req.finished_reason = sg.FINISH_ABORT() if abort else sg.FINISH_LENGTH(length=len(req.output_ids))
        kept = list(req.origin_input_ids) + list(req.output_ids)
        owned = req.kv.kv_committed_len
        sg.release_kv_cache(req, self.cache, checkpoint=not abort)
        self.live.remove(x)
        if not abort:
            # Release evicts nothing, so the published part is matched right away:
            # all of it, or for a request that reused chunks its exact part.
            plan = request_plan(req)
            published = plan.exact_len if plan is not None and plan.reuses_chunks else owned
            key = sg.RadixKey(array("q", kept[:owned]), req.extra_key)
            assert self.cache.match_prefix(sg.MatchPrefixParams(key=key)).device_prefix_len >= published

    @rule(n=st.integers(0, 12))
    def evict(self, n: int):
        sg = self.sg
        before = self.cache.evictable_size()
        radix_before = sg.RadixCache.evictable_size(self.cache)
        available = self.allocator.available_size()
        protected = self.cache.protected_size()
        # Candidates before: evictable radix leaves and unlocked chunks, with their last use.
        leaves = [(node, node.last_access_time) for node in self.cache.evictable_leaves]
        chunks = [(e, e.last_access) for _, key in self._chunk_keys()
                  if (e := self.cache.chunks.peek(key)) is not None and e.lock_ref == 0]
        freed = self.cache.evict(sg.EvictParams(num_tokens=n)).num_tokens_evicted
        assert freed >= min(n, before)
        assert self.allocator.available_size() == available + freed
        assert self.cache.evictable_size() == before - freed
        assert self.cache.protected_size() == protected
        # One LRU order across both trees: nothing evicted was used after anything kept.
        gone, kept = [], []
        for node, t in leaves:
            (kept if node.parent.children.get(node.key.child_key(1)) is node else gone).append(t)
        for e, t in chunks:
            (kept if self.cache.chunks.peek(e.key) is e else gone).append(t)
        assert not gone or not kept or max(gone) <= min(kept)
        assert radix_before <= before

    @precondition(lambda self: len(self.cache.chunks) > 0)
    @rule(data=st.data())
    def pin(self, data):
        """Look a held chunk up and keep it locked across steps (the fold's own locks
        last only for its copy; misses are looked up by every forward)."""
        held = [key for _, key in self._chunk_keys() if self.cache.chunks.peek(key) is not None]
        key = held[data.draw(st.integers(0, len(held) - 1), label="chunk")]
        entry = self.cache.chunks.lookup(key)
        self.lookups += 1
        self.hits += 1
        assert entry is not None and entry.key == key
        self.cache.chunks.lock(entry)
        self.pins.append(entry)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        entry = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.cache.chunks.unlock(entry)

    @precondition(lambda self: self.live)
    @rule()
    def drain(self):
        """Run every live request to its end, so the server goes idle."""
        self._forward([x for x in self.live if not x.forwarded])
        for x in list(self.live):
            self._finish(x, abort=False)

    @precondition(lambda self: not self.live and self.cache.total_size() > 0)
    @rule()
    def flush(self):
        """The scheduler's flush_cache on an idle server: tree reset, then both pools cleared."""
        if self.pins:
            before = self._ownership()
            with pytest.raises(RuntimeError):
                self.cache.reset()
            assert torch.equal(self._ownership(), before)  # a refused reset changes nothing
            return
        radix = [int(s) for node, _, _ in self._radix_nodes() for s in node.value.tolist()]
        self.cache.reset()
        # The chunk tree gave its slots back; the radix tree's come back with the allocator's clear.
        free = self.allocator.get_all_free_pages().tolist()
        assert sorted(free + radix) == list(range(1, POOL + 1))
        self.req_to_token.clear()
        self.allocator.clear()
        assert self.allocator.available_size() == POOL
        assert self.cache.evictable_size() == self.cache.protected_size() == self.cache.total_size() == 0
        assert len(self.cache.chunks) == 0

    # ------------------------------------------------------------ invariants

    def _ownership(self) -> torch.Tensor:
        """How many owners each slot 0..POOL has (tree, live request or free list)."""
        parts = [node.value for node, _, _ in self._radix_nodes()]
        parts += [self.cache.chunks.peek(key).slots for _, key in self._chunk_keys()
                  if self.cache.chunks.peek(key) is not None]
        parts += [self._row(x.req)[x.req.kv.cache_protected_len : x.req.kv.kv_allocated_len] for x in self.live]
        parts.append(self.allocator.get_all_free_pages())
        return torch.bincount(torch.cat([p.to(torch.int64) for p in parts]), minlength=POOL + 1)

    @invariant()
    def every_slot_has_one_owner(self):
        counts = self._ownership()
        assert counts[0] == 0 and len(counts) == POOL + 1
        wrong = (counts[1:] != 1).nonzero().flatten() + 1
        assert not len(wrong), f"slots owned 0 or 2+ times: {wrong.tolist()}"

    @invariant()
    def radix_tree_holds_exact_kv_and_right_counts(self):
        evictable = protected = 0
        for node, extra, before in self._radix_nodes():
            path = before + tuple(node.key)
            values = self._v(node.value)
            assert [self.contents.get(v) for v in values] == [
                (extra, path[: len(before) + i + 1]) for i in range(len(values))
            ]
            self._assert_k_at(node.value, torch.arange(len(before), len(path)))
            # Each live request locks its matched node and every node above it.
            holders = 0
            for x in self.live:
                n = x.req.lock.node
                while n is not None and n is not node:
                    n = n.parent
                holders += n is node
            assert node.lock_ref == holders
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        assert self.sg.RadixCache.evictable_size(self.cache) == evictable
        assert self.cache.protected_size() == protected
        chunk_evictable = sum(e.num_tokens for _, key in self._chunk_keys()
                              if (e := self.cache.chunks.peek(key)) is not None and e.lock_ref == 0)
        assert self.cache.evictable_size() == evictable + chunk_evictable
        assert self.cache.total_size() == evictable + protected + self.cache.chunks.total_tokens()

    @invariant()
    def chunks_hold_their_kv_and_pins_survive(self):
        held = 0
        for extra, key in self._chunk_keys():
            entry = self.cache.chunks.peek(key)
            if entry is None:
                continue
            doc = key.tokens
            held += entry.num_tokens
            assert [self.contents.get(v) for v in self._v(entry.slots)] == [
                (extra, doc[: i + 1]) for i in range(len(doc))
            ]
            self._assert_k_at(entry.slots, torch.arange(len(doc)) + entry.canonical_start)
            # Locks: this test's pins, and admitted requests' pins until their forward.
            admitted = sum(p is entry for pins in self.cache.pins.values() for _, p in pins)
            assert entry.lock_ref == sum(p is entry for p in self.pins) + admitted
        assert held == self.cache.chunks.total_tokens()
        for entry in self.pins + [p for pins in self.cache.pins.values() for _, p in pins]:
            assert self.cache.chunks.peek(entry.key) is entry
        # Only admitted, not yet forwarded requests hold pins.
        assert set(self.cache.pins) <= {x.req.rid for x in self.live if not x.forwarded}
        assert self.cache.chunks.stats().locked_entries == sum(
            1 for _, key in self._chunk_keys() if (e := self.cache.chunks.peek(key)) is not None and e.lock_ref)

    @invariant()
    def locked_prefixes_stay_in_the_tree(self):
        for x in self.live:
            req = x.req
            n = req.lock.node
            while n is not self.cache.root_node:  # still attached, up to the root
                assert n.parent.children.get(n.key.child_key(1)) is n
                n = n.parent
            path = self.cache.path_device_indices(req.lock.node)
            assert torch.equal(path, self._row(req)[: req.kv.cache_protected_len])

    @invariant()
    def chunk_counters_add_up(self):
        stats = self.cache.chunks.stats()
        assert stats.hits + stats.misses == stats.lookups == self.lookups
        assert stats.hits == self.hits

    def teardown(self):
        for entry in self.pins:
            self.cache.chunks.unlock(entry)


@pytest.fixture
def scheduler_context():
    """SGLang's Req reads process-wide server args; publish CPU defaults and clear them after."""
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))
    yield
    reset_context()


def test_tree_cache_matches_model(scheduler_context):
    run_state_machine_as_test(
        TreeCacheMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


class TieredTreeCacheMachine(TreeCacheMachine):
    """The same machine with a small host tier (TinyLFU) and a disk tier below the pool: evicted
    chunks spill, admissions load them back (cache/tiers/, tree_cache: lower tiers). Every
    invariant above still holds (one owner per slot, each chunk entry holding its own KV at its
    canonical position, reused rows holding the chunk's KV re-rotated); a chunk hits iff the pool
    or a lower tier holds it."""

    def _build_cache(self, cls, params, pool_kv):
        import tempfile

        from relaxkv_sglang.cache.sglang.tier_configs import build_tiers
        from relaxkv_sglang.cache.tiers import DiskTierConfig, HostTierConfig, ModelIdentity
        from relaxkv_sglang.cache.tiers.value import DEFAULT_MAX_TOKENS
        self.tmp = tempfile.TemporaryDirectory(prefix="relaxkv-tiers-")
        host_tokens = self.draw_host_tokens if hasattr(self, "draw_host_tokens") else 6
        token_bytes = 1 * 2 * 1 * 2 * 4
        self.tiers = build_tiers(
            [HostTierConfig(host_tokens * token_bytes), DiskTierConfig(self.tmp.name, 1 << 20)], pool_kv,
            ModelIdentity("m", "t", "float32", pool_kv.layout()), DEFAULT_MAX_TOKENS, async_writes=False)
        return cls(params, pool_kv, None, self.tiers)

    def _held(self, ns, tokens) -> bool:
        return super()._held(ns, tokens) or self.tiers.where(ChunkKey(ns, tokens)) is not None

    @invariant()
    def chunk_counters_add_up(self):
        stats = self.cache.chunks.stats()
        assert stats.hits + stats.misses == stats.lookups == self.lookups
        assert stats.hits <= self.hits  # the rest were served by a lower tier

    @invariant()
    def host_tier_within_its_bound(self):
        host = self.tiers.tier(TierName.HOST)
        assert host.used_bytes <= host.capacity_bytes
        assert host.used_bytes == sum(rows.shape[0] for rows, _ in host.entries.values()) * host.token_bytes

    def teardown(self):
        super().teardown()
        self.tiers.close()
        self.tmp.cleanup()


def test_tiered_tree_cache_matches_model(scheduler_context):
    run_state_machine_as_test(
        TieredTreeCacheMachine,
        settings=settings(max_examples=100, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


def test_a_chunk_held_twice_is_pinned_once_in_the_count(scheduler_context):
    """The shrunk case hypothesis found: a request holding one chunk twice locks it twice, but
    the pool tokens it pins are the chunk's once (else admission's arithmetic over-counts)."""
    machine = TreeCacheMachine()
    try:
        machine.admit(RequestSpec("pic", None, (), ((10, 11, 12),), (7,)))
        machine.drain()  # the chunk is published
        req = machine._make_req(RequestSpec("pic", None, (), ((10, 11, 12), (10, 11, 12)), (7,)))
        req.init_next_round_input(machine.cache)
        assert machine.cache.pin_request(req) == 3
        machine.cache.admission_pins.unpin(req)
    finally:
        machine.teardown()
