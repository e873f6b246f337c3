"""Admission: chunk hits pinned from the moment a request is admitted until its fold.

SGLang admits requests in ``Scheduler.get_new_batch_prefill``: for each queued
request it matches the prefix (``Req.init_next_round_input`` ->
``RelaxKVTreeCache.match_prefix``), then ``PrefillAdder.add_one_req`` checks the
request against the budget ``free + tree_cache.evictable_size()`` (read live) and
commits it; after the loop ``prepare_for_extend`` allocates every admitted
request's slots, evicting what it must, and the batch's forward runs the fold.

The hooks here:

* around ``PrefillAdder.add_one_req``: before the check, the cache pins the
  request's chunk hits (:meth:`~relaxkv_sglang.srt.mem_cache.tree_cache_class.RelaxKVTreeCache.pin_request`), so
  they leave the evictable budget (admission counts what the request will copy:
  the slots of its private copy are in its extend, the canonical copy it reads
  is pinned) and no later allocation can evict them. With lower tiers, a chunk
  the pool lacks but the host or disk tier holds is loaded into the pool there
  first (evicting only other unpinned chunks) and pinned the same way. While other requests run
  (or one was admitted this round) the check also runs under
  :meth:`~relaxkv_sglang.srt.mem_cache.pins.AdmissionHold.hold`: chunks that queued
  requests need count as not evictable, so a request that only fits by evicting
  them waits for memory to come back instead. A request not admitted drops its
  pins at once; an admitted one keeps those of its window only.
* around ``PrefillAdder.add_chunked_req``: the next window of a chunked prefill
  pins its chunk hits the same way.
* around ``Scheduler.get_new_batch_prefill``: tells the cache the round's
  waiting queue (whose chunks the hold protects) and ends the round.

The forward hook (:mod:`relaxkv_sglang.srt.forward.pipeline`) drops the batch's pins once the fold has
copied them; a released request (``on_release``) and a flush (``reset``) drop
theirs too. Trade-offs and measurements: docs/reliability.md.

SGLang files touched (hooks registered in ``plugin.py``): ``managers/schedule_policy.py``
``PrefillAdder.add_one_req`` and ``PrefillAdder.add_chunked_req`` (around),
``managers/scheduler.py`` ``Scheduler.get_new_batch_prefill`` (around).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable


def _relaxkv_cache(tree_cache: Any) -> Any:
    """The tree cache if it is the plugin's (it pins), else None."""
    return tree_cache if hasattr(tree_cache, "pin_request") else None


def _admitted(adder: Any, req: Any) -> bool:
    return any(r is req for r in adder.can_run_list)


def around_get_new_batch_prefill(original: Callable, scheduler: Any, running_batch: Any,
                                 *args: Any, **kwargs: Any) -> Any:
    """Hook on ``Scheduler.get_new_batch_prefill``: one admission round."""
    cache = _relaxkv_cache(scheduler.tree_cache)
    if cache is None:
        return original(scheduler, running_batch, *args, **kwargs)
    cache.begin_admission(scheduler.waiting_queue, scheduler.chunked_req)
    try:
        return original(scheduler, running_batch, *args, **kwargs)
    finally:
        cache.hold.end()


def around_add_one_req(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Hook on ``PrefillAdder.add_one_req``: pin the request's hits, check it under the hold."""
    cache = _relaxkv_cache(adder.tree_cache)
    if cache is None:
        return original(adder, req, *args, **kwargs)
    running = adder.running_batch
    others_run = bool(adder.can_run_list) or (running is not None and not running.is_empty())
    hold = cache.hold.hold() if others_run else contextlib.nullcontext()

    def check() -> Any:
        """The adder's own check, under the hold."""
        with hold:
            return original(adder, req, *args, **kwargs)

    return _check_pinned(cache, adder, req, check)


def around_add_chunked_req(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Hook on ``PrefillAdder.add_chunked_req``: the next window pins its hits."""
    cache = _relaxkv_cache(adder.tree_cache)
    if cache is None:
        return original(adder, req, *args, **kwargs)
    return _check_pinned(cache, adder, req, lambda: original(adder, req, *args, **kwargs))


def _check_pinned(cache: Any, adder: Any, req: Any, check: Callable[[], Any]) -> Any:
    """Pin ``req``'s hits, run the adder's ``check``; keep the admitted window's pins, else drop them."""
    cache.pin_request(req)
    try:
        result = check()
    except BaseException:
        cache.admission_pins.unpin(req)
        raise
    if _admitted(adder, req):
        cache.admission_pins.trim(req, req.extend_end)
    else:
        cache.admission_pins.unpin(req)
    return result
