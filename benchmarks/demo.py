"""``make demo``: a multi-request RAG workload served by SGLang, one table row per cache mode.

    python -m benchmarks.demo [--requests 24] [--clients 4] [--max-new-tokens 16]
                              [--model smollm2-135m|tiny-llama|PATH] [--seed 0]
                              [--max-total-tokens 32768] [--modes full,prefix,pic,relaxkv]
                              [--output results/demo-<UTC>.json] [--url http://HOST:PORT]
                              [--server plugin|stock]

It prepares the model and HotpotQA offline (:mod:`relaxkv_sglang.assets`),
starts ONE SGLang server with the relaxkv plugin's cache and attention backend
(or uses ``--url``), and for each *mode* flushes the cache and serves the same
seeded trace (:func:`rag_documents.hotpotqa_requests`) from ``--clients``
concurrent client threads. Each request is an SGLang frontend program
(``@sgl.function``) run with streaming on; the request's own
``relaxkv_policy`` selects the mode, so every row comes from the same server
in the same run. The modes (:data:`benchmarks.demo_modes.MODES`):

* ``full``: the plain program, ``relaxkv_policy=full`` (no reuse at all). The
  reference row: the other rows' "fidelity to full" is the answer F1 of each
  request's answer against ``full``'s answer to the same request.
* ``prefix``: the plain program, ``relaxkv_policy=prefix``: SGLang's radix
  prefix cache only, as stock SGLang.
* ``pic``: a program that marks each document with ``document(doc)``, run
  against ``RelaxKVEndpoint(url, policy="pic")``: chunk reuse, no repair.
* ``relaxkv``: the same program against ``RelaxKVEndpoint(url,
  policy="relaxkv", custom_params=RELAXKV_PARAMS)``: chunk reuse plus RelaxKV repair at
  the default knobs (anchor and context ratio, ``docs/api.md``).

The marking modes send the same text as the plain ones, but the server
tokenizes a marked prompt part by part (docs/api.md, section 1); with some
tokenizers (SmolLM2's: 10 fewer tokens per prompt, at the blank lines before
the documents) that is not the token sequence ``full`` prefilled, so their
fidelity also measures that difference.

It prints one row per mode -- requests, prompt tokens, tokens served from
cache (``meta_info.cached_tokens``), hit rate, time to first token
(mean/p50/p90), answer F1 against the gold answer, fidelity to full, wall
time -- then the workload's best possible hit rate, and writes the same
figures with per-request records to a JSON file.

``--server stock`` starts stock SGLang instead (torch_native attention, its
own radix cache) for comparison; it serves only ``prefix``.

Every failure the user can fix ends in one line, ``relaxkv-sglang demo:
error: ...``, and a non-zero exit; the server is stopped on any exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

# Nothing in the demo may reach a model hub; the tokenizer is read from the model folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import requests as http  # noqa: E402
import sglang as sgl  # noqa: E402

from benchmarks import common, metrics  # noqa: E402
from benchmarks.common import fmt  # noqa: E402
from benchmarks.demo_modes import MODES, REFERENCE_MODE, RELAXKV_PARAMS, DemoError, Mode, ModeBackend, serve_one  # noqa: E402
from benchmarks.replay import ReplayError, replay_in_order  # noqa: E402
from benchmarks.tables import left, right, text_table  # noqa: E402
from benchmarks.prompt_formats import SEPARATOR, token_count, token_ids  # noqa: E402
from benchmarks.rag_documents import RagRequest, hotpotqa_requests, render_prompt  # noqa: E402
from relaxkv_sglang import assets  # noqa: E402
from relaxkv_sglang.client import ServerClient  # noqa: E402
from relaxkv_sglang.request.segments import common_prefix_len  # noqa: E402
from relaxkv_sglang.server.launch import SGLangServer, ServerConfig, ServerError, running_server  # noqa: E402

PROG = "relaxkv-sglang demo"


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def run_mode(mode: Mode, url: str, trace: list[RagRequest], clients: int, max_new_tokens: int) -> dict:
    """Serve the whole trace as ``mode`` from ``clients`` threads; return records and wall time.

    The requests go through the benchmarks' one replay (:func:`benchmarks.replay.replay_in_order`):
    they start in trace order (which is what the reuse bound assumes) and each client has at
    most one request in flight.
    """
    try:
        backend = ModeBackend(mode.make_backend(url), mode.custom_params)
    except Exception as exc:  # the frontend raises bare exceptions on connection failures
        raise DemoError(f"mode {mode.name}: cannot reach the server at {url}: {_one_line(exc)}") from exc
    done = [0]

    def send(i: int, cid: int, began: float) -> dict:
        rec = serve_one(mode, backend, trace[i], max_new_tokens)
        rec.update(mode=mode.name, index=i, client=cid, example_id=trace[i].example_id,
                   start_s=began, gold=trace[i].answers)
        return rec

    def progress(i: int, rec: dict) -> None:
        done[0] += 1
        _log(f"{mode.name} {done[0]:>3}/{len(trace)}  ttft {rec['ttft_s']:6.2f} s  "
             f"cached {rec['cached_tokens']:>5}/{rec['prompt_tokens']:<5} answer {rec['answer'].strip()[:40]!r}")

    try:
        records, wall = replay_in_order(send, len(trace), clients, on_done=progress)
    except ReplayError as exc:
        raise DemoError(f"mode {mode.name}: request {exc.index}: {_one_line(exc.cause)}") from exc.cause
    return {"records": records, "wall_s": wall}


def _mean_report(recs: list[dict], key: str) -> float | None:
    return metrics.mean(r["relaxkv"][key] for r in recs if isinstance(r.get("relaxkv"), dict) and key in r["relaxkv"])


def summarize(mode: Mode, run: dict, reference: list[dict] | None) -> dict:
    """Per-mode figures from its request records, and its fidelity to the reference mode's answers.

    ``reference``: the :data:`REFERENCE_MODE` pass's records for the same
    trace (same order), or None when it did not run; the reference mode
    itself gets fidelity 1.0 by definition and ``is_reference``.
    """
    recs = run["records"]
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    completion = sum(r["completion_tokens"] for r in recs)
    out = {
        "description": mode.description,
        "requests": len(recs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": metrics.hit_rate(cached, prompt),
        "completion_tokens": completion,
        "ttft_s": metrics.latency_summary(r["ttft_s"] for r in recs),
        "latency_s": metrics.latency_summary(r["latency_s"] for r in recs),
        "wall_s": run["wall_s"],
        "requests_per_s": len(recs) / run["wall_s"],
        "output_tokens_per_s": completion / run["wall_s"],
        "answer_f1": metrics.mean(r["f1"] for r in recs),
        "exact_match": metrics.mean(r["exact_match"] for r in recs),
        "is_reference": mode.name == REFERENCE_MODE,
    }
    if reference is not None:
        # Fidelity to full prefill, request by request (the same trace, the same order).
        out["fidelity_to_full_f1"] = metrics.mean(
            metrics.fidelity_f1(r["answer"], b["answer"]) for r, b in zip(recs, reference))
        out["agreement_with_full"] = metrics.mean(
            metrics.exact_agreement(r["answer"], b["answer"]) for r, b in zip(recs, reference))
    # What the plugin reported (repair policies): the knobs as achieved, averaged over requests.
    for key in ("anchor_ratio", "context_ratio", "anchors_per_layer"):
        value = _mean_report(recs, key)
        if value is not None:
            out[f"repair_{key}_mean"] = value
    return out


# ------------------------------------------------------------------ workload


def workload_figures(trace: list[RagRequest], model_dir: pathlib.Path) -> dict:
    """Token counts of the trace with the model's own tokenizer, and its best possible hit rate.

    The bound counts every document token after that document's first
    appearance in the trace (any position, any system prompt in front), over
    all prompt tokens. Documents are tokenized on their own, so tokens that
    merge across a document boundary are off by a few; the prompt totals are
    whole-prompt counts, as the server tokenizes a plain prompt. The "with
    system prompts" bound adds what the radix cache can serve of the part
    before the first document (special tokens, system prompt, separator):
    its longest common token prefix with that part of any earlier request
    (system prompts that begin alike share their first tokens).
    """
    try:
        tok = assets.load_tokenizer(model_dir)
    except Exception as exc:
        raise DemoError(f"cannot load the tokenizer from {model_dir}: {_one_line(exc)}") from exc

    doc_tokens = {d: token_count(tok, d) for req in trace for d in req.documents}
    prompt_tokens = [token_count(tok, render_prompt(req), special=True) for req in trace]
    reusable_docs = metrics.reusable_tokens([(d, doc_tokens[d]) for d in req.documents] for req in trace)
    reusable_sys, seen_prefixes = 0, []
    for req in trace:
        prefix = token_ids(tok, req.system + SEPARATOR, special=True)
        reusable_sys += max((common_prefix_len(prefix, p) for p in seen_prefixes), default=0)
        seen_prefixes.append(prefix)
    total = sum(prompt_tokens)
    return {
        "requests": len(trace),
        "distinct_examples": len({r.example_id for r in trace}),
        "distinct_documents": len(doc_tokens),
        "prompt_tokens": total,
        "max_prompt_tokens": max(prompt_tokens),
        "document_tokens": sum(doc_tokens[d] for r in trace for d in r.documents),
        "reusable_document_tokens": reusable_docs,
        "best_possible_hit_rate": metrics.hit_rate(reusable_docs, total),
        "reusable_system_prompt_tokens": reusable_sys,
        "best_possible_hit_rate_with_system_prompts": metrics.hit_rate(reusable_docs + reusable_sys, total),
    }


# ------------------------------------------------------------------- output


def format_table(summaries: dict[str, dict], workload: dict) -> str:
    """The plain-text table: one row per mode, then the workload's best possible hit rate.

    "fidelity to full" is the mean answer F1 against the ``full`` row's
    answer to the same request; the ``full`` row is that reference ("ref"),
    and the column reads "-" everywhere when no ``full`` pass ran.
    """
    columns = [left("mode")] + [right(h) for h in ("requests", "prompt tok", "cached tok", "hit rate", "TTFT mean s",
                                                   "p50 s", "p90 s", "F1 vs gold", "fidelity to full", "wall s")]
    rows = []
    for name, s in summaries.items():
        if s.get("is_reference"):
            fidelity = "ref"
        elif s.get("fidelity_to_full_f1") is not None:
            fidelity = f"{s['fidelity_to_full_f1']:.3f}"
        else:
            fidelity = "-"
        rows.append([name, str(s["requests"]), str(s["prompt_tokens"]), str(s["cached_tokens"]),
                     f"{100 * s['hit_rate']:.1f}%", fmt(s["ttft_s"]["mean"], ".2f"), fmt(s["ttft_s"]["p50"], ".2f"),
                     fmt(s["ttft_s"]["p90"], ".2f"), f"{s['answer_f1']:.3f}", fidelity, f"{s['wall_s']:.1f}"])
    out = text_table(columns, rows, gap="  ")
    out.append(
        f"best possible hit rate: {100 * workload['best_possible_hit_rate']:.1f}% "
        f"({workload['reusable_document_tokens']} of {workload['prompt_tokens']} prompt tokens are documents "
        f"seen earlier in the trace; {100 * workload['best_possible_hit_rate_with_system_prompts']:.1f}% "
        f"counting repeated system prompts too)"
    )
    if any(s.get("is_reference") for s in summaries.values()):
        out.append(f"fidelity to full: mean answer F1 of each request's answer against the answer of the "
                   f"'{REFERENCE_MODE}' row (full prefill, shown as the reference row) to the same request")
    else:
        out.append(f"fidelity to full: not measured (no '{REFERENCE_MODE}' pass in this run)")
    return "\n".join(out)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


# ---------------------------------------------------------------------- main


def _resolve_model(args: argparse.Namespace) -> pathlib.Path:
    """The folder of ``--model`` (:func:`benchmarks.common.model_dir`), refused unless it holds a model."""
    path = common.model_dir(args)
    if not (path / "config.json").is_file():
        raise DemoError(f"--model {args.model}: neither {' nor '.join(assets.MODELS)} nor a model folder")
    return path


def _served_model_dir(url: str, args: argparse.Namespace) -> pathlib.Path:
    """The served model's folder (for the tokenizer): the server's own ``model_path`` if local, else ``--model``'s."""
    try:
        info = http.get(url.rstrip("/") + "/get_model_info", timeout=10).json()
    except http.ConnectionError as exc:
        raise DemoError(f"--url {url}: cannot connect (is the server running?)") from exc
    except (http.RequestException, ValueError) as exc:
        raise DemoError(f"--url {url}: no SGLang server answers there ({_one_line(exc)})") from exc
    path = pathlib.Path(str(info.get("model_path", "")))
    if (path / "config.json").is_file():
        return path
    return _resolve_model(args)


