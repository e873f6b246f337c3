"""Every policy on one server through SGLang's own load generator: ``sglang.bench_serving`` on the RAG trace.

For each policy this writes :mod:`benchmarks.rag_dataset`'s rows of one trace (the same
requests, the same order; the policy and its knobs in each row's ``custom_params``, which
``bench_serving``'s ``openai`` dataset passes through in the request body), then runs
``python -m sglang.bench_serving --backend sglang-oai-chat --flush-cache --cache-report`` against
the server. Policies run one after another on the same server, the cache flushed before each
(``bench_serving`` flushes after its warm-up request). Reported per policy, as ``bench_serving``
measures them: request throughput, TTFT p50/p99, the hit rate (cached over prompt tokens, from
the server's usage), and each throughput and TTFT as a ratio to ``pic``'s in the same run::

    python -m benchmarks.bench_serving_rag                       # 100 requests, 4 clients, 6 policies
    python -m benchmarks.bench_serving_rag --quick --policies pic relaxkv

Policies are named as in ``bench_cache_hit`` (``relaxkv@auto``: ``relaxkv_budget`` auto); a repair
policy without a budget gets ``--anchor-ratio``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from benchmarks import common, rag_dataset, tables
from benchmarks.replay import add_trace_args, check_trace_args, make_trace, trace_words, trace_workload

BENCH = "bench_serving_rag"
POLICIES = ["full", "prefix", "pic", "relaxkv", "prophetkv", "relaxkv@auto"]
BENCH_SERVING_TIMEOUT_S = 3600


def bench_serving_command(url: str, dataset: pathlib.Path, tokenizer: pathlib.Path, model: str, requests: int,
                          clients: int, output: pathlib.Path) -> list[str]:
    """The ``bench_serving`` run of one policy's dataset (its result appended to ``output``, one JSON line)."""
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang-oai-chat", "--base-url", url,
            "--dataset-name", "openai", "--dataset-path", str(dataset), "--num-prompts", str(requests),
            "--max-concurrency", str(clients), "--tokenizer", str(tokenizer), "--model", model,
            "--flush-cache", "--cache-report", "--output-file", str(output), "--disable-tqdm"]


def policy_row(policy: str, result: dict, sent: int) -> dict:
    """The figures of ``bench_serving``'s result line for ``policy`` (RuntimeError unless all ``sent`` completed)."""
    if result.get("completed") != sent:
        raise RuntimeError(f"bench_serving completed {result.get('completed')} of the {sent} {policy} requests")
    report = result.get("cache_report") or {}
    return {"policy": policy, "requests": result["completed"],
            "requests_per_s": result["request_throughput"],
            "ttft_ms": {"mean": result["mean_ttft_ms"], "p50": result["median_ttft_ms"], "p99": result["p99_ttft_ms"]},
            "prompt_tokens": report.get("total_prompt_tokens"), "cached_tokens": report.get("total_cached_tokens"),
            "cache_hit_rate_pct": report.get("cache_hit_rate_pct")}


def add_ratios(rows: list[dict], baseline: str = "pic") -> None:
    """Each row's throughput and TTFT p50 over ``baseline``'s of the same run (None without it)."""
    base = next((r for r in rows if r["policy"] == baseline), None)
    for r in rows:
        r["throughput_vs_pic"] = r["requests_per_s"] / base["requests_per_s"] if base else None
        r["ttft_p50_vs_pic"] = r["ttft_ms"]["p50"] / base["ttft_ms"]["p50"] if base else None


def policy_params(args: argparse.Namespace) -> dict[str, dict]:
    """Each of ``args.policies``' ``custom_params`` as the server takes them (ValueError naming the field)."""
    return {p: rag_dataset.check_params(rag_dataset.policy_params(p, args.anchor_ratio)) for p in args.policies}


def run(args: argparse.Namespace) -> dict:
    """Every policy's dataset through ``bench_serving`` against one server; a row per policy."""
    trace, params = make_trace(args), policy_params(args)
    model = common.model_dir(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"{BENCH}-") as tmp, \
            common.bench_client(args, BENCH, extra_args=["--enable-cache-report"]) as client:
        work = pathlib.Path(tmp)
        tokenizer = work / "tokenizer"
        rag_dataset.write_bench_tokenizer(model, tokenizer)
        for policy in args.policies:
            dataset, output = work / f"{policy}.jsonl", work / f"{policy}.result.jsonl"
            rag_dataset.write_dataset(dataset, trace, args.max_new_tokens, params[policy])
            command = bench_serving_command(client.url, dataset, tokenizer, str(model), len(trace), args.clients,
                                            output)
            print(f"{BENCH}: {policy} through bench_serving", file=sys.stderr, flush=True)
            done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_SERVING_TIMEOUT_S)
            if done.returncode != 0 or not output.is_file():
                last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"bench_serving failed for {policy} (exit {done.returncode}): {last}")
            rows.append(policy_row(policy, json.loads(output.read_text().splitlines()[-1]), len(trace)))
    add_ratios(rows)
    return {"workload": {**trace_workload(args), "anchor_ratio": args.anchor_ratio, "max_new_tokens": args.max_new_tokens,
                         "kv_pool_tokens": None if args.url else args.max_total_tokens},
            "results": rows}


def print_table(result: dict) -> None:
    """One row per policy, as bench_serving measured it."""
    w = result["workload"]
    print(f"\nbench_serving, {w['requests']} requests, {w['clients']} clients, {trace_words(w)}; "
          f"repair policies at {w['anchor_ratio']:.0%} anchors unless a budget is named")
    columns = [tables.left("policy", 13), tables.right("req/s", 7), tables.right("vs pic", 7),
               tables.right("TTFT p50 ms", 12), tables.right("p99 ms", 8), tables.right("vs pic", 7),
               tables.right("hit rate", 9)]
    rows = [[r["policy"], f"{r['requests_per_s']:.2f}", common.fmt(r["throughput_vs_pic"], ".2f"),
             f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p99']:.0f}", common.fmt(r["ttft_p50_vs_pic"], ".2f"),
             common.fmt(r["cache_hit_rate_pct"], ".1f") + "%"] for r in result["results"]]
    tables.print_text_table(columns, rows)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_serving_rag``: parse the flags, measure, print, write the JSON."""
    parser = common.bench_parser(BENCH, __doc__, quick_help="30 requests, 2 clients")
    add_trace_args(parser)
    parser.add_argument("--clients", type=int, default=4, help="bench_serving's --max-concurrency")
    parser.add_argument("--anchor-ratio", type=float, default=0.15)
    parser.add_argument("--policies", nargs="+", default=POLICIES,
                        help="as bench_cache_hit names them ('<policy>@auto': relaxkv_budget auto)")
    args = common.parse_args(parser, argv, quick={"requests": 30, "clients": 2})
    check_trace_args(BENCH, args)
    if args.clients < 1 or args.requests < 1:
        common.fail(BENCH, "--clients and --requests must be >= 1")
    try:  # every policy's fields checked before the server starts
        policy_params(args)
    except ValueError as exc:
        common.fail(BENCH, f"--policies: {exc}")
    common.run_bench(BENCH, args, run, report=print_table)


if __name__ == "__main__":
    main()
