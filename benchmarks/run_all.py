"""``make bench``: run the four benchmarks (each starts its server, or all use ``--url``) and rewrite the tables.

Results (JSON + PNG) go to ``docs/results/``; the tables between the
``<!-- bench:results -->`` markers of docs/performance.md are
regenerated from those files, so the page shows exactly what the run printed
(the README quotes its headline figures from that page). ``--quick`` uses each benchmark's quick size; ``--tables-only``
rewrites the tables from the JSON files already there. Each benchmark's wall
time (its whole command, server start included) is written into its JSON
(``wall_s``, shown in the table caption) and into ``run_times.json``, which
keeps the latest quick and full run of each, so the documents show both sizes'
run times.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

from benchmarks.common import fmt
from benchmarks.tables import markdown_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
BENCHES = ("bench_cache_hit", "bench_ttft", "bench_quality", "bench_scaling")
RUN_TIMES = RESULTS / "run_times.json"


def run_benchmarks(quick: bool, url: str | None, benches=BENCHES) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RELAXKV_RESULTS=str(RESULTS))
    for bench in benches:
        cmd = [sys.executable, "-m", f"benchmarks.{bench}", "--output", str(RESULTS / f"{bench}.json")]
        if quick:
            cmd.append("--quick")
        if url and bench != "bench_scaling":
            cmd += ["--url", url]
        print("$", " ".join(cmd[2:]), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        record_wall_time(bench, time.perf_counter() - start, quick)


def record_wall_time(bench: str, wall_s: float, quick: bool) -> None:
    """Write a finished benchmark's wall time into its JSON and into ``run_times.json`` (per size)."""
    path = RESULTS / f"{bench}.json"
    result = json.loads(path.read_text())
    result["wall_s"] = wall_s
    path.write_text(json.dumps(result, indent=1))
    times = json.loads(RUN_TIMES.read_text()) if RUN_TIMES.is_file() else {}
    times.setdefault(bench, {})["quick" if quick else "full"] = {"wall_s": wall_s, "date": result["machine"]["date"]}
    RUN_TIMES.write_text(json.dumps(times, indent=1))


def _load(bench: str) -> dict | None:
    path = RESULTS / f"{bench}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _command(result: dict) -> str:
    args = result["args"]
    flags = " --quick" if args.get("quick") else ""
    return f"python -m benchmarks.{result['bench']}{flags}"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _caption(result: dict) -> str:
    m = result["machine"]
    ran = f" · ran in {_duration(result['wall_s'])}" if result.get("wall_s") is not None else ""
    model = f" · model {result['args']['model']}" if result["args"].get("model") else ""  # bench_scaling has none
    return (f"`{_command(result)}`{model} · {m['cpus']} CPU cores, "
            f"{m['platform'].split('-with-')[0]} · {m['date'][:10]}{ran}")


def cache_hit_table(result: dict) -> str:
    w = result["workload"]
    pool = f", KV pool {w['kv_pool_tokens']} tokens" if w.get("kv_pool_tokens") else ""
    lines = [f"**Cache hit rate** ({w['requests']} requests, {w['clients']} concurrent clients, {w['k']} of "
             f"{w['pool']} {w['source']} documents per request, Zipf s={w['zipf']}{pool}). Lost to evictions: "
             f"document tokens computed by an earlier request but missed (a lower bound). {_caption(result)}", ""]
    rows = []
    for r in result["results"]:
        lost = f"{r['lost_to_evictions_pct']:.1f}%" if r.get("lost_to_evictions_pct") is not None else "-"
        rows.append([r["policy"]] + [f"{r[k]:.1f}%" for k in ("cache_hit_rate_pct", "prefix_hit_rate_pct",
                                                              "chunk_hit_rate_pct", "best_possible_hit_rate_pct")]
                    + [str(r["chunk_evictions"]), lost, f"{r['ttft_s']['mean']:.2f}", f"{r['ttft_s']['p90']:.2f}",
                       f"{r['requests_per_s']:.2f}"])
    lines += markdown_table(["policy", "hit rate", "from radix prefix", "from chunks", "best possible", "evictions",
                             "lost to evictions", "TTFT mean s", "TTFT p90 s", "req/s"], rows)
    return "\n".join(lines)


