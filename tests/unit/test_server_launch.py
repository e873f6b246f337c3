"""The launcher's port handling (relaxkv_sglang/server/launch.py), without SGLang.

A stand-in command plays the server: on its first start it logs uvicorn's failed-bind line and
hangs (what SGLang 0.5.23 does when its HTTP port was taken between the pick and the bind); on
later starts it answers ``/health_generate``. The launcher must notice the line at once, stop the
hung process and start again on another free port; a port the caller chose is never swapped.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from relaxkv_sglang.server import launch as server

STAND_IN = r'''
import http.server, pathlib, sys, time
port, marker = int(sys.argv[1]), pathlib.Path(sys.argv[2])
if not marker.exists():
    marker.write_text("taken")
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    time.sleep(600)
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@dataclasses.dataclass
class StandInConfig(server.ServerConfig):
    script: str = ""
    marker: str = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port), self.marker]


def test_a_taken_port_is_swapped_for_a_free_one(tmp_path):
    cfg = StandInConfig(model_path=str(tmp_path), script=STAND_IN, marker=str(tmp_path / "marker"),
                        log_path=str(tmp_path / "server.log"), startup_timeout_s=60)
    proc = server.SGLangServer(cfg)
    start = time.monotonic()
    proc._launch({}, "stand-in-")
    try:
        assert time.monotonic() - start < 30  # noticed from the log, not at the 60 s timeout
        assert (tmp_path / "marker").exists()  # the first start did hit the taken port
        assert server.BIND_FAILED not in (tmp_path / "server.log").read_text()  # the log is the second start's
        assert proc.proc.poll() is None and proc.url.endswith(str(cfg.port))
    finally:
        proc.stop()


def test_a_port_the_caller_chose_is_not_swapped(tmp_path):
    port = server.free_port()
    cfg = StandInConfig(model_path=str(tmp_path), port=port, script=STAND_IN, marker=str(tmp_path / "marker"),
                        log_path=str(tmp_path / "server.log"), startup_timeout_s=60)
    proc = server.SGLangServer(cfg)
    with pytest.raises(server.PortTaken, match=f"port {port} .* was taken"):
        proc._launch({}, "stand-in-")
    assert proc.proc.poll() is not None  # the hung stand-in was stopped
    assert cfg.port == port


# A stand-in for SGLang's process group at shutdown: the launcher handles SIGTERM only at its
# watchdog's next tick (SGLang's: every 5 s); its worker, named as SGLang names its workers,
# exits ``worker_exit_s`` after the signal.
STAND_IN_GROUP = r'''
import signal, subprocess, sys, time
worker, worker_exit_s = sys.argv[1], sys.argv[2]
script = f"import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: (time.sleep({worker_exit_s}), sys.exit(0)))\nprint('up', flush=True)\ntime.sleep(600)"
child = subprocess.Popen([worker, "-c", script], stdout=subprocess.PIPE)
child.stdout.readline()
signal.signal(signal.SIGTERM, lambda *a: None)  # noted, acted on at the next tick
print("ready", flush=True)
while True:
    time.sleep(5)
'''


@pytest.mark.parametrize("worker_exit_s", [0.0, 1.5])
def test_stop_waits_for_the_workers_not_the_launchers_drain_tick(tmp_path, worker_exit_s):
    worker = tmp_path / f"{server.SGLANG_WORKER_PREFIX}stand"  # its process name (comm) carries SGLang's prefix
    worker.symlink_to(sys.executable)
    proc = server.SGLangServer(server.ServerConfig(model_path=str(tmp_path)))
    proc.proc = subprocess.Popen([sys.executable, "-c", STAND_IN_GROUP, str(worker), str(worker_exit_s)],
                                 stdout=subprocess.PIPE, start_new_session=True)
    with proc.proc.stdout:
        assert proc.proc.stdout.readline() == b"ready\n"
    assert server._sglang_workers_running(proc.proc.pid)
    start = time.monotonic()
    proc.stop()
    took = time.monotonic() - start
    assert proc.proc.poll() is not None and not server._sglang_workers_running(proc.proc.pid)
    assert worker_exit_s <= took < worker_exit_s + 2.5  # waited for the worker, not for the 5-s tick


def test_cpu_ranks_beyond_the_numa_nodes_get_core_groups_of_their_own():
    assert server.tp_size_of(["--context-length", "4096", "--tp-size", "2"]) == 2
    assert server.tp_size_of(["--tensor-parallel-size=4"]) == 4 and server.tp_size_of([]) == 1
    with pytest.raises(server.ServerError, match="--tp-size 'two': not a whole number"):
        server.tp_size_of(["--tp-size", "two"])
    assert server.cpu_threads_binding(2, [0, 1], numa_nodes=1) == "0|1"
    assert server.cpu_threads_binding(4, list(range(16)), numa_nodes=2) == "0-3|4-7|8-11|12-15"
    assert server.cpu_threads_binding(3, [0, 1, 2, 3, 4, 5, 6, 7], numa_nodes=1) == "0-2|3-5|6-7"
    assert server.cpu_threads_binding(2, [0, 2, 4, 6], numa_nodes=1) == "0,2|4,6"  # not contiguous: listed
    assert server.cpu_threads_binding(2, list(range(8)), numa_nodes=2) is None  # SGLang binds a node per rank
    with pytest.raises(server.ServerError, match="--tp-size 4 on 2 CPU cores"):
        server.cpu_threads_binding(4, [0, 1], numa_nodes=1)


def test_serve_sets_the_binding_only_where_sglang_needs_it(serve_launch, monkeypatch):
    monkeypatch.setattr(server, "machine_cpus", lambda: ([0, 1], 1))
    monkeypatch.delenv(server.THREADS_BIND_ENV, raising=False)
    cmd, env = serve_launch("--tp-size", "2")
    assert cmd[cmd.index("--tp-size") + 1] == "2" and env[server.THREADS_BIND_ENV] == "0|1"
    _, env = serve_launch()
    assert server.THREADS_BIND_ENV not in env
    monkeypatch.setenv(server.THREADS_BIND_ENV, "1|0")  # the user's choice stays
    _, env = serve_launch("--tp-size", "2")
    assert env[server.THREADS_BIND_ENV] == "1|0"