def _context_length(model_dir: pathlib.Path) -> int | None:
    try:
        return int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings"))
    except (OSError, ValueError, TypeError):
        return None


def flush_cache(url: str) -> None:
    """Empty the server's caches so each mode starts cold (waits up to 60 s for idle)."""
    try:
        ServerClient(url).flush()
    except (http.RequestException, RuntimeError) as exc:
        raise DemoError(f"cannot flush the server's cache: {_one_line(exc)}") from exc


def warm_up(url: str) -> None:
    """One short request so no mode pays the server's first-request costs in its TTFT."""
    try:
        ServerClient(url, timeout=300).generate("Warm-up: the quick brown fox", max_new_tokens=2)
    except (http.RequestException, RuntimeError) as exc:
        raise DemoError(f"warm-up request failed: {_one_line(exc)}") from exc


def server_has_plugin(url: str) -> bool:
    """Whether the server at ``url`` runs the relaxkv plugin's cache (``--radix-cache-backend relaxkv``)."""
    try:
        info = http.get(url.rstrip("/") + "/server_info", timeout=60).json()
    except (http.RequestException, ValueError) as exc:
        raise DemoError(f"--url {url}: cannot read /server_info ({_one_line(exc)})") from exc
    if "radix_cache_backend" in info:
        return info["radix_cache_backend"] == "relaxkv"
    states = info.get("internal_states") or [{}]
    return bool(states[0].get("relaxkv"))


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags: the benchmarks' own (:func:`benchmarks.common.bench_parser`, no ``--quick``) and its trace's."""
    p = common.bench_parser("demo", __doc__, max_total_tokens=32768, quick=False)
    p.prog = PROG  # its errors read "relaxkv-sglang demo: error: ...", as the demo's own do
    p.add_argument("--requests", type=int, default=24, help="requests in the trace (default 24)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length cap (default 16)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated modes, one table row each, run in this order (available: "
                        f"{', '.join(MODES)}; default: all of them, or only prefix with --server stock); "
                        f"'{REFERENCE_MODE}' is the reference of the fidelity column")
    p.add_argument("--server", choices=("plugin", "stock"), default="plugin",
                   help="which server to start: SGLang with the relaxkv plugin's cache and attention backend "
                        "(default; serves every mode), or stock SGLang for comparison (serves prefix only)")
    return p


def select_modes(spec: str | None, plugin: bool) -> list[str]:
    """The modes to run, in order: ``spec`` (comma-separated) or the default for the server."""
    if spec is None:
        return [m for m in MODES if plugin or not MODES[m].needs_plugin]
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise DemoError(f"--modes: unknown mode {', '.join(unknown) or '(none)'}; available: {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise DemoError(f"--modes: a mode is listed twice ({spec})")
    return modes


def _refuse_plugin_modes(modes: list[str], where: str) -> None:
    need = [m for m in modes if MODES[m].needs_plugin]
    if need:
        raise DemoError(f"mode {', '.join(need)} needs the relaxkv plugin, and {where} does not run it "
                        f"(stock SGLang serves only: {', '.join(m for m in MODES if not MODES[m].needs_plugin)})")


@dataclasses.dataclass
class ServedModes:
    """What :func:`serve_modes` hands back: each mode's records and wall time, and how the server ran."""

    results: dict[str, dict]
    server_kind: str
    server_ready_s: float | None
    total_wall_s: float


