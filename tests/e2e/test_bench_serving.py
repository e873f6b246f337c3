"""SGLang's own load generator sees chunk hits: ``sglang.bench_serving`` on the shipped RAG dataset.

``benchmarks.rag_dataset`` writes ``bench_cache_hit``'s trace as OpenAI chat rows (documents as
content parts, the policy in ``custom_params``); ``python -m sglang.bench_serving --backend
sglang-oai-chat --cache-report`` replays it and reports cached over prompt tokens from the
server's ``cached_tokens_details`` and ``usage``. Against the same server, flushed, that hit rate
must be within 2 points of ``bench_cache_hit``'s replay of the same trace through ``/generate``
(the chat template adds a few uncached tokens per request; nothing else differs). The tiny model,
a small trace; the SmolLM2 figure is in ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import rag_dataset, replay
from relaxkv_sglang.client import ServerClient

pytestmark = pytest.mark.e2e


@pytest.mark.long
def test_bench_serving_reports_the_hit_rate_bench_cache_hit_measures(relaxkv_server, tiny_model_path, tmp_path):
    args = argparse.Namespace(source="hotpotqa", pool=12, zipf=1.0, docs_per_request=3, topics=0, requests=16,
                              seed=3, max_new_tokens=2, anchor_ratio=None, pressure=False)
    trace = replay.make_trace(args)
    dataset, tokenizer = tmp_path / "rag.jsonl", tmp_path / "tokenizer"
    assert rag_dataset.write_dataset(dataset, trace, args.max_new_tokens, {"relaxkv_policy": "pic"}) == len(trace)
    rag_dataset.write_bench_tokenizer(pathlib.Path(tiny_model_path), tokenizer)

    # one client on each side: with several, a repeat sent while its documents' first request is
    # still in prefill misses, and where that happens is timing (it moved one side by 2.8 points)
    ours = replay.replay(ServerClient(relaxkv_server.url), trace, "pic", 1, args)
    assert ours["chunk_hit_rate_pct"] > 30  # the trace repeats documents: a test that can fail

    out = tmp_path / "bench_serving.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang-oai-chat", "--base-url", relaxkv_server.url,
         "--dataset-name", "openai", "--dataset-path", str(dataset), "--num-prompts", str(len(trace)),
         "--max-concurrency", "1", "--tokenizer", str(tokenizer), "--model", tiny_model_path,
         "--flush-cache", "--cache-report", "--output-file", str(out), "--disable-tqdm"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == len(trace), result
    report = result["cache_report"]
    print(f"bench_cache_hit {ours['cache_hit_rate_pct']:.1f}% vs bench_serving {report['cache_hit_rate_pct']:.1f}% "
          f"({report['total_cached_tokens']} of {report['total_prompt_tokens']} prompt tokens)")
    assert report["device_cached_tokens"] == report["total_cached_tokens"]
    assert abs(report["cache_hit_rate_pct"] - ours["cache_hit_rate_pct"]) <= 2.0, (report, ours["cache_hit_rate_pct"])
