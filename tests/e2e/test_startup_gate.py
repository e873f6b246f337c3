"""The startup correctness gate, end to end (tiny model).

* On the session's relaxkv server (the model's own RoPE) the gate passed: /get_server_info and
  /metrics report it with errors at fp32 rounding level, and its slots came back.
* A server whose served rotation is deliberately wrong (``RELAXKV_TEST_ROPE_OVERRIDE``: RoPE theta
  20000 for a model trained with 10000; the cache really re-rotates with it) fails the gate: every
  chunk policy gets HTTP 400 naming the reason, on /generate and on chat; ``full`` and ``prefix``
  are served, and a request naming no policy gets ``prefix`` although the server default is ``pic``.
"""

from __future__ import annotations

import pytest
import requests
from conftest import start_server
from rag_helpers import SERVER_START_TIMEOUT_S, documents, flush, generate, marked_prompt, relaxkv_state

from relaxkv_sglang.repair.policies import CHUNK_POLICIES
from relaxkv_sglang.server.launch import STRICT_MEMORY_CHECK, ServerConfig
from relaxkv_sglang.runtime.settings import ROPE_OVERRIDE_ENV

pytestmark = pytest.mark.e2e

CHECKS = ("rope_k", "pic_kv", "pic_logits")


def _metrics(url: str, prefix: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix) and not line.startswith("#")}


def test_gate_passes_on_the_tiny_model(relaxkv_server):
    flush(relaxkv_server.url)
    state = relaxkv_state(relaxkv_server.url)
    gate = state["gate"]
    assert (gate["status"], gate["reason"], gate["dtype"]) == ("passed", "", "float32")
    assert gate["offset"] == 4096 - gate["n_tokens"] and 16 <= gate["n_tokens"] <= 64
    assert 0 < gate["seconds"] < 30
    assert set(gate["checks"]) == set(CHECKS)
    for name, check in gate["checks"].items():
        assert check["passed"] and check["tolerance"] == 2e-3
        assert 0 <= check["max_error"] < 5e-4, (name, check)  # measured ~9e-5: fp32 rounding at p = 4048
    # the gate's 4n slots came back (the strict idle check would also have stopped the server)
    assert state["kv_available_tokens"] == state["kv_total_tokens"]
    metrics = _metrics(relaxkv_server.url, "relaxkv:gate_")
    assert metrics['relaxkv:gate_passed{reason=""}'] == 1.0
    for name in CHECKS:
        assert metrics[f'relaxkv:gate_max_error{{check="{name}"}}'] == pytest.approx(gate["checks"][name]["max_error"])
        assert metrics[f'relaxkv:gate_tolerance{{check="{name}"}}'] == 2e-3


def wrong_rope_config(model_path: str) -> ServerConfig:
    return ServerConfig(
        model_path=model_path, max_total_tokens=2048, policy="pic",
        env={**STRICT_MEMORY_CHECK, ROPE_OVERRIDE_ENV: '{"base": 20000.0}'},
        extra_args=["--context-length", "4096", "--enable-metrics"], startup_timeout_s=SERVER_START_TIMEOUT_S,
    )


start_wrong_rope = start_server(wrong_rope_config)


PRESTART_SERVERS = {"wrong_rope_server": start_wrong_rope}  # launched at the session's start (conftest)


@pytest.fixture(scope="module")
def wrong_rope_server(tiny_model_path, prestart):
    with prestart.serving("wrong_rope_server", lambda: start_wrong_rope(tiny_model_path)) as srv:
        yield srv


def test_wrong_rotation_fails_the_gate_and_refuses_chunk_policies(wrong_rope_server):
    url = wrong_rope_server.url
    gate = relaxkv_state(url)["gate"]
    assert gate["status"] == "failed"
    assert "do not match the model's own RoPE" in gate["reason"]
    assert gate["checks"]["rope_k"]["max_error"] > 0.5  # measured 1.5: 750x the tolerance
    assert gate["checks"]["pic_logits"]["max_error"] > 0.1
    assert not any(c["passed"] for c in gate["checks"].values())

    prompt = marked_prompt("Answer from the documents.", documents(2, seed=3), "Question: what is it about?")
    for policy in sorted(CHUNK_POLICIES):
        body = {"text": prompt.text, "sampling_params": {
            "max_new_tokens": 2, "custom_params": {"relaxkv_policy": policy, "relaxkv_chunks": prompt.offsets}}}
        r = requests.post(url + "/generate", json=body, timeout=120)
        assert r.status_code == 400, (policy, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(f"invalid relaxkv_policy: {policy!r} is refused by this server: its startup "
                                  "correctness gate failed (keys re-rotated by the plugin's RoPE"), message
        assert "rope_k FAILED" in message
    chat = {"model": "tiny", "max_tokens": 2, "custom_params": {"relaxkv_policy": "pic"},
            "messages": [{"role": "user", "content": "A document about ships. Question: what?"}]}
    r = requests.post(url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 400 and "startup correctness gate failed" in r.text, r.text

    full = generate(url, prompt, policy="full")
    prefix = generate(url, prompt, policy="prefix")
    unnamed = generate(url, prompt.text)  # the server default is pic: served as prefix instead
    assert full["output_ids"] == prefix["output_ids"] == unnamed["output_ids"]
    assert relaxkv_state(url)["chunk_lookups"] == 0  # no request went near the chunk tree

    metrics = _metrics(url, "relaxkv:gate_")
    passed = [v for k, v in metrics.items() if k.startswith("relaxkv:gate_passed")]
    assert passed == [0.0]
    assert metrics['relaxkv:gate_max_error{check="rope_k"}'] == pytest.approx(gate["checks"]["rope_k"]["max_error"])
    log = open(wrong_rope_server.log_path).read()
    lines = [line for line in log.splitlines() if "correctness gate FAILED" in line]
    assert len(lines) == 1 and "are refused with HTTP 400" in lines[0], lines


@pytest.mark.long  # two refused starts, ~15 s each: SGLang imports before it parses the flag
@pytest.mark.parametrize("backends", [["--attention-backend", "relaxkv", "--radix-cache-backend", "relaxkv"],
                                      ["--radix-cache-backend", "relaxkv"]], ids=["both", "tree_cache_only"])
def test_deterministic_inference_is_refused_at_startup_saying_why(tiny_model_path, tmp_path, backends):
    """``--enable-deterministic-inference`` with a relaxkv backend: the server stops before any
    process starts, and its last line says why (``server/sglang/deterministic.py``), before SGLang's
    own "only [...] attention backends are supported" (which names no reason, and which a GPU
    server with SGLang's flashinfer attention and the relaxkv tree cache would pass)."""
    from relaxkv_sglang.server.launch import ServerError, SGLangServer
    from relaxkv_sglang.server.sglang.deterministic import REFUSAL

    config = ServerConfig(model_path=tiny_model_path, relaxkv=False,
                          extra_args=backends + ["--enable-deterministic-inference"],
                          log_path=str(tmp_path / "server.log"), startup_timeout_s=SERVER_START_TIMEOUT_S)
    with pytest.raises(ServerError) as refused:
        SGLangServer(config).start()
    assert REFUSAL in str(refused.value), str(refused.value)
