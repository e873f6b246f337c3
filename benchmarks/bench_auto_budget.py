"""The per-request budget against the fixed one: ``relaxkv_budget: auto`` at each quality level,
against ``relaxkv`` and a peer at a fixed reference ratio, in KL and in measured repair cost.

Every example of every task in every format is answered (one token, as ``bench_frontier``) under
``full``, ``pic``, ``relaxkv`` and each ``--peers`` at ``--reference-ratio``, and ``relaxkv`` with
``relaxkv_budget: auto`` at each ``--qualities`` level, interleaved in a shuffled order. Costs per
request against ``pic`` on the same prompt (``frontier_stats.add_costs``): +TTFT and work
(anchor token-layers + priced attended pairs). Reported per layout and pooled:

* each config's mean KL [95% CI over prompts], mean work, median +TTFT, mean chosen anchor ratio;
* ``auto`` against ``relaxkv`` at the reference: the paired KL difference (95% CI resampling
  examples) and the cost ratios (mean work, median +TTFT), with the ratio's CI resampling examples;
* ``auto`` against each peer at the reference: the paired KL difference.

The server's calibration must hold a budget model (``scripts/calibrate.py --budget``), else the
run stops with one line before the first request.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from benchmarks import bench_frontier, bench_quality, common, frontier_stats, metrics, quality_stats, quality_tasks
from benchmarks.tables import markdown_table

BENCH = "bench_auto_budget"
ALL = frontier_stats.ALL
QUICK = {"examples": 1, "formats": ["plain"], "qualities": ["medium"]}


def auto_label(quality: str) -> str:
    return bench_quality.AUTO_PREFIX + quality


def configs(args: argparse.Namespace) -> list[tuple[str, float | str | None]]:
    """full, pic, relaxkv and the peers at the reference ratio, relaxkv auto at each quality."""
    return [("full", None), ("pic", None), ("relaxkv", args.reference_ratio),
            *((p, args.reference_ratio) for p in args.peers), *(("relaxkv", auto_label(q)) for q in args.qualities)]


def _in(rows: list[dict], fmt: str, cfg: tuple) -> list[dict]:
    return [r for r in rows if (r["policy"], r["anchor_ratio"]) == cfg and fmt in (ALL, r["format"])]


def summary(rows: list[dict], fmt: str, cfg: tuple) -> dict:
    """One config's KL and costs in one cell."""
    rs = _in(rows, fmt, cfg)
    kls = [r["kl_first_token"] for r in rs]
    chosen = [((r.get("relaxkv") or {}).get("budget_choice") or {}).get("anchor_ratio") for r in rs]
    fallbacks = sum(1 for r in rs if "fallback" in ((r.get("relaxkv") or {}).get("budget_choice") or {}))
    works = [r["work"] for r in rs if r.get("work") is not None]
    extra = [r["extra_ttft_s"] for r in rs if r.get("extra_ttft_s") is not None]
    return {"format": fmt, "policy": cfg[0], "config": cfg[1], "n": len(rs), "kl": metrics.mean(kls),
            "kl_ci95": metrics.bootstrap_ci(kls) if len(kls) > 1 else None,
            "work": metrics.mean(works) if works else None,
            "extra_ttft_median_s": statistics.median(extra) if extra else None,
            "chosen_ratio": metrics.mean([c for c in chosen if c is not None]) if any(c is not None for c in chosen) else None,
            "fallbacks": fallbacks}


def cost_ratio(rows: list[dict], fmt: str, cfg: tuple, ref: tuple, *, rounds: int = 2000, seed: int = 0) -> dict:
    """Mean work of ``cfg`` over ``ref``'s on the same prompts, with a 95% CI resampling examples, and
    the ratio of their median +TTFT."""
    mine = {frontier_stats.unit_of(r): r for r in _in(rows, fmt, cfg)}
    theirs = {frontier_stats.unit_of(r): r for r in _in(rows, fmt, ref)}
    units = [u for u in mine if u in theirs and mine[u].get("work") is not None and theirs[u].get("work") is not None]
    by_example: dict[tuple[str, str], list] = {}
    for u in units:
        by_example.setdefault(u[:2], []).append((mine[u]["work"], theirs[u]["work"]))
    groups = list(by_example.values())
    if not groups:
        return {"work_ratio": None, "work_ratio_ci95": None, "extra_ttft_ratio": None}

    def ratio(sample: list[list]) -> float:
        pairs = [p for g in sample for p in g]
        return sum(a for a, _ in pairs) / max(sum(b for _, b in pairs), 1e-9)

    rng = np.random.default_rng(seed)
    draws = [ratio([groups[i] for i in rng.integers(0, len(groups), len(groups))]) for _ in range(rounds)]
    extra_mine = [mine[u]["extra_ttft_s"] for u in units if mine[u].get("extra_ttft_s") is not None]
    extra_ref = [theirs[u]["extra_ttft_s"] for u in units if theirs[u].get("extra_ttft_s") is not None]
    ttft_ratio = (statistics.median(extra_mine) / statistics.median(extra_ref)
                  if extra_mine and extra_ref and statistics.median(extra_ref) > 0 else None)
    return {"work_ratio": ratio(groups), "work_ratio_ci95": [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))],
            "extra_ttft_ratio": ttft_ratio}


