"""Model families the repair serves, and their decoder layer's order of operations, written once.

Every family here has the Llama decoder layer. With ``h`` the residual stream [n, hidden] of n
tokens at positions ``p`` (int64 [n]), H query heads and Hkv key/value heads of size d, and
``RMSNorm(x) = x / sqrt(mean(x^2) + eps)`` over the last dim:

1. ``x = RMSNorm(h) * w_in``                          (input norm)
2. ``q = x W_q^T (+ b_q)``, ``k = x W_k^T (+ b_k)``, ``v = x W_v^T (+ b_v)``, split per head:
   q [n, H, d], k and v [n, Hkv, d]                  (q/k/v projection; biases: :attr:`ModelFamily.qkv_bias`)
3. ``q = RMSNorm_d(q) * w_qn``, ``k = RMSNorm_d(k) * w_kn`` over each head's d dims, before
   RoPE, only where the family says so              (:attr:`ModelFamily.qk_norm`, Qwen3)
4. ``q, k = RoPE(q, p), RoPE(k, p)``                (neox pairing: dim i with i + rotary_dim/2)
5. ``a = attention(q, k, v)`` [n, H, dv]             (the caller's: it decides which keys a row sees)
6. ``h = h + a W_o^T``                               (o_proj, residual)
7. ``h = h + W_down (silu(W_gate y) * W_up y)``, ``y = RMSNorm(h) * w_post``  (SwiGLU MLP, residual)

Steps 1-4 are :func:`project_qkv`, 6-7 :func:`finish_layer`, both over :class:`LayerOps`, one
decoder layer's pieces. Two executors supply them: the torch reference over a checkpoint's plain
tensors (:mod:`.reference`) and the server's repair pass over SGLang's own modules
(``srt/model_layers.py``); the order above is nowhere else.

The registry (:data:`FAMILIES`) is what the plugin serves: for each family the HF
``architectures`` (and ``model_type``) it covers, the SGLang decoder-stack class whose ``forward``
the repair hooks (``srt/plugin.py::HOOKS`` is generated from it, one entry per hooked class), the
SGLang module names its layers expose and the weights its HF checkpoints hold. A model outside it
is served, but its repair-policy requests as ``pic`` (the reason in the report). Adding a family
with this layer is one :class:`ModelFamily` entry; a different layer needs new ops (and a new
field saying so).

This module imports only the standard library and torch; it never imports SGLang (its classes
are named as strings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Protocol

import torch

__all__ = [
    "UnknownModelFamilyError",
    "ModelFamily",
    "FAMILIES",
    "SGLANG_MODEL_MODULES",
    "family_for_config",
    "hooked_model_classes",
    "LayerOps",
    "project_qkv",
    "finish_layer",
]


class UnknownModelFamilyError(ValueError):
    """The model's config names no registered family (the message names what it does say)."""


#: SGLang module paths under every decoder layer of these families (``layers[i].<path>``).
_SGLANG_LAYER_MODULES: tuple[str, ...] = (
    "input_layernorm", "self_attn.qkv_proj", "self_attn.rotary_emb", "self_attn.o_proj", "self_attn.attn",
    "self_attn.q_size", "self_attn.kv_size", "post_attention_layernorm", "mlp",
)
#: ... and on the decoder stack itself.
SGLANG_MODEL_MODULES: tuple[str, ...] = ("embed_tokens", "layers", "norm")