def prepare_output(path: str | None) -> pathlib.Path:
    """The JSON results path (``--output`` or a dated default), its folder created."""
    output = pathlib.Path(path) if path else common.default_output("demo", common.stamp())
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"--output {output}: cannot create its folder ({exc.strerror})") from exc
    return output


def locate_model(args: argparse.Namespace, modes: list[str]) -> pathlib.Path:
    """The served model's folder; with ``--url``, also refuse plugin modes on a server without the plugin."""
    if args.url:
        url = args.url.rstrip("/")
        model_dir = _served_model_dir(url, args)
        if not server_has_plugin(url):
            _refuse_plugin_modes(modes, f"the server at {url}")
    else:
        model_dir = _resolve_model(args)
    _log(f"model {model_dir}")
    return model_dir


def prepare_workload(args: argparse.Namespace, model_dir: pathlib.Path) -> tuple[list[RagRequest], dict]:
    """The seeded HotpotQA trace and its token figures; refuse a prompt longer than the model's context."""
    trace = hotpotqa_requests(args.requests, seed=args.seed)
    workload = workload_figures(trace, model_dir)
    _log(f"workload: {workload['requests']} requests over {workload['distinct_examples']} HotpotQA examples, "
         f"{workload['distinct_documents']} distinct documents, {workload['prompt_tokens']} prompt tokens")
    ctx = _context_length(model_dir)
    if ctx is not None and workload["max_prompt_tokens"] + args.max_new_tokens > ctx:
        raise DemoError(f"the longest prompt has {workload['max_prompt_tokens']} tokens; "
                        f"with --max-new-tokens {args.max_new_tokens} it exceeds the model's context of {ctx}")
    return trace, workload


