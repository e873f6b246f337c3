"""One of the test's tensor-parallel ranks, run as its own process (``tests/unit/test_rank_decisions.py``):
``python tests/unit/tp_ranks.py RANK SIZE INIT_FILE OUT_JSON`` writes what the rank decided as JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from relaxkv_sglang.model.tensor_parallel import RankDisagreement, TimedCollectives, check_same, digest, place_shard
from relaxkv_sglang.repair.policies.cacheblend import kv_deviation
from relaxkv_sglang.attention.query_scores import query_attention_scores
from relaxkv_sglang.repair.selection import select_anchors

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
    return [s.tolist() for s in sets]  # plain values cross the process boundary


def rank_main(rank: int, size: int, init_file: str) -> dict:
    """Rank ``rank`` of ``size``: what it decided alone and summed, and what ``check_same`` said."""
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
               "every_head_anchors": _lists(_anchors(every_head)),
               "score_gap": float((summed - every_head).abs().max())}
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
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    rank, size, init_file, out_json = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(out_json, "w") as f:
        json.dump(rank_main(rank, size, init_file), f)
