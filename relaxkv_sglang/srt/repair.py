"""Cache repair inside SGLang's prefill: a layer loop whose rows change per layer.

For a batch holding a request under a repair policy (``epic``, ``cacheblend``,
``prophetkv``, ``relaxkv`` and the ablations), :mod:`relaxkv_sglang.srt.forward`
runs two passes of :class:`LayerLoop` over SGLang's own model modules:

1. **Query pass** (before the scheduled forward): the prompt's computed rows
   (exact prefix tail, chunk misses computed position-independently, glue,
   query) over the stale reused KV. It writes their KV and records, per layer,
   the query's attention mass on every context token (``s_l``).
2. **Repair pass** (as the scheduled forward, replacing the model's own layer
   loop through a hook on ``LlamaModel.forward`` / ``Qwen2Model.forward``):
   at layer ``l`` only the rows in ``A_l`` (the anchors), the glue and the
   query are computed: projections, attention, MLP. Anchors overwrite their
   stale K/V in the request's private slots and attend through a block-sparse
   layout: their full causal prefix for the peers
   (:func:`~relaxkv_sglang.core.layout.full_causal_layout`) or, for ``relaxkv``,
   the relaxed context of :func:`~relaxkv_sglang.core.layout.build_relaxed_layout`.
   Both run through the same executor (:func:`anchor_attention`: on a CPU
   :func:`~relaxkv_sglang.core.attention.block_sparse_attention`, gathered K/V;
   on a GPU FlashInfer's block-sparse wrappers),
   so policies differ only in the keys chosen and the work follows the context. The query then
   attends densely over the repaired KV, and SGLang samples as usual.

Which rows are anchors comes from :func:`~relaxkv_sglang.core.selection.select_anchors`;
this module only executes. SGLang modules used (names checked at startup by
:class:`ModelLayers`): ``embed_tokens``, ``layers[i].{input_layernorm,
self_attn.{qkv_proj,rotary_emb,o_proj,attn}, post_attention_layernorm, mlp}``, ``norm``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from relaxkv_sglang.core.attention import block_sparse_attention, executed_kv_pairs, scoped_causal_attention
from relaxkv_sglang.core.layout import BlockSparseLayout, build_relaxed_layout, full_causal_layout
from relaxkv_sglang.core.selection import (
    RepairPolicy,
    eligible_tokens,
    kv_deviation,
    query_attention_scores,
    select_anchors,
)


class UnsupportedModelError(RuntimeError):
    pass


class ModelLayers:
    """The pieces of an SGLang Llama/Qwen2/Qwen3/Mistral model the loop calls."""

    def __init__(self, model):
        self.model = model
        for name in ("embed_tokens", "layers", "norm"):
            if not hasattr(model, name):
                raise UnsupportedModelError(f"{type(model).__name__} has no `{name}`; repair policies need a Llama-style model")
        first = model.layers[getattr(model, "start_layer", 0)]
        for path in ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.qkv_proj",
                     "self_attn.rotary_emb", "self_attn.o_proj", "self_attn.attn", "self_attn.q_size",
                     "self_attn.kv_size"):
            obj = first
            for part in path.split("."):
                if not hasattr(obj, part):
                    raise UnsupportedModelError(f"{type(first).__name__} has no `{path}`; repair policies need a Llama-style layer")
                obj = getattr(obj, part)
        self.start = getattr(model, "start_layer", 0)
        self.end = getattr(model, "end_layer", len(model.layers))

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def layer(self, l: int):
        return self.model.layers[self.start + l]

    def qkv(self, l: int, positions: torch.Tensor, hidden: torch.Tensor):
        """hidden [n, hidden] (pre-norm) -> q [n, H, d], k [n, Hkv, d], v [n, Hkv, d] post-RoPE."""
        layer = self.layer(l)
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(layer.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        radix = attn.attn
        if hasattr(attn, "q_norm") and hasattr(attn, "k_norm"):  # Qwen3: per-head norms before RoPE
            q = attn.q_norm(q.reshape(-1, radix.head_dim)).view(q.shape)
            k = attn.k_norm(k.reshape(-1, radix.head_dim)).view(k.shape)
        q, k = attn.rotary_emb(positions, q, k)
        n = hidden.shape[0]
        return (q.reshape(n, radix.tp_q_head_num, radix.head_dim), k.reshape(n, radix.tp_k_head_num, radix.head_dim),
                v.reshape(n, radix.tp_v_head_num, radix.head_dim))

    def finish(self, l: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual adds around o_proj and the MLP; attn_out [n, H, dv]."""
        layer = self.layer(l)
        out, _ = layer.self_attn.o_proj(attn_out.reshape(hidden.shape[0], -1))
        hidden = hidden + out
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def attention_params(self, l: int):
        radix = self.layer(l).self_attn.attn
        return radix.layer_id, radix.scaling