def _serve_mode(server: SGLangServer | None, url: str, name: str, trace: list[RagRequest],
                args: argparse.Namespace) -> dict:
    """One mode on a flushed cache; a failure while the started server died names the server's error."""
    flush_cache(url)
    _log(f"mode {name}: {len(trace)} requests from {args.clients} clients")
    try:
        return run_mode(MODES[name], url, trace, args.clients, args.max_new_tokens)
    except DemoError as exc:
        if server is not None and server.proc.poll() is not None:
            raise DemoError(f"the server exited with code {server.proc.returncode} during mode {name}: "
                            f"{server.last_error_line()} (log: {server.log_path})") from exc
        raise


def serve_modes(args: argparse.Namespace, modes: list[str], trace: list[RagRequest], model_dir: pathlib.Path,
                plugin: bool, log_path: pathlib.Path) -> ServedModes:
    """Serve the trace once per mode from ONE server (``--url``, or one started here and stopped after).

    Each request names its policy, so every mode runs on the same server; the
    cache is flushed before each mode and one warm-up request precedes them.
    """
    if args.url is None:
        server_kind = "sglang with the relaxkv plugin" if plugin else "stock sglang"
    else:
        server_kind = "external " + args.url.rstrip("/")
        _log(f"using the server at {args.url.rstrip('/')}")

    def make_config() -> ServerConfig:
        _log(f"starting {server_kind} (log: {log_path})")
        return ServerConfig(
            model_path=str(model_dir), max_total_tokens=args.max_total_tokens, relaxkv=plugin,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, log_path=str(log_path),
        )

    results: dict[str, dict] = {}
    started = time.perf_counter()
    server_ready_s = None
    with running_server(args.url, make_config) as (url, server):
        if server is not None:
            server_ready_s = time.perf_counter() - started
            _log(f"server ready at {url} after {server_ready_s:.1f} s")
        warm_up(url)
        for name in modes:
            results[name] = _serve_mode(server, url, name, trace, args)
    return ServedModes(results, server_kind, server_ready_s, time.perf_counter() - started)


