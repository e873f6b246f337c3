"""The real SGLang server on a plain CPU, with the plugin and its shims."""

from __future__ import annotations

import json

import psutil
import pytest
import requests

from relaxkv_patches import SHIMS

pytestmark = pytest.mark.e2e


def _scheduler_pids(server) -> set[int]:
    leader = psutil.Process(server.proc.pid)
    return {
        child.pid
        for child in leader.children(recursive=True)
        if "scheduler" in " ".join(child.cmdline()).lower() or "scheduler" in child.name().lower()
    }


def test_generate_greedy_is_deterministic(server):
    body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    first = requests.post(server.url + "/generate", json=body, timeout=60).json()
    second = requests.post(server.url + "/generate", json=body, timeout=60).json()
    assert first["meta_info"]["completion_tokens"] == 8
    assert first["output_ids"] == second["output_ids"]
    # The second request reuses the first one's prompt through SGLang's radix cache.
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1


def test_each_shim_is_active_in_the_scheduler_process(server, shim_report_path):
    schedulers = _scheduler_pids(server)
    assert schedulers, "no scheduler process found under the server"
    records = [json.loads(line) for line in shim_report_path.read_text().splitlines() if line.strip()]
    for shim in SHIMS:
        pids = {r["pid"] for r in records if r["shim"] == shim}
        assert pids & schedulers, f"shim {shim} did not act in the scheduler (acted in {pids}, schedulers {schedulers})"


def test_plugin_loaded_in_scheduler(server):
    log = open(server.log_path).read()
    assert "[relaxkv] CPU shims active in pid" in log
