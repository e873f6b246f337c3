"""GPU check: FlashInfer's relaxed anchor attention against the torch reference, and its cost.

For each case (model shape, prompt length, page size, context ratio) it builds
one layer's anchors and layout exactly as the server does (``select_anchors``
with the ``relaxkv`` policy on random query scores, ``build_relaxed_layout``),
puts the request's KV at scattered slots of a larger pool, and compares

* :class:`~relaxkv_sglang.gpu.flashinfer_attention.FlashInferRelaxedAttention`
  (bfloat16) with
* :func:`~relaxkv_sglang.core.attention.block_sparse_attention` (float32, same
  GPU): the reference every executor must match.

It also times the FlashInfer call against the same anchors with their full
causal context (``full_causal_layout``): the work executed must shrink with the
context ratio. Prints a table, writes JSON, exits 1 if any case is off.

    python -m relaxkv_sglang.gpu.check --out /tmp/gpu-check.json

``--time-split`` (any machine, no GPU needed) instead times
:func:`~relaxkv_sglang.gpu.variable_block.to_flashinfer_variable_block` over
every layer's layout of one 6K-token, 30-layer request (:func:`time_split`).

On the lent H200 this runs from ``scripts/gpu_check.sh`` (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from relaxkv_sglang.core.attention import block_sparse_attention
from relaxkv_sglang.core.layout import BlockSparseLayout, Span, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.core.selection import select_anchors
from relaxkv_sglang.gpu.variable_block import FlashInferVariableBlockPlan, to_flashinfer_variable_block

TOLERANCE = 2e-2  # max |out - ref| for bfloat16 inputs, outputs of O(1)


@dataclass(frozen=True)
class Case:
    shape: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    n_context: int
    page_size: int
    context_ratio: float
    anchor_ratio: float = 0.15
    n_chunks: int = 10


SHAPES = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}


def default_cases() -> list[Case]:
    cases = []
    for shape, (hq, hkv, d) in SHAPES.items():
        for n in (1536, 6144, 32768):
            for ratio in (0.1, 0.25, 1.0):
                cases.append(Case(shape, hq, hkv, d, n, 16, ratio))
        cases.append(Case(shape, hq, hkv, d, 6144, 64, 0.25))
        cases.append(Case(shape, hq, hkv, d, 1000, 16, 0.25))  # n_context not a page multiple
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


def _inputs(case: Case, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = case.n_context
    spans, scores, anchor_sets = request_anchors(n, 1, case.anchor_ratio, case.n_chunks, g)
    anchors = anchor_sets[0]
    layout = build_relaxed_layout(anchors, scores[0], spans, n, case.context_ratio, case.page_size)
    full = full_causal_layout(anchors, spans, n, case.page_size)
    pool = 2 * n + 64
    key_rows = torch.randperm(pool, generator=g)[:n]  # the request's slots, scattered in the pool
    k_cache = torch.randn(pool, case.num_kv_heads, case.head_dim, generator=g)
    v_cache = torch.randn(pool, case.num_kv_heads, case.head_dim, generator=g)
    q = torch.randn(anchors.numel(), case.num_qo_heads, case.head_dim, generator=g)
    to = lambda x: x.to(device, torch.bfloat16)  # noqa: E731
    return layout, full, key_rows.to(device), to(q), to(k_cache), to(v_cache)


def _time_ms(fn, repeats: int) -> float:
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


def run_case(case: Case, attn, device: torch.device, repeats: int, seed: int) -> dict:
    layout, full, key_rows, q, k_cache, v_cache = _inputs(case, device, seed)
    scale = case.head_dim ** -0.5
    kw = dict(num_qo_heads=case.num_qo_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
              dtype=torch.bfloat16, scale=scale, key_rows=key_rows)
    attn.plan(layout, **kw)
    out = attn.run(q, k_cache, v_cache)
    ref = block_sparse_attention(q.float(), k_cache.float(), v_cache.float(), layout, scale=scale, key_rows=key_rows)
    err = (out.float() - ref).abs().max().item()
    relaxed_ms = _time_ms(lambda: attn.run(q, k_cache, v_cache), repeats)
    t0 = time.perf_counter()
    attn.plan(layout, **kw)
    plan_ms = (time.perf_counter() - t0) * 1e3
    attn.plan(full, **kw)
    full_out = attn.run(q, k_cache, v_cache)
    full_ref = block_sparse_attention(q.float(), k_cache.float(), v_cache.float(), full, scale=scale, key_rows=key_rows)
    full_err = (full_out.float() - full_ref).abs().max().item()
    full_ms = _time_ms(lambda: attn.run(q, k_cache, v_cache), repeats)
    ok = err <= TOLERANCE and full_err <= TOLERANCE and bool(torch.isfinite(out).all())
    return {**asdict(case), "anchors": layout.n_rows, "kv_pairs": layout.kv_pairs(),
            "full_kv_pairs": full.kv_pairs(), "max_abs_err": err, "full_max_abs_err": full_err,
            "relaxed_ms": relaxed_ms, "full_context_ms": full_ms, "plan_ms": plan_ms, "ok": ok}


def time_split(
    split: Optional[Callable[[BlockSparseLayout, int], FlashInferVariableBlockPlan]] = None,
    n_context: int = 6144,
    n_layers: int = 30,
    anchor_ratio: float = 0.15,
    context_ratio: float = 0.25,
    page_size: int = 16,
    num_kv_heads: int = 3,
    repeats: int = 7,
    seed: int = 0,
) -> float:
    """Median wall time in ms (of ``repeats`` runs) of splitting every layer's relaxed layout of
    one request (:func:`request_anchors`, ``build_relaxed_layout``) with ``split``, by default
    :func:`~relaxkv_sglang.gpu.variable_block.to_flashinfer_variable_block`: the CPU work that
    :meth:`~relaxkv_sglang.gpu.flashinfer_attention.FlashInferRelaxedAttention.plan` adds per layer."""
    split = to_flashinfer_variable_block if split is None else split
    spans, scores, anchor_sets = request_anchors(n_context, n_layers, anchor_ratio, 10,
                                                 torch.Generator().manual_seed(seed))
    layouts = [build_relaxed_layout(a, scores[l], spans, n_context, context_ratio, page_size)
               for l, a in enumerate(anchor_sets)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layout in layouts:
            split(layout, num_kv_heads)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_sglang.gpu.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check.json", help="result JSON path")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the SmolLM2 shape at 1.5K and 6K tokens only")
    parser.add_argument("--time-split", action="store_true",
                        help="only time the layout split of one 6K-token 30-layer request (CPU is enough)")
    args = parser.parse_args(argv)
    if args.time_split:
        print(f"split of one 6K-token 30-layer request (15% anchors, 25% context): "
              f"{time_split(repeats=args.repeats, seed=args.seed):.2f} ms, median of {args.repeats}")
        return 0
    if not torch.cuda.is_available():
        print("relaxkv gpu check: no CUDA device; this check runs only on a GPU", file=sys.stderr)
        return 2
    from relaxkv_sglang.gpu.flashinfer_attention import FlashInferRelaxedAttention, import_flashinfer

    flashinfer = import_flashinfer()
    device = torch.device("cuda")
    attn = FlashInferRelaxedAttention(device)
    cases = default_cases()
    if args.quick:
        cases = [c for c in cases if c.shape == "smollm2-135m" and c.n_context <= 6144]
    rows = []
    head = (f"{'shape':<13}{'tokens':>7}{'page':>5}{'ctx':>6}{'anchors':>8}{'max err':>10}{'KV pairs':>12}"
            f"{'of full':>8}{'relaxed ms':>11}{'full ms':>9}{'speed-up':>9}  ok")
    print(head, flush=True)
    for i, case in enumerate(cases):
        r = run_case(case, attn, device, args.repeats, args.seed + i)
        rows.append(r)
        print(f"{r['shape']:<13}{r['n_context']:>7}{r['page_size']:>5}{r['context_ratio']:>6.2f}{r['anchors']:>8}"
              f"{max(r['max_abs_err'], r['full_max_abs_err']):>10.2e}{r['kv_pairs']:>12,}"
              f"{r['kv_pairs'] / r['full_kv_pairs']:>8.2f}{r['relaxed_ms']:>11.3f}{r['full_context_ms']:>9.3f}"
              f"{r['full_context_ms'] / r['relaxed_ms']:>8.2f}x  {'yes' if r['ok'] else 'NO'}", flush=True)
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
