"""The startup correctness gate on the loaded model, and its verdict in both processes.

The maths is :mod:`relaxkv_sglang.server.gate`; :func:`run_startup_gate` runs it once from the tree
cache's factory, before anything is served, on ``4n`` pool slots (all freed) with the real layers:
``full`` (text at ``0..n-1``), ``moved`` (at ``p..p+n-1``), ``rotated`` (``full`` re-rotated by
``+p``: ``rope_k``, plus the :func:`control_rope` control that must fail) and ``pic`` (one chunk
copied back by ``-p``: ``pic_kv``, ``pic_logits``). The verdict is logged, on ``/metrics`` and on
``/get_server_info`` (``relaxkv.gate``, read by :mod:`relaxkv_sglang.request.sglang.gate_refusal`).

SGLang files touched (none hooked): reads ``managers/tp_worker.py``'s ``TpModelWorker``
(``model_runner.model``, ``tokenizer``), ``mem_cache/allocator/base.py`` (``alloc``/``free``)
and ``mem_cache/memory_pool.py`` (K/V buffers). Under tensor parallelism every rank runs the gate on its
own heads (the layer loop sums the row-parallel outputs over the ranks) and the ranks agree on one verdict.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from relaxkv_sglang.server.gate import (
    GATE_TEXT,
    CheckResult,
    GateResult,
    compare_layers,
    gate_offset,
    gate_token_ids,
    judge,
    tolerance_for,
)
from relaxkv_sglang.repair.policies import CHUNK_POLICIES
from relaxkv_sglang.model.rope import RopeSpec
from relaxkv_sglang.runtime.settings import ROPE_OVERRIDE_ENV, server_settings
from relaxkv_sglang.runtime import records
from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
from relaxkv_sglang.repair.sglang.layer_loop import LayerLoop, LoopRows
from relaxkv_sglang.model.sglang.model_layers import ModelLayers, UnsupportedModelError
from relaxkv_sglang.model.sglang.tensor_parallel import served_tensor_parallel
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV

if TYPE_CHECKING:
    from sglang.srt.managers.tp_worker import TpModelWorker

    from relaxkv_sglang.cache.sglang.tree_cache_class import RelaxKVTreeCache

logger = logging.getLogger(__name__)


def serving_rope(rope: RopeSpec, override: Optional[dict[str, Any]]) -> RopeSpec:
    """The RoPE spec the cache serves with: ``rope``, unless a test overrides fields of it
    (``override``: ``RopeSpec`` fields, the server's ``RELAXKV_TEST_ROPE_OVERRIDE``, e.g. ``{"base": 20000}``)."""
    if not override:
        return rope
    logger.warning("relaxkv: %s=%s: serving a RoPE the model does not use (tests only)", ROPE_OVERRIDE_ENV,
                   json.dumps(override))
    return dataclasses.replace(rope, **override)


def run_startup_gate(worker: "TpModelWorker", cache: "RelaxKVTreeCache", context_len: int, *, tp_rank: int = 0,
                     enable_metrics: bool = False) -> GateResult:
    """Run the gate once on the loaded model (``worker``: SGLang's ``TpModelWorker``); keep its verdict on ``cache``
    (the ``RelaxKVTreeCache`` just built), log it (rank 0) and publish it."""
    causal_lm = getattr(getattr(worker, "model_runner", None), "model", None)
    start = time.perf_counter()
    try:
        result = _run_checks(causal_lm, cache, context_len, getattr(worker, "tokenizer", None))
    except Exception as exc:  # the gate must never stop the server; it refuses chunk policies instead
        logger.debug("relaxkv: correctness gate raised", exc_info=True)
        result = GateResult.failure(f"the gate could not run: {type(exc).__name__}: {exc}")
    result = dataclasses.replace(_agreed(result), seconds=round(time.perf_counter() - start, 3))
    records.attach(cache, result)
    if tp_rank == 0:
        _log(result, type(causal_lm).__name__)
    if enable_metrics:
        _publish_metrics(result)
    return result


def _agreed(result: GateResult) -> GateResult:
    """The verdict every tensor-parallel rank serves: each rank checked its own heads and vocabulary shard, and
    one rank's failure fails the gate on all of them (one sum over the ranks; none at tp 1)."""
    ranks = served_tensor_parallel()
    if ranks.size == 1:
        return result
    failed = torch.zeros(ranks.size)
    failed[ranks.rank] = float(result.refuses_chunks)
    failed_ranks = ranks.sum(failed).nonzero().flatten().tolist()
    if not failed_ranks or result.refuses_chunks:
        return result
    return dataclasses.replace(result, status="failed",
                               reason=f"tensor-parallel rank(s) {failed_ranks} failed the gate on their heads")


def gate_state(cache: "RelaxKVTreeCache") -> Optional[dict]:
    """The verdict as /get_server_info shows it (``relaxkv.gate``), None before the gate ran."""
    held = records.record(cache, GateResult, create=False)
    return None if held is None else held.to_dict()


def _run_checks(causal_lm: Optional[torch.nn.Module], cache: "RelaxKVTreeCache", context_len: int,
                tokenizer: Any) -> GateResult:
    """The three checks (module doc); slots taken from the allocator and always given back."""
    if causal_lm is None or not hasattr(causal_lm, "model"):
        return GateResult.failure("the gate found no model on the worker")
    try:
        layers = ModelLayers(causal_lm.model)
    except UnsupportedModelError as exc:
        return GateResult.failure(f"the gate cannot run this model's layers: {exc}")
    kv_pool = cache.pool_kv.kv_pool
    device = cache.req_to_token.device
    dtype = getattr(kv_pool, "dtype", None) or kv_pool.get_key_buffer(next(iter(cache.pool_kv.layers))).dtype
    dtype_name = str(dtype).replace("torch.", "")
    vocab = int(getattr(getattr(causal_lm, "config", None), "vocab_size", 0) or causal_lm.lm_head.weight.shape[0])
    encoded = tokenizer.encode(GATE_TEXT) if tokenizer is not None else None
    ids = torch.tensor(gate_token_ids(encoded, vocab), dtype=torch.int64, device=device)
    n = int(ids.shape[0])
    n_chunk = (3 * n) // 4
    p = gate_offset(context_len, n)
    allocator = cache.token_to_kv_pool_allocator
    if allocator.available_size() < 4 * n:
        return GateResult.failure(f"the gate needs {4 * n} free KV slots, the pool has "
                                  f"{allocator.available_size()}", offset=p, n_tokens=n, dtype=dtype_name)
    taken = allocator.alloc(4 * n)
    if taken is None:
        return GateResult.failure(f"the gate could not allocate {4 * n} KV slots", offset=p, n_tokens=n,
                                  dtype=dtype_name)
    try:
        slots = taken.to(device=device, dtype=torch.int64)
        full_s, moved_s, rotated_s, pic_s = (slots[i * n:(i + 1) * n] for i in range(4))
        loop = LayerLoop(layers, kv_pool, AnchorAttention())
        tol = tolerance_for(dtype)
        with torch.no_grad():  # not inference_mode: a lazily built module buffer must stay an ordinary tensor
            full_hidden = loop.run([_rows(full_s, 0, 0, n, layers.n_layers)], ids)
            loop.run([_rows(moved_s, p, 0, n, layers.n_layers)], ids)
            cache.pool_kv.copy(full_s, rotated_s, p)
            rope_k = _compare_kv("rope_k", cache, rotated_s, moved_s, tol)
            PoolKV(kv_pool, control_rope(cache.pool_kv.rope)).copy(full_s, rotated_s, p)
            control = _compare_kv("rope_control", cache, rotated_s, moved_s, tol)
            cache.pool_kv.copy(moved_s[:n_chunk], pic_s[:n_chunk], -p)
            pic_hidden = loop.run([_rows(pic_s, 0, n_chunk, n, layers.n_layers)], ids[n_chunk:])
            pic_kv = _compare_kv("pic_kv", cache, pic_s, full_s, tol)
            weight = causal_lm.lm_head.weight  # [vocab (this rank's shard), hidden], in the model's dtype
            logits = [torch.nn.functional.linear(h.to(weight.dtype), weight).float()[:, None, :]
                      for h in (pic_hidden, full_hidden[n_chunk:])]
            pic_logits = compare_layers("pic_logits", [("query", logits[0])], [logits[1]], tol)
    finally:
        allocator.free(taken)
    return judge([rope_k, pic_kv, pic_logits], offset=p, n_tokens=n, dtype=dtype_name, control=control)


def control_rope(rope: RopeSpec) -> RopeSpec:
    """The negative control's rotation: the served one with twice its theta (every frequency but
    the first changes), a rotation the model does not use."""
    return dataclasses.replace(rope, base=2.0 * rope.base)


def _rows(slots: torch.Tensor, offset: int, first: int, n: int, n_layers: int) -> LoopRows:
    """The text's rows ``first..n-1`` at positions ``offset + i`` in ``slots`` (int64 [n]), scope
    ``offset``; positions below ``offset`` map to the never-read padding slot 0."""
    device = slots.device
    slot_of_pos = torch.zeros(offset + n, dtype=torch.int64, device=device)
    slot_of_pos[offset:] = slots
    positions = torch.arange(offset + first, offset + n, dtype=torch.int64, device=device)
    m = n - first
    return LoopRows(slots=slot_of_pos, positions=positions,
                    exits=torch.full((m,), n_layers, dtype=torch.int64, device=device),
                    scope=torch.full((m,), offset, dtype=torch.int64, device=device),
                    anchor=torch.zeros(m, dtype=torch.bool, device=device))


def _compare_kv(name: str, cache: "RelaxKVTreeCache", actual: torch.Tensor, expected: torch.Tensor,
                tol: float) -> CheckResult:
    """Every layer's K and V in slots ``actual`` against ``expected`` (int64 [n] each)."""
    pool = cache.pool_kv.kv_pool
    got, want = [], []
    for layer in cache.pool_kv.layers:
        for kind, buf in (("K", pool.get_key_buffer(layer)), ("V", pool.get_value_buffer(layer))):
            got.append((f"layer {layer - cache.pool_kv.layers.start} {kind}", buf[actual]))
            want.append(buf[expected])
    return compare_layers(name, got, want, tol)


def _log(result: GateResult, model_name: str) -> None:
    """One line: the verdict, each check's error, and on failure what is refused."""
    errors = ", ".join(f"{c.name}={c.max_error:.2g}/{c.tolerance:.2g}" for c in result.checks)
    if result.control is not None:
        errors += f"; wrong-rotation control {result.control.max_error:.2g}"
    if result.refuses_chunks:
        default = server_settings().default_policy
        fallback = ""
        if default in CHUNK_POLICIES:
            fallback = f"; requests naming no policy get prefix, not the default {default}"
        logger.error("relaxkv: correctness gate FAILED on %s (%s): %s; chunk policies (%s) are refused with "
                     "HTTP 400, full and prefix are served%s", model_name, errors or "no checks ran", result.reason,
                     ", ".join(sorted(CHUNK_POLICIES)), fallback)
    else:
        logger.info("relaxkv: correctness gate passed on %s in %.2f s (p=%d, %d tokens, %s; error/tolerance %s)",
                    model_name, result.seconds, result.offset, result.n_tokens, result.dtype, errors)


def _publish_metrics(result: GateResult) -> None:
    """The verdict as gauges on SGLang's /metrics (multiprocess mode, written by the scheduler)."""
    from prometheus_client import Gauge

    passed = Gauge("relaxkv:gate_passed", "1 if the startup correctness gate passed (chunk policies served).",
                   labelnames=["reason"], multiprocess_mode="mostrecent")
    passed.labels(reason=result.reason[:300]).set(0 if result.refuses_chunks else 1)
    error = Gauge("relaxkv:gate_max_error", "Largest relative error of each startup gate check.",
                  labelnames=["check"], multiprocess_mode="mostrecent")
    tolerance = Gauge("relaxkv:gate_tolerance", "Tolerance of each startup gate check.",
                      labelnames=["check"], multiprocess_mode="mostrecent")
    for check in result.checks:
        error.labels(check=check.name).set(check.max_error)
        tolerance.labels(check=check.name).set(check.tolerance)
