"""Torch attention over gathered KV: dense, gathered and scoped causal (block-sparse: :mod:`.block_sparse`).

The numerical reference every accelerated executor must match. Tensors are token-major ``[tokens,
heads, head_dim]`` (SGLang's layout); GQA as HF's ``repeat_kv``; softmax in float32, outputs in the
query dtype. An LSE is the natural log of the softmax denominator, float32 ``[n_q, n_heads]``, ``-inf``
for a query that sees no key (output 0); kernels reporting log2 LSEs must convert. Sparse functions
gather K/V rows first and mask only inside that set: work scales with the gathered keys.
Every ``scale`` defaults to ``d ** -0.5``.
"""

from __future__ import annotations

from typing import Optional

import torch

from relaxkv_sglang.attention.staging import HostStage, Staged

__all__ = [
    "dense_causal_attention",
    "gathered_attention",
    "scoped_causal_attention",
    "masked_attention",
    "sdpa_attention",
    "softmax_scale",
    "ScopedCausalGroups",
]


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n, n_kv, d] -> [n, n_heads, d]."""
    n_kv = x.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


def softmax_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: Optional[torch.Tensor],
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, n_q, H, d], k [B, n_k, H_kv, d], v [B, n_k, H_kv, dv], visible bool [B, n_q, n_k] or None
    -> out [B, n_q, H, dv], lse float32 [B, n_q, H]. What the other functions build on."""
    scale = softmax_scale(q, scale)
    H = q.shape[2]
    kf = _expand_kv(k.flatten(0, 1), H).unflatten(0, k.shape[:2]).float()  # [B, n_k, H, d]
    vf = _expand_kv(v.flatten(0, 1), H).unflatten(0, v.shape[:2]).float()
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if visible is not None:
        logits = logits.masked_fill(~visible[:, None, :, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, n_q]
    # A fully masked row: exp(-inf - -inf) would be NaN.
    probs = torch.exp(logits - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    probs = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(probs), probs)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(q.dtype), lse.transpose(1, 2).contiguous()


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: Optional[torch.Tensor] = None,
    k_pos: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """``k_pos <= q_pos``, the test reference. q [n_q, H, d]; k, v [n_k, H_kv, d | dv]; q_pos int64 [n_q]
    (default: the last n_q keys, prefill after a cached prefix); k_pos int64 [n_k] (default ``arange``)."""
    n_q, n_k = q.shape[0], k.shape[0]
    if k_pos is None:
        k_pos = torch.arange(n_k, device=q.device)
    if q_pos is None:
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    out, lse = masked_attention(q[None], k[None], v[None], visible[None], scale)
    return (out[0], lse[0]) if return_lse else out[0]


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    key_idx: torch.Tensor,
    key_pos: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    every_row_sees_a_key: Optional[bool] = None,
):
    """All queries attend causally to one gathered key set, O(n_q * n_sel): q [n_q, H, d]; k, v [n_k, H_kv,
    d | dv] (a request's KV); q_pos int64 [n_q]; key_idx, key_pos (default ``key_idx``) int64 [n_sel];
    ``every_row_sees_a_key`` known on the host (None: read from the mask, a host sync on a GPU)."""
    key_idx = key_idx.to(torch.long)
    key_pos = key_idx if key_pos is None else key_pos.to(torch.long)
    kg, vg = k.index_select(0, key_idx), v.index_select(0, key_idx)
    visible = key_pos[None, :] <= q_pos.to(key_pos.device, torch.long)[:, None]
    if every_row_sees_a_key is None:
        every_row_sees_a_key = bool(visible.any(dim=1).all())
    if not return_lse and every_row_sees_a_key:
        # The serving path: fused SDPA (the einsum materialises [H, n_q, n_sel] logits, far slower).
        return sdpa_attention(q, kg, vg, visible, softmax_scale(q, scale))
    out, lse = masked_attention(q[None], kg[None], vg[None], visible[None], scale)
    return (out[0], lse[0]) if return_lse else out[0]


class ScopedCausalGroups:
    """:func:`scoped_causal_attention` decided once on the host, run at every layer: indices travel on
    ``stage`` (sent before :meth:`run`), and no run reads the device back."""

    def __init__(self, q_pos: torch.Tensor, scope_start: torch.Tensor, stage: HostStage) -> None:
        self.n_rows = int(q_pos.shape[0])
        self.groups: list[tuple[Staged, Staged, int, int, bool]] = []  # (rows, positions, scope, end, sees a key)
        for scope in torch.unique(scope_start).tolist():
            sel = (scope_start == scope).nonzero().flatten()
            pos = q_pos[sel]
            self.groups.append((stage.put(sel), stage.put(pos), scope, int(pos.max()) + 1, bool((pos >= scope).all())))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
            scale: Optional[float] = None) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for rows, pos, scope, end, sees_a_key in self.groups:
            at = rows.get()
            key_pos = torch.arange(scope, end, dtype=torch.int64, device=key_rows.device)
            out[at] = gathered_attention(q.index_select(0, at), k, v, pos.get(), key_idx=key_rows[key_pos],
                                         key_pos=key_pos, scale=scale, every_row_sees_a_key=sees_a_key)
        return out


def scoped_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scope_start: torch.Tensor,
    key_rows: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Each row attends causally from its scope start (0: the causal prefix; its chunk's start: the chunk
    alone). q [n, H, d]; k, v [n_k, H_kv, d] (a KV pool); q_pos, scope_start int64 [n] on the host (else
    a host sync); key_rows int [>= max(q_pos) + 1] on k's device, the k/v row of each position (a
    ``req_to_token`` row) -> [n, H, dv] in q's dtype. :class:`ScopedCausalGroups` planned and run."""
    stage = HostStage(q.device)
    groups = ScopedCausalGroups(q_pos.cpu(), scope_start.cpu(), stage)
    stage.send()
    return groups.run(q, k, v, key_rows, scale)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [n_q, H, d], k/v [n_k, H_kv, d], visible bool [n_q, n_k] (every row sees a key) -> [n_q, H, dv]."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype),
        attn_mask=visible.to(q.device), scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
