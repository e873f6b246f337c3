"""Chunk discovery's CPU time per request: what an unmarked prompt costs the HTTP process.

For each prompt shape RAG frameworks send (:data:`SHAPES`: LangChain's blank lines, LlamaIndex's
text-QA template, a ``[n]`` list, a chat system message) the benchmark builds a trace of
``--requests`` unmarked prompts of about ``--tokens`` tokens (``--model``'s tokenizer), each holding
as many HotpotQA paragraphs as fill that budget, drawn from a pool of ``--pool`` paragraphs, so
later prompts hold documents earlier ones held, in other orders. Every prompt goes through exactly what
``request/sglang/api.py::plan_item`` adds for an unmarked prompt: its token boundaries (the tokenizer's offset
mapping, ``request/sglang/api.py::prompt_boundaries``: reported on their own, ``boundaries ms``), then
``core.doc_index.discover_chunks`` on them (``discovery ms``), for the chat shape with its two
messages as regions; with the opt-in index (``RELAXKV_DISCOVERY_INDEX=1``) also the search of the
:class:`~relaxkv_sglang.request.doc_index.DocumentIndex` and the ``remember`` of the chunks found,
after a warm-up pass that fills it. The time is the process's CPU time per request
(``time.process_time``), median and 95th percentile over the trace; beside it, the share of each
prompt's documents whose every token is in a chunk (``docs covered``: a chunk starts and ends on
a token boundary, so a document whose first word's token takes the space before it, as after a
``[n]`` marker, loses that word to the glue) and the share found whole.

Then the inputs that used to be slow (:data:`ADVERSARIAL`: a line of text then tags, which took
2.2 s at 24K characters in ``_TRAIL_TAGS.search``; lines of spaces, separators, markers, ...),
each built to ``--tokens`` tokens: discovery's CPU time (best of ``--repeats`` runs), per 8K
tokens (``worst ms per 8K tokens``, the figure issue 46 bounds by 5 ms), and the boundaries' time.

    python -m benchmarks.bench_discovery            # ~8K-token prompts, 200 requests per shape
    python -m benchmarks.bench_discovery --quick
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import time
import zlib
from typing import Any, Callable, Optional, Sequence

from benchmarks import common, rag_documents
from benchmarks.tables import markdown_table
from relaxkv_sglang.request.doc_index import DocumentIndex, discover_chunks
from relaxkv_sglang.request.sglang.api import prompt_boundaries

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


def measure(shape: str, trace: list[list[str]], tokens_of: Callable[[str], int], tok: Any,
            with_index: bool) -> dict[str, Any]:
    """CPU ms per request (boundaries, discovery), documents covered and found whole; with the index:
    a warm-up pass fills it first."""
    make = SHAPES[shape]
    index = DocumentIndex() if with_index else None
    prompts = [make(docs, f"question {i}?") for i, docs in enumerate(trace)]
    bounds = [prompt_boundaries(tok, text) for text, _ in prompts]

    def discover(text: str, regions: Optional[list[tuple[int, int]]], b: list[int]) -> list[tuple[int, int]]:
        spans = discover_chunks(text, index, None, regions=regions, boundaries=b)
        if index is not None:
            index.remember(None, [text[s:e] for s, e in spans])
        return spans

    if index is not None:
        for (text, regions), b in zip(prompts, bounds):
            discover(text, regions, b)
    boundary_ms, times, covered, whole = [], [], [], []
    for (text, regions), docs in zip(prompts, trace):
        t0 = time.process_time()
        b = prompt_boundaries(tok, text)
        t1 = time.process_time()
        spans = discover(text, regions, b)
        t2 = time.process_time()
        boundary_ms.append((t1 - t0) * 1000)
        times.append((t2 - t1) * 1000)
        chunks = {text[s:e] for s, e in spans}
        whole.append(sum(d in chunks for d in docs) / len(docs))
        covered.append(sum(_covered(text, d, spans, b) for d in docs) / len(docs))
    times.sort()
    return {"shape": shape, "index": with_index, "requests": len(trace),
            "prompt_tokens": statistics.mean(tokens_of(text) for text, _ in prompts[:20]),
            "prompt_chars": statistics.mean(len(text) for text, _ in prompts),
            "docs_per_prompt": statistics.mean(len(d) for d in trace), "index_docs": len(index or ()),
            "boundaries_ms_median": statistics.median(boundary_ms),
            "cpu_ms_median": statistics.median(times), "cpu_ms_p95": times[int(0.95 * (len(times) - 1))],
            "docs_covered": statistics.mean(covered), "docs_found": statistics.mean(whole)}


def _covered(text: str, doc: str, spans: list[tuple[int, int]], bounds: list[int]) -> bool:
    """Whether every token inside ``doc`` (its first occurrence) lies in one chunk: a chunk spans from
    the first boundary at or after the document's start to the last at or before its end."""
    s = text.find(doc)
    e = s + len(doc)
    first = bounds[bisect.bisect_left(bounds, s)]
    last = bounds[bisect.bisect_right(bounds, e) - 1]
    return any(cs <= first and last <= ce for cs, ce in spans)


