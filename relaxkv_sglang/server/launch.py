"""Start, wait for and stop a real SGLang server process, the same way for every caller (``serve``, the
demo, the benchmarks, the e2e fixture): in its own process group (stopping it stops the scheduler and
detokenizer children too), on a port checked to be free, with the log in a file, ready only once
``/health_generate`` has generated a token."""

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

from relaxkv_sglang.runtime.settings import DEFAULT_POLICY_ENV, child_environment

CPU_DEFAULTS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--dtype": "float32",
}
# SGLang's idle scheduler polls in a busy loop unless told to sleep: a core stolen from the clients.
CPU_FLAGS = ["--sleep-on-idle"]
# The overlap scheduler is off: chunk reuse folds the batch right before its forward pass.
RELAXKV_FLAGS = ["--attention-backend", "relaxkv", "--radix-cache-backend", "relaxkv", "--disable-overlap-schedule"]
# For tests: a leaked or double-freed KV slot found when the scheduler idles stops the server, not a warning.
STRICT_MEMORY_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def tp_size_of(args: list[str]) -> int:
    """The tensor-parallel size SGLang's command line ``args`` asks for (1 when none)."""
    size = 1
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in TP_FLAGS:
            given = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                size = int(given)
            except ValueError:
                raise ServerError(f"{flag} {given!r}: not a whole number") from None
    return size


def cpu_threads_binding(tp_size: int, cpus: list[int], numa_nodes: int) -> str | None:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp_size`` CPU ranks: None where SGLang binds a rank per NUMA node itself
    (``tp_size <= numa_nodes``), else ``cpus`` cut into ``tp_size`` contiguous groups (``"0|1"``, ``"0-7|8-15"``)."""
    if tp_size <= max(numa_nodes, 1):
        return None
    if len(cpus) < tp_size:
        raise ServerError(f"--tp-size {tp_size} on {len(cpus)} CPU cores: SGLang gives each CPU rank cores of its "
                          f"own; use at most {len(cpus)} ranks, or set {THREADS_BIND_ENV} yourself")
    per, extra = divmod(len(cpus), tp_size)
    groups, start = [], 0
    for rank in range(tp_size):
        n = per + (rank < extra)
        group = cpus[start:start + n]
        start += n
        groups.append(f"{group[0]}-{group[-1]}" if len(group) > 1 and group[-1] - group[0] == len(group) - 1
                      else ",".join(map(str, group)))
    return "|".join(groups)


def machine_cpus() -> tuple[list[int], int]:
    """(the CPU cores this process may run on, the machine's NUMA nodes: 1 where Linux does not say)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    nodes = pathlib.Path("/sys/devices/system/node")
    n_nodes = len([p for p in nodes.glob("node[0-9]*")]) if nodes.is_dir() else 0
    return cpus, max(n_nodes, 1)


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


def end_process_group(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
    """``sig`` to ``proc``'s process group, then SIGKILL if it is still there after ``wait_s``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(wait_s)


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
        self.threads_binding: str | None = None  # SGLANG_CPU_OMP_THREADS_BIND as start() chose it

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> "SGLangServer":
        cfg = self.config
        check_model_path(cfg.model_path)
        env = child_environment(**cfg.env)
        if cfg.policy is not None:
            env[DEFAULT_POLICY_ENV] = cfg.policy
        self.threads_binding = self._bind_cpu_ranks(env)
        return self._launch(env, "relaxkv-sglang-server-")

    def _bind_cpu_ranks(self, env: dict) -> str | None:
        """Set ``SGLANG_CPU_OMP_THREADS_BIND`` in ``env`` when SGLang needs it (CPU ranks beyond the NUMA nodes)
        and it is not set; the binding chosen, or None."""
        tp_size = tp_size_of(self.config.extra_args)
        if self.config.device != "cpu" or tp_size == 1 or env.get(THREADS_BIND_ENV):
            return None
        binding = cpu_threads_binding(tp_size, *machine_cpus())
        if binding is not None:
            env[THREADS_BIND_ENV] = binding
        return binding

    def _launch(self, env: dict, log_prefix: str) -> "SGLangServer":
        """Start ``config.command()`` and wait until ready. A port picked here can be taken before the server
        binds it (a sibling replica's internal ports, an ephemeral port): then it starts again on another, up
        to :data:`PORT_ATTEMPTS` times. A port the caller chose is never swapped."""
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
        """SIGTERM the process group, then SIGKILL the launcher as soon as SGLang's workers have exited: it
        only acts on the signal at its drain watchdog's next tick (every 5 s). After ``timeout_s``, SIGKILL."""
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
    """``(url, None)`` for a server already running at ``url``, else one started from ``make_config()`` (called
    only then) and stopped on exit: ``(its url, the server)``."""
    if url:
        yield url.rstrip("/"), None
        return
    with SGLangServer(make_config()) as server:
        yield server.url, server
