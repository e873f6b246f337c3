"""GPU check: the plugin's FlashInfer calls against the torch reference, and their cost.

Each case compares a kernel path with its torch executor (float32, same GPU) and times it against
what SGLang's own FlashInfer backend would run instead (``docs/gpu.md``):

* **repair** (:mod:`.repair_check`, first): the repair pass (layer loop, anchors, stale shift) over
  stand-in layers, float32 and bfloat16 on the GPU under ``torch.cuda.set_sync_debug_mode("error")``,
  against float32 on the CPU; each dtype in its own step after an untimed warm-up;
* **anchors** (:class:`~.flashinfer_attention.FlashInferAnchorAttention`, bfloat16): a ``relaxkv``
  layer's anchors and layout, KV at scattered pool slots, against
  :func:`~relaxkv_sglang.core.block_sparse.block_sparse_attention`; timed against full causal context
  and a dense prefill of the prompt;
* **scoped** (:class:`~.flashinfer_attention.FlashInferScopedPrefill`, bfloat16): a cold prompt's
  extend batch against :func:`~relaxkv_sglang.core.attention.scoped_causal_attention`;
* **repair timing** (:func:`~.repair_check.time_repair`): one request at 8K and 32K tokens,
  ``relaxkv`` against ``relaxkv_fullctx`` and ``prophetkv``.

Steps (:data:`STEPS`) run in order, each in its own ``try``, printing its estimate and time; the
JSON's ``steps`` say which ran, passed, failed or did not run. Exit 1 if any case is off (max |err|
> ``TOLERANCE``), 2 without CUDA. ``--dry-run``: every step on the CPU at small sizes with
FlashInfer's torch model, under the CUDA-rules harness (:class:`~.cuda_rules.CudaRules`) or, with
``--dry-run-device cpu``, plainly. ``--time-layout``: the host side of the anchors' inputs for one
6K-token, 30-layer request (:func:`time_layout`).

    python -m relaxkv_sglang.gpu.check --out /tmp/gpu-check.json [--quick]
    python -m relaxkv_sglang.gpu.check --quick --dry-run     # any CPU: everything but the CUDA calls
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch

from relaxkv_sglang.core.attention import scoped_causal_attention
from relaxkv_sglang.core.block_sparse import block_sparse_attention
from relaxkv_sglang.core.layout import Span, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.core.selection import select_anchors
from relaxkv_sglang.gpu.prefill_inputs import ScopedPrefillInputs, anchor_prefill_inputs, scoped_prefill_inputs
from relaxkv_sglang.gpu.repair_check import FlashInferOnAnyDevice, Placement, RepairCase, error_line

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


def _wall_ms(fn: Callable[[], object], repeats: int) -> float:
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
    from relaxkv_sglang.gpu.flashinfer_attention import WORKSPACE_BYTES

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
    from relaxkv_sglang.gpu.flashinfer_attention import FlashInferAnchorAttention

    place, timer = _placement(where), timer or _time_ms
    g = torch.Generator().manual_seed(seed)
    n = case.n_context
    spans, scores, anchor_sets = request_anchors(n, 1, case.anchor_ratio, case.n_chunks, g)
    anchors = anchor_sets[0]
    layout = build_relaxed_layout(anchors, scores[0], spans, n, case.context_ratio, case.page_size)
    full = full_causal_layout(anchors, spans, n, case.page_size)
    key_rows, k_cache, v_cache = _pool(case, n, place, g)
    q = place.put(torch.randn(anchors.numel(), case.num_qo_heads, case.head_dim, generator=g).to(torch.bfloat16))
    scale = case.head_dim ** -0.5
    attn = FlashInferAnchorAttention(place.device)
    errs, times, finite = [], [], True
    for lay in (layout, full):
        t0 = time.perf_counter()
        plan = attn.plan_forward([lay])
        host_ms = (time.perf_counter() - t0) * 1e3

        def call():
            return attn.run(plan, 0, q, k_cache, v_cache, key_rows, scale)

        out = call()
        ref = block_sparse_attention(q.float(), k_cache.float(), v_cache.float(), lay, scale=scale, key_rows=key_rows)
        errs.append(_max_err(place, out, ref))
        finite = finite and _finite(place, out)
        times.append((timer(call, repeats), host_ms, plan.layers[0].inputs.n_kv))
    dense_ms = _dense_prefill_ms(flashinfer, place, case, key_rows, n, n, k_cache, v_cache, repeats, timer)
    ok = max(errs) <= TOLERANCE and finite
    return {**asdict(case), "rows": layout.n_rows, "kv_pairs": layout.kv_pairs(), "full_kv_pairs": full.kv_pairs(),
            "keys_read": times[0][2], "full_keys_read": times[1][2],
            "max_abs_err": errs[0], "full_max_abs_err": errs[1], "ms": times[0][0], "full_context_ms": times[1][0],
            "dense_prefill_ms": dense_ms, "host_build_ms": times[0][1], "ok": ok}


def run_scoped(case: Case, where: Placement | torch.device | str, flashinfer, repeats: int, seed: int,
               timer: Optional[Callable] = None) -> dict:
    from relaxkv_sglang.gpu.flashinfer_attention import FlashInferScopedPrefill

    place, timer = _placement(where), timer or _time_ms
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


@dataclass(frozen=True)
class RunPlan:
    """What one run checks and how long each step is expected to take (seconds, H200 estimates:
    not measured until a GPU has run it; the dry run's are this 2-core CPU's)."""

    repair: RepairCase
    cases: list[Case]
    timing: tuple[int, ...]  # n_context of each repair timing
    timing_layers: int
    repeats: int
    timing_repeats: int
    estimates: dict[str, float]


# H200 estimates (s). FlashInfer's JIT compiles the fa2 batch paged prefill for bfloat16 and head
# dimension 64 once (8 generated kernel files, 4 mask modes x paged/ragged, 3 tile sizes each,
# plus host sources; ninja on 16 cores): the one expensive step, inside the bfloat16 warm-up.
JIT_ESTIMATE_S = 180.0
GPU_ESTIMATES = {"flashinfer": 15.0, "repair": 20.0 + JIT_ESTIMATE_S, "case": 2.0, "case_llama": 4.0,
                 "timing": {8192: 15.0, 32768: 45.0}}


def run_plan(quick: bool, dry_run: bool, repair_only: bool, repeats: int) -> RunPlan:
    """The steps' sizes: ``--quick`` the SmolLM2 shape at 1.5K and 6K tokens and the repair timing
    at 8K and 32K over 4 layers; the full run adds the Llama-8B shape (a second JIT compile) and
    32K cases; the dry run the same steps at small sizes (module doc)."""
    cases = [] if repair_only else default_cases()
    if quick:
        cases = [c for c in cases if c.shape == "smollm2-135m" and c.n_context <= 6144]
    timing = () if repair_only else (8192, 32768)
    if not dry_run:
        est = {"flashinfer": GPU_ESTIMATES["flashinfer"], "repair": GPU_ESTIMATES["repair"]}
        if cases:  # the Llama-8B shape (head dimension 128) compiles a second module
            est["cases"] = (sum(GPU_ESTIMATES["case" if c.shape == "smollm2-135m" else "case_llama"] for c in cases)
                            + (JIT_ESTIMATE_S if any(c.head_dim != 64 for c in cases) else 0.0))
        est.update({f"repair timing {n}": GPU_ESTIMATES["timing"][n] for n in timing})
        return RunPlan(RepairCase(), cases, timing, 4, repeats, 5, est)
    # small sizes on the CPU: the same code paths, the torch model in FlashInfer's place
    small = {1536: 128, 6144: 256, 32768: 384, 1000: 200}
    cases = [replace(c, n_context=small[c.n_context], n_chunks=4) for c in cases]
    timing = tuple({8192: 192, 32768: 256}[n] for n in timing)
    est = {"flashinfer": 0.1, "repair": 4.0}  # measured on the 2-core CPU here, loaded
    if cases:
        est["cases"] = 0.6 * len(cases)
    est.update({f"repair timing {n}": 4.0 * n / 192 for n in timing})
    return RunPlan(RepairCase(n_context=384, n_layers=2, n_chunks=4, query=16), cases, timing, 2, 1, 1, est)


@contextlib.contextmanager
def dry_run_placement(device: str) -> Iterator[Placement]:
    """The dry run's device with FlashInfer's torch model as ``flashinfer``: the CUDA-rules
    harness's stand-in device (``device='rules'``) or the plain CPU (``'cpu'``)."""
    from relaxkv_sglang.gpu.flashinfer_attention import FLASHINFER_VERSION
    from relaxkv_sglang.gpu.torch_models import flashinfer_stand_in

    saved = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = flashinfer_stand_in(FLASHINFER_VERSION)
    try:
        if device == "cpu":
            yield Placement.on("cpu", anchors=FlashInferOnAnyDevice)
        else:
            from relaxkv_sglang.gpu.cuda_rules import CudaRules

            with CudaRules() as rules:
                yield Placement.under_rules(rules)
    finally:
        if saved is None:
            sys.modules.pop("flashinfer", None)
        else:
            sys.modules["flashinfer"] = saved


