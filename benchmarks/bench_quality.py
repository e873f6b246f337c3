"""Answer quality and TTFT of every reuse policy on four tasks, across anchor ratios, in one run.

Tasks (``relaxkv_sglang.workloads``, 10 documents as chunks, ~1.5K tokens each):
HotpotQA dev (its 10 paragraphs), multi-document SQuAD (the gold paragraph
among 9 from other articles), and RULER-style multi-value needle and variable
tracking in essay text (seeded). For each example the chunks are cached by a
first request (other system prompt, reversed order, a placeholder question),
then the same prompt is answered by ``full`` and ``pic`` once and by every
repair policy at every anchor ratio, in a shuffled order. Reported per task, policy
and ratio (fidelity to ``full`` prefill is the figure to steer by: a 135M
model's task scores barely separate the policies):

* task score: LongBench QA F1 of the answer's first line (HotpotQA, SQuAD) or
  RULER ``string_match_all``, the fraction of the expected values in the answer;
* F1 of the greedy answer against ``full``'s, and exact agreement with it;
* KL(full || policy) of the first answer token, over ``full``'s top-K tokens
  (the policy's log-probabilities for the same token ids come back through
  ``token_ids_logprob``; the mass outside the top K is left out);
* TTFT: the time to the first streamed token of that same request, at the
  client. It costs no extra request; it includes the small overhead of
  returning log-probabilities, alike for every policy.

Means come with 95% bootstrap intervals over examples (paired: every policy
answers the same examples). A PNG next to the JSON plots first-token KL
against median TTFT: one line per repair policy across the anchor ratios,
``pic`` and ``full`` as single points.

    python -m benchmarks.bench_quality --quick                    # 3 examples per task, 15% anchors
    python -m benchmarks.bench_quality                            # 10 per task x 5/15/30% anchors
    python -m benchmarks.bench_quality --tasks hotpotqa --examples 40 --anchor-ratios 0.15
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import statistics

from tqdm import tqdm

from benchmarks import common
from relaxkv_sglang import metrics, workloads
from relaxkv_sglang.client import ServerClient

BENCH = "bench_quality"
TASKS = workloads.QUALITY_TASKS
POLICIES = ("full", "pic", "epic", "cacheblend", "prophetkv", "relaxkv", "relaxkv_fullctx", "relaxkv_randctx")
BASELINES = ("full", "pic")  # no anchor ratio: answered once per example
WARM_SYSTEM = workloads.SYSTEM_PROMPTS[1]
TOP_K = 20
QUICK_EXAMPLES = 3  # per task: the whole quick run stays under 5 minutes on 2 cores with SmolLM2
HEADLINE_RATIO = 0.15  # the ratio the README's table shows


def first_token_kl(full: dict, other: dict) -> float:
    """KL(full || other) over full's top-K first tokens (renormalised on that support)."""
    full_top = {tok: lp for lp, tok, *_ in full["meta_info"]["output_top_logprobs"][0]}
    other_lp = {tok: lp for lp, tok, *_ in other["meta_info"]["output_token_ids_logprobs"][0]}
    p_mass = sum(math.exp(lp) for lp in full_top.values())
    q_mass = sum(math.exp(other_lp[t]) for t in full_top)
    kl = 0.0
    for tok, lp in full_top.items():
        p = math.exp(lp) / p_mass
        kl += p * (math.log(p) - (other_lp[tok] - math.log(q_mass)))
    return max(kl, 0.0)


def first_line(text: str) -> str:
    """The short answer the QA prompts ask for: the continuation up to its first line break."""
    return text.strip().split("\n", 1)[0]


def task_score(example: workloads.TaskExample, answer: str) -> float:
    """The example's task score: QA F1 on the answer's first line, RULER string match on all of it."""
    return metrics.score(example.scorer, first_line(answer) if example.scorer == "qa_f1" else answer, example.answers)


