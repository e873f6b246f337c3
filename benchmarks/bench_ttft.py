"""Time to first token of every policy, by prompt length and anchor ratio, in one run.

Prompts are HotpotQA paragraphs packed to about 1.5K, 3K and 6K tokens (each
paragraph a chunk), a system prompt and a question. Every measured request is
warm: its chunks were cached by an earlier request (other system prompt, other
order). Requests of all policies are interleaved in a shuffled order, round
after round, so drift on a shared machine hits them alike; figures are medians
over rounds and ratios to ``full`` from the same run.

TTFT here is the latency of a request for one new token (prefill + one
sampling step), measured at the client.

    python -m benchmarks.bench_ttft --quick
    python -m benchmarks.bench_ttft                       # 1.5K/3K/6K x 5-30% anchors
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
from typing import Any

from tqdm import tqdm

from benchmarks import common, prompt_formats, rag_documents, tables
from relaxkv_sglang import assets
from relaxkv_sglang.repair.policies import repair_policies
from relaxkv_sglang.request.schema import CONTEXT_RATIO

BENCH = "bench_ttft"
# The peers and the method; the ablations are for bench_quality.
REPAIR_POLICIES = repair_policies(ablations=False)
# The warm-up request's system prompt: not the measured one (SYSTEM_PROMPTS[0]).
WARM_SYSTEM = prompt_formats.SYSTEM_PROMPTS[2]


def packed_prompt(tokenizer: Any, target_tokens: int, seed: int) -> tuple[str, list[int], int]:
    """(text, offsets, n_tokens): paragraphs of consecutive HotpotQA examples up to ``target_tokens``."""
    data = assets.load_data("hotpotqa")
    rng = random.Random(seed)
    start = rng.randrange(len(data) - 200)
    system, question = prompt_formats.SYSTEM_PROMPTS[0], prompt_formats.question_text(data[start]["question"])
    docs: list[str] = []
    used = prompt_formats.token_count(tokenizer, system + question, special=True)
    for example in data[start:]:
        for doc in rag_documents.hotpotqa_paragraphs(example):
            n = prompt_formats.token_count(tokenizer, doc) + 1
            if used + n > target_tokens:
                text, offsets = prompt_formats.marked_text(system, docs, question)
                return text, offsets, used
            docs.append(doc)
            used += n
    raise RuntimeError("ran out of HotpotQA paragraphs")


def run(args: argparse.Namespace) -> dict:
    """Every (policy, anchor ratio) on warm chunks at each prompt length, interleaved over rounds."""
    tokenizer = common.tokenizer(args)
    configs = [("full", None), ("pic", None)] + [(p, r) for p in REPAIR_POLICIES for r in args.anchor_ratios]
    results = []
    with common.bench_client(args, BENCH) as client:
        for length in args.lengths:
            text, offsets, n_tokens = packed_prompt(tokenizer, length, seed=length)
            client.flush()
            common.warm_chunks(client, prompt_formats.chunk_texts(text, offsets), WARM_SYSTEM)
            samples = {c: [] for c in configs}
            records = {}
            order = list(configs)
            rng = random.Random(length)
            for _ in tqdm(range(args.rounds), desc=f"{BENCH} {length} tokens", unit="round"):
                rng.shuffle(order)
                for policy, ratio in order:
                    out = client.generate(text, offsets, policy, max_new_tokens=1, anchor_ratio=ratio,
                                          context_ratio=args.context_ratio)
                    samples[(policy, ratio)].append(out["client_latency_s"])
                    records[(policy, ratio)] = common.relaxkv_report(out)
            full_median = statistics.median(samples[("full", None)])
            for (policy, ratio), values in samples.items():
                rec = records[(policy, ratio)]
                results.append({
                    "prompt_tokens": n_tokens, "target_tokens": length, "policy": policy, "anchor_ratio": ratio,
                    "context_ratio": args.context_ratio if policy == "relaxkv" else (1.0 if ratio else None),
                    "ttft_median_s": statistics.median(values), "ttft_s": values,
                    "speedup_vs_full": full_median / statistics.median(values),
                    "repair_kv_pairs": rec.get("repair_kv_pairs"),
                    "repair_kv_pairs_executed": rec.get("repair_kv_pairs_executed"),
                    "chunks_hit": rec.get("chunks_hit"), "chunks_seen": rec.get("chunks_seen"),
                })
    return {"results": results}


def print_table(results: list[dict]) -> None:
    """The results as a plain-text table, one row per (prompt length, policy, anchor ratio)."""
    columns = [tables.right("tokens", 7), tables.left("", 1), tables.left("policy", 11), tables.right("anchors", 8),
               tables.right("TTFT p50 s", 12), tables.right("vs full", 9), tables.right("repair KV pairs", 17),
               tables.right("executed", 14)]
    print()
    tables.print_text_table(columns, [
        [str(r["prompt_tokens"]), "", r["policy"], common.fmt(r["anchor_ratio"], ".0%"), f"{r['ttft_median_s']:.3f}",
         f"{r['speedup_vs_full']:.1f}x", common.fmt(r["repair_kv_pairs"], ","),
         common.fmt(r.get("repair_kv_pairs_executed"), ",")] for r in results])


def plot(results: list[dict], path: pathlib.Path) -> None:
    """TTFT median against anchor ratio, one panel per prompt length, full and pic as lines."""
    plt = common.pyplot()
    lengths = sorted({r["prompt_tokens"] for r in results})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        rows = [r for r in results if r["prompt_tokens"] == length]
        for baseline, style in (("full", "k--"), ("pic", "k:")):
            value = next(r["ttft_median_s"] for r in rows if r["policy"] == baseline)
            ax.axhline(value, linestyle=style[1:], color=style[0], label=baseline)
        for policy in REPAIR_POLICIES:
            pts = sorted((r["anchor_ratio"], r["ttft_median_s"]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_title(f"{length} prompt tokens")
        ax.set_xlabel("anchor ratio (%)")
        ax.set_ylabel("TTFT median (s)")
        ax.set_ylim(bottom=0)
    axes[0][0].legend()
    fig.tight_layout()
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_ttft``: parse the flags, measure, print, write the JSON and the plot."""
    parser = common.bench_parser(BENCH, __doc__, quick_help="1.5K and 6K tokens, 15%% anchors, 2 rounds")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1500, 3000, 6000])
    parser.add_argument("--anchor-ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    parser.add_argument("--context-ratio", type=float, default=CONTEXT_RATIO.default,
                        help=f"relaxkv's context ratio (default: the server's, {CONTEXT_RATIO.default})")
    parser.add_argument("--rounds", type=int, default=3)
    args = common.parse_args(parser, argv, quick={"lengths": [1500, 6000], "anchor_ratios": [0.15], "rounds": 2})
    common.run_bench(BENCH, args, run, report=lambda result: print_table(result["results"]),
                     plot=lambda result, path: plot(result["results"], path))


if __name__ == "__main__":
    main()
