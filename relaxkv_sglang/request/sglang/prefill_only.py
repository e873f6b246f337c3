"""A prefill-only request (``max_new_tokens`` 0) reports no output logprobs, whatever its batch.

SGLang 0.5.23 appends an output logprob to one batched with a generating request; the hook drops it
(``tests/e2e/test_cache_invariant_regressions.py``). Loaded into every server, stock SGLang included.

SGLang file touched: ``managers/scheduler_components/logprob_result_processor.py``
(``SchedulerLogprobResultProcessor.add_logprob_return_values``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from relaxkv_sglang.runtime.hooks import Hook

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor

__all__ = ["around_add_logprob_return_values"]

# The per-request lists add_logprob_return_values appends one output position to.
_OUTPUT_LISTS = ("output_token_logprobs_val", "output_token_logprobs_idx", "output_top_logprobs_val",
                 "output_top_logprobs_idx", "output_token_ids_logprobs_val", "output_token_ids_logprobs_idx")


def around_add_logprob_return_values(original: Callable[..., Any], processor: SchedulerLogprobResultProcessor, i: int,
                                     req: Req, *args: Any, **kwargs: Any) -> Any:
    """Hook: SGLang's own bookkeeping, less the output entries of a prefill-only request."""
    if not req.is_prefill_only:
        return original(processor, i, req, *args, **kwargs)
    logprob = req.logprob
    lengths = {name: len(getattr(logprob, name)) for name in _OUTPUT_LISTS if getattr(logprob, name, None) is not None}
    result = original(processor, i, req, *args, **kwargs)
    for name, n in lengths.items():
        del getattr(logprob, name)[n:]
    return result


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.managers.scheduler_components.logprob_result_processor.SchedulerLogprobResultProcessor"
         ".add_logprob_return_values",
         around_add_logprob_return_values, ("self", "i", "req")),
)
