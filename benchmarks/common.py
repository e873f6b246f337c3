"""What every benchmark shares: its command line, model, server, client, warm-up and where results go.

A benchmark module holds only its own measurement: a ``run(args) -> dict``, a
report that prints it and, if it draws one, a plot. Its ``main`` is

    parser = bench_parser(BENCH, __doc__, quick_help="...")
    parser.add_argument(...)                      # its own knobs
    args = parse_args(parser, argv, quick={...})  # --quick overrides
    run_bench(BENCH, args, run, report=print_table, plot=plot)

Benchmarks talk to the server over HTTP only (``/generate``, ``/flush_cache``,
``/get_server_info``, through :class:`relaxkv_sglang.client.ServerClient`), as
any client would, and start it through :mod:`relaxkv_sglang.server.launch`. Concurrent
requests go through the one replay (:func:`benchmarks.replay.replay_in_order`),
tables through the one printer (:mod:`benchmarks.tables`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import sys
from typing import Any, Callable, Iterator, NoReturn, Sequence

from benchmarks import prompt_formats

from relaxkv_sglang import assets
from relaxkv_sglang.client import ServerClient
from relaxkv_sglang.server.launch import SGLangServer, ServerConfig, running_server

RESULTS_DIR = pathlib.Path(os.environ.get("RELAXKV_RESULTS", "results"))

# ---------------------------------------------------------------- command line


def bench_parser(bench: str, doc: str, *, server: bool = True, max_total_tokens: int = 65536,
                 quick: bool = True, quick_help: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's parser with the flags every benchmark has.

    ``--output`` always, ``--quick`` with ``quick``; with ``server`` also ``--model``,
    ``--url`` and ``--max-total-tokens`` (the server measured). The
    description is the first paragraph of ``doc`` (the module docstring).
    """
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{bench}", description=doc.split("\n\n")[0])
    if server:
        parser.add_argument("--model", default="smollm2-135m",
                            help="model name (%s) or folder" % ", ".join(assets.MODELS))
        parser.add_argument("--url", default=None, help="use a running server instead of starting one")
        parser.add_argument("--max-total-tokens", type=int, default=max_total_tokens,
                            help="KV pool of the started server")
    parser.add_argument("--output", default=None, help=f"result JSON path (default: {default_output(bench)})")
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               quick: dict[str, Any] | None = None) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick``, the ``quick`` sizes replace the parsed values."""
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        for name, value in (quick or {}).items():
            setattr(args, name, value)
    return args


# ------------------------------------------------------ model, server, client


def model_dir(args: argparse.Namespace) -> pathlib.Path:
    """The folder of ``--model`` (a known model is prepared offline on first use)."""
    return assets.resolve_model(args.model)


def tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer of ``--model``, to count tokens as the server does."""
    return assets.load_tokenizer(model_dir(args))


@contextlib.contextmanager
def bench_client(args: argparse.Namespace, bench: str, *, policy: str = "prefix",
                 **config: Any) -> Iterator[ServerClient]:
    """A client of the server to measure (:func:`bench_server`'s)."""
    with bench_server(args, bench, policy=policy, **config) as (client, _):
        yield client


@contextlib.contextmanager
def bench_server(args: argparse.Namespace, bench: str, *, policy: str = "prefix",
                 **config: Any) -> Iterator[tuple[ServerClient, SGLangServer | None]]:
    """A client of the server to measure and the server: ``--url`` (server None), or one started
    here (and stopped on exit).

    The started server serves ``--model`` with a ``--max-total-tokens`` KV
    pool, default policy ``policy`` (``prefix``: every request names its own), its log
    under the results folder; ``config`` adds :class:`ServerConfig` fields.
    """
    def make_config() -> ServerConfig:
        model = str(model_dir(args))
        log = RESULTS_DIR / f"{bench}-{stamp()}.server.log"
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        print(f"{bench}: starting sglang with {model} (log: {log})", file=sys.stderr, flush=True)
        return ServerConfig(model_path=model, max_total_tokens=args.max_total_tokens, policy=policy,
                            log_path=str(log), **config)

    with running_server(args.url, make_config) as (url, server):
        yield ServerClient(url), server


