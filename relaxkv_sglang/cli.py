"""``relaxkv-sglang``: serve, and prepare the offline model and data.

    relaxkv-sglang serve [--model smollm2-135m|tiny-llama|qwen2.5-0.5b|PATH] [--port N] [--policy P]
                         [--max-total-tokens N] [--stock] [sglang args] [-- sglang args]
    relaxkv-sglang serve --replicas N [--routing document|cache_aware|round_robin] [...]
                         [-- extra sglang args [-- extra smg args]]
    relaxkv-sglang serve ... [--host-cache-gb G] [--chunk-dir DIR] [--disk-cache-gb G]
    relaxkv-sglang serve ... [--calibration FILE|none]
    relaxkv-sglang encode --url URL --input corpus.jsonl|corpus.txt [--separator SEP] [--batch-size N]
    relaxkv-sglang model smollm2-135m|tiny-llama|qwen2.5-0.5b|tiny-<family>
    relaxkv-sglang data hotpotqa|squad|essays
    relaxkv-sglang --version

``serve`` takes SGLang's names for what it wraps (``--model-path``, ``--host``, ``--port``,
``--max-total-tokens``, ``--device``), hands every other flag and those after ``--`` to
``sglang.launch_server`` unchanged, and passes its own as the variables a raw ``launch_server`` reads
(``RELAXKV_DEFAULT_POLICY``, ``RELAXKV_HOST_CACHE_GB``, ``RELAXKV_CHUNK_DIR``, ``RELAXKV_DISK_CACHE_GB``,
``RELAXKV_CALIBRATION``): without them it serves as a raw server with the plugin would. ``serve
--replicas N`` starts N servers and one ``smg`` gateway on ``--port`` in front
(:class:`relaxkv_sglang.server.cluster.Cluster`; flags after a second ``--`` go to ``smg``) and stops all
of them on Ctrl-C or SIGTERM. Every failure the user can fix ends in one line, ``relaxkv-sglang: error:
...``, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

from relaxkv_sglang import __version__, assets
from relaxkv_sglang.request.schema import POLICY, check_default_policy
from relaxkv_sglang.server.launch import THREADS_BIND_ENV, SGLangServer, ServerConfig, ServerError
from relaxkv_sglang.runtime.settings import CALIBRATION_ENV, DEFAULT_POLICY_ENV, ServerSettings, child_environment

TIER_ENV = {"host_cache_gb": "RELAXKV_HOST_CACHE_GB", "chunk_dir": "RELAXKV_CHUNK_DIR",
            "disk_cache_gb": "RELAXKV_DISK_CACHE_GB"}


def tier_env(args) -> dict[str, str]:
    """The environment of the lower-tier flags (only those given); checked here, so a bad value
    stops before SGLang's minutes of startup."""
    env = {}
    for attr in ("host_cache_gb", "disk_cache_gb"):
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not value >= 0 or value == float("inf"):
            raise ServerError(f"--{attr.replace('_', '-')} {value}: must be a finite number >= 0")
        env[TIER_ENV[attr]] = repr(float(value))
    chunk_dir = getattr(args, "chunk_dir", None)
    if chunk_dir is not None:
        if os.path.exists(chunk_dir) and not os.path.isdir(chunk_dir):
            raise ServerError(f"--chunk-dir {chunk_dir}: exists and is not a directory")
        env[TIER_ENV["chunk_dir"]] = os.path.abspath(chunk_dir)
    elif getattr(args, "disk_cache_gb", None) is not None:
        raise ServerError("--disk-cache-gb needs --chunk-dir DIR")
    return env


def calibration_env(args, model_path: str) -> dict[str, str]:
    """Read and matched against the model folder here: a wrong file stops before SGLang's minutes of
    startup (without the flag the server finds the repository's calibration itself)."""
    if args.calibration is None:
        return {}
    from relaxkv_sglang.repair.calibration import NO_CALIBRATION, CalibrationError, calibration_for_model

    if args.calibration.strip().lower() == NO_CALIBRATION:
        return {CALIBRATION_ENV: NO_CALIBRATION}
    path = os.path.abspath(args.calibration)
    if pathlib.Path(model_path, "config.json").is_file():  # a hub name is checked by the server
        try:
            calibration_for_model(model_path, path)
        except CalibrationError as exc:
            raise ServerError(f"--calibration: {exc}") from None
    return {CALIBRATION_ENV: path}


def serve_env(args, model_path: str) -> dict[str, str]:
    """The server's environment from ``serve``'s flags: the lower tiers and the calibration."""
    return {**tier_env(args), **calibration_env(args, model_path)}


