"""Document routing's balance guarantee, on the real gateway, without a model.

``serve --replicas N --routing document`` starts ``smg`` with sticky routing keys whose NEW keys
take the gateway's round-robin turn (:data:`relaxkv_sglang.server.cluster.ROUTINGS`). The promise: the k-th
distinct key goes to the k-th replica in turn, so after K keys every replica holds floor(K/N) or
ceil(K/N) of them, however fast each replica answers. Checked here with the stand-in workers of
``scripts/probe_router_placement.py`` (stdlib HTTP servers, seconds per trial) under the timing
that defeated the old ``min_load`` placement: one worker already holding every key, so it answers
10x faster (``min_load`` put 32 to 36 of the 40 requests there, docs/scaling.md).
"""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest

from relaxkv_sglang.server.cluster import RouterConfig, RouterProcess, router_installed

pytestmark = pytest.mark.skipif(not router_installed(), reason="smg (the gateway) not installed (make install)")

_PROBE = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "probe_router_placement.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_router_placement", _PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workers, keys, clients", [(2, 10, 2), (3, 10, 4)])
def test_new_keys_take_turns_whatever_the_timing(workers, keys, clients):
    probe = _probe()
    stand_ins = [probe.StandInWorker(hit_s=0.02, miss_s=0.2) for _ in range(workers)]
    names = [f"key{i}" for i in range(keys)]
    stand_ins[0].seen.update(names)  # the first worker answers every key fast
    router = RouterProcess(RouterConfig([w.url for w in stand_ins], routing="document")).start()
    try:
        requests_per, keys_per, sticky = probe.run_trial(router.url, [w.port for w in stand_ins], names, rounds=4,
                                                         clients=clients, rng=random.Random(workers))
    finally:
        router.stop()
        for w in stand_ins:
            w.server.shutdown()
    assert sticky  # every key's 4 requests on one worker
    # floor/ceil of K/N keys per worker (which worker takes the extra one is the turn's start)
    assert sorted(keys_per) == sorted([keys // workers + (i < keys % workers) for i in range(workers)]), keys_per
    assert requests_per == [4 * k for k in keys_per]
