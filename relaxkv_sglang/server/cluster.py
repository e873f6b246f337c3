"""N plugin servers and one ``smg`` gateway (its own process group) in front.

Routing ``document`` keys every request by ``x-smg-routing-key``, the MinHash of its documents that the
project's clients send (:mod:`relaxkv_sglang.request.routing`): a key seen before goes where it went first; a
new key (or a keyless request) takes the gateway's ``round_robin`` turn (``--assignment-mode delegate``), so
after K keys every replica holds floor(K/N) or ceil(K/N) of them, whatever the timing (docs/scaling.md).
``cache_aware`` and ``round_robin`` are the gateway's own policies, for comparison.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import requests

from relaxkv_sglang.request.routing import ROUTING_HEADER
from relaxkv_sglang.server.launch import SGLangServer, ServerConfig, ServerError, free_port
from relaxkv_sglang.runtime.settings import child_environment


ROUTINGS: dict[str, list[str]] = {
    "document": ["--policy", "round_robin", "--routing-key-override", "--assignment-mode", "delegate",
                 "--routing-key-headers", ROUTING_HEADER],
    "cache_aware": ["--policy", "cache_aware"],
    "round_robin": ["--policy", "round_robin"],
}
# Health checks every 5 s, a replica out after 2 failures (a dead replica otherwise stays pinned to
# its routing keys for minutes); user flags after them win.
ROUTER_DEFAULTS = ["--health-check-interval-secs", "5", "--health-failure-threshold", "2"]


@dataclasses.dataclass
class RouterConfig:
    """One ``smg`` gateway process; ``extra_args`` go last (they override the routing flags and
    :data:`ROUTER_DEFAULTS`); the Prometheus port is a free one unless given."""

    worker_urls: list[str]
    routing: str = "document"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    model_path: str | None = None  # the gateway loads its tokenizer from it (else it asks HuggingFace)
    extra_args: list[str] = dataclasses.field(default_factory=list)
    log_path: str | None = None
    startup_timeout_s: float = 120.0

    def command(self) -> list[str]:
        if self.routing not in ROUTINGS:
            raise ServerError(f"--routing {self.routing}: choose one of {', '.join(ROUTINGS)}")
        cmd = [sys.executable, "-m", "smg.launch_router", "--host", self.host, "--port", str(self.port),
               "--worker-urls", *self.worker_urls, *ROUTINGS[self.routing], *ROUTER_DEFAULTS]
        if self.model_path:
            cmd += ["--model-path", self.model_path]
        if "--prometheus-port" not in self.extra_args:
            cmd += ["--prometheus-port", str(free_port())]
        return cmd + list(self.extra_args)


def router_installed() -> bool:
    """Whether the ``smg`` gateway wheel (module ``smg``) is installed."""
    import importlib.util

    return importlib.util.find_spec("smg") is not None


class RouterProcess(SGLangServer):
    """A running ``smg`` gateway: ready once ``/readiness`` reports every worker healthy."""

    def __init__(self, config: RouterConfig):
        super().__init__(config)  # type: ignore[arg-type]  # same process handling, another command

    def start(self) -> "RouterProcess":
        if not router_installed():
            raise ServerError("smg (the gateway) is not installed (make install pins it); --replicas needs it")
        return self._launch(child_environment(NO_COLOR="1", RUST_LOG_STYLE="never"), "relaxkv-sglang-router-")

    def _wait_ready(self) -> None:
        cfg = self.config
        deadline = time.monotonic() + cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"smg exited with code {self.proc.returncode} during startup: "
                                  f"{self.last_error_line()} (log: {self.log_path})")
            try:
                r = requests.get(self.url + "/readiness", timeout=5)
                if r.status_code == 200 and r.json().get("healthy_workers") == len(cfg.worker_urls):
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.5)
        raise ServerError(f"smg not ready after {cfg.startup_timeout_s:.0f} s (log: {self.log_path})")


def healthy_workers(gateway_url: str) -> list[str]:
    """The worker URLs an ``smg`` gateway currently counts healthy (its ``/workers``)."""
    workers = requests.get(gateway_url + "/workers", timeout=10).json()["workers"]
    return [w["url"] for w in workers if w.get("is_healthy")]


class Cluster:
    """N :class:`SGLangServer` replicas (started in parallel) and one :class:`RouterProcess`; :meth:`stop`
    stops the router first, then every replica, each by its process group, so nothing outlives it."""

    def __init__(self, replicas: list[ServerConfig], router: RouterConfig | None):
        self.servers = [SGLangServer(c) for c in replicas]
        self.router_config = router
        self.router: RouterProcess | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def replica_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> "Cluster":
        from concurrent.futures import ThreadPoolExecutor

        def start_one(server: SGLangServer) -> None:
            if not self._stopping:  # a stop (Ctrl-C, a failed sibling) came first: do not start
                server.start()

        self._stopping = False
        pool = ThreadPoolExecutor(len(self.servers))
        try:
            for future in [pool.submit(start_one, s) for s in self.servers]:
                future.result()
            if self.router_config is not None:  # None: the replicas only (routers started by the caller)
                self.router_config.worker_urls = self.replica_urls
                self.router = RouterProcess(self.router_config).start()
        except BaseException:
            self.stop()  # the replicas still starting see their process gone and give up at once
            pool.shutdown(wait=True)
            self.stop()
            raise
        finally:
            pool.shutdown(wait=False)
        return self

    def stop(self) -> None:
        self._stopping = True
        if self.router is not None:
            self.router.stop()
        for server in self.servers:
            server.stop()

    def exited(self) -> dict[str, int]:
        """``{"router" | "replica i": exit code}`` of every process that has exited."""
        out = {}
        if self.router is not None and self.router.proc.poll() is not None:
            out["router"] = self.router.proc.returncode
        for i, server in enumerate(self.servers):
            if server.proc is not None and server.proc.poll() is not None:
                out[f"replica {i}"] = server.proc.returncode
        return out

    def serving(self) -> bool:
        """Whether the router and at least one replica are still running (the router routes around the dead)."""
        gone = self.exited()
        return "router" not in gone and len(gone) < len(self.servers)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


#: OpenMP's wait policy for CPU replicas sharing one machine's cores: a spinning OpenMP thread (the default,
#: after each parallel region) spins against the other replicas' forward passes.
SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def shared_cores_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`SHARED_CORES_ENV` where neither it nor this process's environment sets the variable."""
    inherited = child_environment()
    return {**{k: v for k, v in SHARED_CORES_ENV.items() if k not in env and k not in inherited}, **env}


