"""GPU check: the plugin's FlashInfer calls against the torch reference, and their cost.

Two kernels run on a GPU (``docs/gpu.md``); each case compares one with its torch executor (float32,
same GPU) and times it against what SGLang's own FlashInfer backend would run instead:

* **anchors** (:class:`~relaxkv_sglang.gpu.flashinfer_attention.FlashInferAnchorAttention`,
  bfloat16): one layer's anchors and layout built exactly as the server does
  (``select_anchors`` with the ``relaxkv`` policy on peaked random query scores,
  ``build_relaxed_layout``), the request's KV at scattered slots of a larger pool, against
  :func:`~relaxkv_sglang.core.attention.block_sparse_attention`; timed against the same anchors
  with their full causal context (``full_causal_layout``, same path: the work must shrink with the
  context ratio) and against a dense causal prefill of the whole prompt at one layer (what
  recomputing it costs);
* **repair** (:mod:`.repair_check`): the plugin's repair pass itself (layer loop, anchors, stale
  shift) over stand-in layers with random weights, in float32 and bfloat16 on the GPU under
  ``torch.cuda.set_sync_debug_mode("error")`` (a host sync in the pass fails it), against the
  same pass in float32 on the CPU; first, so that it runs within any time limit;
* **scoped** (:class:`~relaxkv_sglang.gpu.flashinfer_attention.FlashInferScopedPrefill`,
  bfloat16): an extend batch as the fold leaves it on a cold prompt (8 prefix tokens, every chunk
  a miss scoped to itself, a 64-token query with scope 0), against
  :func:`~relaxkv_sglang.core.attention.scoped_causal_attention`; timed against a dense causal
  prefill of the same rows (SGLang's ordinary extend).

Prints a table, writes JSON, exits 1 if any case is off (max |err| > ``TOLERANCE``).

    python -m relaxkv_sglang.gpu.check --out /tmp/gpu-check.json [--quick]

``--time-layout`` (any machine, no GPU needed) instead times the host side of the anchors'
inputs (:func:`~relaxkv_sglang.gpu.prefill_inputs.anchor_prefill_inputs`) for every layer of one
6K-token, 30-layer request (:func:`time_layout`).

On the lent H200 this runs from ``scripts/gpu_check.sh`` (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from relaxkv_sglang.core.attention import block_sparse_attention, scoped_causal_attention
from relaxkv_sglang.core.layout import Span, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.core.selection import select_anchors
from relaxkv_sglang.gpu.prefill_inputs import ScopedPrefillInputs, anchor_prefill_inputs, scoped_prefill_inputs

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


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
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


def _pool(case: Case, n: int, device: torch.device, g: torch.Generator):
    """The request's KV at scattered slots of a pool twice its size (bfloat16)."""
    pool = 2 * n + 64
    key_rows = torch.randperm(pool, generator=g)[:n]
    k_cache = torch.randn(pool, case.num_kv_heads, case.head_dim, generator=g)
    v_cache = torch.randn(pool, case.num_kv_heads, case.head_dim, generator=g)
    to = lambda x: x.to(device, torch.bfloat16)  # noqa: E731
    return key_rows.to(device), to(k_cache), to(v_cache)