def ttft_table(result: dict) -> str:
    lines = [f"**Time to first token**, warm chunks, median of {result['args']['rounds']} interleaved rounds; "
             f"relaxkv context ratio {result['args']['context_ratio']}. {_caption(result)}", ""]
    lines += markdown_table(
        ["prompt tokens", "policy", "anchors", "TTFT median s", "speed-up vs full", "repair KV pairs attended",
         "executed (CPU)"],
        [[str(r["prompt_tokens"]), r["policy"], fmt(r["anchor_ratio"], ".0%"), f"{r['ttft_median_s']:.3f}",
          f"{r['speedup_vs_full']:.1f}x", fmt(r["repair_kv_pairs"], ","), fmt(r.get("repair_kv_pairs_executed"), ",")]
         for r in result["results"]])
    return "\n".join(lines)


TASK_LABELS = {"hotpotqa": "HotpotQA", "squad": "SQuAD multi-doc", "niah_multivalue": "NIAH multi-value",
               "variable_tracking": "variable tracking"}


def quality_table(result: dict) -> str:
    """The headline quality table (formats pooled, at the ratio closest to 15%) and the anchor-ratio sweep.

    A result with several prompt formats shows their pooled cells (format ``"all"``); one with
    ``paired`` comparisons adds the paired KL difference to its reference policy.
    """
    a = result["args"]
    summary = [s for s in result["summary"] if s.get("format", "all") == "all"]  # older results: no format
    ratios = sorted({s["anchor_ratio"] for s in summary if s["anchor_ratio"] is not None})
    head = min(ratios, key=lambda r: abs(r - 0.15)) if ratios else None
    tasks = list(result["tasks"])
    cell = {(s["task"], s["policy"], s["anchor_ratio"]): s for s in summary}
    policies = list(dict.fromkeys(s["policy"] for s in summary))
    paired = {p["policy"]: p for p in result.get("paired", [])
              if (p["format"], p["task"], p["anchor_ratio"]) == ("all", "all", head)}
    versus = result.get("versus")
    what = ", ".join(f"{TASK_LABELS.get(t, t)} {i['examples']}" for t, i in result["tasks"].items())
    at = f" at {head:.0%} anchors," if head is not None else ""
    formats = result.get("formats", ["plain"])
    split = result.get("split", {}).get("name", "dev")
    lines = [f"**Quality and fidelity to full prefill**{at} relaxkv context ratio "
             f"{a['context_ratio']}; examples per task: {what} ({split} split: HotpotQA dev from {a['offset']}, "
             f"the others seed {a['seed']}); 10 chunks each; prompt format{'s' if len(formats) > 1 else ''} "
             f"{', '.join(formats)}{' (pooled)' if len(formats) > 1 else ''}"
             f"{'; one answer token (--kl-only): no task scores' if result.get('kl_only') else ''}. "
             f"Pooled: mean over all examples [95% bootstrap CI]; per task: "
             f"first-token KL to full (lower is better) / task score (QA F1 or RULER string match). "
             + (f"Paired: per-example KL difference to {versus} [95% paired bootstrap CI], wins/ties/losses. "
                if paired else "")
             + _caption(result), ""]
    rows = []
    for policy in policies:
        ratio = None if cell.get(("all", policy, None)) else head
        pooled = cell[("all", policy, ratio)]
        lo, hi = pooled["kl_first_token_ci95"]
        row = [policy, f"{pooled['kl_first_token']:.3f} [{lo:.2f}, {hi:.2f}]", fmt(pooled["exact_to_full"], ".3f")]
        row += [f"{c['kl_first_token']:.3f} / {fmt(c['score'], '.2f')}" for c in (cell[(t, policy, ratio)] for t in tasks)]
        row.append(f"{pooled['ttft_median_s']:.2f}")
        if paired:
            p = paired.get(policy)  # none for full and for the reference itself
            if p and p["diff_ci95"]:
                d_lo, d_hi = p["diff_ci95"]
                row += [f"{p['diff']:+.3f} [{d_lo:+.3f}, {d_hi:+.3f}]", f"{p['wins']}/{p['ties']}/{p['losses']}"]
            else:
                row += ["-", "-"]
        rows.append(row)
    lines += markdown_table(["policy", "KL to full, pooled", "agreement with full"]
                            + [TASK_LABELS.get(t, t) for t in tasks] + ["TTFT median s"]
                            + ([f"KL − {versus}, paired", "W/T/L"] if paired else []), rows)
    if len(ratios) > 1:
        lines += ["", "**Anchor-ratio sweep**, all tasks pooled: first-token KL to full / TTFT median s. "
                  + "; ".join(f"{p}: {cell[('all', p, None)]['kl_first_token']:.3f} / "
                              f"{cell[('all', p, None)]['ttft_median_s']:.2f}"
                              for p in policies if ("all", p, None) in cell) + ".", ""]
        lines += markdown_table(["policy"] + [f"{r:.0%}" for r in ratios], [
            [policy] + [f"{cell[('all', policy, r)]['kl_first_token']:.3f} / {cell[('all', policy, r)]['ttft_median_s']:.2f}"
                        for r in ratios] for policy in policies if ("all", policy, None) not in cell])
    return "\n".join(lines)