def build_report(args: argparse.Namespace, modes: list[str], model_dir: pathlib.Path, workload: dict,
                 served: ServedModes, log_path: pathlib.Path) -> dict:
    """The JSON report: the run's configuration and machine, the workload, each mode's summary, every request."""
    results = served.results
    reference = results[REFERENCE_MODE]["records"] if REFERENCE_MODE in results else None
    machine = common.machine()
    return {
        "config": {
            "model": args.model,
            "model_path": str(model_dir),
            "requests": args.requests,
            "clients": args.clients,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "max_total_tokens": args.max_total_tokens if args.url is None else None,
            "modes": modes,
            "relaxkv_params": RELAXKV_PARAMS,
            "fidelity_reference": REFERENCE_MODE if reference is not None else None,
            "server": served.server_kind,
            "server_log": str(log_path) if args.url is None else None,
            "server_ready_s": served.server_ready_s,
            "total_wall_s": served.total_wall_s,
            "workload": "hotpotqa dev distractor; pool of requests//3 examples, 10 shuffled paragraphs each",
            "ttft": "client-side: program.run() call to the first streamed event of the answer",
            "date_utc": machine["date"],
            "cpu_count": machine["cpus"],
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "platform": machine["platform"],
            "python": machine["python"],
            "sglang": getattr(sgl, "__version__", None),
        },
        "workload": workload,
        "modes": {name: summarize(MODES[name], result, reference) for name, result in results.items()},
        "requests": [rec for result in results.values() for rec in result["records"]],
    }


