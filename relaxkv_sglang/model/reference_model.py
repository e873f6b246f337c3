"""The torch reference's model: a registered family's weights read from a HF checkpoint, and one
decoder layer's ops over them (:class:`~.model_family.LayerOps`), float32 on the CPU, in plain torch
independent of SGLang's kernels: what the server's repair pass is checked against. No SGLang import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from relaxkv_sglang.model.model_family import ModelFamily, family_for_config
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config

__all__ = [
    "LlamaWeights",
    "from_hf_state_dict",
    "rms_norm",
    "apply_neox_rope",
    "routed_experts",
    "ReferenceLayerOps",
]


@dataclass
class LlamaWeights:
    """A registered family's decoder weights, float32 unless built otherwise (H, Hkv heads of size d).

    ``layers[i]``: ``attn_norm``, ``mlp_norm`` [hidden]; ``q`` [H*d, hidden], ``k``/``v`` [Hkv*d, hidden],
    ``o`` [hidden, H*d]; a SwiGLU's ``gate``/``up`` [inter, hidden] and ``down`` [hidden, inter], or an MoE's
    ``router`` [E, hidden], ``experts_gate``/``experts_up`` [E, inter, hidden], ``experts_down`` [E, hidden,
    inter]; where the family's layer has them (:meth:`~.model_family.ModelFamily.hf_layer_weights`) the
    biases of ``q``/``k``/``v`` and ``q_norm``/``k_norm`` [d]. ``embed``, ``lm_head``: [vocab, hidden];
    ``norm``: [hidden]. ``rotary_dim``: the rotated leading dims (None: d); ``inv_freq``: float32
    [rotary_dim/2] (llama3's, YaRN's); ``attention_scaling``: on cos/sin (YaRN's mscale)."""

    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor
    lm_head: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    rotary_dim: Optional[int] = None
    inv_freq: Optional[torch.Tensor] = None
    attention_scaling: float = 1.0
    family: ModelFamily = field(default_factory=lambda: family_for_config({"model_type": "llama"}))
    top_k: int = 0
    renormalize: bool = True

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def rot_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def mlp_width(self) -> int:
        """The intermediate size one token's MLP computes (an MoE: top-k experts' widths)."""
        layer = self.layers[0]
        if "experts_gate" in layer:
            return self.top_k * layer["experts_gate"].shape[1]
        return layer["gate"].shape[0]

    def rope_inv_freq(self) -> torch.Tensor:
        """float32 [rot_dim/2] RoPE frequencies."""
        if self.inv_freq is not None:
            return self.inv_freq.float()
        r = self.rot_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))


def from_hf_state_dict(
    sd: Mapping[str, torch.Tensor],
    config_dict: Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
) -> LlamaWeights:
    """A registered family's (:func:`~.model_family.family_for_config`) ``model.state_dict()``
    (``lm_head.weight`` absent: tied embeddings) and ``config.to_dict()`` (RoPE:
    :func:`~relaxkv_sglang.model.rope_config.rope_spec_from_hf_config`). KeyError: a weight the family's
    layer has is missing from ``sd``."""
    cfg = dict(config_dict)
    family = family_for_config(cfg)
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    spec = rope_spec_from_hf_config(cfg)
    head_dim = spec.head_dim
    if "model.layers.0.self_attn.o_proj.bias" in sd:
        raise NotImplementedError("an o_proj bias: the reference's layer has none")
    moe = family.moe
    stacked = moe is not None and f"model.layers.0.{moe.stacked_module}.experts.gate_up_proj" in sd
    keys = family.hf_layer_weights(cfg, stacked_experts=stacked)  # transformers 5 stacks experts in memory

    def conv(key: str | tuple[str, ...], i: int) -> torch.Tensor:
        if isinstance(key, tuple):  # one tensor per expert, stacked
            return torch.stack([conv(k, i) for k in key])
        return sd[f"model.layers.{i}.{key}"].detach().to(dtype).clone()

    layers = [_split_fused({name: conv(key, i) for name, key in keys.items()}, n_heads * head_dim, n_kv * head_dim)
              for i in range(int(cfg["num_hidden_layers"]))]
    embed = sd["model.embed_tokens.weight"].detach().to(dtype).clone()
    top_k, renormalize = moe.routing(cfg) if moe is not None else (0, True)
    return LlamaWeights(
        embed=embed,
        layers=layers,
        norm=sd["model.norm.weight"].detach().to(dtype).clone(),
        lm_head=sd["lm_head.weight"].detach().to(dtype).clone() if "lm_head.weight" in sd else embed,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=spec.base,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_dim=spec.rotary_dim if spec.rotary_dim != head_dim else None,
        inv_freq=spec.inv_freq() if spec.scaling_type != "default" else None,
        attention_scaling=spec.attention_scaling,
        family=family,
        top_k=top_k,
        renormalize=renormalize,
    )


