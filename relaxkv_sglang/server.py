"""Start, wait for and stop a real SGLang server process.

Used by ``relaxkv-sglang serve``, ``make demo``, the benchmarks and the
end-to-end test fixture, so every caller launches SGLang the same way: in its
own process group (so stopping it also stops the scheduler and detokenizer
children), on a port checked to be free, with the log in a file, ready only
once ``/health_generate`` has generated a token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

import requests

from relaxkv_sglang.routing import ROUTING_HEADER

CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--dtype": "float32",
}
# SGLang's scheduler polls in a busy loop when idle unless told to sleep; on a
# shared CPU machine that steals a core from the clients it serves.
CPU_FLAGS = ["--sleep-on-idle"]
# The plugin's cache and attention backend; the overlap scheduler is off because
# chunk reuse folds the batch right before its forward pass.
RELAXKV_FLAGS = ["--attention-backend", "relaxkv", "--radix-cache-backend", "relaxkv", "--disable-overlap-schedule"]
# Environment for tests: SGLang checks its KV accounting whenever the scheduler
# idles, and with this set a leaked or double-freed slot stops the server
# instead of logging a warning.
STRICT_MEMORY_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


SGLANG_WORKER_PREFIX = "sglang::"  # SGLang names its worker processes so (sglang::scheduler, ...)


def _sglang_workers_running(group: int) -> bool:
    """Whether a live (not zombie) SGLang worker process is in process group ``group``, from Linux's
    /proc; without /proc, True (the launcher is then waited for until it exits)."""
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == group and state != "Z" and comm.startswith(SGLANG_WORKER_PREFIX):
            return True
    return False


class ServerError(RuntimeError):
    """The server could not be started; the message is one line for the user."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_model_path(model_path: str) -> None:
    path = pathlib.Path(model_path)
    if not path.is_dir():
        raise ServerError(f"--model-path {model_path}: no such directory")
    if not (path / "config.json").is_file():
        raise ServerError(f"--model-path {model_path}: not a model folder (no config.json)")


@dataclasses.dataclass
class ServerConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    max_total_tokens: int = 16384
    device: str = "cpu"
    relaxkv: bool = True  # False: stock SGLang (the plugin loads but stays inert)
    policy: str | None = None  # server default policy (RELAXKV_DEFAULT_POLICY)
    extra_args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log_path: str | None = None
    startup_timeout_s: float = 300.0

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host, "--port", str(self.port),
            "--max-total-tokens", str(self.max_total_tokens),
        ]
        given = set(self.extra_args)
        if self.relaxkv:
            cmd += RELAXKV_FLAGS
            given |= set(RELAXKV_FLAGS[::2])
        if self.device == "cpu":
            for flag, value in CPU_DEFAULTS.items():
                if flag not in given:
                    cmd += [flag, value]
            cmd += [flag for flag in CPU_FLAGS if flag not in given]
        return cmd + list(self.extra_args)


PORT_ATTEMPTS = 3  # starts on a fresh free port when the picked one was taken meanwhile
BIND_FAILED = "error while attempting to bind on address"  # uvicorn's line (sglang 0.5.23) for a taken port


class PortTaken(ServerError):
    """The server's HTTP port was bound by another process between the pick and the bind."""


