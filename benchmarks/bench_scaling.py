"""How each cost of chunk reuse grows with prompt length and chunk count.

Measures the method's pieces through the package's core API on tensors shaped
like SmolLM2-135M's KV (30 layers, 3 KV heads of 64 dims, 9 query heads),
without a server, so each cost is isolated:

* lookup: finding every chunk of a prompt in the chunk tree (by token ids);
* re-rotation: rotating the reused K of every layer to its new position;
* selection: RelaxKV anchor sets (15%) and every layer's relaxed layout (25%);
* repair attention: the anchors' attention at 15%, relaxed (25%) vs full causal
  context, through the same executor;
* GPU inputs: the host side of the anchors' FlashInfer inputs for every layer's relaxed
  layout (``attention/gpu/anchor_inputs.py::anchor_prefill_inputs``, one vectorised pass over all 30
  layers): the CPU work a GPU repair adds per request (the FlashInfer calls themselves need a GPU).

Medians of several repetitions; the machine is shared, so read ratios.

    python -m benchmarks.bench_scaling --quick
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

from benchmarks import common, tables
from relaxkv_sglang.attention.block_sparse import block_sparse_attention
from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import PoolChunkIndex
from relaxkv_sglang.attention.layout import RelaxedContextSpec, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.model.rope import RopeSpec, rotate_keys
from relaxkv_sglang.repair.selection import select_anchors
from relaxkv_sglang.attention.gpu.anchor_inputs import anchor_prefill_inputs

BENCH = "bench_scaling"
LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64
ROPE = RopeSpec(head_dim=HEAD_DIM, base=100000.0)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(n_tokens: int, n_chunks: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(n_tokens * 31 + n_chunks)
    prefix = 32
    size = (n_tokens - prefix) // n_chunks
    spans = [(prefix + i * size, prefix + (i + 1) * size) for i in range(n_chunks)]
    n_context = spans[-1][1]
    ids = torch.randint(0, 49152, (n_context,), generator=g)

    store = PoolChunkIndex(free_slots=lambda slots: None)
    for s, e in spans:
        store.insert(ChunkKey(None, ids[s:e].tolist()), torch.arange(s, e))
    lookup = _median_time(lambda: [store.lookup(ChunkKey(None, ids[s:e].tolist())) for s, e in spans], repeats)

    k = torch.randn(n_context, KV_HEADS, HEAD_DIM, generator=g)
    rotation = _median_time(lambda: [rotate_keys(k, 1000, ROPE) for _ in range(LAYERS)], repeats)

    scores = torch.rand(LAYERS, n_context, generator=g)

    def select():
        sets = select_anchors("relaxkv", scores, spans, n_context, 0.15, n_layers=LAYERS)
        context = RelaxedContextSpec(spans, n_context, 0.25)
        return sets, [build_relaxed_layout(a, scores[l], context) for l, a in enumerate(sets)]

    selection = _median_time(select, repeats)
    sets, relaxed = select()
    full = [full_causal_layout(a, spans, n_context) for a in sets]
    v = torch.randn(n_context, KV_HEADS, HEAD_DIM, generator=g)
    queries = [torch.randn(a.numel(), HEADS, HEAD_DIM, generator=g) for a in sets]

    def attend(layouts):
        return lambda: [block_sparse_attention(q, k, v, lay) for q, lay in zip(queries, layouts)]

    return {
        "prompt_tokens": n_tokens, "chunks": n_chunks,
        "lookup_s": lookup, "rerotation_s": rotation, "selection_s": selection,
        "repair_attention_relaxed_s": _median_time(attend(relaxed), repeats),
        "repair_attention_full_s": _median_time(attend(full), repeats),
        "gpu_inputs_s": _median_time(lambda: anchor_prefill_inputs(relaxed), max(repeats, 5)),
        "kv_pairs_relaxed": sum(x.kv_pairs() for x in relaxed), "kv_pairs_full": sum(x.kv_pairs() for x in full),
    }


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Each cost against prompt length at 10 chunks, log scale."""
    plt = common.pyplot()
    by_len = [r for r in rows if r["chunks"] == 10]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("lookup_s", "chunk lookup"), ("rerotation_s", "K re-rotation (30 layers)"),
                       ("selection_s", "anchor + layout selection"), ("gpu_inputs_s", "GPU anchor inputs (host)"),
                       ("repair_attention_relaxed_s", "repair attention, relaxed 25%"),
                       ("repair_attention_full_s", "repair attention, full context")):
        ax.plot([r["prompt_tokens"] for r in by_len], [r[key] for r in by_len], marker="o", label=label)
    ax.set_xlabel("prompt tokens (10 chunks)")
    ax.set_ylabel("seconds (median)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    common.save_plot(fig, path)


def run(args: argparse.Namespace) -> dict:
    """Every prompt length at 10 chunks, then every chunk count at 6000 tokens."""
    rows = [measure(n, 10, args.repeats) for n in args.lengths]
    rows += [measure(6000, c, args.repeats) for c in args.chunk_counts if c != 10]
    return {"results": rows}


def print_table(result: dict) -> None:
    """The rows as a plain-text table, in milliseconds."""
    rows = result["results"]
    columns = [tables.right("tokens", 7), tables.right("chunks", 7), tables.right("lookup ms", 11),
               tables.right("rotate ms", 11), tables.right("select ms", 11), tables.right("relaxed ms", 12),
               tables.right("full ms", 10), tables.right("gpu inputs ms", 15)]
    tables.print_text_table(columns, [
        [str(r["prompt_tokens"]), str(r["chunks"]), f"{r['lookup_s'] * 1e3:.2f}", f"{r['rerotation_s'] * 1e3:.1f}",
         f"{r['selection_s'] * 1e3:.1f}", f"{r['repair_attention_relaxed_s'] * 1e3:.1f}",
         f"{r['repair_attention_full_s'] * 1e3:.1f}",
         common.fmt(r["gpu_inputs_s"] * 1e3 if "gpu_inputs_s" in r else None, ".1f")]  # older results have none
        for r in rows])


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_scaling``: parse the flags, measure, print, write the JSON and the plot."""
    parser = common.bench_parser(BENCH, __doc__, server=False, quick_help="3 lengths x 10/40 chunks, 2 repeats")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1500, 3000, 6000, 12000])
    parser.add_argument("--chunk-counts", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--repeats", type=int, default=3)
    args = common.parse_args(parser, argv,
                             quick={"lengths": [1500, 3000, 6000], "chunk_counts": [10, 40], "repeats": 2})
    common.run_bench(BENCH, args, run, report=print_table, plot=lambda result, path: plot(result["results"], path))


if __name__ == "__main__":
    main()