def analyse(rows: list[dict], args: argparse.Namespace, n_layers: int, pair_cost: float) -> dict:
    rows = frontier_stats.add_costs(rows, n_layers, pair_cost)
    cells = [*args.formats, ALL] if len(args.formats) > 1 else list(args.formats)
    cfgs = configs(args)
    ref = ("relaxkv", args.reference_ratio)
    autos = [("relaxkv", auto_label(q)) for q in args.qualities]
    versus = []
    for fmt in cells:
        cell_rows = [r for r in rows if fmt in (ALL, r["format"])]
        for auto in autos:
            for other in [ref, *((p, args.reference_ratio) for p in args.peers)]:
                versus.append({"format": fmt, "auto": auto[1], "versus": f"{other[0]}@{other[1]:.0%}",
                               **quality_stats.paired_cell(cell_rows, auto, other),
                               **(cost_ratio(rows, fmt, auto, other) if other == ref else {})})
    return {"formats": list(args.formats), "n_layers": n_layers, "pair_cost": pair_cost,
            "summary": [summary(rows, f, c) for f in cells for c in cfgs if c[0] != "full"],
            "versus": versus, "per_example": rows}


def require_budget_model(calibration: dict | None) -> None:
    """Stop before the run when the server's calibration has no budget model (auto would fall back)."""
    if not (calibration or {}).get("budget_prices"):
        raise RuntimeError("the server's calibration has no budget model: auto requests would fall back "
                           "(python -m scripts.calibrate --budget ...)")


def run(args: argparse.Namespace) -> dict:
    n_layers, pair_cost = bench_frontier.model_costs(args)
    rows, tasks, split, calibration = bench_quality.answer_all(args, [], BENCH, cfgs=configs(args),
                                                               check_calibration=require_budget_model)
    return {"split": split, "tasks": tasks, "calibration": calibration, **analyse(rows, args, n_layers, pair_cost)}


def print_md(heads: list[str], rows: list[list]) -> None:
    print("\n".join(markdown_table(heads, [[str(c) for c in r] for r in rows])))


def _label(policy: str, config) -> str:
    return f"{policy} {config}" if isinstance(config, str) else f"{policy} {common.fmt(config, '.0%', '')}".strip()


def print_report(result: dict, args: argparse.Namespace) -> None:
    print(f"\n{BENCH}: KL and measured cost per config (work: anchor token-layers + priced pairs; "
          f"+TTFT over pic on the same prompt)")
    print_md(["layout", "config", "n", "KL [95% CI]", "chosen ratio", "work", "+TTFT p50", "fallbacks"],
                       [[s["format"], _label(s["policy"], s["config"]), s["n"],
                         f"{s['kl']:.3f} {common.ci_text(s['kl_ci95'], '.3f')}", common.fmt(s["chosen_ratio"], ".1%"),
                         common.fmt(s["work"], ",.0f"), common.fmt(s["extra_ttft_median_s"], "+.2f") + " s",
                         s["fallbacks"]] for s in result["summary"]])
    print(f"\n{BENCH}: auto against the fixed reference (paired over examples)")
    print_md(["layout", "auto", "versus", "KL auto", "KL versus", "diff [95% CI]", "W/T/L",
                        "work ratio [95% CI]", "+TTFT ratio"],
                       [[v["format"], v["auto"], v["versus"], common.fmt(v["kl"], ".3f"), common.fmt(v["kl_versus"], ".3f"),
                         f"{common.fmt(v['diff'], '+.3f')} {common.ci_text(v['diff_ci95'], '+.3f')}",
                         f"{v['wins']}/{v['ties']}/{v['losses']}",
                         (f"{v['work_ratio']:.2f} {common.ci_text(v['work_ratio_ci95'], '.2f')}"
                          if v.get("work_ratio") is not None else ""),
                         common.fmt(v.get("extra_ttft_ratio"), ".2f", "")] for v in result["versus"]])


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(BENCH, __doc__, quick_help="1 example per task, plain, medium")
    parser.add_argument("--tasks", nargs="+", default=list(bench_quality.TASKS), choices=bench_quality.TASKS)
    parser.add_argument("--formats", nargs="+", default=["plain", "tagged", "question_first", "chat"],
                        choices=bench_quality.FORMATS)
    parser.add_argument("--examples", type=int, default=4, help="examples per task")
    parser.add_argument("--documents", type=int, default=quality_tasks.DOCUMENTS_PER_PROMPT)
    parser.add_argument("--split", default="test", choices=tuple(bench_quality.SPLITS))
    parser.add_argument("--offset", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--qualities", nargs="+", default=["low", "medium", "high"])
    parser.add_argument("--reference-ratio", type=float, default=0.15)
    parser.add_argument("--peers", nargs="+", default=["prophetkv"],
                        choices=[p for p in bench_quality.POLICIES if p not in bench_quality.BASELINES])
    parser.add_argument("--context-ratio", type=float, default=None, help="relaxkv's (default: the server's)")
    args = common.parse_args(parser, argv, quick=QUICK)
    args.kl_only, args.max_new_tokens, args.anchor_ratios = True, None, []
    args.formats = list(dict.fromkeys(args.formats))
    try:
        args.offset, args.seed = bench_quality.split_origin(args.split, args.tasks, args.examples, args.offset, args.seed)
    except ValueError as exc:
        common.fail(BENCH, str(exc))
    common.run_bench(BENCH, args, run, report=lambda result: print_report(result, args))


if __name__ == "__main__":
    main()