def bootstrap_ci(values: list[float], *, seed: int = 0, rounds: int = 1000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean; one seed, so equal-length lists resample alike (paired)."""
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def configs(policies: list[str], ratios: list[float]) -> list[tuple[str, float | None]]:
    """(policy, anchor ratio) pairs one example is answered under; baselines once, with ratio None."""
    return ([(p, None) for p in policies if p in BASELINES]
            + [(p, r) for r in ratios for p in policies if p not in BASELINES])


def answer_example(client: ServerClient, example: workloads.TaskExample, cfgs: list[tuple[str, float | None]],
                   args: argparse.Namespace, rng: random.Random) -> list[dict]:
    """One example under every config: ``full`` first (its top tokens are the KL support), the rest shuffled."""
    client.flush()
    common.warm_chunks(client, example.documents, WARM_SYSTEM)
    text, offsets = example.marked()
    max_new = args.max_new_tokens or example.max_new_tokens
    full = client.generate_stream(text, offsets, "full", max_new_tokens=max_new, top_logprobs=TOP_K)
    top_ids = [tok for _, tok, *_ in full["meta_info"]["output_top_logprobs"][0]]
    order = [c for c in cfgs if c[0] != "full"]
    rng.shuffle(order)  # drift on a shared machine then hits every policy alike
    outs = {("full", None): full}
    for policy, ratio in order:
        outs[(policy, ratio)] = client.generate_stream(
            text, offsets, policy, max_new_tokens=max_new, anchor_ratio=ratio,
            context_ratio=args.context_ratio if ratio is not None else None, token_ids_logprob=top_ids)
    rows = []
    for policy, ratio in cfgs:
        out = outs[(policy, ratio)]
        rows.append({
            "task": example.task, "example_id": example.example_id, "policy": policy, "anchor_ratio": ratio,
            "answer": out["text"],
            "score": task_score(example, out["text"]),
            "f1_to_full": metrics.fidelity_f1(out["text"], full["text"]),
            "exact_to_full": metrics.exact_agreement(out["text"], full["text"]),
            "kl_first_token": 0.0 if policy == "full" else first_token_kl(full, out),
            "ttft_s": out["ttft_s"], "latency_s": out["latency_s"],
            "prompt_tokens": out["meta_info"]["prompt_tokens"],
            "cached_tokens": out["meta_info"]["cached_tokens"],
            "relaxkv": common.relaxkv_report(out),
        })
    return rows


def run(args: argparse.Namespace) -> dict:
    """Every example of every task under every config against one server; per-example rows and summaries."""
    try:
        examples = {t: workloads.task_examples(t, args.examples, seed=args.seed, offset=args.offset)
                    for t in args.tasks}
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc
    cfgs = configs(args.policies, args.anchor_ratios)
    rng = random.Random(args.seed)
    rows: list[dict] = []
    with common.bench_client(args, BENCH) as client:
        for task, exs in examples.items():
            for example in tqdm(exs, desc=f"{BENCH} {task}", unit="example"):
                rows += answer_example(client, example, cfgs, args, rng)
    tasks = {t: {"examples": len(exs), "scorer": exs[0].scorer, "example_ids": [e.example_id for e in exs]}
             for t, exs in examples.items()}
    return {"tasks": tasks, "summary": summarize_all(rows, args.tasks, cfgs), "per_example": rows}


def summarize(rows: list[dict]) -> dict:
    """Means (with paired bootstrap CIs) and the TTFT median of one (task, policy, ratio) cell."""
    out = {"n": len(rows)}
    for key in ("score", "f1_to_full", "exact_to_full", "kl_first_token"):
        values = [r[key] for r in rows]
        out[key] = metrics.mean(values)
        out[key + "_ci95"] = bootstrap_ci(values)
    out["ttft_median_s"] = statistics.median(r["ttft_s"] for r in rows)
    out["latency_s"] = metrics.mean(r["latency_s"] for r in rows)
    out["prompt_tokens"] = metrics.mean(r["prompt_tokens"] for r in rows)
    for key, name in (("anchor_ratio", "anchor_ratio_achieved"), ("context_ratio", "context_ratio"),
                      ("repair_kv_pairs", "repair_kv_pairs")):
        values = [r["relaxkv"][key] for r in rows if r["relaxkv"].get(key) is not None]
        out[name] = metrics.mean(values) if values else None
    return out


def summarize_all(rows: list[dict], tasks: list[str], cfgs: list[tuple[str, float | None]]) -> list[dict]:
    """One summary per (task, policy, ratio), task ``"all"`` pooling every task's examples."""
    out = []
    for task in [*tasks, "all"]:
        for policy, ratio in cfgs:
            cell = [r for r in rows if (task == "all" or r["task"] == task)
                    and r["policy"] == policy and r["anchor_ratio"] == ratio]
            out.append({"task": task, "policy": policy, "anchor_ratio": ratio, **summarize(cell)})
    return out


def headline_ratio(ratios: list[float]) -> float:
    """The swept ratio closest to 15% (the paper's and the README's operating point)."""
    return min(ratios, key=lambda r: abs(r - HEADLINE_RATIO))


def print_table(result: dict, args: argparse.Namespace) -> None:
    """The summaries as plain-text tables: one per task, then all tasks pooled."""
    for task in [*args.tasks, "all"]:
        info = result["tasks"].get(task)
        what = (f"{info['examples']} examples, score = {info['scorer']}" if info
                else "all tasks pooled, score = mean task score")
        print(f"\n{task}: {what}; model {args.model}, relaxkv context ratio {args.context_ratio}")
        head = (f"{'policy':<16}{'anchors':>8}{'score':>7}{'F1→full':>16}{'exact':>7}{'KL 1st tok':>18}"
                f"{'TTFT p50':>9}{'achieved':>9}{'ctx':>6}{'repair KV':>11}")
        print(head)
        print("-" * len(head))
        for s in (s for s in result["summary"] if s["task"] == task):
            f1_lo, f1_hi = s["f1_to_full_ci95"]
            kl_lo, kl_hi = s["kl_first_token_ci95"]
            ratio, achieved = common.fmt(s["anchor_ratio"], ".0%"), common.fmt(s["anchor_ratio_achieved"], ".3f")
            ctx, work = common.fmt(s["context_ratio"], ".2f"), common.fmt(s["repair_kv_pairs"], ".0f")
            print(f"{s['policy']:<16}{ratio:>8}{s['score']:>7.3f}{s['f1_to_full']:>6.3f} [{f1_lo:.2f},{f1_hi:.2f}]"
                  f"{s['exact_to_full']:>7.3f}{s['kl_first_token']:>7.3f} [{kl_lo:.2f},{kl_hi:.2f}]"
                  f"{s['ttft_median_s']:>8.2f}s{achieved:>9}{ctx:>6}{work:>11}")


def plot(summary: list[dict], tasks: list[str], path: pathlib.Path) -> None:
    """First-token KL against median TTFT: all tasks pooled (top left), then one panel per task."""
    plt = common.pyplot()
    panels = ["all", *tasks] if len(tasks) > 1 else list(tasks)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    cells_of_axes = list(axes.flat)
    for ax, task in zip(cells_of_axes, panels):
        cells = [s for s in summary if s["task"] == task]
        for baseline, marker in (("full", "s"), ("pic", "D")):
            for s in (s for s in cells if s["policy"] == baseline):
                ax.scatter([s["ttft_median_s"]], [s["kl_first_token"]], marker=marker, color="k", zorder=3,
                           label=baseline)
                ax.annotate(baseline, (s["ttft_median_s"], s["kl_first_token"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        for policy in dict.fromkeys(s["policy"] for s in cells if s["policy"] not in BASELINES):
            pts = sorted((s["anchor_ratio"], s["ttft_median_s"], s["kl_first_token"])
                         for s in cells if s["policy"] == policy)
            line, = ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=policy)
            for ratio, x, y in pts:
                ax.annotate(f"{ratio:.0%}", (x, y), textcoords="offset points", xytext=(3, -9), fontsize=7,
                            color=line.get_color())
        ax.set_title("all tasks pooled" if task == "all" else task)
        ax.set_xlabel("TTFT median (s)")
        ax.set_ylabel("first-token KL to full (lower is better)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    handles, labels = cells_of_axes[0].get_legend_handles_labels()
    spare = cells_of_axes[len(panels):]
    for ax in spare:
        ax.axis("off")
    if spare:  # an empty grid cell holds the legend
        spare[0].legend(handles, labels, loc="center", title="policy (point labels: anchor ratio)")
        fig.tight_layout()
    else:
        fig.tight_layout(rect=(0, 0, 0.83, 1))
        fig.legend(handles, labels, loc="center right", title="policy\n(labels: anchor ratio)", fontsize=8)
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_quality``: parse the flags, measure, print, write the JSON and the plot."""
    parser = common.bench_parser(BENCH, __doc__, quick_help=f"{QUICK_EXAMPLES} examples per task, 15%% anchors only")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--examples", type=int, default=10, help="examples per task")
    parser.add_argument("--offset", type=int, default=0, help="first HotpotQA dev example")
    parser.add_argument("--seed", type=int, default=0, help="seed of the SQuAD and RULER-style examples")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--anchor-ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    parser.add_argument("--context-ratio", type=float, default=0.25)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="answer length (default: each task's own: 16 for QA, 40 needle, 32 variable tracking)")
    args = common.parse_args(parser, argv, quick={"examples": QUICK_EXAMPLES, "anchor_ratios": [HEADLINE_RATIO]})
    if "full" not in args.policies:
        args.policies = ["full"] + args.policies
    common.run_bench(BENCH, args, run, report=lambda result: print_table(result, args),
                     plot=lambda result, path: plot(result["summary"], args.tasks, path))


if __name__ == "__main__":
    main()
