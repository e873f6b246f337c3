"""What the forward stages and admission call on the relaxkv tree cache, and how a worker finds it.

Implemented by :class:`~.tree_cache_class.RelaxKVTreeCache`; attached to the worker, so no module holds
a process-wide reference. Imports no SGLang at run time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Optional, Protocol, Sequence

import torch

from relaxkv_sglang.runtime import records

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.tp_worker import TpModelWorker

    from relaxkv_sglang.cache.chunk_key import ChunkKey
    from relaxkv_sglang.cache.tiers import TierName
    from relaxkv_sglang.cache.sglang.chunk_reuse import ChunkReuse
    from relaxkv_sglang.cache.sglang.pins import AdmissionHold, AdmissionPins
    from relaxkv_sglang.cache.sglang.pool_kv import PoolKV

class RelaxKVCache(Protocol):
    """The relaxkv tree cache as the fold, the query pass, the repair, the finish and admission use it."""

    pool_kv: "PoolKV"
    reuse: "ChunkReuse"
    admission_pins: "AdmissionPins"
    hold: "AdmissionHold"

    @property
    def req_to_token(self) -> torch.Tensor:
        """int32 [max_requests, max_context] each request's KV slot per position."""

    def publish_chunks(self, chunks: Sequence[tuple["ChunkKey", int, int]], req_pool_idx: int) -> None:
        """Publish a request's miss chunks, (key, start, end) of its ``req_to_token`` row."""

    def pin_request(self, req: Req) -> int:
        """Lock the request's chunk hits until its fold (a lower tier's hit loaded first); tokens pinned."""

    def begin_admission(self, waiting_queue: list[Req], chunked_req: Optional[Req] = None) -> None:
        """An admission round starts (the hold learns the queue; lower-tier reads start)."""

    def update_metrics(self) -> None:
        """Push the chunk counters to /metrics."""


@dataclasses.dataclass(frozen=True)
class WorkerCache:
    """A scheduler worker's record: its relaxkv tree cache."""

    cache: RelaxKVCache


def worker_cache(worker: TpModelWorker) -> Optional[RelaxKVCache]:
    """The relaxkv tree cache of this scheduler's worker, or None if not selected."""
    held = records.record(worker, WorkerCache, create=False)
    return held.cache if held is not None else None


def attach_worker_cache(worker: TpModelWorker, cache: RelaxKVCache) -> None:
    """Make ``cache`` the one :func:`worker_cache` finds for ``worker`` (the factory's call)."""
    records.attach(worker, WorkerCache(cache))


__all__ = ["RelaxKVCache", "worker_cache", "attach_worker_cache"]
