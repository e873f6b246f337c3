"""Admission: chunk hits pinned from the moment a request is admitted until its fold.

Before ``PrefillAdder`` checks a request against ``free + evictable_size()``, its chunk hits are
pinned so no allocation evicts them; while others run, the check also runs under
:meth:`~relaxkv_sglang.cache.sglang.pins.AdmissionHold.hold`. Pins are dropped after the fold
(:mod:`relaxkv_sglang.forward.pipeline`), on release and on a flush; docs/reliability.md.

SGLang functions wrapped (:data:`HOOKS`): ``managers/schedule_policy.py`` ``PrefillAdder.add_one_req``
and ``PrefillAdder.add_chunked_req``, ``managers/scheduler.py`` ``Scheduler.get_new_batch_prefill``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Optional

from relaxkv_sglang.runtime.hooks import Hook

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache


def _relaxkv_cache(tree_cache: BasePrefixCache) -> Optional[RelaxKVCache]:
    """The tree cache if it is the plugin's (it pins), else None."""
    return tree_cache if hasattr(tree_cache, "pin_request") else None


def _admitted(adder: PrefillAdder, req: Req) -> bool:
    return any(r is req for r in adder.can_run_list)


def around_get_new_batch_prefill(original: Callable, scheduler: Scheduler, running_batch: ScheduleBatch,
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


def around_add_one_req(original: Callable, adder: PrefillAdder, req: Req, *args: Any, **kwargs: Any) -> Any:
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


def around_add_chunked_req(original: Callable, adder: PrefillAdder, req: Req, *args: Any, **kwargs: Any) -> Any:
    """Hook on ``PrefillAdder.add_chunked_req``: the next window pins its hits."""
    cache = _relaxkv_cache(adder.tree_cache)
    if cache is None:
        return original(adder, req, *args, **kwargs)
    return _check_pinned(cache, adder, req, lambda: original(adder, req, *args, **kwargs))


def _check_pinned(cache: RelaxKVCache, adder: PrefillAdder, req: Req, check: Callable[[], Any]) -> Any:
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


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
         around_get_new_batch_prefill, ("self", "running_batch")),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
         around_add_one_req, ("self", "req")),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
         around_add_chunked_req, ("self", "req")),
)
