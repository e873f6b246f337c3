"""Answer quality of every reuse policy on HotpotQA, side by side in one run.

For each HotpotQA dev example (its 10 paragraphs as chunks): the chunks are
cached by a first request (other system prompt, other order), then the same
prompt is answered under every policy. Fidelity to ``full`` prefill is the
figure to steer by (brief: a 135M model's gold accuracy barely separates the
policies):

* F1 of the 16 greedy tokens against ``full``'s, and exact agreement with them;
* KL(full || policy) of the first answer token, over ``full``'s top-K tokens
  (the policy's log-probabilities for the same token ids come back through
  ``token_ids_logprob``; the mass outside the top K is left out);
* gold answer F1 (LongBench QA F1 of the first line of the answer) beside it.

Means come with 95% bootstrap intervals over examples (paired: every policy
answers the same examples).

    python -m benchmarks.bench_quality --quick          # 8 examples, a few minutes
    python -m benchmarks.bench_quality --examples 40    # the issue's slice (0-39)
"""

from __future__ import annotations

import argparse
import math
import random

from tqdm import tqdm

from benchmarks.common import add_server_args, fail, server_url, write_result
from relaxkv_sglang import assets, metrics, workloads
from relaxkv_sglang.client import ServerClient

BENCH = "bench_quality"
POLICIES = ("full", "pic", "epic", "cacheblend", "prophetkv", "relaxkv", "relaxkv_fullctx", "relaxkv_randctx")
SYSTEM = workloads.SYSTEM_PROMPTS[0]
WARM_SYSTEM = workloads.SYSTEM_PROMPTS[1]
TOP_K = 20


def example_prompt(example: dict, system: str, question: str | None = None, reverse: bool = False):
    docs = [workloads.format_paragraph(t, s) for t, s in example["context"]]
    if reverse:
        docs = docs[::-1]
    return workloads.marked_text(system, docs, workloads.question_text(question or example["question"]))


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
    """The short answer the prompt asks for: the continuation up to its first line break."""
    return text.strip().split("\n", 1)[0]


def bootstrap_ci(values: list[float], *, seed: int = 0, rounds: int = 1000) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def run(args) -> dict:
    data = assets.load_data("hotpotqa")[args.offset: args.offset + args.examples]
    rows = {p: [] for p in args.policies}
    with server_url(args, BENCH) as url:
        client = ServerClient(url)
        for example in tqdm(data, desc=BENCH, unit="example"):
            client.flush()
            warm_text, warm_offsets = example_prompt(example, WARM_SYSTEM, question="?", reverse=True)
            client.generate(warm_text, warm_offsets, "pic", max_new_tokens=1)
            text, offsets = example_prompt(example, SYSTEM)
            full = client.generate(text, offsets, "full", max_new_tokens=args.max_new_tokens, top_logprobs=TOP_K)
            top_ids = [tok for _, tok, *_ in full["meta_info"]["output_top_logprobs"][0]]
            for policy in args.policies:
                out = full if policy == "full" else client.generate(
                    text, offsets, policy, max_new_tokens=args.max_new_tokens,
                    anchor_ratio=args.anchor_ratio, context_ratio=args.context_ratio, token_ids_logprob=top_ids)
                record = out["meta_info"].get("relaxkv") or {}
                rows[policy].append({
                    "answer": out["text"],
                    "f1_to_full": metrics.fidelity_f1(out["text"], full["text"]),
                    "exact_to_full": metrics.exact_agreement(out["text"], full["text"]),
                    "kl_first_token": 0.0 if policy == "full" else first_token_kl(full, out),
                    "gold_f1": metrics.qa_f1(first_line(out["text"]), example["answer"]),
                    "latency_s": out["client_latency_s"],
                    "prompt_tokens": out["meta_info"]["prompt_tokens"],
                    "cached_tokens": out["meta_info"]["cached_tokens"],
                    "relaxkv": record,
                })
    summary = {p: summarize(r) for p, r in rows.items()}
    return {"summary": summary, "per_example": rows}


def summarize(rows: list[dict]) -> dict:
    out = {"n": len(rows)}
    for key in ("f1_to_full", "exact_to_full", "kl_first_token", "gold_f1", "latency_s"):
        values = [r[key] for r in rows]
        out[key] = metrics.mean(values)
        out[key + "_ci95"] = bootstrap_ci(values)
    out["prompt_tokens"] = metrics.mean(r["prompt_tokens"] for r in rows)
    pairs = [r["relaxkv"].get("repair_kv_pairs") for r in rows if r["relaxkv"].get("repair_kv_pairs") is not None]
    out["repair_kv_pairs"] = metrics.mean(pairs) if pairs else None
    ratios = [r["relaxkv"].get("anchor_ratio") for r in rows if r["relaxkv"].get("anchor_ratio") is not None]
    out["anchor_ratio"] = metrics.mean(ratios) if ratios else None
    ctx = [r["relaxkv"].get("context_ratio") for r in rows if r["relaxkv"].get("context_ratio") is not None]
    out["context_ratio"] = metrics.mean(ctx) if ctx else None
    return out


def print_table(summary: dict, args) -> None:
    print(f"\nHotpotQA dev {args.offset}-{args.offset + args.examples - 1}, model {args.model}, "
          f"anchor ratio {args.anchor_ratio}, context ratio {args.context_ratio}")
    head = f"{'policy':<16}{'F1→full':>16}{'exact':>8}{'KL 1st tok':>18}{'gold F1':>9}{'anchors':>9}{'ctx':>7}{'repair KV':>11}{'latency':>9}"
    print(head)
    print("-" * len(head))
    for policy, s in summary.items():
        f1_lo, f1_hi = s["f1_to_full_ci95"]
        kl_lo, kl_hi = s["kl_first_token_ci95"]
        anchors = f"{s['anchor_ratio']:.3f}" if s["anchor_ratio"] is not None else "-"
        ctx = f"{s['context_ratio']:.2f}" if s["context_ratio"] is not None else "-"
        work = f"{s['repair_kv_pairs']:.0f}" if s["repair_kv_pairs"] is not None else "-"
        print(f"{policy:<16}{s['f1_to_full']:>6.3f} [{f1_lo:.2f},{f1_hi:.2f}]{s['exact_to_full']:>8.3f}"
              f"{s['kl_first_token']:>7.3f} [{kl_lo:.2f},{kl_hi:.2f}]{s['gold_f1']:>9.3f}{anchors:>9}{ctx:>7}{work:>11}"
              f"{s['latency_s']:>8.2f}s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_quality", description=__doc__.split("\n\n")[0])
    add_server_args(parser)
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 examples")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--anchor-ratio", type=float, default=0.15)
    parser.add_argument("--context-ratio", type=float, default=0.25)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.quick:
        args.examples = 8
    if "full" not in args.policies:
        args.policies = ["full"] + args.policies
    try:
        result = run(args)
    except (RuntimeError, assets.AssetError) as exc:
        fail(BENCH, str(exc))
    print_table(result["summary"], args)
    write_result(BENCH, args, result)


if __name__ == "__main__":
    main()