class SGLangServer:
    """A running ``sglang.launch_server`` process group. Use as a context manager."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self.log_path: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> "SGLangServer":
        cfg = self.config
        check_model_path(cfg.model_path)
        env = dict(os.environ, **cfg.env)
        if cfg.policy is not None:
            env["RELAXKV_DEFAULT_POLICY"] = cfg.policy
        return self._launch(env, "relaxkv-sglang-server-")

    def _launch(self, env: dict, log_prefix: str) -> "SGLangServer":
        """Start ``config.command()`` on its port (0: a free one) with its log, and wait until ready.

        A port picked here can be taken by another process before the server binds it (a
        sibling replica's internal ports, an outgoing connection's ephemeral port); then the
        server is stopped and started again on another free port, up to :data:`PORT_ATTEMPTS`
        times. A port the caller chose is never swapped: that is a clear error instead."""
        cfg = self.config
        picked = cfg.port == 0
        if not picked and port_in_use(cfg.host, cfg.port):
            raise ServerError(f"port {cfg.port} on {cfg.host} is in use; pick another with --port")
        if cfg.log_path is None:
            fd, cfg.log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
            os.close(fd)
        self.log_path = cfg.log_path
        for attempt in range(PORT_ATTEMPTS if picked else 1):
            if picked:
                cfg.port = free_port()
            self._log_file = open(cfg.log_path, "w")
            self.proc = subprocess.Popen(
                cfg.command(), stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # own process group: stop() reaches the children
            )
            try:
                self._wait_ready()
                return self
            except PortTaken:
                self.stop()
                if not picked or attempt == PORT_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"sglang server exited with code {self.proc.returncode} during startup: "
                    f"{self.last_error_line()} (log: {self.log_path})"
                )
            if self._bind_failed():
                # uvicorn logs the failed bind and then waits (SGLang's process stays up), so
                # without this check the start would only end at the timeout.
                raise PortTaken(f"port {self.config.port} on {self.config.host} was taken before the "
                                f"server could bind it (log: {self.log_path})")
            try:
                r = requests.get(self.url + "/health_generate", timeout=10)
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise ServerError(f"sglang server not ready after {self.config.startup_timeout_s:.0f} s (log: {self.log_path})")

    def _log_text(self) -> str | None:
        """The server's log so far (None when it cannot be read)."""
        try:
            return pathlib.Path(self.log_path).read_text(errors="replace")
        except OSError:
            return None

    def _bind_failed(self) -> bool:
        """Whether the server's log says its HTTP port could not be bound."""
        return BIND_FAILED in (self._log_text() or "")

    def last_error_line(self) -> str:
        text = self._log_text()
        if text is None:
            return "no log"
        lines = text.splitlines()
        for line in reversed(lines):
            if "Error" in line or "error:" in line:
                return line.strip()[-300:]
        return lines[-1].strip()[-300:] if lines else "empty log"

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group; once SGLang's workers have exited, end the launcher too.

        The scheduler and detokenizer exit on the signal itself. SGLang's launcher process only
        acts on it at its drain watchdog's next tick (every 5 s) and then finds its workers gone,
        so it is killed as soon as they are rather than waited for; after ``timeout_s`` the whole
        group is killed."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while self.proc.poll() is None and _sglang_workers_running(self.proc.pid):
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(self.proc.args, timeout_s)
                    time.sleep(0.05)
                if self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:  # children that outlived the leader (same group)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def running_server(url: str | None,
                   make_config: Callable[[], ServerConfig]) -> Iterator[tuple[str, SGLangServer | None]]:
    """``(url, None)`` for a server already running at ``url``, else ``(its url, the server)``.

    Without ``url`` a server is started from ``make_config()`` (called only
    then) and stopped on exit: how the demo and the benchmarks get theirs.
    """
    if url:
        yield url.rstrip("/"), None
        return
    with SGLangServer(make_config()) as server:
        yield server.url, server


# ------------------------------------------------------------- replicas behind a gateway
#
# ``relaxkv-sglang serve --replicas N``, the multi-replica benchmark and its test: N plugin servers
# and one ``smg`` gateway (the Shepherd Model Gateway, sglang-router's successor, pinned in the
# requirements; its own process and process group) in front. Routing ``document`` keys every request
# by ``x-smg-routing-key``, the MinHash of its documents that the project's clients send
# (:mod:`relaxkv_sglang.routing`): a key seen before goes where it went first (sticky); a NEW key is
# placed by the gateway's ``round_robin`` turn (``--assignment-mode delegate``), and only new keys
# and keyless requests take a turn. So the k-th distinct key goes to replica k mod N: after K keys
# every replica holds floor(K/N) or ceil(K/N) of them, whatever the timing (docs/scaling.md).
# sglang-router 0.3.2 could not promise this: its new keys went to the fewest requests *in flight*.
# ``cache_aware`` and ``round_robin`` are the gateway's own policies, for comparison.

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
    """One ``smg`` gateway process in front of ``worker_urls``.

    ``extra_args`` go to ``python -m smg.launch_router`` last (so they override the routing flags
    and :data:`ROUTER_DEFAULTS`); the Prometheus port is a free one unless given.
    """

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
        return self._launch(dict(os.environ, NO_COLOR="1", RUST_LOG_STYLE="never"), "relaxkv-sglang-router-")

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

    def healthy_workers(self) -> list[str]:
        """The worker URLs the gateway currently counts healthy (its ``/workers``)."""
        workers = requests.get(self.url + "/workers", timeout=10).json()["workers"]
        return [w["url"] for w in workers if w.get("is_healthy")]


class Cluster:
    """N :class:`SGLangServer` replicas (started in parallel) and one :class:`RouterProcess` in front.

    Use as a context manager; :meth:`stop` stops the router first, then every replica, each by its
    process group, so nothing outlives it.
    """

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


def replica_configs(base: ServerConfig, replicas: int) -> list[ServerConfig]:
    """``replicas`` copies of ``base`` on distinct free ports (``base.port`` ignored), each with
    ``--enable-metrics`` (per-replica request counts on ``/metrics``), ``--enable-cache-report``
    (``cached_tokens`` in the OpenAI routes' usage, for OpenAI clients through the gateway) and its
    own log beside ``base``'s."""
    configs = []
    for i in range(replicas):
        extra = list(base.extra_args) + [f for f in ("--enable-metrics", "--enable-cache-report")
                                         if f not in base.extra_args]
        log = f"{base.log_path}.replica{i}" if base.log_path else None
        configs.append(dataclasses.replace(base, port=0, extra_args=extra, log_path=log, env=dict(base.env)))
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
