"""The query's attention mass on the context (``s_l``), the signal query-aware anchor rules score by."""

from __future__ import annotations

from typing import Optional

import torch


def query_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    n_context: int,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Query attention mass per context token: ``s(t) = sum_{q, heads} softmax(q K^T)[t]``.

    Args:
        q: [n_q, n_heads, d] (or [n_layers, n_q, n_heads, d]) float; the query tokens' queries,
           post-RoPE.  Query token i sits at key index ``n_context + i``.
        k: [n_context + n_q, n_kv_heads, d] (or with a leading n_layers dim) float; the stale
           context keys followed by the query tokens' own keys, post-RoPE.
        n_context: number of context keys (columns kept in the result).
        scale: softmax scale, default ``d ** -0.5``.

    GQA: head h reads kv head ``h // (n_heads // n_kv_heads)``.  The softmax runs over all keys
    a query token can see (context + query keys up to itself, causal), so mass spent on the
    query's own tokens is not handed to the context; only context columns are returned.

    Returns:
        float32 [n_context] (or [n_layers, n_context]).
    """
    if q.dim() == 4:
        return torch.stack(
            [query_attention_scores(q[i], k[i], n_context, scale) for i in range(q.shape[0])]
        )
    n_q, n_heads, d = q.shape
    n_keys, n_kv, _ = k.shape
    if n_keys != n_context + n_q:
        raise ValueError(f"k has {n_keys} keys, expected n_context + n_q = {n_context + n_q}")
    if n_heads % n_kv:
        raise ValueError("n_heads must be a multiple of n_kv_heads")
    scale = d ** -0.5 if scale is None else scale
    group = n_heads // n_kv
    # One batched matmul per KV head over its `group` query heads: K is read as it is stored
    # (no copy per query head); head h = kv * group + j, as in the GQA rule above.
    q_grouped = q.float().reshape(n_q, n_kv, group, d).permute(1, 2, 0, 3).reshape(n_kv, group * n_q, d)
    logits = torch.bmm(q_grouped, k.float().permute(1, 2, 0)).mul_(scale).view(n_kv, group, n_q, n_keys)
    # Query i sees every context key and query keys 0..i.
    after_self = torch.ones(n_q, n_q, dtype=torch.bool, device=q.device).triu_(1)
    logits[..., n_context:].masked_fill_(after_self, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs[..., :n_context].sum(dim=(0, 1, 2)).to(torch.float32)