def _split_fused(layer: dict[str, torch.Tensor], q_rows: int, kv_rows: int) -> dict[str, torch.Tensor]:
    """A fused checkpoint's ``qkv`` [q_rows + 2 kv_rows, hidden] and ``gate_up`` [2 inter, hidden]
    (Phi-3), and stacked experts' ``experts_gate_up`` [E, 2 inter, hidden], as the separate weights
    the ops read (gate rows first); other layers unchanged."""
    if "qkv" in layer:
        layer["q"], layer["k"], layer["v"] = layer.pop("qkv").split([q_rows, kv_rows, kv_rows])
    if "gate_up" in layer:
        layer["gate"], layer["up"] = layer.pop("gate_up").chunk(2)
    if "experts_gate_up" in layer:
        layer["experts_gate"], layer["experts_up"] = layer.pop("experts_gate_up").chunk(2, dim=1)
    return layer


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] RMS-normed over its last dim, times w [d]; float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)) * w.float()


def apply_neox_rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: Optional[int] = None,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Neox RoPE (halves of the first ``rotary_dim`` dims, None: all): x float [n or 1, heads, head_dim] (one
    row: rotated to each position), pos int64 [n] (or a delta: rotations compose), inv_freq float32
    [rotary_dim/2] -> float32 [n, heads, head_dim]. ``scaling`` (YaRN's mscale) multiplies cos/sin: 1.0 for a
    delta, or it would be applied twice."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    ang = pos.float()[:, None] * inv_freq.float()[None, :]  # [n, r/2]
    cos, sin = (ang.cos() * scaling)[:, None, :], (ang.sin() * scaling)[:, None, :]
    xf = x.float()
    x1, x2, rest = xf[..., : r // 2], xf[..., r // 2: r], xf[..., r:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rot, rest.expand(rot.shape[0], -1, -1)], dim=-1)  # one x, n positions: broadcast


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [n, hidden]; gate/up [inter, hidden], down [hidden, inter] -> [n, hidden]."""
    f = torch.nn.functional
    return f.linear(f.silu(f.linear(x, gate)) * f.linear(x, up), down)


def routed_experts(x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   top_k: int, renormalize: bool) -> torch.Tensor:
    """``model_family`` step 7's ``moe``, token by token (router softmax in float32): x [n, hidden], router
    [E, hidden], gate/up [E, inter, hidden], down [E, hidden, inter] -> float32 [n, hidden]."""
    x = x.float()
    probs = torch.nn.functional.linear(x, router.float()).softmax(dim=-1)  # [n, E]
    weights, experts = probs.topk(top_k, dim=-1)  # [n, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, weights[rows, slot, None] * _swiglu(x[rows], gate[e], up[e], down[e]))
    return out


@dataclass(frozen=True)
class ReferenceLayerOps:
    """:class:`~.model_family.LayerOps` over ``layer``, one of ``w.layers`` (H = ``w.n_heads``, Hkv =
    ``w.n_kv_heads``, d = ``w.head_dim``), float32 results."""

    w: LlamaWeights
    layer: dict[str, torch.Tensor]

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.layer["attn_norm"], self.w.rms_eps)

    def qkv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w, layer, n = self.w, self.layer, x.shape[0]
        q = torch.nn.functional.linear(x, layer["q"], layer.get("q_bias")).view(n, w.n_heads, w.head_dim)
        k = torch.nn.functional.linear(x, layer["k"], layer.get("k_bias")).view(n, w.n_kv_heads, w.head_dim)
        v = torch.nn.functional.linear(x, layer["v"], layer.get("v_bias")).view(n, w.n_kv_heads, w.head_dim)
        return q, k, v

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(q, self.layer["q_norm"], self.w.rms_eps), rms_norm(k, self.layer["k_norm"], self.w.rms_eps)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, inv = self.w, self.w.rope_inv_freq()
        return (apply_neox_rope(q, positions, inv, w.rotary_dim, w.attention_scaling),
                apply_neox_rope(k, positions, inv, w.rotary_dim, w.attention_scaling))

    def o_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(attn_out.flatten(1), self.layer["o"])

    def post_attention_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.layer["mlp_norm"], self.w.rms_eps)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if self.w.family.mlp == "moe":
            return routed_experts(x, layer["router"], layer["experts_gate"], layer["experts_up"], layer["experts_down"],
                                  self.w.top_k, self.w.renormalize)
        return _swiglu(x, layer["gate"], layer["up"], layer["down"])