def scaling_table(result: dict) -> str:
    rows = result["results"]
    gpu = all("gpu_inputs_s" in r for r in rows)  # results from before the column have none
    lines = [f"**Cost scaling** (core API on SmolLM2-shaped KV: 30 layers, 3 KV heads; 15% anchors; medians). "
             f"{_caption(result)}", ""]
    lines += markdown_table(
        ["prompt tokens", "chunks", "lookup ms", "re-rotation ms", "selection ms", "repair attn relaxed 25% ms",
         "repair attn full ctx ms", "KV pairs relaxed / full"] + (["GPU anchor inputs (host) ms"] if gpu else []),
        [[str(r["prompt_tokens"]), str(r["chunks"]), f"{r['lookup_s'] * 1e3:.2f}", f"{r['rerotation_s'] * 1e3:.1f}",
          f"{r['selection_s'] * 1e3:.1f}", f"{r['repair_attention_relaxed_s'] * 1e3:.1f}",
          f"{r['repair_attention_full_s'] * 1e3:.1f}", f"{r['kv_pairs_relaxed'] / r['kv_pairs_full']:.2f}"]
         + ([f"{r['gpu_inputs_s'] * 1e3:.1f}"] if gpu else []) for r in rows])
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
    if RUN_TIMES.is_file():
        parts.append(run_times_table(json.loads(RUN_TIMES.read_text())))
    return "\n\n".join(parts) if parts else "(no benchmark run recorded yet)"


def run_times_table(times: dict) -> str:
    """The latest recorded wall time of each benchmark at each size (whole command, server start included)."""
    rows = [[bench] + [f"{_duration(sizes[size]['wall_s'])} ({sizes[size]['date'][:10]})" if size in sizes
                       else "not recorded" for size in ("quick", "full")]
            for bench, sizes in ((bench, times.get(bench, {})) for bench in BENCHES)]
    return "\n".join(["**Run times** (`make bench-quick` / `make bench`, whole command including the server's start):", ""]
                     + markdown_table(["benchmark", "quick size", "full size"], rows))


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
    parser.add_argument("--benches", nargs="+", choices=BENCHES, default=list(BENCHES),
                        help="run only these (the tables still show every recorded result)")
    args = parser.parse_args(argv)
    if not args.tables_only:
        run_benchmarks(args.quick, args.url, args.benches)
    body = tables()
    rewrite(ROOT / "docs" / "performance.md", body, link_prefix="./")
    print(body)


if __name__ == "__main__":
    main()
