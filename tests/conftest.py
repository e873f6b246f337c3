"""Shared fixtures: the tiny model, and one real SGLang server per test session."""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest
import torch

from relaxkv_sglang import assets
from relaxkv_sglang.server import STRICT_MEMORY_CHECK, SGLangServer, ServerConfig

TINY_POOL_TOKENS = 8192


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    return str(assets.model_path("tiny-llama"))


@pytest.fixture(scope="session")
def shim_report_path() -> pathlib.Path:
    fd, path = tempfile.mkstemp(prefix="relaxkv-shims-", suffix=".jsonl")
    os.close(fd)
    return pathlib.Path(path)


@pytest.fixture(scope="session")
def server(tiny_model_path, shim_report_path):
    """Stock SGLang (torch_native attention, its own radix cache) on the tiny model."""
    config = ServerConfig(
        model_path=tiny_model_path,
        max_total_tokens=TINY_POOL_TOKENS,
        relaxkv=False,
        env={"RELAXKV_SHIM_REPORT": str(shim_report_path)},
        extra_args=["--context-length", "4096"],
    )
    with SGLangServer(config) as srv:
        yield srv


@pytest.fixture(scope="session")
def relaxkv_server(tiny_model_path):
    """SGLang with the plugin's chunk tree and attention backend, default policy ``prefix``."""
    config = ServerConfig(
        model_path=tiny_model_path,
        max_total_tokens=TINY_POOL_TOKENS,
        policy="prefix",
        env=STRICT_MEMORY_CHECK,
        extra_args=["--context-length", "4096", "--enable-metrics"],
    )
    with SGLangServer(config) as srv:
        yield srv


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def reference_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from relaxkv_sglang.core.reference import from_hf_state_dict

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return from_hf_state_dict(model.state_dict(), model.config.to_dict())


@pytest.fixture
def serve_launch(monkeypatch, tmp_path):
    """``serve_launch(*ARGS, model_flag="--model")``: the command line and environment
    ``relaxkv-sglang serve MODEL_FLAG DIR --port 0 --log FILE ARGS`` would start the server process
    with (``(None, {})`` when serve stops before launching); nothing is started."""
    from relaxkv_sglang import cli, server

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
