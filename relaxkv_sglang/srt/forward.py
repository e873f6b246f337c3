"""The scheduler-side pipeline of one forward pass: fold, repair, forward, finish.

``TpModelWorker.forward_batch_generation`` is wrapped by :func:`around_forward_batch_generation`:

1. :func:`~.fold.fold_batch`: chunk hits copied (re-rotated) into the requests' slots and
   dropped from the batch; misses kept, scoped to their own chunk;
2. :func:`~.repair.prepare_repair`: for repair policies, the requests to repair and their
   query pass (SGLang's forward over their folded rows, the backend recording the query's
   scores), and the repair the model hook runs after it;
3. the folded batch and its :class:`~.context.ForwardContext` are attached to the scheduled
   batch and the context to the worker's attention backend and decoder stack; SGLang's own forward runs,
   building its ``ForwardBatch`` through :func:`around_forward_batch_init_new` (folded rows,
   real positions), then the ``relaxkv`` attention backend and the model hook (on the decoder
   stack: after SGLang's layers, the repair: plan, anchors, glue and query) read the context;
4. :func:`~.fold.finish_fold`: misses published to the chunk tree, reuse counted, reports;
5. the chunk pins the batch's requests took at admission (:mod:`.admission`) are dropped,
   whatever happened above.

A request's own trouble never raises out of here (an aborted request's stub has no plan,
:mod:`.plan`; a repair that cannot be carried out is served as ``pic``, :mod:`.repair`). A broken
invariant of the plugin's bookkeeping (:class:`~.context.InvariantError`) is logged in one line,
then left to SGLang, which stops the server.

SGLang files touched (hooks registered in ``plugin.py``): ``managers/tp_worker.py``
``TpModelWorker.forward_batch_generation`` (around) and
``model_executor/forward_batch_info.py`` ``ForwardBatch.init_new`` (around).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from relaxkv_sglang.srt.context import InvariantError, PendingForward, attach_context, attach_pending, pending_forward
from relaxkv_sglang.srt.fold import finish_fold, fold_batch
from relaxkv_sglang.srt.repair import prepare_repair
from relaxkv_sglang.srt.tree_cache import worker_cache

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
            cache.unpin_requests(batch.reqs)


def _forward(original: Callable, cache: Any, worker: Any, batch: Optional[Any], *args: Any, **kwargs: Any) -> Any:
    fold = fold_batch(cache, batch)
    if fold is None:
        return original(worker, batch, *args, **kwargs)
    context = fold.context(prepare_repair(cache, worker.model_runner, fold))
    attach_pending(batch, PendingForward(fold.batch(), context))
    readers = _context_readers(worker)
    for reader in readers:
        attach_context(reader, context)
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        attach_pending(batch, None)
        for reader in readers:
            attach_context(reader, None)
    finish_fold(cache, fold)
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