@dataclasses.dataclass
class RequestRows:
    """One request's rows in a pass of the layer loop.

    Attributes:
        slots: int64 [>= max position + 1] KV-pool slot of every position (the
            request's ``req_to_token`` row).
        positions: int64 [n] position of each row, ascending.
        exits: int64 [n] a row takes part in layers ``[0, exits[i])``.
        scope: int64 [n] first key position a non-anchor row attends to
            (0: its causal prefix; a chunk's start: that chunk only).
        anchor: bool [n] repair targets: they attend through ``layouts``.
        layouts: per layer, the layout of the anchors active at it (rows in
            position order).
        n_context: positions ``>= n_context`` are the query (for scores).
        want_scores: record s_l during this pass.
        on_kv: optional callback(l, rows_active_mask, k_new, v_new, k_cache, v_cache)
            run before the layer's K/V are written (CacheBlend's check layer).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    exits: torch.Tensor
    scope: torch.Tensor
    anchor: torch.Tensor
    layouts: list = dataclasses.field(default_factory=list)
    n_context: int = 0
    want_scores: bool = False
    on_kv: Optional[Callable] = None
    scores: list = dataclasses.field(default_factory=list)
    kv_pairs: int = 0
    full_kv_pairs: int = 0
    executed_kv_pairs: int = 0

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])


def anchor_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BlockSparseLayout,
                     scale: float, key_rows: torch.Tensor) -> torch.Tensor:
    """The anchors' block-sparse attention over the layer's KV pool: FlashInfer on a GPU
    (half precision, :mod:`relaxkv_sglang.gpu.flashinfer_attention`), the torch executor
    otherwise. Both execute the same layout; ``python -m relaxkv_sglang.gpu.check`` compares them."""
    if k_cache.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from relaxkv_sglang.gpu.flashinfer_attention import relaxed_attention

        return relaxed_attention(q, k_cache, v_cache, layout, scale, key_rows)
    return block_sparse_attention(q, k_cache, v_cache, layout, scale=scale, key_rows=key_rows)


class LayerLoop:
    """Runs the model layer by layer over rows that may leave at any layer."""

    def __init__(self, layers: ModelLayers, kv_pool):
        self.layers = layers
        self.kv_pool = kv_pool

    def run(self, requests: list[RequestRows], input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [sum n_rows] (requests' rows in order) -> final-normed hidden [sum n_rows, hidden]."""
        model = self.layers.model
        positions = torch.cat([r.positions for r in requests])
        offsets = [0]
        for r in requests:
            offsets.append(offsets[-1] + r.n_rows)
        hidden = model.embed_tokens(input_ids)
        for l in range(self.layers.n_layers):
            # Recomputed every layer: a callback may shorten exits (CacheBlend).
            active = torch.cat([(r.exits > l).nonzero().flatten() + off for r, off in zip(requests, offsets)])
            if active.numel() == 0:
                break
            h = hidden[active]
            q, k, v = self.layers.qkv(l, positions[active], h)
            layer_id, scale = self.layers.attention_params(l)
            k_cache = self.kv_pool.get_key_buffer(layer_id)
            v_cache = self.kv_pool.get_value_buffer(layer_id)
            out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
            # Write every active row's K/V first: rows attend to each other's new KV.
            spans = []
            start = 0
            for i, r in enumerate(requests):
                mask = r.exits > l
                n = int(mask.sum())
                spans.append((start, start + n, mask))
                if n:
                    if r.on_kv is not None:
                        r.on_kv(l, mask, k[start:start + n], v[start:start + n], k_cache, v_cache)
                    slots = r.slots[r.positions[mask]]
                    k_cache[slots] = k[start:start + n].to(k_cache.dtype)
                    v_cache[slots] = v[start:start + n].to(v_cache.dtype)
                start += n
            for r, (s0, s1, mask) in zip(requests, spans):
                if s1 > s0:
                    out[s0:s1] = self._attend(r, l, mask, q[s0:s1], k_cache, v_cache, scale)
            hidden[active] = self.layers.finish(l, h, out)
        return model.norm(hidden)

    def _attend(self, r: RequestRows, l: int, mask, q, k_cache, v_cache, scale) -> torch.Tensor:
        pos, scope, anchor = r.positions[mask], r.scope[mask], r.anchor[mask]
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
        plain = ~anchor
        if bool(plain.any()):
            out[plain] = scoped_causal_attention(q[plain], k_cache, v_cache, pos[plain], scope[plain], r.slots, scale)
        if bool(anchor.any()):
            layout: BlockSparseLayout = r.layouts[l]
            sel = anchor.nonzero().flatten()
            if not torch.equal(layout.q_pos, pos[sel]):
                raise RuntimeError("relaxkv: layout rows do not match the layer's anchors")
            out[sel] = anchor_attention(q[sel], k_cache, v_cache, layout, scale, r.slots)
            r.kv_pairs += layout.kv_pairs()
            r.full_kv_pairs += layout.full_kv_pairs()
            r.executed_kv_pairs += executed_kv_pairs(layout)
        if r.want_scores:
            is_query = pos >= r.n_context
            end = int(pos.max()) + 1
            keys = r.slots[:end]
            if int(is_query.sum()) == end - r.n_context:  # the whole query is in this pass
                r.scores.append(query_attention_scores(q[is_query], k_cache[keys], r.n_context, scale))
        return out


