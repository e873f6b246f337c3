"""Layer-by-layer reference executor for one request of a registered model family, every policy: the numerical reference
(float32, CPU) the SGLang integration is checked against.

Request: ``[prefix][chunk_1](glue)[chunk_2]...[chunk_n][query]``; the glue is computed with the request like the
query: never stale, never an anchor. :func:`reference_prefill`: (1) stale KV: each chunk alone at ``0..len-1``, its K
re-rotated by its start; (2) the query over it: ``pic``'s logits and s_l; (3) the server's planner; (4) repair: at
layer l only ``A_l``, the glue and the query are computed at their positions and written over the stale K/V (after
the policy's step, if any).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from relaxkv_sglang.attention.causal import dense_causal_attention
from relaxkv_sglang.attention.block_sparse import block_sparse_attention
from relaxkv_sglang.attention.layout import BlockSparseLayout
from relaxkv_sglang.model.model_family import finish_layer, project_qkv
from relaxkv_sglang.repair.policies.base import LayerEdit, MeasuredKV
from relaxkv_sglang.repair.policies import Policy, PolicySpec, policy_spec
from relaxkv_sglang.model.reference_model import LlamaWeights, ReferenceLayerOps, apply_neox_rope, from_hf_state_dict
from relaxkv_sglang.model.reference_model import rms_norm as _rms_norm
from relaxkv_sglang.repair.repair_config import RepairConfig, RepairCost
from relaxkv_sglang.repair.anchor_schedule import AnchorSchedule, schedule_anchors
from relaxkv_sglang.attention.query_scores import query_attention_scores
from relaxkv_sglang.repair.selection import eligible_tokens

Span = tuple[int, int]

__all__ = [
    "LlamaWeights",
    "from_hf_state_dict",
    "ReferenceLayerOps",
    "apply_neox_rope",
    "RepairReport",
    "Result",
    "build_stale_kv",
    "glue_tokens",
    "StaleContext",
    "stale_context",
    "query_over",
    "reference_prefill",
]


def _project_qkv(w: LlamaWeights, layer: dict, h: torch.Tensor,
                 pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [n, hidden] residual stream -> q [n, H, hd], k/v [n, Hkv, hd], RoPE'd at pos."""
    return project_qkv(ReferenceLayerOps(w, layer), w.family, h, pos)


