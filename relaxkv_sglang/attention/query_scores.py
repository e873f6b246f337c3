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
    """``s(t) = sum_{q, heads} softmax(q K^T)[t]``. q float [n_layers?, n_q, H, d] post-RoPE (query i is
    key ``n_context + i``); k float [n_layers?, n_context + n_q, H_kv, d] post-RoPE, the stale context's
    then the query's own -> float32 [n_layers?, n_context]. The softmax also covers the query's own keys
    (causal), so mass spent on them is not handed to the context."""
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
    # One bmm per KV head over its query heads (h = kv * group + j): K read as stored, no copy per head.
    q_grouped = q.float().reshape(n_q, n_kv, group, d).permute(1, 2, 0, 3).reshape(n_kv, group * n_q, d)
    logits = torch.bmm(q_grouped, k.float().permute(1, 2, 0)).mul_(scale).view(n_kv, group, n_q, n_keys)
    after_self = torch.ones(n_q, n_q, dtype=torch.bool, device=q.device).triu_(1)
    logits[..., n_context:].masked_fill_(after_self, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs[..., :n_context].sum(dim=(0, 1, 2)).to(torch.float32)