def serve_policy(args) -> str:
    """``--policy``, else the plugin's default, which the server reads itself as a raw ``launch_server``
    does; read here only to name it and to stop on a bad value before SGLang starts."""
    if args.policy is not None:
        return args.policy
    try:
        settings = ServerSettings.from_env(child_environment())
        check_default_policy(settings)
        return settings.default_policy
    except SystemExit as exc:  # a bad RELAXKV_DEFAULT_POLICY
        raise ServerError(str(exc).removeprefix("relaxkv-sglang: ")) from None


def _policy_help() -> str:
    env = child_environment().get(DEFAULT_POLICY_ENV)  # what the launched server reads
    if env:
        default = f"{env}, from ${DEFAULT_POLICY_ENV}; without it {POLICY.default}"
    else:
        default = f"{POLICY.default} (SGLang's radix cache), or ${DEFAULT_POLICY_ENV} when set"
    return (f"server default policy, for requests that do not set relaxkv_policy (default: {default}; "
            "the same default as a raw sglang.launch_server with the plugin)")


def _wait_for_stop(alive) -> None:
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop["now"] and alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass


def _interrupt(*_) -> None:
    """A SIGTERM handler that stops whatever is running as Ctrl-C does."""
    raise KeyboardInterrupt


def cmd_serve_replicas(args, extra: list[str]) -> int:
    """``serve --replicas N``: N plugin servers and one smg gateway in front, until Ctrl-C/SIGTERM."""
    from relaxkv_sglang.server.cluster import Cluster, RouterConfig, replica_configs, router_installed
    from relaxkv_sglang.server.launch import port_in_use

    if not router_installed():
        raise ServerError("smg (the gateway) is not installed (make install pins it); --replicas needs it")
    if args.port and port_in_use(args.host, args.port):  # checked before the replicas' minutes of startup
        raise ServerError(f"port {args.port} on {args.host} is in use; pick another with --port")
    sglang_extra, router_extra = extra, []
    if "--" in extra:
        cut = extra.index("--")
        sglang_extra, router_extra = extra[:cut], extra[cut + 1:]
    policy = serve_policy(args)
    routing = args.routing or "document"
    model_path = str(assets.resolve_model(args.model))
    base = ServerConfig(
        model_path=model_path, host=args.host, port=0,
        max_total_tokens=args.max_total_tokens, device=args.device, relaxkv=not args.stock, policy=args.policy,
        extra_args=sglang_extra, log_path=args.log, startup_timeout_s=args.startup_timeout,
        env=serve_env(args, model_path),
    )
    router = RouterConfig(worker_urls=[], routing=routing, host=args.host, port=args.port,
                          model_path=base.model_path, extra_args=router_extra,
                          log_path=f"{args.log}.router" if args.log else None)
    cluster = Cluster(replica_configs(base, args.replicas), router)
    print(f"starting {args.replicas} sglang replicas with {base.model_path}, default policy "
          f"{policy if base.relaxkv else 'none (--stock)'}, and the smg gateway on {args.host}:{args.port} "
          f"(routing {routing})", file=sys.stderr, flush=True)
    # SIGTERM during startup: stop what has started (the finally below), no orphans.
    signal.signal(signal.SIGTERM, _interrupt)
    exited = None
    try:
        cluster.start()
        for i, server in enumerate(cluster.servers):
            print(f"replica {i}: {server.url}  (log: {server.log_path})", file=sys.stderr, flush=True)
        print(f"ready: {cluster.url}  (router log: {cluster.router.log_path}; Ctrl-C stops it and the "
              f"{args.replicas} replicas)", flush=True)
        reported: set[str] = set()

        def serving() -> bool:  # a replica that exits is reported; the router routes around it
            for which, code in cluster.exited().items():
                if which not in reported:
                    reported.add(which)
                    print(f"relaxkv-sglang: warning: {which} exited with code {code}", file=sys.stderr, flush=True)
            return cluster.serving()

        _wait_for_stop(serving)
        exited = None if cluster.serving() else cluster.exited()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    if exited:
        print(f"relaxkv-sglang: error: {', '.join(sorted(exited))} exited; stopped the rest", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args, extra: list[str]) -> int:
    """``serve``: one server until Ctrl-C, SIGTERM or its exit (``--replicas N``: :func:`cmd_serve_replicas`).

        relaxkv-sglang serve --model smollm2-135m --policy pic --port 30000
    """
    if args.replicas < 1:
        raise ServerError(f"--replicas {args.replicas}: must be >= 1")
    if args.replicas > 1:
        return cmd_serve_replicas(args, extra)
    if args.routing is not None:
        raise ServerError("--routing needs --replicas N with N >= 2")
    if "--" in extra:
        raise ServerError("gateway flags (after a second --) need --replicas N with N >= 2")
    policy = serve_policy(args)
    model_path = str(assets.resolve_model(args.model))
    config = ServerConfig(
        model_path=model_path,
        host=args.host,
        port=args.port,
        max_total_tokens=args.max_total_tokens,
        device=args.device,
        relaxkv=not args.stock,
        policy=args.policy,
        extra_args=extra,
        log_path=args.log,
        startup_timeout_s=args.startup_timeout,
        env=serve_env(args, model_path),
    )
    server = SGLangServer(config)
    print(f"starting sglang on {config.host}:{config.port or '(free port)'} "
          f"with {config.model_path}, default policy {policy if config.relaxkv else 'none (--stock)'} "
          f"(log: {args.log or 'a temp file'})", file=sys.stderr, flush=True)
    server.start()
    if server.threads_binding is not None:
        print(f"tensor parallelism on the CPU: {THREADS_BIND_ENV}={server.threads_binding} (each rank's threads on "
              f"its own cores; set {THREADS_BIND_ENV} yourself to choose)", file=sys.stderr, flush=True)
    print(f"ready: {server.url}  (log: {server.log_path}; Ctrl-C stops it)", flush=True)
    return _until_stopped(server, "the server")