def write_report(output: pathlib.Path, report: dict) -> None:
    """Write the JSON report to ``output``."""
    try:
        output.write_text(json.dumps(report, indent=1) + "\n")
    except OSError as exc:
        raise DemoError(f"--output {output}: cannot write it ({exc.strerror})") from exc


def print_results(args: argparse.Namespace, report: dict, served: ServedModes, output: pathlib.Path) -> None:
    """The table, one line on the server and the run, and where the JSON went."""
    print(format_table(report["modes"], report["workload"]))
    startup = "" if served.server_ready_s is None else f", server start {served.server_ready_s:.1f} s"
    print(f"server: {served.server_kind}; {args.requests} requests x {len(report['config']['modes'])} modes from "
          f"{args.clients} clients; total wall {served.total_wall_s:.1f} s{startup}")
    print(f"results: {output}")


def run(args: argparse.Namespace) -> int:
    """The whole demo: check the flags, prepare model and trace, serve every mode, report; 0 on success."""
    plugin = args.url is not None or args.server == "plugin"  # an external server is checked in locate_model
    modes = select_modes(args.modes, plugin)
    if args.url is None and not plugin:
        _refuse_plugin_modes(modes, "--server stock")
    output = prepare_output(args.output)
    model_dir = locate_model(args, modes)
    trace, workload = prepare_workload(args, model_dir)
    log_path = output.with_suffix(".server.log")
    served = serve_modes(args, modes, trace, model_dir, plugin, log_path)
    report = build_report(args, modes, model_dir, workload, served, log_path)
    write_report(output, report)
    print_results(args, report, served, output)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--clients", args.clients),
                        ("--max-new-tokens", args.max_new_tokens), ("--max-total-tokens", args.max_total_tokens)):
        if value < 1:
            print(f"{PROG}: error: {flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    try:
        return run(args)
    except (DemoError, assets.AssetError, ServerError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the server was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
