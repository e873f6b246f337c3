"""The GPU check's run: its steps, their sizes and budget, the result JSON, the command line.

Steps (:func:`run_scope`) run in order, each in its own ``try`` (:class:`Steps`), printing its
estimate and time; the JSON's ``steps`` say which ran, passed, failed or did not run:

* **flashinfer**: the import (its torch model in the dry run);
* **repair** (:func:`~.repair.run_repair`): the repair pass on the device against the CPU;
* **cases** (:mod:`.kernels`): the plugin's FlashInfer calls against the torch reference;
* **repair timing N** (:func:`~.repair.time_repair`): one request at 8K and 32K tokens,
  ``relaxkv`` against ``relaxkv_fullctx`` and ``prophetkv``.

Exit 1 if any case is off, 2 without CUDA. ``--dry-run``: every step on the CPU at small sizes
with FlashInfer's torch model, under the CUDA-rules harness
(:class:`~relaxkv_sglang.attention.gpu.cuda_rules.CudaRules`) or, with ``--dry-run-device cpu``, plainly.
``--time-layout``: :func:`~.kernels.time_layout` only.

    python -m relaxkv_sglang.gpu_check --out /tmp/gpu-check.json [--quick]
    python -m relaxkv_sglang.gpu_check --quick --dry-run     # any CPU: everything but the CUDA calls
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator

import torch

from relaxkv_sglang.gpu_check.kernels import (
    TOLERANCE, Case, default_cases, device_ms, run_anchors, run_scoped, time_layout, wall_ms,
)
from relaxkv_sglang.gpu_check.repair import (
    FlashInferOnAnyDevice, Placement, RepairCase, error_line, run_repair, time_repair,
)

DESCRIPTION = ("GPU check: the plugin's repair pass and FlashInfer calls on a GPU against the CPU and the "
               "torch reference, and their cost")


@dataclass(frozen=True)
class RunScope:
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


def run_scope(quick: bool, dry_run: bool, repair_only: bool, repeats: int) -> RunScope:
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
        return RunScope(RepairCase(), cases, timing, 4, repeats, 5, est)
    # small sizes on the CPU: the same code paths, the torch model in FlashInfer's place
    small = {1536: 128, 6144: 256, 32768: 384, 1000: 200}
    cases = [replace(c, n_context=small[c.n_context], n_chunks=4) for c in cases]
    timing = tuple({8192: 192, 32768: 256}[n] for n in timing)
    est = {"flashinfer": 0.1, "repair": 4.0}  # measured on the 2-core CPU here, loaded
    if cases:
        est["cases"] = 0.6 * len(cases)
    est.update({f"repair timing {n}": 4.0 * n / 192 for n in timing})
    return RunScope(RepairCase(n_context=384, n_layers=2, n_chunks=4, query=16), cases, timing, 2, 1, 1, est)


@contextlib.contextmanager
def dry_run_placement(device: str) -> Iterator[Placement]:
    """The dry run's device with FlashInfer's torch model as ``flashinfer``: the CUDA-rules
    harness's stand-in device (``device='rules'``) or the plain CPU (``'cpu'``)."""
    from relaxkv_sglang.attention.gpu.flashinfer_attention import FLASHINFER_VERSION
    from relaxkv_sglang.attention.gpu.torch_models import flashinfer_stand_in

    saved = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = flashinfer_stand_in(FLASHINFER_VERSION)
    try:
        if device == "cpu":
            yield Placement.on("cpu", anchors=FlashInferOnAnyDevice)
        else:
            from relaxkv_sglang.attention.gpu.cuda_rules import CudaRules

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


