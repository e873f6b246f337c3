"""What every benchmark shares: its server, its client, and where results go.

Benchmarks talk to the server over HTTP only (``/generate``, ``/flush_cache``,
``/get_server_info``), as any client would.
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

from relaxkv_sglang import assets
from relaxkv_sglang.server import SGLangServer, ServerConfig

RESULTS_DIR = pathlib.Path(os.environ.get("RELAXKV_RESULTS", "results"))


def add_server_args(parser: argparse.ArgumentParser, *, max_total_tokens: int = 65536) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model name (%s) or folder" % ", ".join(assets.MODELS))
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--max-total-tokens", type=int, default=max_total_tokens, help="KV pool of the started server")
    parser.add_argument("--output", default=None, help="result JSON path (default: results/<bench>-<time>.json)")


def fail(bench: str, message: str) -> None:
    print(f"{bench}: error: {message}", file=sys.stderr)
    sys.exit(1)


@contextlib.contextmanager
def server_url(args, bench: str, **config):
    """The URL of the server to measure: ``--url``, or one started (and stopped) here."""
    if args.url:
        yield args.url.rstrip("/")
        return
    model = str(assets.model_path(args.model)) if args.model in assets.MODELS else args.model
    log = RESULTS_DIR / f"{bench}-{stamp()}.server.log"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    cfg = ServerConfig(model_path=model, max_total_tokens=args.max_total_tokens, policy="prefix",
                       log_path=str(log), **config)
    print(f"{bench}: starting sglang with {model} (log: {log})", file=sys.stderr, flush=True)
    with SGLangServer(cfg) as server:
        yield server.url


def stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_result(bench: str, args, payload: dict) -> pathlib.Path:
    path = pathlib.Path(args.output) if args.output else RESULTS_DIR / f"{bench}-{stamp()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": bench, "machine": machine(), "args": vars(args), **payload}
    path.write_text(json.dumps(payload, indent=1))
    print(f"{bench}: results written to {path}")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, path) -> None:
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