def _dense_prefill_ms(flashinfer, device, case: Case, key_rows, q_len: int, kv_len: int, k_cache, v_cache,
                      repeats: int) -> float:
    """SGLang's ordinary extend: one request, ``q_len`` new rows over ``kv_len`` keys, causal."""
    from relaxkv_sglang.gpu.flashinfer_attention import WORKSPACE_BYTES

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD", backend="fa2")
    w.plan(torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
           key_rows[:kv_len].to(torch.int32), torch.ones(1, dtype=torch.int32),
           case.num_qo_heads, case.num_kv_heads, case.head_dim, 1, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(q_len, case.num_qo_heads, case.head_dim, device=device, dtype=torch.bfloat16)
    kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
    return _time_ms(lambda: w.run(q, kv), repeats)


def run_anchors(case: Case, device: torch.device, flashinfer, repeats: int, seed: int) -> dict:
    from relaxkv_sglang.gpu.flashinfer_attention import FlashInferAnchorAttention

    g = torch.Generator().manual_seed(seed)
    n = case.n_context
    spans, scores, anchor_sets = request_anchors(n, 1, case.anchor_ratio, case.n_chunks, g)
    anchors = anchor_sets[0]
    layout = build_relaxed_layout(anchors, scores[0], spans, n, case.context_ratio, case.page_size)
    full = full_causal_layout(anchors, spans, n, case.page_size)
    key_rows, k_cache, v_cache = _pool(case, n, device, g)
    q = torch.randn(anchors.numel(), case.num_qo_heads, case.head_dim, generator=g).to(device, torch.bfloat16)
    scale = case.head_dim ** -0.5
    attn = FlashInferAnchorAttention(device)
    errs, times = [], []
    for lay in (layout, full):
        t0 = time.perf_counter()
        plan = attn.plan_forward([lay])
        host_ms = (time.perf_counter() - t0) * 1e3

        def call():
            return attn.run(plan, 0, q, k_cache, v_cache, key_rows, scale)

        out = call()
        ref = block_sparse_attention(q.float(), k_cache.float(), v_cache.float(), lay, scale=scale, key_rows=key_rows)
        errs.append((out.float() - ref).abs().max().item())
        times.append((_time_ms(call, repeats), host_ms, plan.layers[0].inputs.n_kv))
    dense_ms = _dense_prefill_ms(flashinfer, device, case, key_rows, n, n, k_cache, v_cache, repeats)
    ok = max(errs) <= TOLERANCE and bool(torch.isfinite(out).all())
    return {**asdict(case), "rows": layout.n_rows, "kv_pairs": layout.kv_pairs(), "full_kv_pairs": full.kv_pairs(),
            "keys_read": times[0][2], "full_keys_read": times[1][2],
            "max_abs_err": errs[0], "full_max_abs_err": errs[1], "ms": times[0][0], "full_context_ms": times[1][0],
            "dense_prefill_ms": dense_ms, "host_build_ms": times[0][1], "ok": ok}


def run_scoped(case: Case, device: torch.device, flashinfer, repeats: int, seed: int) -> dict:
    from relaxkv_sglang.gpu.flashinfer_attention import FlashInferScopedPrefill

    g = torch.Generator().manual_seed(seed)
    positions, scope = cold_prompt_rows(case.n_context, case.n_chunks)
    n = positions.numel()
    key_rows, k_cache, v_cache = _pool(case, n, device, g)
    req_to_token = key_rows[None, :]  # one request in req_to_token's row 0
    t0 = time.perf_counter()
    inputs: ScopedPrefillInputs = scoped_prefill_inputs(torch.zeros(n, dtype=torch.long), positions, scope)
    host_ms = (time.perf_counter() - t0) * 1e3
    scale = case.head_dim ** -0.5
    scoped = FlashInferScopedPrefill(device)
    scoped.plan(inputs, req_to_token, num_qo_heads=case.num_qo_heads, num_kv_heads=case.num_kv_heads,
                head_dim=case.head_dim, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, scale=scale)
    q = torch.randn(n, case.num_qo_heads, case.head_dim, generator=g).to(device, torch.bfloat16)
    out = scoped.run(q, k_cache, v_cache)
    ref = scoped_causal_attention(q.float(), k_cache.float(), v_cache.float(), positions.to(device),
                                  scope.to(device), key_rows, scale=scale)
    err = (out.float() - ref).abs().max().item()
    ms = _time_ms(lambda: scoped.run(q, k_cache, v_cache), repeats)
    dense_ms = _dense_prefill_ms(flashinfer, device, case, key_rows, n, n, k_cache, v_cache, repeats)
    ok = err <= TOLERANCE and bool(torch.isfinite(out).all())
    return {**asdict(case), "rows": n, "segments": inputs.n_segments, "keys_read": inputs.n_kv,
            "max_abs_err": err, "ms": ms, "dense_prefill_ms": dense_ms, "host_build_ms": host_ms, "ok": ok}


def time_layout(n_context: int = 6144, n_layers: int = 30, anchor_ratio: float = 0.15, context_ratio: float = 0.25,
                page_size: int = 16, repeats: int = 7, seed: int = 0) -> float:
    """Median wall time in ms (of ``repeats`` runs) of the host side of every layer's anchor inputs
    of one request (:func:`request_anchors`, ``build_relaxed_layout``, then
    :func:`~relaxkv_sglang.gpu.prefill_inputs.anchor_prefill_inputs` over all layers at once):
    the CPU work a GPU repair adds per request before its first anchor call."""
    spans, scores, anchor_sets = request_anchors(n_context, n_layers, anchor_ratio, 10,
                                                 torch.Generator().manual_seed(seed))
    layouts = [build_relaxed_layout(a, scores[l], spans, n_context, context_ratio, page_size)
               for l, a in enumerate(anchor_sets)]
    anchor_prefill_inputs(layouts)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        anchor_prefill_inputs(layouts)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_repair_rows(device: torch.device, seed: int) -> list[dict]:
    """The repair pass on the device against the CPU (:mod:`.repair_check`), printed."""
    from relaxkv_sglang.gpu.repair_check import run_repair

    t0 = time.perf_counter()
    try:
        rows = run_repair(device, seed)
    except Exception as exc:  # noqa: BLE001 (the attention cases still run; the row says what broke)
        traceback.print_exc()
        return [{"kind": "repair", "error": f"{type(exc).__name__}: {exc}", "ok": False}]
    for r in rows:
        print(f"repair  {r['dtype']:<9}{r['n_context']:>7} tokens {r['n_layers']} layers {r['anchor_layers']:>6} anchor-layers"
              f"  max err {r['max_abs_err']:.2e}  {r['ms']:.1f} ms (CPU float32 {r['cpu_float32_ms']:.1f} ms)"
              f"  {'yes' if r['ok'] else 'NO'}", flush=True)
    print(f"repair check: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_sglang.gpu.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check.json", help="result JSON path")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the SmolLM2 shape at 1.5K and 6K tokens only")
    parser.add_argument("--repair-only", action="store_true",
                        help="only the repair pass (layer loop, anchors, stale shift) against the CPU")
    parser.add_argument("--time-layout", action="store_true",
                        help="only time the anchors' host inputs of one 6K-token 30-layer request (CPU is enough)")
    args = parser.parse_args(argv)
    if args.time_layout:
        print(f"anchor inputs of one 6K-token 30-layer request (15% anchors, 25% context), host side: "
              f"{time_layout(repeats=args.repeats, seed=args.seed):.2f} ms, median of {args.repeats} "
              f"({torch.get_num_threads()} torch threads)")
        return 0
    if not torch.cuda.is_available():
        print("relaxkv gpu check: no CUDA device; this check runs only on a GPU", file=sys.stderr)
        return 2
    from relaxkv_sglang.gpu.flashinfer_attention import import_flashinfer

    flashinfer = import_flashinfer()
    device = torch.device("cuda")
    cases = [] if args.repair_only else default_cases()
    if args.quick:
        cases = [c for c in cases if c.shape == "smollm2-135m" and c.n_context <= 6144]
    rows = run_repair_rows(device, args.seed)
    head = (f"{'kind':<8}{'shape':<13}{'tokens':>7}{'page':>5}{'ctx':>6}{'rows':>7}{'max err':>10}{'keys read':>11}"
            f"{'ms':>9}{'full ms':>9}{'dense ms':>9}{'vs dense':>9}  ok")
    print(head, flush=True)
    for i, case in enumerate(cases):
        run = run_anchors if case.kind == "anchors" else run_scoped
        r = run(case, device, flashinfer, args.repeats, args.seed + i)
        rows.append(r)
        err = max(r["max_abs_err"], r.get("full_max_abs_err", 0.0))
        full = f"{r['full_context_ms']:>9.3f}" if "full_context_ms" in r else f"{'-':>9}"
        print(f"{r['kind']:<8}{r['shape']:<13}{r['n_context']:>7}{r['page_size']:>5}{r['context_ratio']:>6.2f}"
              f"{r['rows']:>7}{err:>10.2e}{r['keys_read']:>11,}{r['ms']:>9.3f}{full}{r['dense_prefill_ms']:>9.3f}"
              f"{r['dense_prefill_ms'] / r['ms']:>8.2f}x  {'yes' if r['ok'] else 'NO'}", flush=True)
    result = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "flashinfer": flashinfer.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "tolerance": TOLERANCE, "cases": rows,
        "all_ok": all(r["ok"] for r in rows),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} cases within {TOLERANCE}; result: {args.out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