class StepFailed(Exception):
    """A step ran to its end and its checks were off (the message says which)."""


class Steps:
    """The run's steps in order, each in its own ``try``, timed and printed, with a deadline: a step
    whose estimate would end past ``budget_s`` is not started (the JSON still comes back)."""

    def __init__(self, budget_s: float, on_change: Callable[[], None]) -> None:
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.rows: list[dict] = []
        self.on_change = on_change

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, name: str, estimate_s: float, fn: Callable[[], Any]) -> Any:
        """``fn()``'s value, or None if it raised or was not run; the step's row says which."""
        row: dict = {"step": name, "estimate_s": round(estimate_s, 1)}
        self.rows.append(row)
        if self.elapsed() + estimate_s > self.budget_s:
            row.update(status="not run", error=f"over the {self.budget_s:.0f} s budget at +{self.elapsed():.0f} s")
            print(f"gpu_check: step {name}: not run ({row['error']})", flush=True)
            self.on_change()
            return None
        print(f"gpu_check: step {name} (estimate {estimate_s:.0f} s) at +{self.elapsed():.0f} s", flush=True)
        t = time.perf_counter()
        value = None
        try:
            value = fn()
            row["status"] = "passed"
        except StepFailed as exc:
            row.update(status="failed", error=str(exc))
        except Exception as exc:  # noqa: BLE001 (the next step still runs; the row says what broke)
            traceback.print_exc()
            row.update(status="error", error=error_line(exc))
        row["s"] = round(time.perf_counter() - t, 2)
        print(f"gpu_check: step {name}: {row['status']} in {row['s']:.1f} s (estimate {estimate_s:.0f} s)"
              + (f": {row['error']}" if "error" in row else ""), flush=True)
        self.on_change()
        return value


