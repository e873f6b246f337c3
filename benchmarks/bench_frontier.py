"""The cost frontier: first-token KL against the repair's *measured* cost, across anchor ratios, for
every repair policy, per prompt layout and pooled.

For each example and prompt format, exactly as ``bench_quality`` answers it
(:func:`benchmarks.bench_quality.answer_example`: caches flushed, the format's chunks warmed by
another request, then ``full`` first and ``pic`` and every (policy, ratio) in a shuffled order,
one answer token each), so every point of the frontier comes from the same interleaved run. Each
repair answer's cost is measured against ``pic``'s answer to the same prompt
(:mod:`benchmarks.frontier_stats`): its TTFT minus ``pic``'s, the anchors' recomputed
token-layers, the (row, key) pairs they attended, and the two summed into one work figure at the
device's price of a pair (``core.repair_config.RepairCost`` for the CPU).

Reported per format and pooled: each point's KL (95% CI), median extra TTFT and mean work; and the
method (``--method``, default ``relaxkv``) against every other policy at equal measured cost, two
ways: per prompt at equal work (the peer's KL interpolated on its own per-prompt work curve), and
per cell at equal median extra TTFT (the peer's curve of medians; interval over examples).
A PNG beside the JSON plots KL against median extra TTFT (top row) and mean work (bottom row).

Result JSON (beside the benchmark's name, machine and arguments): ``split``, ``formats``,
``tasks``, ``n_layers``, ``pair_cost``, ``calibration``, ``points`` (frontier_stats.frontier_points
per cell), ``equal_work`` and ``equal_ttft`` (the comparisons), ``per_example`` (the rows with their
costs). ``--merge a.json b.json`` pools parts over disjoint examples (or re-derives one file)
without a server.

    python -m benchmarks.bench_frontier --quick        # dev split, 1 example per task, plain, 3 ratios
    python -m benchmarks.bench_frontier --split test --formats plain chat tagged --examples 4 \\
        --anchor-ratios 0.02 0.05 0.10 0.15 0.20 0.30
"""

from __future__ import annotations

import argparse
import json
import pathlib

from benchmarks import bench_quality, common, frontier_stats, quality_stats, quality_tasks, tables
from benchmarks.frontier_stats import ALL
from relaxkv_sglang.repair.repair_config import RepairCost

BENCH = "bench_frontier"
PEERS = ("relaxkv", "prophetkv", "cacheblend", "epic")
RATIOS = (0.02, 0.04, 0.06, 0.08, 0.10, 0.15, 0.20, 0.30)
QUICK = {"examples": 1, "anchor_ratios": [0.05, 0.15, 0.30], "formats": ["plain"]}
MERGE_AGREE = ("model", "split", "formats", "tasks", "documents", "policies", "anchor_ratios", "context_ratio",
               "method")


def model_costs(args: argparse.Namespace) -> tuple[int, float]:
    """(layers, price of one attended pair in token-layers on the CPU) of ``--model``."""
    config = json.loads((common.model_dir(args) / "config.json").read_text())
    return int(config["num_hidden_layers"]), RepairCost.from_hf_config(config, "cpu").pair_cost


def analyse(rows: list[dict], args: argparse.Namespace, n_layers: int, pair_cost: float) -> dict:
    """The result body from the raw rows: costs, frontier points per cell, the equal-cost comparisons."""
    rows = frontier_stats.add_costs(rows, n_layers, pair_cost)
    cells = [*args.formats, ALL] if len(args.formats) > 1 else list(args.formats)
    peers = [p for p in args.policies if p not in (args.method, "full", "pic")]
    compared = frontier_stats.equal_cost_all(rows, list(args.formats), args.method, peers)
    equal_ratio = [{"format": f, "peer": p, "ratio": r,
                    **quality_stats.paired_cell([x for x in rows if f in (ALL, x["format"])], (args.method, r), (p, r))}
                   for f in cells for p in peers for r in args.anchor_ratios]
    return {"formats": list(args.formats), "n_layers": n_layers, "pair_cost": pair_cost,
            "points": [p for f in cells for p in frontier_stats.frontier_points(rows, f)],
            "equal_work": compared["work"], "equal_ttft": compared["extra_ttft_s"], "equal_ratio": equal_ratio, "per_example": rows}


def run(args: argparse.Namespace) -> dict:
    """Every example of every task in every format under full, pic and every (policy, ratio)."""
    n_layers, pair_cost = model_costs(args)
    rows, tasks, split, calibration = bench_quality.answer_all(args, ["full", "pic", *args.policies], BENCH)
    return {"split": split, "tasks": tasks, "calibration": calibration,
            **analyse(rows, args, n_layers, pair_cost)}


