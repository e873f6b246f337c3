"""The plugin's FlashInfer calls against the torch reference on one device, and their cost.

* **anchors** (:func:`run_anchors`,
  :class:`~relaxkv_sglang.attention.gpu.flashinfer_attention.FlashInferAnchorAttention`,
  bfloat16): a ``relaxkv`` layer's anchors and layout, KV at scattered pool slots, against
  :func:`~relaxkv_sglang.attention.block_sparse.block_sparse_attention`; timed against full causal context
  and a dense prefill of the prompt (SGLang's ordinary extend);
* **scoped** (:func:`run_scoped`, :class:`~relaxkv_sglang.attention.gpu.flashinfer_attention.FlashInferScopedPrefill`,
  bfloat16): a cold prompt's extend batch against
  :func:`~relaxkv_sglang.attention.causal.scoped_causal_attention`;
* :func:`time_layout`: the host side of the anchors' inputs for one 6K-token, 30-layer request.

A case is off when max |out - ref| > :data:`TOLERANCE` or the output is not finite.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from relaxkv_sglang.attention.causal import scoped_causal_attention
from relaxkv_sglang.attention.block_sparse import block_sparse_attention
from relaxkv_sglang.attention.layout import RelaxedContextSpec, Span, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.repair.selection import select_anchors
from relaxkv_sglang.attention.gpu.anchor_inputs import anchor_prefill_inputs
from relaxkv_sglang.attention.gpu.prefill_inputs import ScopedPrefillInputs, scoped_prefill_inputs
from relaxkv_sglang.gpu_check.repair import Placement

TOLERANCE = 2e-2  # max |out - ref| for bfloat16 inputs, outputs of O(1)


@dataclass(frozen=True)
class Case:
    kind: str  # "anchors" | "scoped"
    shape: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    n_context: int
    page_size: int = 16
    context_ratio: float = 0.25
    anchor_ratio: float = 0.15
    n_chunks: int = 10


SHAPES = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}


def default_cases() -> list[Case]:
    cases = []
    for shape, (hq, hkv, d) in SHAPES.items():
        for n in (1536, 6144, 32768):
            for ratio in (0.1, 0.25, 1.0):
                cases.append(Case("anchors", shape, hq, hkv, d, n, 16, ratio))
        cases.append(Case("anchors", shape, hq, hkv, d, 6144, 64, 0.25))
        cases.append(Case("anchors", shape, hq, hkv, d, 1000, 16, 0.25))  # n_context not a page multiple
        for n in (1536, 6144, 32768):
            cases.append(Case("scoped", shape, hq, hkv, d, n))
    return cases


def request_anchors(n_context: int, n_layers: int, anchor_ratio: float, n_chunks: int,
                    g: torch.Generator) -> tuple[list[Span], torch.Tensor, list[torch.Tensor]]:
    """One request as the server sees it: 8 prefix tokens then ``n_chunks`` equal chunks, peaked
    random query scores (like a query's attention) and ``select_anchors('relaxkv', ...)``.

    Returns (chunk spans, scores float [n_layers, n_context], anchors of every layer).
    """
    bounds = torch.linspace(8, n_context, n_chunks + 1).long().tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    scores = torch.rand(n_layers, n_context, generator=g) ** 4
    return spans, scores, select_anchors("relaxkv", scores, spans, n_context, anchor_ratio)


def cold_prompt_rows(n_context: int, n_chunks: int, query: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A cold prompt's rows as the fold leaves them (every chunk a miss): (positions, scope starts),
    int64 [n_context + query]: 8 prefix tokens (scope 0), ``n_chunks`` chunks each scoped to its
    own start, the query (scope 0)."""
    bounds = torch.linspace(8, n_context, n_chunks + 1).long()
    n = n_context + query
    positions = torch.arange(n)
    scope = torch.zeros(n, dtype=torch.long)
    for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        scope[s:e] = s
    return positions, scope


def device_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median device time in ms of ``fn`` (CUDA events), after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time in ms of ``fn`` after one untimed call (the dry run: no device clock)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _placement(where: Placement | torch.device | str) -> Placement:
    return where if isinstance(where, Placement) else Placement.on(where)


def _max_err(place: Placement, out: torch.Tensor, ref: torch.Tensor) -> float:
    return place.take((out.float() - ref.float()).abs().max()).item()


def _finite(place: Placement, out: torch.Tensor) -> bool:
    return bool(place.take(torch.isfinite(out).all()))


def _pool(case: Case, n: int, place: Placement, g: torch.Generator):
    """The request's KV at scattered slots of a pool twice its size (bfloat16)."""
    pool = 2 * n + 64
    key_rows = torch.randperm(pool, generator=g)[:n]
    k_cache = torch.randn(pool, case.num_kv_heads, case.head_dim, generator=g)
    v_cache = torch.randn(pool, case.num_kv_heads, case.head_dim, generator=g)
    return place.put(key_rows), place.put(k_cache.to(torch.bfloat16)), place.put(v_cache.to(torch.bfloat16))


def _dense_prefill_ms(flashinfer, place: Placement, case: Case, key_rows, q_len: int, kv_len: int, k_cache, v_cache,
                      repeats: int, timer: Callable) -> float:
    """SGLang's ordinary extend: one request, ``q_len`` new rows over ``kv_len`` keys, causal."""
    from relaxkv_sglang.attention.gpu.flashinfer_attention import WORKSPACE_BYTES

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=place.device), "NHD", backend="fa2")
    w.plan(torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
           key_rows[:kv_len].to(torch.int32), torch.ones(1, dtype=torch.int32),
           case.num_qo_heads, case.num_kv_heads, case.head_dim, 1, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(q_len, case.num_qo_heads, case.head_dim, device=place.device).to(torch.bfloat16)
    kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
    return timer(lambda: w.run(q, kv), repeats)


def run_anchors(case: Case, where: Placement | torch.device | str, flashinfer, repeats: int, seed: int,
                timer: Optional[Callable] = None) -> dict:
    from relaxkv_sglang.attention.gpu.flashinfer_attention import FlashInferAnchorAttention

    place, timer = _placement(where), timer or device_ms
    g = torch.Generator().manual_seed(seed)
    n = case.n_context
    spans, scores, anchor_sets = request_anchors(n, 1, case.anchor_ratio, case.n_chunks, g)
    anchors = anchor_sets[0]
    layout = build_relaxed_layout(anchors, scores[0], RelaxedContextSpec(spans, n, case.context_ratio, case.page_size))
    full = full_causal_layout(anchors, spans, n, case.page_size)
    key_rows, k_cache, v_cache = _pool(case, n, place, g)
    q = place.put(torch.randn(anchors.numel(), case.num_qo_heads, case.head_dim, generator=g).to(torch.bfloat16))
    scale = case.head_dim ** -0.5
    attn = FlashInferAnchorAttention(place.device)
    errs, times, finite = [], [], True
    for lay in (layout, full):
        t0 = time.perf_counter()
        metadata = attn.pass_metadata([lay])
        host_ms = (time.perf_counter() - t0) * 1e3

        def call():
            return attn.run(metadata, 0, q, k_cache, v_cache, key_rows, scale)

        out = call()
        ref = block_sparse_attention(q.float(), k_cache.float(), v_cache.float(), lay, scale=scale, key_rows=key_rows)
        errs.append(_max_err(place, out, ref))
        finite = finite and _finite(place, out)
        times.append((timer(call, repeats), host_ms, metadata.layers[0].inputs.n_kv))
    dense_ms = _dense_prefill_ms(flashinfer, place, case, key_rows, n, n, k_cache, v_cache, repeats, timer)
    ok = max(errs) <= TOLERANCE and finite
    return {**asdict(case), "rows": layout.n_rows, "kv_pairs": layout.kv_pairs(), "full_kv_pairs": full.kv_pairs(),
            "keys_read": times[0][2], "full_keys_read": times[1][2],
            "max_abs_err": errs[0], "full_max_abs_err": errs[1], "ms": times[0][0], "full_context_ms": times[1][0],
            "dense_prefill_ms": dense_ms, "host_build_ms": times[0][1], "ok": ok}


def run_scoped(case: Case, where: Placement | torch.device | str, flashinfer, repeats: int, seed: int,
               timer: Optional[Callable] = None) -> dict:
    from relaxkv_sglang.attention.gpu.flashinfer_attention import FlashInferScopedPrefill

    place, timer = _placement(where), timer or device_ms
    g = torch.Generator().manual_seed(seed)
    positions, scope = cold_prompt_rows(case.n_context, case.n_chunks)
    n = positions.numel()
    key_rows, k_cache, v_cache = _pool(case, n, place, g)
    req_to_token = key_rows[None, :]  # one request in req_to_token's row 0
    t0 = time.perf_counter()
    inputs: ScopedPrefillInputs = scoped_prefill_inputs(torch.zeros(n, dtype=torch.long), positions, scope)
    host_ms = (time.perf_counter() - t0) * 1e3
    scale = case.head_dim ** -0.5
    scoped = FlashInferScopedPrefill(place.device)
    scoped.plan(inputs, req_to_token, num_qo_heads=case.num_qo_heads, num_kv_heads=case.num_kv_heads,
                head_dim=case.head_dim, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, scale=scale)
    q = place.put(torch.randn(n, case.num_qo_heads, case.head_dim, generator=g).to(torch.bfloat16))
    out = scoped.run(q, k_cache, v_cache)
    # the rows' positions and scopes are the host's (the layer loop decides its rows there)
    ref = scoped_causal_attention(q.float(), k_cache.float(), v_cache.float(), positions, scope, key_rows,
                                  scale=scale)
    err = _max_err(place, out, ref)
    ms = timer(lambda: scoped.run(q, k_cache, v_cache), repeats)
    dense_ms = _dense_prefill_ms(flashinfer, place, case, key_rows, n, n, k_cache, v_cache, repeats, timer)
    ok = err <= TOLERANCE and _finite(place, out)
    return {**asdict(case), "rows": n, "segments": inputs.n_segments, "keys_read": inputs.n_kv,
            "max_abs_err": err, "ms": ms, "dense_prefill_ms": dense_ms, "host_build_ms": host_ms, "ok": ok}


def time_layout(n_context: int = 6144, n_layers: int = 30, anchor_ratio: float = 0.15, context_ratio: float = 0.25,
                page_size: int = 16, repeats: int = 7, seed: int = 0) -> float:
    """Median wall time in ms (of ``repeats`` runs) of the host side of every layer's anchor inputs
    of one request (:func:`request_anchors`, ``build_relaxed_layout``, then
    :func:`~relaxkv_sglang.attention.gpu.anchor_inputs.anchor_prefill_inputs` over all layers at once):
    the CPU work a GPU repair adds per request before its first anchor call."""
    spans, scores, anchor_sets = request_anchors(n_context, n_layers, anchor_ratio, 10,
                                                 torch.Generator().manual_seed(seed))
    context = RelaxedContextSpec(spans, n_context, context_ratio, page_size)
    layouts = [build_relaxed_layout(a, scores[l], context) for l, a in enumerate(anchor_sets)]
    anchor_prefill_inputs(layouts)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        anchor_prefill_inputs(layouts)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)