def _case_line(r: dict) -> str:
    err = max(r["max_abs_err"], r.get("full_max_abs_err", 0.0))
    full = f"{r['full_context_ms']:>9.3f}" if "full_context_ms" in r else f"{'-':>9}"
    return (f"{r['kind']:<8}{r['shape']:<13}{r['n_context']:>7}{r['page_size']:>5}{r['context_ratio']:>6.2f}"
            f"{r['rows']:>7}{err:>10.2e}{r['keys_read']:>11,}{r['ms']:>9.3f}{full}{r['dense_prefill_ms']:>9.3f}"
            f"{r['dense_prefill_ms'] / r['ms']:>8.2f}x  {'yes' if r['ok'] else 'NO'}")


def _timing_line(r: dict) -> str:
    parts = [f"repair timing {r['n_context']:>6} tokens {r['n_layers']} layers {r['dtype']}:"]
    for policy in ("relaxkv", "relaxkv_fullctx", "prophetkv"):
        if f"{policy}_ms" in r:
            parts.append(f"{policy} {r[policy + '_ms']:.2f} ms ({r[policy + '_pairs']:,} pairs)")
    if "dense_over_relaxkv" in r:
        parts.append(f"dense/relaxkv {r['dense_over_relaxkv']:.2f}x, prophetkv/relaxkv "
                     f"{r.get('prophetkv_over_relaxkv', float('nan')):.2f}x")
    return "  ".join(parts)


