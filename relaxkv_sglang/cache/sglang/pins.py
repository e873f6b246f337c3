"""Admission pins and the admission hold: chunk hits kept in the pool from admission to the fold.

Both change what ``PrefillAdder`` sees as evictable (hooks: :mod:`.admission`). The hold also takes the
chunk index's learned share of the pool off ``evictable_size``, so a request that fits only by evicting
queued requests' chunks waits (docs/reliability.md, "Chunk hits under memory pressure").
``stats()["chunk_locked_entries"]`` is 0 whenever no admitted request waits.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import ChunkEntry, PoolChunkIndex
from relaxkv_sglang.request.plan import request_plan
from relaxkv_sglang.runtime import records

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from relaxkv_sglang.request.plan import RequestPlan

# Queued requests (in queue order) whose chunks the admission hold protects.
HOLD_QUEUE_DEPTH = 256

# Loads a chunk the pool lacks from a lower tier: its key -> its entry, or None.
ChunkLoader = Callable[[ChunkKey], Optional[ChunkEntry]]


@dataclasses.dataclass(frozen=True)
class RequestChunks:
    """A ``Req``'s record: (start, end, key) of each of its chunks, made once (admission asks every round)."""

    chunks: tuple[tuple[int, int, ChunkKey], ...]


def chunk_keys(req: "Req", plan: "RequestPlan") -> tuple[tuple[int, int, ChunkKey], ...]:
    """(start, end, key) of each chunk of the request, computed once per request."""
    held = records.record(req, RequestChunks, create=False)
    if held is None:
        ids = req.origin_input_ids
        held = records.attach(req, RequestChunks(tuple((cs, ce, ChunkKey(plan.namespace, ids[cs:ce]))
                                                        for cs, ce in plan.chunk_spans)))
    return held.chunks


def requests_chunks(reqs: Iterable[Req]) -> Iterator[ChunkKey]:
    """The key of every chunk of the requests that reuse chunks, in order."""
    for req in reqs:
        plan = request_plan(req)
        if plan is None or not plan.reuses_chunks:
            continue
        for _cs, _ce, key in chunk_keys(req, plan):
            yield key


class AdmissionPins:
    """Chunk entries locked for admitted requests until their fold (module doc)."""

    def __init__(self, chunks: PoolChunkIndex) -> None:
        """``chunks``: the pool's chunk index."""
        self.chunks = chunks
        self.by_request: dict[str, list[tuple[int, ChunkEntry]]] = {}  # rid -> [(chunk end, entry)]
        self.dropped_at_reset = 0  # requests whose pins a flush found (a leak: flushes happen when idle)

    def pin(self, req: Req, load: Optional[ChunkLoader] = None) -> int:
        """Lock every held (or ``load``ed) chunk of ``req`` after its matched prefix, replacing earlier
        pins; the pool tokens pinned (a chunk held twice is locked twice, counted once)."""
        self.unpin(req)
        plan = request_plan(req)
        if plan is None or not plan.reuses_chunks:
            return 0
        start = req.prefix_len
        pins = []
        for _cs, ce, key in chunk_keys(req, plan):
            if ce < start:  # settled by an earlier window (fold.settles_in_window)
                continue
            entry = self.chunks.peek(key)
            if entry is None and load is not None:
                entry = load(key)
            if entry is not None:
                self.chunks.lock(entry)
                pins.append((ce, entry))
        if pins:
            self.by_request[req.rid] = pins
        return sum(e.num_tokens for e in {id(e): e for _, e in pins}.values())

    def trim(self, req: Req, end: int) -> None:
        """Keep only the pins of chunks that end by ``end`` (the admitted window's end)."""
        pins = self.by_request.get(req.rid)
        if not pins:
            return
        keep = []
        for ce, entry in pins:
            if ce > end:
                self.chunks.unlock(entry)
            else:
                keep.append((ce, entry))
        if keep:
            self.by_request[req.rid] = keep
        else:
            del self.by_request[req.rid]

    def unpin(self, req: Req) -> None:
        """Drop the request's pins (copied, not admitted, finished, aborted)."""
        for _, entry in self.by_request.pop(req.rid, ()):
            self.chunks.unlock(entry)

    def unpin_all(self, reqs: Iterable[Req]) -> None:
        """Drop the pins of a batch's requests (after its forward)."""
        if self.by_request:
            for req in reqs:
                self.unpin(req)

    def drop_all(self) -> int:
        """A flush: unlock every pin; returns the requests that still held some (counted)."""
        n = len(self.by_request)
        self.dropped_at_reset += n
        for rid in list(self.by_request):
            for _, entry in self.by_request.pop(rid):
                self.chunks.unlock(entry)
        return n


class AdmissionHold:
    """The chunks queued requests need, held out of the adder's budget for one check (module doc)."""

    def __init__(self, chunks: PoolChunkIndex, enabled: bool = True) -> None:
        """``enabled``: False with ``RELAXKV_ADMISSION_HOLD=0``."""
        self.chunks = chunks
        self.enabled = enabled
        self.queue: Optional[list[Req]] = None  # the waiting queue, during an admission round
        self.hot: Optional[list[ChunkEntry]] = None  # entries queued requests need, once per round
        self.reserve = 0  # tokens admission leaves to the pool's chunk index, during one admission check

    def begin(self, waiting_queue: list[Req], chunked_req: Optional[Req] = None) -> None:
        """An admission round starts over ``waiting_queue`` (and the chunked request, first)."""
        self.queue = ([chunked_req] if chunked_req is not None else []) + list(waiting_queue)
        self.hot = None

    def end(self) -> None:
        """The admission round is over."""
        self.queue = self.hot = None

    def _hot_entries(self) -> list[ChunkEntry]:
        """Stored chunks the first HOLD_QUEUE_DEPTH queued requests need, each once."""
        if self.hot is None:
            seen: dict[int, ChunkEntry] = {}
            for key in requests_chunks((self.queue or ())[:HOLD_QUEUE_DEPTH]):
                entry = self.chunks.peek(key)
                if entry is not None:
                    seen.setdefault(id(entry), entry)
            self.hot = list(seen.values())
        return self.hot

    @contextlib.contextmanager
    def hold(self) -> Iterator[int]:
        """For one admission check: lock the queued requests' chunks and reserve the index's
        learned share (less what is locked); yields the tokens held back (locked + reserved)."""
        if not self.enabled:
            yield 0
            return
        held = [e for e in self._hot_entries() if self.chunks.peek(e.key) is e]
        for entry in held:
            self.chunks.lock(entry)
        try:
            self.reserve = max(0, self.chunks.target_tokens() - self.chunks.locked_tokens())
            yield sum(e.num_tokens for e in held) + self.reserve
        finally:
            self.reserve = 0
            for entry in held:
                self.chunks.unlock(entry)
