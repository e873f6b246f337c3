"""Where a warm repair's time goes, per stage, at several anchor ratios and prompt lengths.

For each prompt length (HotpotQA paragraphs packed as in ``bench_ttft``, every chunk warm) and
each configuration (``pic``, then ``relaxkv`` at each ``--ratios``), one client sends ``--requests``
identical requests one after another while ``py-spy`` samples SGLang's scheduler process (where
the fold, the query pass and the repair run). Each sample is put in the stage whose function is on
its stack (:data:`STAGES`, most specific first); a stage's time per request is its samples over
the sampling rate and the requests. Busy time only: py-spy leaves out the samples of an idle
scheduler. The HTTP process's tokenization (each part encoded on its own; unmarked, discovery's
second encoding for the token boundaries) is timed in this process with the served tokenizer.

The anchors' and the glue and query rows' linear work run as one batch in the layer loop
(``loop: QKV+RoPE``, ``loop: o_proj+MLP``): per layer, ``anchors_per_layer`` rows and the
``glue_and_query_rows`` that ``pic`` computes (``tokens_computed``). py-spy is not sampling for free: read shares and differences between columns of one run.

    python -m benchmarks.profile_repair --quick                  # 1.6K tokens, 2% and 15%
    python -m benchmarks.profile_repair                          # 1.6K and 6K, 2/5/15/30%
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import psutil

from benchmarks import bench_ttft, common, prompt_formats, tables
from relaxkv_sglang.request.segments import split_text, tokenize_parts

BENCH = "profile_repair"
SAMPLE_RATE_HZ = 100

# (stage, markers): a stack belongs to the first stage whose markers all appear on it, root to leaf
# in this order (function names as py-spy prints them, without the file).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("repair: answer logits", ("RepairStage.run", "RepairStage._answer_logits")),
    ("repair: publish misses", ("RepairStage._plan", "publish_chunks")),
    ("repair: budget", ("RepairStage._plan", "decide_budget")),
    ("repair: planning (exits, layouts)", ("RepairStage._plan",)),
    ("repair: planning (pass staging)", ("LayerLoop._plan",)),
    ("loop: anchor attention", ("LayerLoop._attend", "PreparedAnchors.run")),
    ("loop: anchor attention", ("LayerLoop._attend", "AnchorAttention.__call__")),
    ("loop: glue+query attention", ("LayerLoop._attend", "ScopedCausalGroups.run")),
    ("loop: QKV+RoPE", ("LayerLoop.run", "ModelLayers.qkv")),
    ("loop: o_proj+MLP", ("LayerLoop.run", "ModelLayers.finish")),
    ("loop: stale shift", ("LayerLoop.run", "_stale_shift")),
    ("loop: other (KV writes, gathers)", ("LayerLoop.run",)),
    ("repair: other", ("RepairStage.run",)),
    ("query pass: scores", ("around_model_forward", "record_query_scores")),
    ("query pass: attention", ("around_model_forward", "RelaxKVAttnBackend.forward_extend")),
    ("query pass: linear and the rest", ("around_model_forward",)),
    ("fold (warm chunks copied)", ("fold_batch",)),
    ("query pass set-up", ("set_up_forward",)),
    ("finish and report", ("finish_forward",)),
    ("SGLang: logits, sampling", ("_forward",)),
)
OTHER = "scheduler: the rest"
SCHEDULER_LOOP = "run_scheduler_process"  # the root of the scheduler's main thread (sglang 0.5.23)
WARM_UP_REQUESTS = 2


def stage_of(frames: Sequence[str]) -> str:
    """The stage of one sampled stack (``frames``: root first, ``name (file:line)`` as py-spy writes them)."""
    names = [frame.rsplit(" (", 1)[0] for frame in frames]
    for stage, markers in STAGES:
        found = 0
        for name in names:
            if found < len(markers) and name == markers[found]:
                found += 1
        if found == len(markers):
            return stage
    return OTHER


def stage_samples(raw: str) -> dict[str, int]:
    """Samples per stage of py-spy's ``--format raw`` output (a line per stack: frames joined by
    ``;``, a space, its count), the scheduler's event loop only (:data:`SCHEDULER_LOOP` on the
    stack: a background thread's samples would count its time twice)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if count.isdigit() and any(f.startswith(SCHEDULER_LOOP + " (") for f in frames):
            counts[stage_of(frames)] += int(count)
    return dict(counts)


def py_spy() -> str:
    """The py-spy executable beside this interpreter, else on PATH (RuntimeError: make install)."""
    here = pathlib.Path(sys.executable).parent / "py-spy"
    found = str(here) if here.is_file() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy is not installed (requirements/bench.txt; make install)")
    return found


def scheduler_pid(server: Any) -> int:
    """The pid of the started server's scheduler process (SGLang names it ``sglang::scheduler``)."""
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("sglang::scheduler"):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError("no sglang::scheduler process under the started server")


