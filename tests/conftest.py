"""Shared fixtures: the tiny model, the real SGLang servers of a test session, started side by side.

Starting an SGLang server takes 20-40 s on the 2-core machine (mostly imports in its three
processes), and a start keeps about one core busy. So the servers a run needs are all launched
when collection ends, the first alone and then two at a time, while the first tests run
(:class:`ServerPrestart`): the session's two (``server``, ``relaxkv_server``) and those a test
module declares in its ``PRESTART_SERVERS`` (fixture name -> ``start(tiny_model_path)``, which
returns the started server or cluster; it has a ``stop()``), each launched when a collected test
names its fixture or carries ``pytest.mark.prestart(name)`` (a parametrized fixture's params can:
one server per param). A fixture takes its server with
``prestart.serving(name, start)`` (waiting while it starts; calling ``start()`` then if it was not
launched), which stops it when the fixture's scope ends, as before. Only servers a collected test
needs are launched.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import tempfile
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from relaxkv_sglang import assets
from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, SGLangServer, ServerConfig
from relaxkv_sglang.runtime.settings import TP_CHECK_ENV

TINY_POOL_TOKENS = 8192
PRESTART_AT_ONCE = 2  # launches in flight together: each keeps ~1 of 2 cores busy while it imports (measured
# on the tiny model: one alone 26 s, two at once 39 s each, three 57 s each)


class ServerPrestart:
    """Servers launched in the background at the session's start, taken by their fixtures."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(PRESTART_AT_ONCE, thread_name_prefix="prestart")
        self._starting: dict[str, concurrent.futures.Future] = {}
        self._first: Optional[concurrent.futures.Future] = None

    def launch(self, name: str, start: Callable[[], Any]) -> None:
        """Start ``start()`` in the background. The first launch runs alone, since the first test
        waits for it; the later ones follow once it is up, ``PRESTART_AT_ONCE`` at a time."""
        if self._first is None:
            self._first = self._starting[name] = self._pool.submit(start)
        else:
            self._starting[name] = self._pool.submit(self._after_first, start)

    def _after_first(self, start: Callable[[], Any]) -> Any:
        concurrent.futures.wait([self._first])
        return start()

    @contextlib.contextmanager
    def serving(self, name: str, start: Callable[[], Any]) -> Iterator[Any]:
        """``with prestart.serving(name, start) as server:`` the server launched as ``name`` once
        started (else ``start()``'s), stopped on exit (a fixture yields it inside)."""
        future = self._starting.pop(name, None)
        server = future.result() if future is not None else start()
        try:
            yield server
        finally:
            server.stop()

    def close(self) -> None:
        """Stop every launched server no fixture took (a run stopped early, a deselected test)."""
        for future in self._starting.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        for future in self._starting.values():
            if not future.cancelled() and future.exception() is None:
                future.result().stop()
        self._starting.clear()


PRESTART = ServerPrestart()
_fd, _path = tempfile.mkstemp(prefix="relaxkv-shims-", suffix=".jsonl")
os.close(_fd)
SHIM_REPORT = pathlib.Path(_path)  # where the stock server's shims say they are active


def stock_server_config(model_path: str) -> ServerConfig:
    """Stock SGLang (torch_native attention, its own radix cache) on the tiny model; its shims
    report to :data:`SHIM_REPORT`."""
    return ServerConfig(model_path=model_path, max_total_tokens=TINY_POOL_TOKENS, relaxkv=False,
                        env={"RELAXKV_SHIM_REPORT": str(SHIM_REPORT)}, extra_args=["--context-length", "4096"])


def relaxkv_server_config(model_path: str) -> ServerConfig:
    """SGLang with the plugin's chunk tree and attention backend, default policy ``prefix``."""
    return ServerConfig(model_path=model_path, max_total_tokens=TINY_POOL_TOKENS, policy="prefix",
                        env=STRICT_MEMORY_CHECK, extra_args=["--context-length", "4096", "--enable-metrics"])


def tensor_parallel(config: ServerConfig, tp_size: int = 2) -> ServerConfig:
    """``config`` over ``tp_size`` tensor-parallel ranks (one CPU core each: the launcher binds them), with the
    ranks comparing each fold and repair schedule (``RELAXKV_TP_CHECK``: a disagreement stops the server)."""
    config.extra_args = [*config.extra_args, "--tp-size", str(tp_size)]
    config.env = {**config.env, TP_CHECK_ENV: "1"}
    return config


def relaxkv_tp2_server_config(model_path: str) -> ServerConfig:
    """:func:`relaxkv_server_config` over two tensor-parallel ranks."""
    return tensor_parallel(relaxkv_server_config(model_path))