def merge(paths: list[str], args: argparse.Namespace) -> dict:
    """Pool the rows of result files over disjoint examples (one file: re-derive its analysis)."""
    parts = []
    for path in paths:
        try:
            parts.append(json.loads(pathlib.Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"--merge {path}: {exc}") from exc
        if parts[-1].get("bench") != BENCH:
            raise RuntimeError(f"--merge {path}: not a {BENCH} result file")
    first = parts[0]["args"]
    for path, part in zip(paths[1:], parts[1:]):
        for key in MERGE_AGREE:
            if part["args"].get(key) != first.get(key):
                raise RuntimeError(f"--merge {path}: {key} {part['args'].get(key)!r} differs from {paths[0]}'s")
    seen: set = set()
    rows = []
    for path, part in zip(paths, parts):
        units = {frontier_stats.unit_of(r) for r in part["per_example"]}
        if units & seen:
            raise RuntimeError(f"--merge {path}: prompt {sorted(units & seen)[0]} is in an earlier part")
        seen |= units
        rows += part["per_example"]
    for key in MERGE_AGREE:
        setattr(args, key, first.get(key))
    tasks = {}
    for part in parts:
        for t, info in part["tasks"].items():
            merged = tasks.setdefault(t, {"examples": 0, "example_ids": []})
            merged["examples"] += info["examples"]
            merged["example_ids"] += info["example_ids"]
    return {"split": {**parts[0]["split"], "parts": [p["split"] for p in parts]}, "tasks": tasks,
            "calibration": parts[0].get("calibration"),
            **analyse(rows, args, parts[0]["n_layers"], parts[0]["pair_cost"])}


# ------------------------------------------------------------------- report


def _signed(row: dict, name: str) -> str:
    """A difference column of a comparison row with its CI (``name`` and ``name_ci95``), "-" when none."""
    return "-" if row[name] is None else f"{row[name]:+.3f} {common.ci_text(row[name + '_ci95'], '+.3f')}"


def print_report(result: dict, args: argparse.Namespace) -> None:
    """The frontier points per cell, then the equal-cost comparisons."""
    split = result["split"]
    n = sum(t["examples"] for t in result["tasks"].values())
    print(f"\nsplit {split['name']} (HotpotQA from {split['offset']}, seed {split['seed']}); model {args.model}; "
          f"{n} examples x {len(result['formats'])} formats; {result['n_layers']} layers, "
          f"a pair = {result['pair_cost']:.2e} token-layers; {common.calibration_line(result.get('calibration'))}")
    columns = [tables.left("format", 14), tables.left("policy", 11), tables.right("anchors", 8),
               tables.right("achieved", 9), tables.right("KL [95% CI]", 22), tables.right("+TTFT p50", 10),
               tables.right("tok-layers", 11), tables.right("pairs", 12), tables.right("work", 11)]
    tables.print_text_table(columns, [
        [p["format"], p["policy"], common.fmt(p["anchor_ratio"], ".0%"), common.fmt(p["anchor_ratio_achieved"], ".1%"),
         f"{p['kl']:.3f} {common.ci_text(p['kl_ci95'], '.3f')}", common.fmt(p["extra_ttft_median_s"], "+.3f"),
         common.fmt(p["token_layers"], ",.0f"), common.fmt(p["pairs"], ",.0f"), common.fmt(p["work"], ",.0f")]
        for p in result["points"]])
    print(f"\n{args.method} against each peer at the same asked ratio (diff = {args.method} − peer per example, "
          f"95% CI over examples; W/T/L over prompts)")
    columns = [tables.left("format", 14), tables.left("peer", 11), tables.right("anchors", 8), tables.right("KL", 7),
               tables.right("peer KL", 8), tables.right("diff [95% CI]", 26), tables.right("W/T/L", 10)]
    tables.print_text_table(columns, [
        [r["format"], r["peer"], f"{r['ratio']:.0%}", common.fmt(r["kl"], ".3f"), common.fmt(r["kl_versus"], ".3f"),
         _signed(r, "diff"),
         f"{r['wins']}/{r['ties']}/{r['losses']}"]
        for r in result.get("equal_ratio", [])])
    print(f"\n{args.method} against each peer at equal work, per prompt (the peer's KL interpolated on its own "
          f"work curve for that prompt; diff = {args.method} − peer, 95% CI over examples)")
    columns = [tables.left("format", 14), tables.left("peer", 11), tables.right("anchors", 8),
               tables.right("work", 10), tables.right("KL", 7), tables.right("peer@work", 10),
               tables.right("diff [95% CI]", 26), tables.right("W/T/L", 10), tables.right("n/out", 8)]
    tables.print_text_table(columns, [
        [r["format"], r["peer"], f"{r['ratio']:.0%}", common.fmt(r["method_cost"], ",.0f"), common.fmt(r["kl"], ".3f"),
         common.fmt(r["kl_peer_at_cost"], ".3f"),
         _signed(r, "diff"),
         f"{r['wins']}/{r['ties']}/{r['losses']}", f"{r['n_units']}/{r['n_outside']}"]
        for r in result["equal_work"]])
    print(f"\n{args.method} against each peer at equal median extra TTFT (TTFT − pic's, same prompt, same run; "
          f"gap = {args.method}'s KL − the peer's curve there; CI over examples, medians recomputed)")
    columns = [tables.left("format", 14), tables.left("peer", 11), tables.right("anchors", 8),
               tables.right("+TTFT", 8), tables.right("KL", 7), tables.right("peer@TTFT", 10),
               tables.right("gap [95% CI]", 26), tables.right("verdict", 8), tables.right("where", 8)]
    tables.print_text_table(columns, [
        [r["format"], r["peer"], f"{r['ratio']:.0%}", f"{r['extra_ttft_s']:+.3f}", f"{r['kl']:.3f}",
         common.fmt(r["kl_peer_at_cost"], ".3f"),
         _signed(r, "gap"),
         r["verdict"] or "-", r["where"]]
        for r in result["equal_ttft"]])


def plot(result: dict, path: pathlib.Path) -> None:
    """KL against median extra TTFT (top) and mean work (bottom), one column per cell (pooled first)."""
    plt = common.pyplot()
    cells = list(dict.fromkeys(p["format"] for p in result["points"]))
    cells = cells[-1:] + cells[:-1] if ALL in cells else cells
    fig, axes = plt.subplots(2, len(cells), figsize=(4.4 * len(cells), 7.6), squeeze=False)
    for col, fmt in enumerate(cells):
        pts = [p for p in result["points"] if p["format"] == fmt]
        for row, (key, label) in enumerate((("extra_ttft_median_s", "median TTFT − pic's (s)"),
                                            ("work", "mean work (token-layers)"))):
            ax = axes[row][col]
            for p in pts:
                if p["policy"] == "pic":
                    ax.scatter([0], [p["kl"]], marker="D", color="k", zorder=3, label="pic")
            for policy in dict.fromkeys(p["policy"] for p in pts if p["anchor_ratio"] is not None):
                line = sorted((p["anchor_ratio"], p[key], p["kl"]) for p in pts
                              if p["policy"] == policy and p[key] is not None)
                handle, = ax.plot([x for _, x, _ in line], [y for _, _, y in line], marker="o", ms=3, label=policy)
                for ratio, x, y in line:
                    ax.annotate(f"{ratio:.0%}", (x, y), textcoords="offset points", xytext=(2, 3), fontsize=6,
                                color=handle.get_color())
            ax.set_xlabel(label)
            ax.set_ylabel("first-token KL to full")
            ax.set_yscale("log")
            ax.set_title(f"{'all formats' if fmt == ALL else fmt}", fontsize=10)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_frontier``: measure (or merge), print, write the JSON and the plot."""
    parser = common.bench_parser(BENCH, __doc__, quick_help="1 example per task, plain, 5/15/30%%")
    parser.add_argument("--tasks", nargs="+", default=list(bench_quality.TASKS), choices=bench_quality.TASKS)
    parser.add_argument("--formats", nargs="+", default=["plain", "chat", "tagged"], choices=bench_quality.FORMATS)
    parser.add_argument("--examples", type=int, default=4, help="examples per task")
    parser.add_argument("--documents", type=int, default=quality_tasks.DOCUMENTS_PER_PROMPT)
    parser.add_argument("--split", default="dev", choices=tuple(bench_quality.SPLITS))
    parser.add_argument("--offset", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--policies", nargs="+", default=list(PEERS),
                        choices=[p for p in bench_quality.POLICIES if p not in bench_quality.BASELINES])
    parser.add_argument("--method", default="relaxkv", help="the policy set against every other (default relaxkv)")
    parser.add_argument("--anchor-ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--context-ratio", type=float, default=None, help="relaxkv's (default: the server's)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="no server: pool these result files (parts over disjoint examples)")
    args = common.parse_args(parser, argv, quick=QUICK)
    args.kl_only, args.max_new_tokens = True, None  # one answer token: KL and TTFT are exact
    report = lambda result: print_report(result, args)  # noqa: E731
    if args.merge:
        common.run_bench(BENCH, args, lambda a: merge(a.merge, a), report=report, plot=plot)
        return
    if args.method not in args.policies:
        common.fail(BENCH, f"--method {args.method} is not among --policies")
    args.formats = list(dict.fromkeys(args.formats))
    try:
        args.offset, args.seed = bench_quality.split_origin(args.split, args.tasks, args.examples,
                                                            args.offset, args.seed)
    except ValueError as exc:
        common.fail(BENCH, str(exc))
    common.run_bench(BENCH, args, run, report=report, plot=plot)


if __name__ == "__main__":
    main()