def profile_requests(client: Any, pid: int, text: str, offsets: list[int], policy: str, ratio: float | None,
                     requests: int) -> dict:
    """``requests`` identical requests while py-spy samples ``pid``; per-stage ms per request, latency."""
    for _ in range(WARM_UP_REQUESTS):  # the same prompt: what the first ones do once (tier copies) is not profiled
        client.generate(text, offsets, policy, max_new_tokens=1, anchor_ratio=ratio)
    with tempfile.TemporaryDirectory(prefix=f"{BENCH}-") as tmp:
        raw = pathlib.Path(tmp) / "samples.txt"
        spy = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--format", "raw", "-r", str(SAMPLE_RATE_HZ),
                                "--nonblocking", "-o", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # py-spy attached
        latencies, report = [], {}
        for _ in range(requests):
            start = time.perf_counter()
            out = client.generate(text, offsets, policy, max_new_tokens=1, anchor_ratio=ratio)
            latencies.append(time.perf_counter() - start)
            report = common.relaxkv_report(out)
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
        if not raw.is_file():
            raise RuntimeError(f"py-spy wrote no samples: {err.decode(errors='replace').strip()[-300:]}")
        samples = stage_samples(raw.read_text())
    per_request_ms = {stage: 1000.0 * n / SAMPLE_RATE_HZ / requests for stage, n in samples.items()}
    return {"policy": policy, "anchor_ratio": ratio, "requests": requests,
            "latency_median_s": statistics.median(latencies), "stage_ms": per_request_ms,
            "scheduler_busy_ms": sum(per_request_ms.values()),
            "anchors_per_layer": report.get("anchors_per_layer", 0.0), "tokens_computed": report.get("tokens_computed")}


def tokenization_ms(tokenizer: Any, text: str, offsets: list[int], rounds: int = 5) -> dict[str, float]:
    """The HTTP process's tokenization of the request, median ms: every part encoded on its own
    (``request/segments.py::tokenize_parts``, marked chunks), and unmarked the whole text's offsets
    too (discovery's token boundaries, a second encoding)."""
    spans = list(zip(offsets[::2], offsets[1::2]))

    def encode(t: str, special: bool) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=special)

    def median_ms(work: Any) -> float:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return 1000.0 * statistics.median(times)

    def marked() -> None:
        tokenize_parts(split_text(text, spans), encode)

    def unmarked() -> None:
        tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        marked()

    return {"marked": median_ms(marked), "unmarked": median_ms(unmarked)}


def run(args: argparse.Namespace) -> dict:
    """Every (prompt length, configuration) profiled against one started server."""
    if args.url:
        raise RuntimeError("profile_repair samples the scheduler of a server it starts; drop --url")
    tokenizer = common.tokenizer(args)
    configs = [("pic", None)] + [("relaxkv", r) for r in args.ratios]
    results = []
    with common.bench_server(args, BENCH) as (client, server):
        pid = scheduler_pid(server)
        for target in args.tokens:
            text, offsets, n_tokens = bench_ttft.packed_prompt(tokenizer, target, args.seed)
            common.warm_chunks(client, prompt_formats.chunk_texts(text, offsets), bench_ttft.WARM_SYSTEM)
            n = max(3, round(args.requests * 1600 / target))
            rows = [profile_requests(client, pid, text, offsets, policy, ratio, n) for policy, ratio in configs]
            results.append({"prompt_tokens": n_tokens, "configs": rows, "glue_and_query_rows": rows[0]["tokens_computed"],
                            "http_planning_ms": tokenization_ms(tokenizer, text, offsets)})
    return {"workload": {"tokens": args.tokens, "ratios": args.ratios, "requests": args.requests, "seed": args.seed,
                         "sample_rate_hz": SAMPLE_RATE_HZ}, "results": results}


def print_table(result: dict) -> None:
    """A table per prompt length: stage rows, configuration columns, ms per request."""
    for block in result["results"]:
        rows_ = block["configs"]
        names = [r["policy"] if r["anchor_ratio"] is None else f"{r['anchor_ratio']:.0%}" for r in rows_]
        print(f"\n~{block['prompt_tokens']} tokens ({block['glue_and_query_rows']} glue and query rows), warm: "
              f"scheduler ms per request by stage (py-spy); "
              f"HTTP planning {block['http_planning_ms']['marked']:.1f} ms marked, "
              f"{block['http_planning_ms']['unmarked']:.1f} ms unmarked")
        stages = [s for s, _ in STAGES if any(s in r["stage_ms"] for r in rows_)]
        stages = list(dict.fromkeys(stages)) + ([OTHER] if any(OTHER in r["stage_ms"] for r in rows_) else [])
        columns = [tables.left("stage", 34)] + [tables.right(n, 8) for n in names]
        body = [[s] + [f"{r['stage_ms'].get(s, 0.0):.0f}" for r in rows_] for s in stages]
        body.append(["scheduler busy"] + [f"{r['scheduler_busy_ms']:.0f}" for r in rows_])
        body.append(["  over pic"] + [f"{r['scheduler_busy_ms'] - rows_[0]['scheduler_busy_ms']:.0f}" for r in rows_])
        body.append(["client latency (median)"] + [f"{1000 * r['latency_median_s']:.0f}" for r in rows_])
        body.append(["anchors per layer"] + [f"{r['anchors_per_layer']:.0f}" for r in rows_])
        tables.print_text_table(columns, body)


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.profile_repair``: parse the flags, profile, print, write the JSON."""
    parser = common.bench_parser(BENCH, __doc__, quick_help="1.6K tokens, 2%% and 15%%")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1600, 6000], help="prompt lengths")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.02, 0.05, 0.15, 0.30], help="relaxkv anchor ratios")
    parser.add_argument("--requests", type=int, default=20, help="requests per configuration at 1.6K (fewer when longer)")
    parser.add_argument("--seed", type=int, default=0)
    args = common.parse_args(parser, argv, quick={"tokens": [1600], "ratios": [0.02, 0.15], "requests": 10})
    if args.requests < 1 or any(not 0 < r <= 1 for r in args.ratios):
        common.fail(BENCH, "--requests must be >= 1 and every --ratios value in (0, 1]")
    common.run_bench(BENCH, args, run, report=print_table)


if __name__ == "__main__":
    main()