def start_server(config: Callable[[str], ServerConfig]) -> Callable[[str], SGLangServer]:
    """``start(model_path)`` for :data:`PRESTART_SERVERS`: an SGLang server from ``config(model_path)``,
    given the suite's start deadline (``rag_helpers.SERVER_START_TIMEOUT_S``: a hang guard sized for
    a loaded machine) unless its config asks for more."""
    def start(model_path: str) -> SGLangServer:
        from rag_helpers import SERVER_START_TIMEOUT_S  # tests/e2e is on sys.path once its modules are collected

        cfg = config(model_path)
        cfg.startup_timeout_s = max(cfg.startup_timeout_s, SERVER_START_TIMEOUT_S)
        return SGLangServer(cfg).start()

    return start


SESSION_SERVERS = {"server": start_server(stock_server_config), "relaxkv_server": start_server(relaxkv_server_config),
                   "relaxkv_tp2_server": start_server(relaxkv_tp2_server_config)}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Launch the servers the collected tests need, in the order the tests first need them."""
    if session.config.option.collectonly:
        return
    starts: dict[str, Callable[[str], Any]] = dict(SESSION_SERVERS)
    needed: list[str] = []
    for item in session.items:
        starts.update(getattr(getattr(item, "module", None), "PRESTART_SERVERS", {}))
        names = [*getattr(item, "fixturenames", ()), *(n for mark in item.iter_markers("prestart") for n in mark.args)]
        needed += [name for name in names if name in starts and name not in needed]
    if needed:
        path = str(assets.model_path("tiny-llama"))
        for name in needed:
            PRESTART.launch(name, lambda start=starts[name]: start(path))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "prestart(name): launch PRESTART_SERVERS[name] when the session starts")


def pytest_sessionfinish(session: pytest.Session) -> None:
    PRESTART.close()


@pytest.fixture(scope="session")
def prestart() -> ServerPrestart:
    return PRESTART


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    return str(assets.model_path("tiny-llama"))


@pytest.fixture(scope="session")
def shim_report_path() -> pathlib.Path:
    return SHIM_REPORT


@pytest.fixture(scope="session")
def server(tiny_model_path, prestart):
    """Stock SGLang on the tiny model (:func:`stock_server_config`)."""
    with prestart.serving("server", lambda: SESSION_SERVERS["server"](tiny_model_path)) as srv:
        yield srv


@pytest.fixture(scope="session")
def relaxkv_server(tiny_model_path, prestart):
    """SGLang with the plugin's chunk tree and attention backend, default policy ``prefix``."""
    with prestart.serving("relaxkv_server", lambda: SESSION_SERVERS["relaxkv_server"](tiny_model_path)) as srv:
        yield srv


@pytest.fixture(scope="session")
def relaxkv_tp2_server(tiny_model_path, prestart):
    """:func:`relaxkv_server` over two tensor-parallel ranks (:func:`relaxkv_tp2_server_config`)."""
    with prestart.serving("relaxkv_tp2_server",
                          lambda: SESSION_SERVERS["relaxkv_tp2_server"](tiny_model_path)) as srv:
        yield srv


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def reference_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from relaxkv_sglang.repair.reference import from_hf_state_dict

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return from_hf_state_dict(model.state_dict(), model.config.to_dict())


@pytest.fixture
def serve_launch(monkeypatch, tmp_path):
    """``serve_launch(*ARGS, model_flag="--model")``: the command line and environment
    ``relaxkv-sglang serve MODEL_FLAG DIR --port 0 --log FILE ARGS`` would start the server process
    with (``(None, {})`` when serve stops before launching); nothing is started."""
    from relaxkv_sglang import cli
    from relaxkv_sglang.server import launch as server

    def run(*args: str, model_flag: str = "--model") -> tuple:
        launched = []

        def fake_popen(cmd, env, **kwargs):
            launched.append((cmd, env))
            raise server.ServerError("not launched in a unit test")

        monkeypatch.setattr(server.subprocess, "Popen", fake_popen)
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
        assert cli.main(["serve", model_flag, str(model), "--port", "0", "--log", str(tmp_path / "log"), *args]) == 1
        assert len(launched) <= 1
        return launched[0] if launched else (None, {})

    return run


@pytest.fixture
def serve_env(serve_launch):
    """``serve_env(*ARGS)``: the environment of :func:`serve_launch`'s server process ({} when serve
    stops before launching)."""
    return lambda *args: serve_launch(*args)[1]


@pytest.fixture
def settings_env(monkeypatch):
    """``settings_env(NAME=value, ...)``: set (None: unset) ``RELAXKV_*`` variables and read this
    process's server settings again, as a server starting with them would; the settings are read
    afresh from the restored environment after the test."""
    from relaxkv_sglang.runtime.settings import server_settings

    def set_env(**env: Optional[str]) -> None:
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        server_settings.cache_clear()

    yield set_env
    server_settings.cache_clear()