def replica_configs(base: ServerConfig, replicas: int) -> list[ServerConfig]:
    """Copies of ``base`` on free ports, each with ``--enable-metrics`` (per-replica request counts),
    ``--enable-cache-report`` (``cached_tokens`` in the OpenAI routes' usage, through the gateway), its own log
    beside ``base``'s and, on the CPU, :func:`shared_cores_env`."""
    configs = []
    for i in range(replicas):
        extra = list(base.extra_args) + [f for f in ("--enable-metrics", "--enable-cache-report")
                                         if f not in base.extra_args]
        log = f"{base.log_path}.replica{i}" if base.log_path else None
        env = shared_cores_env(base.env) if base.device == "cpu" else dict(base.env)
        configs.append(dataclasses.replace(base, port=0, extra_args=extra, log_path=log, env=env))
    return configs


def replica_request_counts(urls: list[str]) -> list[int]:
    """Requests each replica has received since it started: the sum of ``sglang:num_requests_total``
    on its ``/metrics`` (needs ``--enable-metrics``), read from the replica itself, not the router."""
    counts = []
    for url in urls:
        text = requests.get(url.rstrip("/") + "/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("sglang:num_requests_total"):
                total += float(line.rsplit(" ", 1)[1])
        counts.append(int(total))
    return counts