def supports_repair(causal_lm) -> bool:
    """Whether the model's layer stack runs through the hooked forward (Llama/Qwen2 family).

    A model class that overrides ``forward`` itself would bypass the repair
    pass, so its requests are served as ``pic`` (and ``repaired`` is false).
    """
    inner = getattr(causal_lm, "model", None)
    if inner is None or getattr(type(inner).forward, "__wrapped__", None) is None:
        return False
    try:
        ModelLayers(inner)
    except UnsupportedModelError:
        return False
    return True


# --------------------------------------------------------------- the model hook

_ACTIVE_PASS: Optional[list[RequestRows]] = None


def set_active_pass(requests: Optional[list[RequestRows]]) -> None:
    global _ACTIVE_PASS
    _ACTIVE_PASS = requests


def around_model_forward(original, model, input_ids, positions, forward_batch, *args, **kwargs):
    """Hook on ``LlamaModel.forward`` / ``Qwen2Model.forward``: run the repair pass instead."""
    requests = _ACTIVE_PASS
    if requests is None or not forward_batch.forward_mode.is_extend():
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    from relaxkv_sglang.srt.tree_cache import active_cache

    loop = LayerLoop(ModelLayers(model), active_cache().copier.kv_pool)
    return loop.run(requests, input_ids)


# ------------------------------------------------------------------ planning

PAGE_SIZE = 16  # relaxed-context page, in tokens
SINK_TOKENS = 4  # first prompt tokens every anchor attends to
CHUNK_SINK_TOKENS = 4  # first tokens of each chunk favoured as anchors
CACHEBLEND_CHECK_LAYER = 1


def _repairable(r) -> bool:
    """Repair needs the whole rest of the prompt in this extend window."""
    plan = r.plan
    if plan is None or not plan.repairs:
        return False
    end = r.window_start + r.window_len
    in_window = [s for s in plan.chunk_spans if s[0] >= r.window_start]
    logprobs_ok = r.logprob_start is None or r.window_start + r.logprob_start >= plan.query_start
    return end == len(r.req.origin_input_ids) and bool(in_window) and logprobs_ok


def _rows(req_to_token, r, n_layers: int) -> RequestRows:
    """The request's folded rows, each at every layer with its own scope (no anchors)."""
    n = r.positions.shape[0]
    return RequestRows(
        slots=req_to_token[r.req_pool_idx, : r.window_start + r.window_len].to(torch.int64),
        positions=r.positions, exits=torch.full((n,), n_layers, dtype=torch.int64),
        scope=r.scope_start.clone(), anchor=torch.zeros(n, dtype=torch.bool),
    )


def prepare_repair(cache, model_runner, fold) -> Optional[list[RequestRows]]:
    """Run the query pass and choose anchors for the batch's repair requests.

    Updates each repaired ``RequestFold`` (its rows become glue + query +
    anchors) and returns the repair pass's rows for every request of the
    batch, or None when no request can be repaired in this window.
    """
    targets = [r for r in fold.requests if _repairable(r)]
    if not targets or not supports_repair(model_runner.model):
        return None
    layers = ModelLayers(model_runner.model.model)
    loop = LayerLoop(layers, cache.copier.kv_pool)
    n_layers = layers.n_layers
    req_to_token = cache.req_to_token_pool.req_to_token

    # 1. Query pass over the stale context (also computes misses and exact rows).
    passes, ids = [], []
    for r in targets:
        rows = _rows(req_to_token, r, n_layers)
        rows.n_context = r.plan.query_start
        rows.want_scores = RepairPolicy(r.plan.policy).needs_query_scores
        passes.append(rows)
        ids.append(torch.tensor(r.req.origin_input_ids)[r.positions])
    with torch.no_grad():
        loop.run(passes, torch.cat(ids).to(model_runner.device))

    # 2. Misses are now final, position-independent KV: publish them.
    from relaxkv_sglang.srt.forward import publish_misses

    for r in targets:
        publish_misses(cache, r)

    # 3. Targets, relaxed contexts, and the repair pass's rows.
    for r, query_rows in zip(targets, passes):
        r.query_pass_rows = query_rows.n_rows
        r.repair_rows = _plan_request(r, query_rows, n_layers)
    return [r.repair_rows if r.repair_rows is not None else _rows(req_to_token, r, n_layers) for r in fold.requests]