# The inputs that used to be slow (issue 46): a unit repeated to fill the prompt.
ADVERSARIAL: dict[str, Callable[[int], str]] = {
    "text, then a line of tags, then text": lambda n: "x" + "<a>" * n + " x",
    "text, then a line of spaced tags": lambda n: "x" + "<a> " * n + "x",
    "a tag line with a role word": lambda n: "<a>" * n + "user" + "<a>" * n + " x",
    "a line of spaces": lambda n: " " * n + "x",
    "one-character lines": lambda n: "x\n" * n,
    "rule lines": lambda n: "---\n" * n,
    "separators of two kinds": lambda n: "---\n<|a|>\n" * n,
    "marker lines": lambda n: "[1] x\n" * n,
    "metadata lines": lambda n: "a: b\n" * n,
    "tag lines": lambda n: "<a>\n" * n,
    "title lines": lambda n: "Ab.\nT\n" * n,
}


def adversarial(tok: Any, tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Each :data:`ADVERSARIAL` input grown to ``tokens`` tokens: discovery's best CPU ms of
    ``repeats`` runs, scaled to 8K tokens; the boundaries' time beside it."""
    rows = []
    for name, make in ADVERSARIAL.items():
        n = 64
        while len(tok.encode(make(n), add_special_tokens=False)) < tokens:
            n *= 2
        lo, hi = n // 2, n  # the smallest repeat count reaching ``tokens``
        while hi - lo > max(1, hi // 64):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(tok.encode(make(mid), add_special_tokens=False)) < tokens else (lo, mid)
        text = make(hi)
        n_tokens = len(tok.encode(text, add_special_tokens=False))
        b = prompt_boundaries(tok, text)
        best, best_b = float("inf"), float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            discover_chunks(text, None, None, boundaries=b)
            t1 = time.process_time()
            prompt_boundaries(tok, text)
            best, best_b = min(best, t1 - t0), min(best_b, time.process_time() - t1)
        rows.append({"input": name, "chars": len(text), "tokens": n_tokens, "discovery_ms": best * 1000,
                     "discovery_ms_per_8k_tokens": best * 1000 * 8192 / n_tokens,
                     "boundaries_ms_per_8k_tokens": best_b * 1000 * 8192 / n_tokens})
    return rows


def run(args: argparse.Namespace) -> dict:
    """Every shape over the same trace, without and with the index; then the adversarial inputs."""
    tok = common.tokenizer(args)
    cache: dict[str, int] = {}

    def tokens_of(text: str) -> int:
        """Tokens of ``text`` (memoised per document)."""
        if text not in cache:
            cache[text] = len(tok.encode(text, add_special_tokens=False))
        return cache[text]

    pool = rag_documents.document_pool("hotpotqa", args.pool, seed=args.seed)
    trace = build_trace(pool, tokens_of, args.tokens, args.requests, args.seed)
    rows = [measure(shape, trace, tokens_of, tok, with_index) for with_index in (False, True) for shape in SHAPES]
    worst = adversarial(tok, args.tokens, args.repeats)
    return {"rows": rows, "adversarial": worst,
            "worst_ms_per_8k_tokens": max(r["discovery_ms_per_8k_tokens"] for r in worst)}


def report(result: dict) -> None:
    """One row per shape and index setting; one per adversarial input."""
    rows = [[r["shape"], "on" if r["index"] else "off", f"{r['prompt_tokens']:,.0f}", f"{r['docs_per_prompt']:.0f}",
             f"{r['boundaries_ms_median']:.2f}", f"{r['cpu_ms_median']:.2f}", f"{r['cpu_ms_p95']:.2f}",
             f"{r['docs_covered']:.0%}", f"{r['docs_found']:.0%}"] for r in result["rows"]]
    print("\n".join(markdown_table(["shape", "index", "prompt tokens", "docs", "boundaries ms", "discovery ms median",
                                    "discovery ms p95", "docs covered", "docs found whole"], rows)))
    print()
    rows = [[r["input"], f"{r['chars']:,}", f"{r['tokens']:,}", f"{r['discovery_ms']:.2f}",
             f"{r['discovery_ms_per_8k_tokens']:.2f}", f"{r['boundaries_ms_per_8k_tokens']:.2f}"]
            for r in result["adversarial"]]
    print("\n".join(markdown_table(["input (used to be slow)", "chars", "tokens", "discovery ms",
                                    "discovery ms per 8K tokens", "boundaries ms per 8K tokens"], rows)))
    print(f"\nworst discovery ms per 8K tokens: {result['worst_ms_per_8k_tokens']:.2f}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = common.bench_parser(BENCH, __doc__, server=False, quick_help="2K-token prompts, 40 requests")
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer sizes the prompts")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt size in tokens")
    parser.add_argument("--requests", type=int, default=200, help="requests per shape")
    parser.add_argument("--pool", type=int, default=600, help="distinct HotpotQA paragraphs the trace draws from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each adversarial input (the best is kept)")
    args = common.parse_args(parser, argv, quick={"tokens": 2048, "requests": 40})
    common.run_bench(BENCH, args, run, report=report)


if __name__ == "__main__":
    main()
