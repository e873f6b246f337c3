"""The hook on ``TpModelWorker.forward_batch_generation`` (``managers/tp_worker.py``): the forward's stages in
order (:mod:`relaxkv_sglang.forward`), each taking the last one's value; and on ``ForwardBatch.init_new``
(``model_executor/forward_batch_info.py``): the ``ForwardBatch`` built from the folded batch.

With ``RELAXKV_TP_CHECK`` the ranks compare their folds first (one gather): a store out of lockstep stops the
server naming the request instead of hanging in SGLang's collectives. The batch's admission pins are dropped
whatever happens; only an :class:`~relaxkv_sglang.runtime.failures.InvariantError` raises out (logged).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from relaxkv_sglang.attention.extend_rows import FoldedRows
from relaxkv_sglang.cache.sglang.relaxkv_cache import worker_cache
from relaxkv_sglang.forward.context import PendingForward, attached, pending_forward
from relaxkv_sglang.forward.finish import finish_forward
from relaxkv_sglang.forward.fold import fold_batch, fold_digests
from relaxkv_sglang.forward.query_pass import set_up_forward
from relaxkv_sglang.forward.repair_stage import repair_stage
from relaxkv_sglang.model.sglang.tensor_parallel import served_tensor_parallel
from relaxkv_sglang.model.tensor_parallel import check_same
from relaxkv_sglang.repair.sglang.services import repair_services
from relaxkv_sglang.runtime.failures import InvariantError
from relaxkv_sglang.runtime.hooks import Hook

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache

logger = logging.getLogger(__name__)


def around_forward_batch_generation(original: Callable, worker: "TpModelWorker",
                                    batch: Optional["ScheduleBatch"] = None, *args: Any, **kwargs: Any) -> Any:
    """Hook on ``TpModelWorker.forward_batch_generation``: fold, repair, forward, finish."""
    cache = worker_cache(worker)
    if cache is None:
        return original(worker, batch, *args, **kwargs)
    try:
        return _forward(original, cache, worker, batch, *args, **kwargs)
    except InvariantError as exc:
        logger.error("relaxkv: a broken invariant of the server stops it: %s (batch of %d requests)",
                     exc, len(batch.reqs) if batch is not None else 0)
        raise
    finally:
        # the pins taken at admission (admission.py), on a failed forward too
        if batch is not None:
            cache.admission_pins.unpin_all(batch.reqs)


def _forward(original: Callable, cache: "RelaxKVCache", worker: "TpModelWorker", batch: Optional["ScheduleBatch"],
             *args: Any, **kwargs: Any) -> Any:
    fold = fold_batch(cache, batch)
    if fold is None:
        return original(worker, batch, *args, **kwargs)
    ranks = served_tensor_parallel()
    if ranks.size > 1 and ranks.checks:  # digests only where they are compared
        check_same(ranks, fold_digests(fold), [f"request {f.req.rid}" for f in fold.requests], "the fold (chunk hits)")
    runner = worker.model_runner
    setup = set_up_forward(cache, runner, fold)
    stage = repair_stage(cache, repair_services(worker), setup)
    rows = FoldedRows(list(setup.extend_rows), repairs=stage is not None)
    pending = PendingForward(setup.batch, setup.positions, rows, stage)
    decoder_stack = getattr(runner.model, "model", None)  # whose ``forward`` the repair hook wraps
    with attached(batch, runner.attn_backend, decoder_stack, pending):
        result = original(worker, batch, *args, **kwargs)
    finish_forward(cache, setup, stage)
    return result


def around_forward_batch_init_new(original: Callable, cls: type["ForwardBatch"], batch: "ScheduleBatch",
                                  model_runner: "ModelRunner", *args: Any, **kwargs: Any) -> Any:
    """Hook on the classmethod ``ForwardBatch.init_new``: build it from the folded batch."""
    pending = pending_forward(batch)
    if pending is None:
        return original(cls, batch, model_runner, *args, **kwargs)
    forward_batch = original(cls, pending.batch, model_runner, *args, **kwargs)
    forward_batch.positions = pending.positions.to(forward_batch.positions.dtype).to(forward_batch.positions.device)
    return forward_batch


#: the SGLang functions this module wraps (registered by ``server/sglang/plugin.py``)
HOOKS = (
    Hook("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
         around_forward_batch_generation, ("self", "batch")),
    Hook("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
         around_forward_batch_init_new, ("cls", "batch", "model_runner")),
)