#: HF checkpoint weights of every decoder layer (``model.layers.{i}.<key>``), by the reference's name.
_HF_LAYER_WEIGHTS: dict[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_HF_QKV_BIASES = {f"{x}_bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_HF_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


@dataclass(frozen=True)
class ModelFamily:
    """One family of decoder-only models and what its decoder layer is (module doc, steps 1-7).

    Attributes:
        name: the family's name (``"llama"``).
        architectures: HF ``config.architectures`` names it covers (a checkpoint's config.json).
        model_types: HF ``config.model_type`` values it covers, for a config without
            ``architectures`` (one built in code).
        causal_lm_class: the SGLang class serving those architectures (dotted path).
        model_class: the SGLang decoder stack that class holds as ``.model``, whose ``forward`` the
            repair hooks (dotted path; it defines ``forward`` itself, so the hook reaches it).
        qkv_bias: the q/k/v projections always carry biases (Qwen2); otherwise only when the
            config's ``attention_bias`` says so (:meth:`has_qkv_bias`).
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3), step 3.
        rope: the RoPE pairing (``"neox"``: dim i with i + rotary_dim/2).
        mlp: ``"swiglu"``: ``W_down (silu(W_gate y) * W_up y)``.
        norm: ``"rms"``: RMSNorm with a weight and no bias, for every norm of the layer.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    causal_lm_class: str
    model_class: str
    qkv_bias: bool = False
    qk_norm: bool = False
    rope: Literal["neox"] = "neox"
    mlp: Literal["swiglu"] = "swiglu"
    norm: Literal["rms"] = "rms"

    def __post_init__(self) -> None:
        if (self.rope, self.mlp, self.norm) != ("neox", "swiglu", "rms"):
            raise ValueError(f"family {self.name!r}: only the neox/swiglu/rms decoder layer has ops "
                             f"(got rope={self.rope!r}, mlp={self.mlp!r}, norm={self.norm!r})")

    @property
    def hooked_forward(self) -> str:
        """The SGLang function the repair's model hook wraps (``<model_class>.forward``)."""
        return f"{self.model_class}.forward"

    @property
    def sglang_layer_modules(self) -> tuple[str, ...]:
        """Dotted attribute paths every SGLang decoder layer of this family has (the repair pass
        calls them; step 3's norms included when the family has them)."""
        return _SGLANG_LAYER_MODULES + (("self_attn.q_norm", "self_attn.k_norm") if self.qk_norm else ())

    def has_qkv_bias(self, config: Mapping[str, Any]) -> bool:
        """Whether a checkpoint with this HF config dict has q/k/v biases."""
        return self.qkv_bias or bool(config.get("attention_bias", False))

    def hf_layer_weights(self, config: Mapping[str, Any]) -> dict[str, str]:
        """The weights every decoder layer of a HF checkpoint with this config dict holds: the torch
        reference's name (``LlamaWeights.layers``) -> the key under ``model.layers.{i}.``."""
        weights = dict(_HF_LAYER_WEIGHTS)
        if self.has_qkv_bias(config):
            weights.update(_HF_QKV_BIASES)
        if self.qk_norm:
            weights.update(_HF_QK_NORMS)
        return weights


_LLAMA = "sglang.srt.models.llama"
_QWEN2 = "sglang.srt.models.qwen2"
_QWEN3 = "sglang.srt.models.qwen3"

#: The registered families. Mistral's SGLang class is a LlamaForCausalLM, so LlamaModel's hooked
#: forward serves it too; Qwen3Model subclasses Qwen2Model but defines its own forward, hooked apart.
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), ("llama",), f"{_LLAMA}.LlamaForCausalLM", f"{_LLAMA}.LlamaModel"),
    ModelFamily("mistral", ("MistralForCausalLM",), ("mistral",), "sglang.srt.models.mistral.MistralForCausalLM",
                f"{_LLAMA}.LlamaModel"),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), f"{_QWEN2}.Qwen2ForCausalLM", f"{_QWEN2}.Qwen2Model",
                qkv_bias=True),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), f"{_QWEN3}.Qwen3ForCausalLM", f"{_QWEN3}.Qwen3Model",
                qk_norm=True),
)


def family_for_config(config: Mapping[str, Any]) -> ModelFamily:
    """The family of a model from its HF config dict (``config.to_dict()`` or config.json).

    Its ``architectures`` decide (the first registered one); a config without them (built in code)
    is looked up by ``model_type``.

    Raises:
        UnknownModelFamilyError: naming the config's architectures (or model type) and the
            registered ones.
    """
    architectures = list(config.get("architectures") or ())
    model_type: Optional[str] = config.get("model_type")
    for arch in architectures:
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    if not architectures:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    said = f"architectures {architectures}" if architectures else f"model_type {model_type!r} (no architectures)"
    known = ", ".join(arch for family in FAMILIES for arch in family.architectures)
    raise UnknownModelFamilyError(f"{said}: no registered model family (core/model_family.py: {known})")


def hooked_model_classes() -> dict[str, list[str]]:
    """Each hooked SGLang decoder stack (dotted class path) -> the families whose models it serves,
    in registry order (one hook per class)."""
    hooked: dict[str, list[str]] = {}
    for family in FAMILIES:
        hooked.setdefault(family.model_class, []).append(family.name)
    return hooked


# ----------------------------------------------------------------------------- the layer


class LayerOps(Protocol):
    """One decoder layer's pieces (module doc's steps), over some weights. n rows; H, Hkv, d as in
    the module doc; dtypes are the executor's (float32 in the reference, the served dtype in SGLang)."""

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Step 1: hidden [n, hidden] -> [n, hidden]."""
        ...

    def qkv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 2: x [n, hidden] -> q [n, H, d], k [n, Hkv, d], v [n, Hkv, d] (biases included)."""
        ...

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3: q [n, H, d], k [n, Hkv, d] -> the same shapes, each head RMS-normed over d."""
        ...

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 4: positions int64 [n], q [n, H, d], k [n, Hkv, d] -> q, k rotated, same shapes."""
        ...

    def o_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        """Step 6's projection: attn_out [n, H, dv] -> [n, hidden]."""
        ...

    def post_attention_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Step 7's norm: hidden [n, hidden] -> [n, hidden]."""
        ...

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Step 7's MLP: x [n, hidden] -> [n, hidden]."""
        ...


def project_qkv(ops: LayerOps, family: ModelFamily, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-4: the residual stream hidden [n, hidden] at positions int64 [n] -> q [n, H, d],
    k [n, Hkv, d] after RoPE, v [n, Hkv, d]."""
    q, k, v = ops.qkv_proj(ops.input_norm(hidden))
    if family.qk_norm:
        q, k = ops.qk_norm(q, k)
    q, k = ops.rope(positions, q, k)
    return q, k, v


def finish_layer(ops: LayerOps, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Steps 6-7: hidden [n, hidden] (the layer's input) and attn_out [n, H, dv] -> the layer's
    output [n, hidden]: residual + o_proj, then residual + MLP."""
    hidden = hidden + ops.o_proj(attn_out)
    return hidden + ops.mlp(ops.post_attention_norm(hidden))
