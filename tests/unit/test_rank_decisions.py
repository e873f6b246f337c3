"""The repair's decisions under tensor parallelism, on two real gloo ranks (two processes).

Each rank holds half the heads, as a TP=2 server does. Alone, the ranks score the query's attention on their own
heads and would choose different anchors (the row-parallel sums would then add rows of different tokens);
summed over the ranks (``model/tensor_parallel.py``), both choose the anchors of all heads. A forced
disagreement is caught by ``check_same``, naming the layer, on both ranks. CacheBlend's deviation and the LM
head's vocabulary shards reduce to their one-rank values too.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from relaxkv_sglang.model.tensor_parallel import ONE_RANK, check_same, place_shard

RANK_SCRIPT = pathlib.Path(__file__).with_name("tp_ranks.py")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    """Both ranks' results: two processes of their own (not forked: a forked pytest process may hold OpenMP's
    threads, which deadlock the child's first parallel op)."""
    folder = tmp_path_factory.mktemp("gloo")
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(r), "2", str(folder / "init"),
                               str(folder / f"rank{r}.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    for r, p in enumerate(procs):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank {r} failed:\n{output[-3000:]}"
    return {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)}


def test_ranks_alone_choose_different_anchors_and_the_sum_makes_them_those_of_every_head(two_ranks):
    alone = [two_ranks[r]["alone"] for r in (0, 1)]
    assert alone[0] != alone[1], "the premise: each rank's heads rank the tokens otherwise"
    for r in (0, 1):
        assert two_ranks[r]["score_gap"] < 1e-5
        assert two_ranks[r]["summed_anchors"] == two_ranks[r]["every_head_anchors"] == two_ranks[0]["summed_anchors"]


def test_a_disagreement_is_caught_on_every_rank_naming_the_layer(two_ranks):
    first = next(l for l, (a, b) in enumerate(zip(two_ranks[0]["alone"], two_ranks[1]["alone"])) if a != b)
    for r in (0, 1):
        message = two_ranks[r]["disagreement"]
        assert message is not None and f"decided the anchors differently at layer {first} (rank 0: " in message
        assert "the server stops instead of hanging" in message


def test_deviation_and_vocabulary_shards_reduce_to_their_one_rank_values(two_ranks):
    for r in (0, 1):
        assert two_ranks[r]["deviation_gap"] < 1e-5 and two_ranks[r]["logits_equal"]
        assert two_ranks[r]["calls"] == 5  # scores, two checks, deviation, logits: one collective each


def test_one_rank_runs_no_collective():
    x = torch.ones(3)
    assert ONE_RANK.sum(x) is x and ONE_RANK.gather(x).shape == (1, 3) and ONE_RANK.tally.calls == 0
    check_same(ONE_RANK, [1], ["layer 0"], "anything")  # nothing to compare
    assert place_shard(x, ONE_RANK) is x
