"""The scheduler-side pipeline of one forward pass: one-way stages, each taking the last one's value.

``TpModelWorker.forward_batch_generation`` is wrapped by :func:`around_forward_batch_generation`:

====  ===========================================  ============================================
step  stage                                        value it returns
====  ===========================================  ============================================
1     :func:`~relaxkv_sglang.srt.forward.fold.fold_batch`                    :class:`~relaxkv_sglang.srt.forward.fold.Fold`: chunk hits copied
                                                   (re-rotated) into the requests' slots and
                                                   dropped; misses kept, scoped to their chunk
2     :func:`~relaxkv_sglang.srt.forward.query_pass.set_up_forward`          :class:`~relaxkv_sglang.srt.forward.query_pass.ForwardSetup`: every
                                                   request's rows; a request to repair gets its
                                                   query pass (scores recorded by the backend)
3     :func:`~relaxkv_sglang.srt.forward.repair.repair_stage`                :class:`~relaxkv_sglang.srt.forward.repair.RepairStage` (None: no
                                                   request is repaired), run by the model hook
4     SGLang's forward, under                      the stage's
      :func:`~relaxkv_sglang.srt.forward.context.attached`                   :attr:`~relaxkv_sglang.srt.forward.repair.RepairStage.outcomes`
5     :func:`~relaxkv_sglang.srt.forward.finish.finish_forward`              misses published, reuse counted in SGLang's
                                                   accounting, ``meta_info.relaxkv`` (:mod:`relaxkv_sglang.srt.forward.report`)
====  ===========================================  ============================================

In step 4 SGLang builds its ``ForwardBatch`` through :func:`around_forward_batch_init_new` from
the folded batch (real positions); the ``relaxkv`` attention backend and the model hook (on the
decoder stack: after SGLang's layers, the repair) read the :class:`~relaxkv_sglang.srt.forward.context.ForwardContext`.
Finally the chunk pins the batch's requests took at admission (:mod:`relaxkv_sglang.srt.scheduler.admission`) are dropped,
whatever happened above.

A request's own trouble never raises out of here (an aborted request's stub has no plan,
:mod:`.plan`; a repair that cannot be carried out is served as ``pic``, :mod:`relaxkv_sglang.srt.forward.repair`). A broken
invariant of the plugin's bookkeeping (:class:`~.failures.InvariantError`) is logged in one line,
then left to SGLang, which stops the server.

SGLang files touched (hooks registered in ``plugin.py``): ``managers/tp_worker.py``
``TpModelWorker.forward_batch_generation`` (around) and
``model_executor/forward_batch_info.py`` ``ForwardBatch.init_new`` (around).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from relaxkv_sglang.srt.forward.context import ForwardContext, PendingForward, attached, pending_forward
from relaxkv_sglang.srt.failures import InvariantError
from relaxkv_sglang.srt.forward.finish import finish_forward
from relaxkv_sglang.srt.forward.fold import fold_batch
from relaxkv_sglang.srt.forward.query_pass import set_up_forward
from relaxkv_sglang.srt.forward.repair import repair_stage
from relaxkv_sglang.srt.mem_cache.chunk_cache import worker_cache

logger = logging.getLogger(__name__)


def around_forward_batch_generation(original: Callable, worker: Any, batch: Optional[Any] = None,
                                    *args: Any, **kwargs: Any) -> Any:
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
        # the chunk pins taken at admission (admission.py): copied by the fold, or not
        # needed (a mixed batch is not folded); on a failed forward too
        if batch is not None:
            cache.admission_pins.unpin_all(batch.reqs)


def _forward(original: Callable, cache: Any, worker: Any, batch: Optional[Any], *args: Any, **kwargs: Any) -> Any:
    fold = fold_batch(cache, batch)
    if fold is None:
        return original(worker, batch, *args, **kwargs)
    runner = worker.model_runner
    setup = set_up_forward(cache, runner, fold)
    stage = repair_stage(cache, runner.attn_backend, setup)
    context = ForwardContext(setup.positions, list(setup.extend_rows), stage)
    with attached(batch, _context_readers(worker), PendingForward(setup.batch, context)):
        result = original(worker, batch, *args, **kwargs)
    finish_forward(cache, setup, stage.outcomes if stage is not None else {})
    return result


def _context_readers(worker: Any) -> list[Any]:
    """The objects that read the context during the forward: the attention backend, and the
    decoder stack whose ``forward`` the repair hook wraps."""
    runner = worker.model_runner
    inner = getattr(runner.model, "model", None)
    return [runner.attn_backend] + ([inner] if inner is not None else [])


def around_forward_batch_init_new(original: Callable, cls: type, batch: Any, model_runner: Any,
                                  *args: Any, **kwargs: Any) -> Any:
    """Hook on the classmethod ``ForwardBatch.init_new``: build it from the folded batch."""
    pending = pending_forward(batch)
    if pending is None:
        return original(cls, batch, model_runner, *args, **kwargs)
    forward_batch = original(cls, pending.batch, model_runner, *args, **kwargs)
    positions = pending.context.positions
    forward_batch.positions = positions.to(forward_batch.positions.dtype).to(forward_batch.positions.device)
    return forward_batch