def run_checks(place: Placement, flashinfer_or_error: Any, plan: RunPlan, steps: Steps, rows: list[dict],
               seed: int, timer: Callable) -> None:
    """The steps after FlashInfer's import (module doc), appending result rows to ``rows``."""
    from relaxkv_sglang.gpu.repair_check import run_repair, time_repair

    def repair() -> None:
        got = run_repair(place, seed, plan.repair, log=lambda line: print(f"  {line}", flush=True))
        rows.extend(got)
        for r in got:
            if "ms" in r:
                print(f"repair  {r['dtype']:<9}{r['n_context']:>7} tokens {r['n_layers']} layers "
                      f"{r['anchor_layers']:>6} anchor-layers  max err {r['max_abs_err']:.2e}  {r['ms']:.1f} ms "
                      f"(CPU float32 {r['cpu_float32_ms']:.1f} ms)  {'yes' if r['ok'] else 'NO'}", flush=True)
        off = [f"{r['step']} {r['status']}: {r.get('error', '')}" for r in got if r["status"] != "passed"]
        if off:
            raise StepFailed("; ".join(off))

    steps.run("repair", plan.estimates["repair"], repair)
    if isinstance(flashinfer_or_error, str):
        for name in ["cases"] * bool(plan.cases) + [f"repair timing {n}" for n in plan.timing]:
            steps.rows.append({"step": name, "status": "not run", "error": flashinfer_or_error})
            print(f"gpu_check: step {name}: not run ({flashinfer_or_error})", flush=True)
        return
    flashinfer = flashinfer_or_error

    def cases() -> None:
        print(f"{'kind':<8}{'shape':<13}{'tokens':>7}{'page':>5}{'ctx':>6}{'rows':>7}{'max err':>10}{'keys read':>11}"
              f"{'ms':>9}{'full ms':>9}{'dense ms':>9}{'vs dense':>9}  ok", flush=True)
        off = 0
        for i, case in enumerate(plan.cases):
            run = run_anchors if case.kind == "anchors" else run_scoped
            try:
                r = run(case, place, flashinfer, plan.repeats, seed + i, timer)
                print(_case_line(r), flush=True)
            except Exception as exc:  # noqa: BLE001 (the other cases still run)
                traceback.print_exc()
                r = {**asdict(case), "ok": False, "error": error_line(exc)}
                print(f"{case.kind:<8}{case.shape:<13}{case.n_context:>7}  error: {r['error']}", flush=True)
            rows.append(r)
            off += not r["ok"]
        if off:
            raise StepFailed(f"{off} of {len(plan.cases)} cases off or raised")

    if plan.cases:
        steps.run("cases", plan.estimates["cases"], cases)
    for n in plan.timing:
        def timing(n: int = n) -> None:
            r = time_repair(place, replace(plan.repair, n_context=n, n_layers=plan.timing_layers), seed,
                            plan.timing_repeats)
            rows.append(r)
            print(_timing_line(r), flush=True)

        steps.run(f"repair timing {n}", plan.estimates[f"repair timing {n}"], timing)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_sglang.gpu.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check.json", help="result JSON path (written after every step)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="the SmolLM2 shape at 1.5K and 6K tokens, the repair timing at 8K and 32K")
    parser.add_argument("--repair-only", action="store_true",
                        help="only the repair pass (layer loop, anchors, stale shift) against the CPU")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU at small sizes, FlashInfer's torch model in its place")
    parser.add_argument("--dry-run-device", choices=("rules", "cpu"), default="rules",
                        help="the dry run's device: the CUDA-rules stand-in (default) or the plain CPU")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="do not start a step whose estimate ends past this (default: 480 with --quick)")
    parser.add_argument("--time-layout", action="store_true",
                        help="only time the anchors' host inputs of one 6K-token 30-layer request (CPU is enough)")
    args = parser.parse_args(argv)
    if args.time_layout:
        print(f"anchor inputs of one 6K-token 30-layer request (15% anchors, 25% context), host side: "
              f"{time_layout(repeats=args.repeats, seed=args.seed):.2f} ms, median of {args.repeats} "
              f"({torch.get_num_threads()} torch threads)")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("relaxkv gpu check: no CUDA device; this check runs only on a GPU (or use --dry-run)", file=sys.stderr)
        return 2
    plan = run_plan(args.quick, args.dry_run, args.repair_only, args.repeats)
    budget = args.budget_s if args.budget_s is not None else (480.0 if args.quick else 1e9)
    rows: list[dict] = []
    result: dict = {"dry_run": args.dry_run, "quick": args.quick, "torch": torch.__version__,
                    "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "tolerance": TOLERANCE, "steps": [], "cases": rows}

    def write() -> None:
        result["all_ok"] = all(r["ok"] for r in rows if "ok" in r) and all(
            s.get("status") == "passed" for s in steps.rows)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    steps = Steps(budget, write)
    result["steps"] = steps.rows
    total = sum(plan.estimates.values())
    print(f"gpu_check: {'dry run, ' if args.dry_run else ''}steps {', '.join(plan.estimates)}; "
          f"estimated {total:.0f} s in all ({'this CPU' if args.dry_run else 'H200, unmeasured'}), "
          f"budget {budget:.0f} s", flush=True)
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            result["device"] = f"dry run: {args.dry_run_device}"
            place = stack.enter_context(dry_run_placement(args.dry_run_device))
            timer: Callable = _wall_ms
        else:
            place, timer = Placement.on("cuda"), _time_ms
            result["device"] = torch.cuda.get_device_name(place.device)
        from relaxkv_sglang.gpu.flashinfer_attention import import_flashinfer

        flashinfer = steps.run("flashinfer", plan.estimates["flashinfer"], import_flashinfer)
        if flashinfer is None:
            flashinfer = f"flashinfer: {steps.rows[-1].get('error', 'not imported')}"
        else:
            result["flashinfer"] = getattr(flashinfer, "__version__", "?")
        run_checks(place, flashinfer, plan, steps, rows, args.seed, timer)
    write()
    passed = sum(s["status"] == "passed" for s in steps.rows)
    print(f"gpu_check: {passed}/{len(steps.rows)} steps passed "
          + ", ".join(f"{s['step']} {s['status']}" for s in steps.rows)
          + f"; {sum(r['ok'] for r in rows if 'ok' in r)}/{sum('ok' in r for r in rows)} cases within tolerance; "
          f"result: {args.out}", flush=True)
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