def _plan_request(r, query_rows: RequestRows, n_layers: int) -> RequestRows:
    plan, pre = r.plan, r.window_start
    policy = RepairPolicy(plan.policy)
    n_context = plan.query_start
    end = pre + r.window_len
    spans = [s for s in plan.chunk_spans if s[0] >= pre]
    scores = torch.stack(query_rows.scores) if policy.needs_query_scores else None
    rng = torch.Generator().manual_seed(0)
    sets = select_anchors(policy, scores, spans, n_context, plan.anchor_ratio, rng, n_layers=n_layers,
                          check_layer=CACHEBLEND_CHECK_LAYER, chunk_sink_tokens=CHUNK_SINK_TOKENS)
    exit_of = torch.zeros(n_context, dtype=torch.int64)
    for l, anchors in enumerate(sets):
        exit_of[anchors] = l + 1

    in_chunk = torch.zeros(end, dtype=torch.bool)
    for s, e in spans:
        in_chunk[s:e] = True
    glue_and_query = torch.arange(spans[0][0], end)
    glue_and_query = glue_and_query[~in_chunk[glue_and_query]]
    anchors = (exit_of > 0).nonzero().flatten()
    positions, order = torch.sort(torch.cat([anchors, glue_and_query]))
    n_anchor = anchors.shape[0]
    is_anchor = (order < n_anchor)
    exits = torch.where(is_anchor, exit_of[positions.clamp(max=n_context - 1)], torch.tensor(n_layers))
    rows = RequestRows(
        slots=query_rows.slots, positions=positions, exits=exits, scope=torch.zeros_like(positions),
        anchor=is_anchor, n_context=n_context,
    )
    rows.layouts = _layouts(policy, sets, scores, spans, n_context, plan.context_ratio)
    if policy is RepairPolicy.CACHEBLEND:
        rows.on_kv = _cacheblend_check(rows, spans, n_context, plan.anchor_ratio, n_layers)
    r.keep = positions - pre
    r.scope_start = torch.zeros_like(positions)
    r.n_eligible = int(eligible_tokens(spans, n_context).numel())
    return rows


def _layouts(policy, sets, scores, spans, n_context: int, context_ratio: float) -> list:
    """Each layer's anchors' context: relaxed for relaxkv (and its random ablation), else causal."""
    if policy.context_mode == "full":
        return [full_causal_layout(a, spans, n_context, PAGE_SIZE) for a in sets]
    gen = torch.Generator().manual_seed(1)
    return [
        build_relaxed_layout(a, scores[l], spans, n_context, context_ratio, PAGE_SIZE, SINK_TOKENS,
                             mode=policy.context_mode, generator=gen)
        for l, a in enumerate(sets)
    ]


def _cacheblend_check(rows: RequestRows, spans, n_context: int, ratio: float, n_layers: int):
    """CacheBlend: at the check layer keep the anchors whose K/V deviate most."""
    def on_kv(l, mask, k_new, v_new, k_cache, v_cache):
        if l != CACHEBLEND_CHECK_LAYER:
            return
        active_anchor = rows.anchor[mask]
        pos = rows.positions[mask][active_anchor]
        slots = rows.slots[pos]
        dev = torch.zeros(n_context)
        dev[pos] = kv_deviation(k_new[active_anchor], v_new[active_anchor], k_cache[slots], v_cache[slots])
        sets = select_anchors("cacheblend", None, spans, n_context, ratio, n_layers=n_layers, deviation=dev,
                              check_layer=CACHEBLEND_CHECK_LAYER)
        exit_of = torch.zeros(n_context, dtype=torch.int64)
        for layer, anchors in enumerate(sets):
            exit_of[anchors] = layer + 1
        rows.exits[rows.anchor] = exit_of[rows.positions[rows.anchor]]
        rows.layouts = rows.layouts[: l + 1] + _layouts(RepairPolicy.CACHEBLEND, sets[l + 1:], None, spans, n_context, 1.0)

    return on_kv


def repair_report(r) -> dict:
    """The repair fields of ``meta_info.relaxkv`` for a repaired request."""
    rows: RequestRows = r.repair_rows
    n_layers = int(rows.exits.max()) if rows.n_rows else 0
    anchor_layers = int(rows.exits[rows.anchor].sum())
    n_layers = max(n_layers, 1)
    return {
        "anchor_ratio": anchor_layers / (n_layers * r.n_eligible) if r.n_eligible else 0.0,
        "anchors_per_layer": anchor_layers / n_layers,
        "context_ratio": rows.kv_pairs / rows.full_kv_pairs if rows.full_kv_pairs else 1.0,
        "repair_kv_pairs": rows.kv_pairs,
        "repair_kv_pairs_executed": rows.executed_kv_pairs,
    }