def _until_stopped(process: SGLangServer, what: str) -> int:
    """Wait until Ctrl-C, SIGTERM or ``process`` exits, stop it; 1 (with its last error line) if it had failed."""
    try:
        _wait_for_stop(lambda: process.proc.poll() is None)
    finally:
        code = process.proc.poll()
        process.stop()
    if code not in (None, 0):
        print(f"relaxkv-sglang: error: {what} exited with code {code}: {process.last_error_line()}", file=sys.stderr)
        return 1
    return 0


def cmd_gateway(args, extra: list[str]) -> int:
    """``gateway``: the smg gateway with this project's routing in front of replicas already running (on this
    host or others), until Ctrl-C or SIGTERM; flags after ``--`` go to smg. Run one on each of two hosts for
    a gateway that survives its host (each keeps its own routing table: docs/scaling.md).

        relaxkv-sglang gateway --host 10.0.0.4 --port 30000 \\
            --worker-urls http://10.0.0.2:30000 http://10.0.0.3:30000
    """
    from urllib.parse import urlparse

    from relaxkv_sglang.server.cluster import RouterConfig, RouterProcess

    for url in args.worker_urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
            raise ServerError(f"--worker-urls {url}: not a replica URL (http://HOST:PORT)")
    router = RouterProcess(RouterConfig(
        worker_urls=args.worker_urls, routing=args.routing, host=args.host, port=args.port,
        model_path=str(assets.resolve_model(args.model)), extra_args=extra, log_path=args.log,
        startup_timeout_s=args.startup_timeout))
    print(f"starting the smg gateway on {args.host}:{args.port} in front of {' '.join(args.worker_urls)} "
          f"(routing {args.routing})", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # during the start: stop what started
    try:
        router.start()
    except KeyboardInterrupt:
        router.stop()
        return 0
    print(f"ready: {router.url}  (log: {router.log_path}; Ctrl-C stops it)", flush=True)
    return _until_stopped(router, "the gateway")


def cmd_encode(args, extra) -> int:
    from relaxkv_sglang.encode import EncodeError, encode_corpus

    if extra:
        raise ServerError(f"encode takes no extra arguments after --: {' '.join(extra)}")
    try:
        counts = encode_corpus(args.url, args.input, separator=args.separator, batch_size=args.batch_size,
                               state_path=args.state, cache_salt=args.cache_salt, timeout=args.timeout)
    except EncodeError as exc:
        raise ServerError(str(exc)) from None
    print(f"stored {counts['stored']}, skipped {counts['skipped']} (already stored), failed {counts['failed']} "
          f"of {counts['documents']} documents", flush=True)
    return 1 if counts["failed"] else 0


def cmd_model(args, extra) -> int:
    print(assets.model_path(args.name, verify=not args.no_verify))
    return 0


def cmd_data(args, extra) -> int:
    print(assets.data_path(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relaxkv-sglang", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the SGLang server with the plugin and CPU defaults",
                       description="Run sglang.launch_server with the plugin. Flags it does not know go to "
                                   "launch_server unchanged (e.g. --context-length 8192 --enable-metrics), as "
                                   "do flags after --.", allow_abbrev=False)
    s.add_argument("--model", "--model-path", dest="model", default="smollm2-135m",
                   help="model name (%s) or a model folder (SGLang's --model-path)" % ", ".join(assets.MODELS))
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool size in tokens (not sized from RAM)")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s.add_argument("--policy", default=None, choices=list(POLICY.choices), help=_policy_help())
    s.add_argument("--stock", action="store_true", help="plain SGLang: no chunk tree, torch_native attention")
    s.add_argument("--log", default=None, help="server log file (default: a temp file)")
    s.add_argument("--startup-timeout", type=float, default=300.0)
    s.add_argument("--replicas", type=int, default=1,
                   help="N >= 2: N servers on free ports and the smg gateway on --port in front of them")
    s.add_argument("--routing", default=None, choices=["document", "cache_aware", "round_robin"],
                   help="with --replicas: the gateway's policy (default: document, the MinHash routing key, "
                        "new keys by round-robin turn)")
    s.add_argument("--host-cache-gb", type=float, default=None,
                   help="host-memory tier below the KV pool, in GB (evicted chunks spill here; default 0: none)")
    s.add_argument("--chunk-dir", default=None,
                   help="disk tier folder: chunks are written here and served after a restart (may be shared)")
    s.add_argument("--disk-cache-gb", type=float, default=None, help="bound of --chunk-dir in GB (default 10)")
    s.add_argument("--calibration", default=None, metavar="FILE|none",
                   help="the repair knobs' calibration file for the model (RELAXKV_CALIBRATION; default: the "
                        "repository's file for the model, if any; none: the code defaults)")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("gateway", help="the smg gateway with document routing in front of running replicas",
                       description="Run the smg gateway in front of replicas started elsewhere (each host's "
                                   "`serve --host ITS_ADDRESS`). Flags after -- go to smg.")
    g.add_argument("--worker-urls", nargs="+", required=True, metavar="URL",
                   help="the replicas, e.g. http://10.0.0.2:30000 http://10.0.0.3:30000")
    g.add_argument("--host", default="127.0.0.1", help="the address to listen on (this host's)")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--routing", default="document", choices=["document", "cache_aware", "round_robin"])
    g.add_argument("--model", "--model-path", dest="model", default="smollm2-135m",
                   help="the replicas' model (name or folder): the gateway reads its tokenizer from it")
    g.add_argument("--log", default=None, help="gateway log file (default: a temp file)")
    g.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds to wait until every replica is healthy")
    g.set_defaults(func=cmd_gateway)

    e = sub.add_parser("encode", help="pre-encode a corpus into a running server's chunk store")
    e.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    e.add_argument("--input", required=True,
                   help='a .jsonl file of {"text": ...} documents, or a plain text file split by --separator')
    e.add_argument("--separator", default="\n\n",
                   help="document separator of a plain text file (escapes like \\n allowed; default: a blank line)")
    e.add_argument("--batch-size", type=int, default=8, help="documents in flight at once")
    e.add_argument("--state", default=None,
                   help="progress file for resuming (default: INPUT.encoded; 'none' keeps none)")
    e.add_argument("--cache-salt", default=None, help="tenant namespace (SGLang's cache_salt) to store under")
    e.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    e.set_defaults(func=cmd_encode)

    m = sub.add_parser("model", help="prepare a model offline and print its folder")
    m.add_argument("name", choices=assets.MODELS,
                   help="; ".join(f"{name}: {spec.description}" for name, spec in assets.GGUF_MODELS.items())
                   + "; tiny-llama: a 2-layer random-weight model for tests; "
                   + ", ".join(assets.TINY_FAMILY_MODELS) + ": the same for each model family")
    m.add_argument("--no-verify", action="store_true", help="skip the greedy-generation check")
    m.set_defaults(func=cmd_model)

    d = sub.add_parser("data", help="prepare a data set offline and print its path")
    d.add_argument("name", choices=list(assets.DATA_MEMBERS))
    d.set_defaults(func=cmd_data)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # everything after -- goes to sglang.launch_server unchanged
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command != "serve":
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        extra = unknown + extra  # serve: SGLang's own flags, passed through (before any router flags)
    try:
        return args.func(args, extra)
    except (assets.AssetError, ServerError) as exc:
        print(f"relaxkv-sglang: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
