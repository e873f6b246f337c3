"""The repair's decisions under tensor parallelism, on two real gloo ranks (two processes).

Each rank holds half the heads, as a TP=2 server does. Alone, the ranks score the query's attention on their own
heads and would choose different anchors (the row-parallel sums would then add rows of different tokens);
summed over the ranks (``model/tensor_parallel.py``), both choose the anchors of all heads. A forced
disagreement is caught by ``check_same``, naming the layer, on both ranks. CacheBlend's deviation and the LM
head's vocabulary shards reduce to their one-rank values too.
"""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch
import torch.distributed as dist

from relaxkv_sglang.model.tensor_parallel import (ONE_RANK, RankDisagreement, TimedCollectives, check_same, digest,
                                                  place_shard)
from relaxkv_sglang.repair.policies.cacheblend import kv_deviation
from relaxkv_sglang.repair.selection import query_attention_scores, select_anchors

N_LAYERS, N_CONTEXT, N_QUERY, HEADS, KV_HEADS, D = 3, 64, 5, 4, 2, 8
SPANS = [(4, 30), (30, 60)]


class GlooRanks(TimedCollectives):
    """torch.distributed's default (gloo) group: the test's ranks, in place of SGLang's TP coordinator."""

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x)
        return torch.cat(out)


def _model_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's query q [L, n_q, H, d] and keys k [L, n_ctx + n_q, Hkv, d], the same on every rank."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(N_LAYERS, N_QUERY, HEADS, D, generator=g) * 2
    k = torch.randn(N_LAYERS, N_CONTEXT + N_QUERY, KV_HEADS, D, generator=g) * 2
    return q, k


def _anchors(scores: torch.Tensor) -> list[torch.Tensor]:
    return select_anchors("prophetkv", scores, SPANS, N_CONTEXT, 0.2)


def _lists(sets: list[torch.Tensor]) -> list[list[int]]:
    return [s.tolist() for s in sets]  # plain values cross the process boundary (no shared tensor storage)


def _rank_main(rank: int, size: int, init_file: str, results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        ranks = GlooRanks(size, rank, checks=True)
        q, k = _model_inputs()
        heads, kv_heads = slice(rank * HEADS // size, (rank + 1) * HEADS // size), slice(rank, rank + 1)
        every_head = torch.stack([query_attention_scores(q[l], k[l], N_CONTEXT) for l in range(N_LAYERS)])
        mine = torch.stack([query_attention_scores(q[l][:, heads], k[l][:, kv_heads], N_CONTEXT)
                            for l in range(N_LAYERS)])
        alone = _anchors(mine)
        summed = ranks.sum(mine.clone())
        out = {"alone": _lists(alone), "summed_anchors": _lists(_anchors(summed)),
               "every_head_anchors": _lists(_anchors(every_head)), "score_gap": float((summed - every_head).abs().max())}
        try:
            check_same(ranks, [digest(a) for a in alone], [f"layer {l}" for l in range(N_LAYERS)], "the anchors")
            out["disagreement"] = None
        except RankDisagreement as exc:
            out["disagreement"] = str(exc)
        check_same(ranks, [digest(a) for a in _anchors(summed)], ["layer"] * N_LAYERS, "the anchors")
        # CacheBlend's deviation over KV heads, and the LM head's logits over vocabulary shards
        g = torch.Generator().manual_seed(9)
        new, old = torch.randn(2, 40, KV_HEADS, D, generator=g), torch.randn(2, 40, KV_HEADS, D, generator=g)
        whole = kv_deviation(new[0], new[1], old[0], old[1], use_k=True)
        split = kv_deviation(new[0][:, kv_heads], new[1][:, kv_heads], old[0][:, kv_heads], old[1][:, kv_heads],
                             use_k=True, ranks=ranks)
        logits = torch.randn(2, 10, generator=g)
        gathered = ranks.sum(place_shard(logits[:, rank * 5:(rank + 1) * 5].clone(), ranks))
        out.update(deviation_gap=float((split - whole).abs().max()), logits_equal=bool(torch.equal(gathered, logits)),
                   calls=ranks.tally.calls)
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    init_file = str(tmp_path_factory.mktemp("gloo") / "init")
    procs = [ctx.Process(target=_rank_main, args=(r, 2, init_file, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, value in got.items():
        assert isinstance(value, dict), f"rank {rank} failed:\n{value}"
    return got


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