def run_checks(place: Placement, flashinfer_or_error: Any, scope: RunScope, steps: Steps, rows: list[dict],
               seed: int, timer: Callable) -> None:
    """The steps after FlashInfer's import (module doc), appending result rows to ``rows``."""
    def repair() -> None:
        got = run_repair(place, seed, scope.repair, log=lambda line: print(f"  {line}", flush=True))
        rows.extend(got)
        for r in got:
            if "ms" in r:
                print(f"repair  {r['dtype']:<9}{r['n_context']:>7} tokens {r['n_layers']} layers "
                      f"{r['anchor_layers']:>6} anchor-layers  max err {r['max_abs_err']:.2e}  {r['ms']:.1f} ms "
                      f"(CPU float32 {r['cpu_float32_ms']:.1f} ms)  {'yes' if r['ok'] else 'NO'}", flush=True)
        off = [f"{r['step']} {r['status']}: {r.get('error', '')}" for r in got if r["status"] != "passed"]
        if off:
            raise StepFailed("; ".join(off))

    steps.run("repair", scope.estimates["repair"], repair)
    if isinstance(flashinfer_or_error, str):
        for name in ["cases"] * bool(scope.cases) + [f"repair timing {n}" for n in scope.timing]:
            steps.rows.append({"step": name, "status": "not run", "error": flashinfer_or_error})
            print(f"gpu_check: step {name}: not run ({flashinfer_or_error})", flush=True)
        return
    flashinfer = flashinfer_or_error

    def cases() -> None:
        print(f"{'kind':<8}{'shape':<13}{'tokens':>7}{'page':>5}{'ctx':>6}{'rows':>7}{'max err':>10}{'keys read':>11}"
              f"{'ms':>9}{'full ms':>9}{'dense ms':>9}{'vs dense':>9}  ok", flush=True)
        off = 0
        for i, case in enumerate(scope.cases):
            run = run_anchors if case.kind == "anchors" else run_scoped
            try:
                r = run(case, place, flashinfer, scope.repeats, seed + i, timer)
                print(_case_line(r), flush=True)
            except Exception as exc:  # noqa: BLE001 (the other cases still run)
                traceback.print_exc()
                r = {**asdict(case), "ok": False, "error": error_line(exc)}
                print(f"{case.kind:<8}{case.shape:<13}{case.n_context:>7}  error: {r['error']}", flush=True)
            rows.append(r)
            off += not r["ok"]
        if off:
            raise StepFailed(f"{off} of {len(scope.cases)} cases off or raised")

    if scope.cases:
        steps.run("cases", scope.estimates["cases"], cases)
    for n in scope.timing:
        def timing(n: int = n) -> None:
            r = time_repair(place, replace(scope.repair, n_context=n, n_layers=scope.timing_layers), seed,
                            scope.timing_repeats)
            rows.append(r)
            print(_timing_line(r), flush=True)

        steps.run(f"repair timing {n}", scope.estimates[f"repair timing {n}"], timing)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_sglang.gpu_check", description=DESCRIPTION)
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
    scope = run_scope(args.quick, args.dry_run, args.repair_only, args.repeats)
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
    total = sum(scope.estimates.values())
    print(f"gpu_check: {'dry run, ' if args.dry_run else ''}steps {', '.join(scope.estimates)}; "
          f"estimated {total:.0f} s in all ({'this CPU' if args.dry_run else 'H200, unmeasured'}), "
          f"budget {budget:.0f} s", flush=True)
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            result["device"] = f"dry run: {args.dry_run_device}"
            place = stack.enter_context(dry_run_placement(args.dry_run_device))
            timer: Callable = wall_ms
        else:
            place, timer = Placement.on("cuda"), device_ms
            result["device"] = torch.cuda.get_device_name(place.device)
        from relaxkv_sglang.attention.gpu.flashinfer_attention import import_flashinfer

        flashinfer = steps.run("flashinfer", scope.estimates["flashinfer"], import_flashinfer)
        if flashinfer is None:
            flashinfer = f"flashinfer: {steps.rows[-1].get('error', 'not imported')}"
        else:
            result["flashinfer"] = getattr(flashinfer, "__version__", "?")
        run_checks(place, flashinfer, scope, steps, rows, args.seed, timer)
    write()
    passed = sum(s["status"] == "passed" for s in steps.rows)
    print(f"gpu_check: {passed}/{len(steps.rows)} steps passed "
          + ", ".join(f"{s['step']} {s['status']}" for s in steps.rows)
          + f"; {sum(r['ok'] for r in rows if 'ok' in r)}/{sum('ok' in r for r in rows)} cases within tolerance; "
          f"result: {args.out}", flush=True)
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
