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
import random
import statistics

from tqdm import tqdm

from benchmarks.common import add_server_args, fail, pyplot, save_plot, server_url, write_result
from relaxkv_sglang import assets, workloads
from relaxkv_sglang.client import ServerClient

BENCH = "bench_ttft"
REPAIR_POLICIES = ("epic", "cacheblend", "prophetkv", "relaxkv")


def packed_prompt(tokenizer, target_tokens: int, seed: int):
    """(text, offsets, n_tokens): paragraphs of consecutive HotpotQA examples up to ``target_tokens``."""
    data = assets.load_data("hotpotqa")
    rng = random.Random(seed)
    start = rng.randrange(len(data) - 200)
    system, question = workloads.SYSTEM_PROMPTS[0], workloads.question_text(data[start]["question"])
    docs, used = [], len(tokenizer.encode(system + question))
    for example in data[start:]:
        for title, sentences in example["context"]:
            doc = workloads.format_paragraph(title, sentences)
            n = len(tokenizer.encode(doc, add_special_tokens=False)) + 1
            if used + n > target_tokens:
                text, offsets = workloads.marked_text(system, docs, question)
                return text, offsets, used
            docs.append(doc)
            used += n
    raise RuntimeError("ran out of HotpotQA paragraphs")


def warm(client: ServerClient, text: str, offsets: list[int]) -> None:
    """Cache the prompt's chunks through a request with another system prompt and order."""
    docs = [text[s:e] for s, e in zip(offsets[::2], offsets[1::2])]
    w_text, w_offsets = workloads.marked_text(workloads.SYSTEM_PROMPTS[2], docs[::-1], "Question: ?")
    client.generate(w_text, w_offsets, "pic", max_new_tokens=1)


def run(args) -> dict:
    from transformers import AutoTokenizer

    model = str(assets.model_path(args.model)) if args.model in assets.MODELS else args.model
    tokenizer = AutoTokenizer.from_pretrained(model)
    configs = [("full", None), ("pic", None)] + [(p, r) for p in REPAIR_POLICIES for r in args.anchor_ratios]
    results = []
    with server_url(args, BENCH) as url:
        client = ServerClient(url)
        for length in args.lengths:
            text, offsets, n_tokens = packed_prompt(tokenizer, length, seed=length)
            client.flush()
            warm(client, text, offsets)
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
                    records[(policy, ratio)] = out["meta_info"].get("relaxkv") or {}
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
    head = f"{'tokens':>7} {'policy':<11}{'anchors':>8}{'TTFT p50 s':>12}{'vs full':>9}{'repair KV pairs':>17}"
    print("\n" + head)
    print("-" * len(head))
    for r in results:
        ratio = f"{r['anchor_ratio']:.0%}" if r["anchor_ratio"] is not None else "-"
        work = f"{r['repair_kv_pairs']:,}" if r["repair_kv_pairs"] is not None else "-"
        print(f"{r['prompt_tokens']:>7} {r['policy']:<11}{ratio:>8}{r['ttft_median_s']:>12.3f}"
              f"{r['speedup_vs_full']:>8.1f}x{work:>17}")


def plot(results: list[dict], path) -> None:
    plt = pyplot()
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
    save_plot(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ttft", description=__doc__.split("\n\n")[0])
    add_server_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1500, 3000, 6000])
    parser.add_argument("--anchor-ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    parser.add_argument("--context-ratio", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1.5K and 6K tokens, 15%% anchors, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.anchor_ratios, args.rounds = [1500, 6000], [0.15], 2
    try:
        result = run(args)
    except (RuntimeError, assets.AssetError) as exc:
        fail(BENCH, str(exc))
    print_table(result["results"])
    path = write_result(BENCH, args, result)
    plot(result["results"], path.with_suffix(".png"))


if __name__ == "__main__":
    main()
