"""Chunk discovery's CPU time per request: what an unmarked prompt costs the HTTP process.

For each prompt shape RAG frameworks send (:data:`SHAPES`: LangChain's blank lines, LlamaIndex's
text-QA template, a ``[n]`` list, a chat system message) the benchmark builds a trace of
``--requests`` unmarked prompts of about ``--tokens`` tokens (``--model``'s tokenizer), each holding
as many HotpotQA paragraphs as fill that budget, drawn from a pool of ``--pool`` paragraphs, so
later prompts hold documents earlier ones held, in other orders. Every prompt goes through exactly what
``srt/api.py::plan_item`` adds for an unmarked prompt (``core.doc_index.discover_chunks`` against
the process's :class:`~relaxkv_sglang.core.doc_index.DocumentIndex`, then ``remember`` of the chunks
found) and, for the chat shape, with its two messages as regions. The time is the process's CPU
time per request (``time.process_time``), median and 95th percentile over the trace after a warm-up
pass that fills the index; the share of each prompt's documents found whole is reported beside
it. Tokenization is not included (the native path tokenizes each part whether or not it
discovers them).

    python -m benchmarks.bench_discovery            # ~8K-token prompts, 200 requests per shape
    python -m benchmarks.bench_discovery --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import zlib
from typing import Any, Callable, Optional, Sequence

from benchmarks import common, workloads
from benchmarks.tables import markdown_table
from relaxkv_sglang.core.doc_index import DocumentIndex, discover_chunks

BENCH = "bench_discovery"
SYSTEM = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context to "
          "answer the question. If you don't know the answer, say that you don't know.")


def _langchain(docs: Sequence[str], q: str) -> tuple[str, Optional[list[tuple[int, int]]]]:
    return SYSTEM + "\n\n" + "\n\n".join(docs) + "\n\nQuestion: " + q, None


def _llamaindex(docs: Sequence[str], q: str) -> tuple[str, Optional[list[tuple[int, int]]]]:
    body = "\n\n".join(f"file_path: /data/{zlib.crc32(d.encode())}.txt\n\n{d}" for d in docs)
    return ("Context information is below.\n---------------------\n" + body + "\n---------------------\n"
            "Given the context information and not prior knowledge, answer the query.\nQuery: " + q + "\nAnswer: "), None


def _numbered(docs: Sequence[str], q: str) -> tuple[str, Optional[list[tuple[int, int]]]]:
    return "Documents:\n" + "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(docs)) + "\n\nQuestion: " + q, None


def _chat(docs: Sequence[str], q: str) -> tuple[str, Optional[list[tuple[int, int]]]]:
    system = SYSTEM + "\n\n" + "\n\n".join(docs)
    text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    s, u = text.index(system), text.rindex(q)
    return text, [(s, s + len(system)), (u, u + len(q))]


SHAPES: dict[str, Callable[[Sequence[str], str], tuple[str, Optional[list[tuple[int, int]]]]]] = {
    "langchain (blank lines)": _langchain, "llamaindex (text-QA)": _llamaindex, "[n] list": _numbered,
    "chat (regions)": _chat,
}


def build_trace(pool: list[str], tokens_of: Callable[[str], int], tokens: int, n: int, seed: int) -> list[list[str]]:
    """``n`` retrievals: documents drawn from ``pool`` until the prompt holds about ``tokens`` tokens."""
    rng = random.Random(seed)
    trace = []
    for _ in range(n):
        docs, total = [], 0
        for d in rng.sample(pool, len(pool)):
            if total + tokens_of(d) > tokens:
                break
            docs.append(d)
            total += tokens_of(d)
        trace.append(docs)
    return trace


def measure(shape: str, trace: list[list[str]], tokens_of: Callable[[str], int]) -> dict[str, Any]:
    """Warm-up pass (fills the index), then the timed pass: CPU ms per request and documents found."""
    make = SHAPES[shape]
    index = DocumentIndex()
    prompts = [make(docs, f"question {i}?") for i, docs in enumerate(trace)]
    for text, regions in prompts:
        index.remember(None, [text[s:e] for s, e in discover_chunks(text, index, None, regions=regions)])
    times, found_share = [], []
    for (text, regions), docs in zip(prompts, trace):
        t0 = time.process_time()
        spans = discover_chunks(text, index, None, regions=regions)
        index.remember(None, [text[s:e] for s, e in spans])
        times.append((time.process_time() - t0) * 1000)
        chunks = {text[s:e] for s, e in spans}
        found_share.append(sum(d in chunks for d in docs) / len(docs))
    times.sort()
    return {"shape": shape, "requests": len(trace), "prompt_tokens": statistics.mean(
                tokens_of(text) for text, _ in prompts[:20]),
            "prompt_chars": statistics.mean(len(text) for text, _ in prompts),
            "docs_per_prompt": statistics.mean(len(d) for d in trace), "index_docs": len(index),
            "cpu_ms_median": statistics.median(times), "cpu_ms_p95": times[int(0.95 * (len(times) - 1))],
            "docs_found": statistics.mean(found_share)}


def run(args: argparse.Namespace) -> dict:
    """Every shape over the same trace."""
    tok = common.tokenizer(args)
    cache: dict[str, int] = {}

    def tokens_of(text: str) -> int:
        """Tokens of ``text`` (memoised per document)."""
        if text not in cache:
            cache[text] = len(tok.encode(text, add_special_tokens=False))
        return cache[text]

    pool = workloads.document_pool("hotpotqa", args.pool, seed=args.seed)
    trace = build_trace(pool, tokens_of, args.tokens, args.requests, args.seed)
    return {"rows": [measure(shape, trace, tokens_of) for shape in SHAPES]}


def report(result: dict) -> None:
    """One row per shape."""
    rows = [[r["shape"], f"{r['prompt_tokens']:,.0f}", f"{r['docs_per_prompt']:.0f}", f"{r['index_docs']:,}",
             f"{r['cpu_ms_median']:.2f}", f"{r['cpu_ms_p95']:.2f}", f"{r['docs_found']:.0%}"] for r in result["rows"]]
    print("\n".join(markdown_table(["shape", "prompt tokens", "docs", "index docs", "CPU ms median", "CPU ms p95",
                          "docs found whole"], rows)))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = common.bench_parser(BENCH, __doc__, server=False, quick_help="2K-token prompts, 40 requests")
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer sizes the prompts")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt size in tokens")
    parser.add_argument("--requests", type=int, default=200, help="requests per shape")
    parser.add_argument("--pool", type=int, default=600, help="distinct HotpotQA paragraphs the trace draws from")
    parser.add_argument("--seed", type=int, default=0)
    args = common.parse_args(parser, argv, quick={"tokens": 2048, "requests": 40})
    common.run_bench(BENCH, args, run, report=report)


if __name__ == "__main__":
    main()