def _finish_layer(w: LlamaWeights, layer: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual + o_proj, then residual + SwiGLU MLP.  h [n, hidden], attn [n, H, hd]."""
    return finish_layer(ReferenceLayerOps(w, layer), h, attn)


def _logits(w: LlamaWeights, h_last: torch.Tensor) -> torch.Tensor:
    """h_last [hidden] -> float32 [vocab]."""
    return torch.nn.functional.linear(_rms_norm(h_last, w.norm, w.rms_eps), w.lm_head.float()).float()


def _causal_prefill(w: LlamaWeights, ids: torch.Tensor, pos: torch.Tensor):
    """(per layer (k [n, Hkv, hd], v [n, Hkv, hd]), final residual [n, hidden]) of ``ids`` at ``pos``."""
    h = w.embed[ids].float()
    kv = []
    for layer in w.layers:
        q, k, v = _project_qkv(w, layer, h, pos)
        kv.append((k, v))
        h = _finish_layer(w, layer, h, dense_causal_attention(q, k, v, pos, pos))
    return kv, h


@dataclass
class RepairReport:
    """What one request's repair did: ``context_ratio`` repair_kv_pairs / full_kv_pairs (same anchors, full prefix)."""

    policy: str
    n_context: int
    n_eligible: int
    anchors_per_layer: list[int] = field(default_factory=list)
    anchor_ratio: float = 0.0
    context_ratio: float = 1.0
    repair_kv_pairs: int = 0
    full_kv_pairs: int = 0
    query_kv_pairs: int = 0
    recomputed_token_layers: int = 0


@dataclass
class Result:
    """``last_logits`` float32 [vocab]; ``kv`` per layer (k [n_tokens, n_kv_heads, head_dim] post-RoPE, v [same])
    float32; ``anchors`` per layer int64 sorted; ``scores`` float32 [n_layers, n_context] s_l, or None."""

    last_logits: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    report: RepairReport
    anchors: list[torch.Tensor]
    scores: Optional[torch.Tensor] = None


def _check_request(input_ids: torch.Tensor, chunk_spans: Sequence[Span], query_start: int) -> list[Span]:
    n = input_ids.numel()
    if not 0 <= query_start < n:
        raise ValueError("need at least one query token: 0 <= query_start < len(input_ids)")
    spans = [(int(s), int(e)) for s, e in chunk_spans]
    if spans:
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            if e0 > s1:
                raise ValueError(f"chunk spans must be sorted and not overlap: {spans}")
        if spans[-1][1] != query_start or any(s >= e for s, e in spans) or spans[0][0] < 0:
            raise ValueError(f"chunk spans must be non-empty and end at query_start: {spans}")
    return spans


def glue_tokens(chunk_spans: Sequence[Span], query_start: int) -> torch.Tensor:
    """int64 [n_glue] sorted positions after the first chunk's start that no chunk covers."""
    if not chunk_spans:
        return torch.zeros(0, dtype=torch.long)
    covered = torch.zeros(query_start, dtype=torch.bool)
    covered[: chunk_spans[0][0]] = True  # the prefix
    for s, e in chunk_spans:
        covered[s:e] = True
    return (~covered).nonzero().flatten()


def _fresh_pass(w: "LlamaWeights", input_ids: torch.Tensor, rows: torch.Tensor,
                kv: list[tuple[torch.Tensor, torch.Tensor]], score_from: Optional[int] = None):
    """The tokens at ``rows`` (int64 [n_rows] sorted), dense causal, each layer's K/V written into ``kv`` (per layer (k
    [n_buf, n_kv_heads, head_dim], v [same]) float32) first: (residual [n_rows, hidden], with ``score_from`` s_l
    float32 [n_layers, score_from] of the rows from there on)."""
    h = w.embed[input_ids[rows]].float()
    scores = []
    for l, layer in enumerate(w.layers):
        q, k, v = _project_qkv(w, layer, h, rows)
        keys, vals = kv[l]
        keys[rows], vals[rows] = k, v
        if score_from is not None:
            scores.append(query_attention_scores(q[rows >= score_from], keys, score_from))
        h = _finish_layer(w, layer, h, dense_causal_attention(q, keys, vals, rows, torch.arange(keys.shape[0])))
    return h, (torch.stack(scores) if score_from is not None else None)


def build_stale_kv(
    weights: LlamaWeights,
    input_ids: torch.Tensor,
    chunk_spans: Sequence[Span],
    query_start: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step 1's position-independent KV: per layer (k [query_start, n_kv_heads, head_dim], v [same]) float32."""
    spans = _check_request(input_ids, chunk_spans, query_start)
    prefix_len = spans[0][0] if spans else query_start
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    if prefix_len:
        pieces.append(_causal_prefill(weights, input_ids[:prefix_len], torch.arange(prefix_len))[0])
    inv = weights.rope_inv_freq()
    shape = (weights.n_kv_heads, weights.head_dim)
    for i, (s, e) in enumerate(spans):
        if i and s > spans[i - 1][1]:  # glue slots, filled by the glue's own pass below
            gap = s - spans[i - 1][1]
            pieces.append([(torch.zeros(gap, *shape), torch.zeros(gap, *shape))] * weights.n_layers)
        kv, _ = _causal_prefill(weights, input_ids[s:e], torch.arange(e - s))
        delta = torch.full((e - s,), s, dtype=torch.long)
        pieces.append([(apply_neox_rope(k, delta, inv, weights.rotary_dim), v) for k, v in kv])
    kv = [(torch.cat([p[l][0] for p in pieces]), torch.cat([p[l][1] for p in pieces]))
          for l in range(weights.n_layers)]
    glue = glue_tokens(spans, query_start)
    if glue.numel():
        _fresh_pass(weights, input_ids, glue, kv)
    return kv


def query_over(w: LlamaWeights, input_ids: torch.Tensor, query_start: int,
               context_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """The query over ``context_kv`` (per layer (k [query_start, n_kv_heads, head_dim], v [same]) float32): (logits
    float32 [vocab], per layer the context KV then the query's, s_l float32 [n_layers, query_start])."""
    n_q = input_ids.numel() - query_start
    kv = [(torch.cat([k, k.new_zeros(n_q, *k.shape[1:])]), torch.cat([v, v.new_zeros(n_q, *v.shape[1:])]))
          for k, v in context_kv]
    h, scores = _fresh_pass(w, input_ids, torch.arange(query_start, input_ids.numel()), kv, score_from=query_start)
    return _logits(w, h[-1]), kv, scores


@dataclass
class StaleContext:
    """What every chunk-reusing policy starts from: ``pic_logits`` float32 [vocab], ``query_kv`` (``kv`` then the
    query's own), ``scores`` float32 [n_layers, query_start] s_l."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    pic_logits: torch.Tensor
    query_kv: list[tuple[torch.Tensor, torch.Tensor]]
    scores: torch.Tensor


def stale_context(weights: LlamaWeights, input_ids: torch.Tensor, chunk_spans: Sequence[Span],
                  query_start: int) -> StaleContext:
    """The stale KV and the query pass over it; arguments as :func:`reference_prefill`."""
    input_ids = input_ids.to(torch.long).flatten()
    stale = build_stale_kv(weights, input_ids, chunk_spans, query_start)
    logits, q_kv, scores = query_over(weights, input_ids, query_start, stale)
    return StaleContext(stale, logits, q_kv, scores)


def reference_prefill(
    weights: LlamaWeights,
    input_ids: torch.Tensor,
    chunk_spans: Sequence[Span],
    query_start: int,
    policy: Policy | str | PolicySpec,
    config: RepairConfig = RepairConfig(),
    stale: Optional[StaleContext] = None,
) -> Result:
    """Prefill one request under ``policy``, decided by the server's planner
    (:func:`~relaxkv_sglang.repair.anchor_schedule.schedule_anchors`), so the reference and the server differ only in
    how they execute. ``input_ids`` int64 [n_tokens]; ``stale``: this request's :func:`stale_context`, to compare
    policies without recomputing it. Example (a 2-layer random model; with every token an anchor at every layer and
    full context, the repair equals full prefill; ``pic`` does not):

    >>> g = torch.Generator().manual_seed(0)
    >>> def rand(*shape): return torch.randn(*shape, generator=g) * 0.3
    >>> def layer(): return dict(attn_norm=torch.ones(16), q=rand(16, 16), k=rand(8, 16), v=rand(8, 16), o=rand(16, 16),
    ...                          mlp_norm=torch.ones(16), gate=rand(32, 16), up=rand(32, 16), down=rand(16, 32))
    >>> weights = LlamaWeights(embed=rand(50, 16), layers=[layer(), layer()], norm=torch.ones(16),
    ...                        lm_head=rand(50, 16), n_heads=2, n_kv_heads=1, head_dim=8)
    >>> ids, spans = torch.randint(0, 50, (40,), generator=g), [(4, 20), (20, 36)]  # prefix 0..3, query 36..39
    >>> full, pic = (reference_prefill(weights, ids, spans, 36, policy).last_logits for policy in ("full", "pic"))
    >>> config = RepairConfig(anchor_ratio=1.0, context_ratio=1.0, page_size=4)
    >>> repaired = reference_prefill(weights, ids, spans, 36, "relaxkv", config).last_logits
    >>> torch.allclose(repaired, full, atol=1e-4), torch.allclose(pic, full, atol=1e-4)
    (True, False)
    """
    spec = policy_spec(policy)
    input_ids = input_ids.to(torch.long).flatten()
    spans = _check_request(input_ids, chunk_spans, query_start)
    n, L = input_ids.numel(), weights.n_layers
    elig = eligible_tokens(spans, query_start)
    report = RepairReport(policy=spec.name, n_context=query_start, n_eligible=int(elig.numel()))
    # Glue and query: computed at every layer, each over its causal prefix.
    fresh = torch.cat([glue_tokens(spans, query_start), torch.arange(query_start, n)])
    report.query_kv_pairs = int((fresh + 1).sum()) * L
    no_anchors = [torch.zeros(0, dtype=torch.long)] * L
    if not spec.reuses_chunks:
        kv, h = _causal_prefill(weights, input_ids, torch.arange(n))
        return Result(_logits(weights, h[-1]), kv, report, no_anchors)
    if stale is None:
        stale = stale_context(weights, input_ids, spans, query_start)
    if not spec.repairs:  # pic
        return Result(stale.pic_logits, stale.query_kv, report, no_anchors, stale.scores)

    scores = stale.scores if spec.needs_query_scores else None
    w = weights
    cost = RepairCost.from_dims(w.embed.shape[1], w.mlp_width, w.n_heads, w.n_kv_heads, w.head_dim,
                                device_type="cpu")
    schedule = schedule_anchors(spec, scores, spans, query_start, L, config, cost, input_ids=input_ids)
    schedule, kv_out, h_last = _repair_pass(weights, input_ids, schedule, stale.kv, elig, fresh, report)
    report.anchors_per_layer = [int(a.numel()) for a in schedule.anchor_sets]
    report.recomputed_token_layers = sum(report.anchors_per_layer)
    report.anchor_ratio = schedule.achieved_anchor_ratio()
    report.context_ratio = report.repair_kv_pairs / report.full_kv_pairs if report.full_kv_pairs else 1.0
    return Result(_logits(weights, h_last), kv_out, report, list(schedule.anchor_sets), scores)


def _repair_pass(w: LlamaWeights, input_ids: torch.Tensor, schedule: AnchorSchedule,
                 stale_kv: list[tuple[torch.Tensor, torch.Tensor]], elig: torch.Tensor, fresh: torch.Tensor,
                 report: RepairReport) -> tuple[AnchorSchedule, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Step 4 over every layer (``elig`` int64 [n_eligible]; ``fresh`` int64 [n_fresh] the glue and query): (the
    schedule as decided at a check layer; per layer (k [n, Hkv, d], v [same]) float32; the last token's residual
    [hidden])."""
    h_q = w.embed[input_ids[fresh]].float()
    cur_tok = elig  # tokens whose residual stream we carry (A_{l-1}; all eligible before layer 0)
    h_cur = w.embed[input_ids[elig]].float()
    kv_out = []
    for l in range(w.n_layers):
        anchors = schedule.anchor_sets[l]
        # Nesting guarantees anchors ⊆ cur_tok; take their carried residual rows.
        rows = torch.searchsorted(cur_tok, anchors)
        if anchors.numel() and not bool((cur_tok[rows.clamp(max=cur_tok.numel() - 1)] == anchors).all()):
            raise AssertionError("anchor sets are not nested")
        schedule, kv, h, layout = _repair_layer(w, l, schedule, h_cur[rows], h_q, fresh, stale_kv[l],
                                                input_ids.numel())
        h_cur, h_q, cur_tok = h[:anchors.numel()], h[anchors.numel():], anchors
        kv_out.append(kv)
        report.repair_kv_pairs += layout.kv_pairs()
        report.full_kv_pairs += layout.full_kv_pairs()
    return schedule, kv_out, h_q[-1]


def _repair_layer(w: LlamaWeights, l: int, schedule: AnchorSchedule, h_a: torch.Tensor, h_q: torch.Tensor,
                  fresh: torch.Tensor, stale: tuple[torch.Tensor, torch.Tensor], n: int,
                  ) -> tuple[AnchorSchedule, tuple[torch.Tensor, torch.Tensor], torch.Tensor, BlockSparseLayout]:
    """Step 4 at layer l (``h_a`` [n_a, hidden], ``h_q`` [n_fresh, hidden], ``stale`` (k [n_context, Hkv, d], v
    [same])): (the schedule, the layer's (k [n, Hkv, d], v [same]), residual [n_a + n_fresh, hidden], the layout)."""
    anchors, n_ctx = schedule.anchor_sets[l], stale[0].shape[0]
    n_a = anchors.numel()
    q, k, v = _project_qkv(w, w.layers[l], torch.cat([h_a, h_q]), torch.cat([anchors, fresh]))
    keys = torch.cat([stale[0], stale[0].new_zeros(n - n_ctx, *stale[0].shape[1:])])
    vals = torch.cat([stale[1], stale[1].new_zeros(n - n_ctx, *stale[1].shape[1:])])
    # reads the anchors' stale K/V before they are overwritten
    edit = _layer_step(w, schedule, l, k[:n_a], v[:n_a], keys, vals)
    keys[anchors], vals[anchors] = k[:n_a], v[:n_a]
    keys[fresh], vals[fresh] = k[n_a:], v[n_a:]
    if edit is not None and edit.later_sets is not None:
        schedule = schedule.with_later_layers(edit.later_sets)
    K, V = keys[:n_ctx], vals[:n_ctx]  # the context: what anchors may attend to
    layout = schedule.layout_at(l, q[:n_a], K)
    o_a = block_sparse_attention(q[:n_a], K, V, layout)
    o_q = dense_causal_attention(q[n_a:], keys, vals, fresh, torch.arange(n))
    h = _finish_layer(w, w.layers[l], torch.cat([h_a, h_q]), torch.cat([o_a, o_q]))
    return schedule, (keys, vals), h, layout


def _layer_step(w: LlamaWeights, schedule: AnchorSchedule, l: int, k_a: torch.Tensor, v_a: torch.Tensor,
                keys: torch.Tensor, vals: torch.Tensor) -> Optional[LayerEdit]:
    """The policy's step at layer l, if it reads there: its delta added in place to keys and vals [n, Hkv, d] (not yet
    overwritten by the layer's rows); k_a, v_a [n_a, Hkv, d] the anchors' new K/V."""
    step = schedule.layer_step
    read = step.reads(l) if step is not None else None
    if read is None:
        return None
    inv_freq = w.rope_inv_freq()

    def rotate(k_post: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:  # re-rotation (no YaRN mscale)
        return apply_neox_rope(k_post, delta, inv_freq, w.rotary_dim)

    at, pos = torch.searchsorted(schedule.anchor_sets[l], read.positions), read.positions
    edit = step.run(l, MeasuredKV(pos, read.groups, k_a[at], v_a[at], keys[pos], vals[pos], rotate))
    if edit.body_dk is None and edit.body_dv is None:
        return edit
    body = step.body
    groups = step.body_groups if step.body_groups is not None else torch.zeros_like(body)
    if edit.body_dk is not None:
        keys[body] += rotate(edit.body_dk[groups], body).float()
    if edit.body_dv is not None:
        vals[body] += edit.body_dv[groups]
    return edit
