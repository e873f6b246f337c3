"""``make bench``: run the three benchmarks against one server and rewrite the result tables.

Results (JSON + PNG) go to ``docs/results/``; the tables between the
``<!-- bench:results -->`` markers of README.md and docs/performance.md are
regenerated from those files, so the documents show exactly what the run
printed. ``--quick`` uses each benchmark's quick size; ``--tables-only``
rewrites the tables from the JSON files already there.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
BENCHES = ("bench_cache_hit", "bench_ttft", "bench_quality", "bench_scaling")


def run_benchmarks(quick: bool, url: str | None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RELAXKV_RESULTS=str(RESULTS))
    for bench in BENCHES:
        cmd = [sys.executable, "-m", f"benchmarks.{bench}", "--output", str(RESULTS / f"{bench}.json")]
        if quick:
            cmd.append("--quick")
        if url and bench != "bench_scaling":
            cmd += ["--url", url]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def _load(bench: str) -> dict | None:
    path = RESULTS / f"{bench}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _command(result: dict) -> str:
    args = result["args"]
    flags = " --quick" if args.get("quick") else ""
    return f"python -m benchmarks.{result['bench']}{flags}"


def _caption(result: dict) -> str:
    m = result["machine"]
    return (f"`{_command(result)}` · model {result['args']['model']} · {m['cpus']} CPU cores, "
            f"{m['platform'].split('-with-')[0]} · {m['date'][:10]}")


def cache_hit_table(result: dict) -> str:
    w = result["workload"]
    lines = [f"**Cache hit rate** ({w['requests']} requests, {w['clients']} concurrent clients, {w['k']} of "
             f"{w['pool']} {w['source']} documents per request, Zipf s={w['zipf']}). {_caption(result)}", "",
             "| policy | hit rate | from radix prefix | from chunks | best possible | TTFT mean s | TTFT p90 s | req/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['policy']} | {r['cache_hit_rate_pct']:.1f}% | {r['prefix_hit_rate_pct']:.1f}% | "
                     f"{r['chunk_hit_rate_pct']:.1f}% | {r['best_possible_hit_rate_pct']:.1f}% | "
                     f"{r['ttft_s']['mean']:.2f} | {r['ttft_s']['p90']:.2f} | {r['requests_per_s']:.2f} |")
    return "\n".join(lines)


def ttft_table(result: dict) -> str:
    lines = [f"**Time to first token**, warm chunks, median of {result['args']['rounds']} interleaved rounds; "
             f"relaxkv context ratio {result['args']['context_ratio']}. {_caption(result)}", "",
             "| prompt tokens | policy | anchors | TTFT median s | speed-up vs full | repair KV pairs |",
             "|---|---|---|---|---|---|"]
    for r in result["results"]:
        ratio = f"{r['anchor_ratio']:.0%}" if r["anchor_ratio"] is not None else "-"
        work = f"{r['repair_kv_pairs']:,}" if r["repair_kv_pairs"] is not None else "-"
        lines.append(f"| {r['prompt_tokens']} | {r['policy']} | {ratio} | {r['ttft_median_s']:.3f} | "
                     f"{r['speedup_vs_full']:.1f}x | {work} |")
    return "\n".join(lines)


def quality_table(result: dict) -> str:
    a = result["args"]
    lines = [f"**Fidelity to full prefill** on HotpotQA dev {a['offset']}-{a['offset'] + a['examples'] - 1} "
             f"(10 paragraphs as chunks), anchor ratio {a['anchor_ratio']}, relaxkv context ratio "
             f"{a['context_ratio']}; [95% bootstrap CI]. {_caption(result)}", "",
             "| policy | answer F1 to full | exact agreement | first-token KL | gold F1 | anchor ratio | context ratio |",
             "|---|---|---|---|---|---|---|"]
    for policy, s in result["summary"].items():
        f1_lo, f1_hi = s["f1_to_full_ci95"]
        kl_lo, kl_hi = s["kl_first_token_ci95"]
        anchors = f"{s['anchor_ratio']:.3f}" if s["anchor_ratio"] is not None else "-"
        ctx = f"{s['context_ratio']:.2f}" if s["context_ratio"] is not None else "-"
        lines.append(f"| {policy} | {s['f1_to_full']:.3f} [{f1_lo:.2f}, {f1_hi:.2f}] | {s['exact_to_full']:.3f} | "
                     f"{s['kl_first_token']:.3f} [{kl_lo:.2f}, {kl_hi:.2f}] | {s['gold_f1']:.3f} | {anchors} | {ctx} |")
    return "\n".join(lines)


def scaling_table(result: dict) -> str:
    lines = [f"**Cost scaling** (core API on SmolLM2-shaped KV: 30 layers, 3 KV heads; 15% anchors; medians). "
             f"{_caption(result)}", "",
             "| prompt tokens | chunks | lookup ms | re-rotation ms | selection ms | repair attn relaxed 25% ms "
             "| repair attn full ctx ms | KV pairs relaxed / full |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['prompt_tokens']} | {r['chunks']} | {r['lookup_s'] * 1e3:.2f} | {r['rerotation_s'] * 1e3:.1f} | "
                     f"{r['selection_s'] * 1e3:.1f} | {r['repair_attention_relaxed_s'] * 1e3:.1f} | "
                     f"{r['repair_attention_full_s'] * 1e3:.1f} | {r['kv_pairs_relaxed'] / r['kv_pairs_full']:.2f} |")
    return "\n".join(lines)


def tables() -> str:
    parts = []
    for bench, render in (("bench_cache_hit", cache_hit_table), ("bench_ttft", ttft_table),
                          ("bench_quality", quality_table), ("bench_scaling", scaling_table)):
        result = _load(bench)
        if result is not None:
            parts.append(render(result))
            png = RESULTS / f"{bench}.png"
            if png.is_file():
                parts.append(f"![{bench}](docs/results/{bench}.png)")
    return "\n\n".join(parts) if parts else "(no benchmark run recorded yet)"


def rewrite(path: pathlib.Path, body: str, link_prefix: str = "") -> None:
    text = path.read_text()
    body = body.replace("](docs/results/", f"]({link_prefix}results/") if link_prefix else body
    new = re.sub(r"(<!-- bench:results -->\n).*?(\n<!-- /bench:results -->)", lambda m: m.group(1) + body + m.group(2),
                 text, flags=re.S)
    path.write_text(new)
    print(f"tables rewritten in {path.relative_to(ROOT)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--url", default=None, help="measure a running server instead of starting one per benchmark")
    parser.add_argument("--tables-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.tables_only:
        run_benchmarks(args.quick, args.url)
    body = tables()
    rewrite(ROOT / "README.md", body)
    rewrite(ROOT / "docs" / "performance.md", body, link_prefix="./")
    print(body)


if __name__ == "__main__":
    main()