def warm_chunks(client: ServerClient, documents: Sequence[str], system: str) -> None:
    """Cache ``documents`` as chunks through one request with ``system`` in front, in reversed order.

    The measured request then finds every chunk stored, but no radix prefix
    past its system prompt (another system prompt, another order).
    """
    text, offsets = prompt_formats.marked_text(system, list(documents)[::-1], prompt_formats.question_text("?"))
    client.generate(text, offsets, "pic", max_new_tokens=1)


def calibration_line(calibration: dict | None) -> str:
    """One line naming the server's repair calibration (``ServerClient.calibration``)."""
    if calibration is None:
        return "calibration unknown (a stock server, or one that does not report it)"
    if calibration.get("file") is None:
        return f"no calibration for {calibration.get('model')}: the default repair knobs"
    knobs = ", ".join(f"{k}={v}" for k, v in sorted(calibration.get("knobs", {}).items()))
    return f"calibration {calibration['file']} ({knobs or 'no knob differs from the defaults'})"


def relaxkv_report(response: dict) -> dict:
    """The plugin's per-request report (``meta_info.relaxkv``) of a response; ``{}`` when there is none."""
    return response["meta_info"].get("relaxkv") or {}


# ------------------------------------------------------------------- results


def fail(bench: str, message: str) -> NoReturn:
    """End the benchmark with one error line and exit status 1."""
    print(f"{bench}: error: {message}", file=sys.stderr)
    sys.exit(1)


def run_bench(bench: str, args: argparse.Namespace, run: Callable[[argparse.Namespace], dict], *,
              report: Callable[[dict], None] | None = None,
              plot: Callable[[dict, pathlib.Path], None] | None = None) -> pathlib.Path:
    """Run the measurement, print its ``report``, write its JSON (and ``plot`` a PNG beside it).

    A failure the user can fix (no server, no data: ``RuntimeError``,
    ``AssetError``) ends in one line via :func:`fail`.
    """
    try:
        result = run(args)
    except (RuntimeError, assets.AssetError) as exc:
        fail(bench, str(exc))
    if report is not None:
        report(result)
    path = write_result(bench, args, result)
    if plot is not None:
        plot(result, path.with_suffix(".png"))
    return path


def ci_text(ci: Sequence[float] | None, spec: str) -> str:
    """A 95% interval as a table cell, ``[lo,hi]`` with ``spec``; ``[-]`` when there is none."""
    return "[-]" if ci is None else f"[{format(ci[0], spec)},{format(ci[1], spec)}]"


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    """``value`` formatted with ``spec`` (``".0%"``, ``","``, ...) for a table cell, ``missing`` when None."""
    return missing if value is None else format(value, spec)


def stamp() -> str:
    """The UTC time as ``YYYYmmddTHHMMSSZ``, for file names."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def machine() -> dict:
    """The machine and time of the run, as each result file records them."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def default_output(bench: str, when: str = "<time>") -> pathlib.Path:
    """Where a run's JSON goes without ``--output``: ``results/<bench>-<when>.json`` (``$RELAXKV_RESULTS``)."""
    return RESULTS_DIR / f"{bench}-{when}.json"


def write_result(bench: str, args: argparse.Namespace, payload: dict) -> pathlib.Path:
    """Write ``payload`` with the benchmark's name, machine and arguments to ``--output`` (or a dated file)."""
    path = pathlib.Path(args.output) if args.output else default_output(bench, stamp())
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": bench, "machine": machine(), "args": vars(args), **payload}
    path.write_text(json.dumps(payload, indent=1))
    print(f"{bench}: results written to {path}")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, path: str | os.PathLike) -> None:
    """Save ``fig`` as a PNG at ``path`` and say where."""
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
