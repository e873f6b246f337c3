"""Model families the repair serves, and their decoder layer's order of operations, written once.

Every family has the Llama decoder layer. With ``h`` the residual stream [n, hidden] at positions ``p``
(int64 [n]), H query and Hkv key/value heads of size d, ``RMSNorm(x) = x / sqrt(mean(x^2) + eps)``:

1. ``x = RMSNorm(h) * w_in``
2. ``q, k, v = x W_{q,k,v}^T (+ b)`` per head: q [n, H, d], k and v [n, Hkv, d] (:attr:`ModelFamily.qkv_bias`)
3. ``q, k = RMSNorm_d(q) * w_qn, RMSNorm_d(k) * w_kn`` per head, only if :attr:`ModelFamily.qk_norm` (Qwen3)
4. ``q, k = RoPE(q, p), RoPE(k, p)`` (neox pairing; partial rotary, llama3 or YaRN scaling: the config's)
5. ``a = attention(q, k, v)`` [n, H, dv] (the caller's: it decides which keys a row sees)
6. ``h = h + a W_o^T``
7. ``h = h + MLP(RMSNorm(h) * w_post)``; ``swiglu``: ``W_down (silu(W_gate y) * W_up y)``; ``moe``
   (:class:`MoESpec`): router logits ``y W_r^T`` [E], softmax in float32, top-k experts (weights
   renormalized where the model says so), ``sum_k w_k SwiGLU_{e_k}(y)``.

Steps 1-4 are :func:`project_qkv`, 6-7 :func:`finish_layer`, over :class:`LayerOps` from the torch
reference and the server's repair pass: the order is nowhere else. A model outside :data:`FAMILIES` is
served ``full`` and ``prefix`` only; SGLang classes are named as strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Protocol

import torch

__all__ = [
    "UnknownModelFamilyError",
    "MoESpec",
    "ModelFamily",
    "FAMILIES",
    "SGLANG_MODEL_MODULES",
    "family_for_config",
    "families_of_model_class",
    "mlp_width",
    "hooked_model_classes",
    "LayerOps",
    "project_qkv",
    "finish_layer",
]


class UnknownModelFamilyError(ValueError):
    """The config names no registered family (the message says what it names)."""


#: SGLang module paths under every decoder layer (``layers[i].<path>``), the MLP's apart.
_SGLANG_LAYER_MODULES: tuple[str, ...] = (
    "input_layernorm", "self_attn.qkv_proj", "self_attn.rotary_emb", "self_attn.o_proj", "self_attn.attn",
    "self_attn.q_size", "self_attn.kv_size", "post_attention_layernorm",
)
#: ... and on the decoder stack itself.
SGLANG_MODEL_MODULES: tuple[str, ...] = ("embed_tokens", "layers", "norm")

#: HF checkpoint weights of every decoder layer (``model.layers.{i}.<key>``) by the reference's name.
_HF_ATTN_WEIGHTS: dict[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "o": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
}
_HF_QKV = {x: f"self_attn.{x}_proj.weight" for x in "qkv"}
_HF_QKV_FUSED = {"qkv": "self_attn.qkv_proj.weight"}  # q, k, v rows stacked in this order (Phi-3)
_HF_QKV_BIASES = {f"{x}_bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_HF_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


@dataclass(frozen=True)
class MoESpec:
    """Step 7's ``moe`` as the HF config (``*_key``) and checkpoint name it. ``renormalize``: True, or the config
    key saying whether (absent: False, as HF); ``router``: ``<mlp>.<router>.weight`` [E, hidden]; ``experts``:
    ``<mlp>.experts.{e}.<gate|up|down>.weight``; ``stacked_module``: a transformers 5 model's MLP in memory, its
    experts stacked: ``gate_up_proj`` [E, 2 inter, hidden] (gate rows first), ``down_proj`` [E, hidden, inter]."""

    n_experts_keys: tuple[str, ...]
    width_key: str
    top_k_key: str = "num_experts_per_tok"
    renormalize: bool | str = True
    router: str = "gate"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stacked_module: str = "mlp"

    def n_experts(self, config: Mapping[str, Any]) -> int:
        """E, from the first of :attr:`n_experts_keys` the config holds."""
        for key in self.n_experts_keys:
            if config.get(key):
                return int(config[key])
        raise KeyError(f"the config holds none of {self.n_experts_keys} (the expert count)")

    def routing(self, config: Mapping[str, Any]) -> tuple[int, bool]:
        renorm = self.renormalize if isinstance(self.renormalize, bool) else bool(config.get(self.renormalize, False))
        return int(config[self.top_k_key]), renorm

    def hf_weights(self, mlp: str, config: Mapping[str, Any],
                   stacked: bool = False) -> dict[str, str | tuple[str, ...]]:
        """The reference's MLP weights -> HF keys under ``model.layers.{i}.``, one per expert (the reader
        stacks them); ``stacked``: a transformers 5 state dict's (:attr:`stacked_module`)."""
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
            raise ValueError("an MoE with dense layers (mlp_only_layers, decoder_sparse_step): SGLang 0.5.23 "
                             "serves every Qwen3-MoE layer as sparse, so the reference does not model them")
        if stacked:
            m = self.stacked_module
            return {"router": f"{m}.{self.router}.weight", "experts_gate_up": f"{m}.experts.gate_up_proj",
                    "experts_down": f"{m}.experts.down_proj"}
        weights: dict[str, str | tuple[str, ...]] = {"router": f"{mlp}.{self.router}.weight"}
        for part, name in zip(("gate", "up", "down"), self.experts):
            weights[f"experts_{part}"] = tuple(f"{mlp}.experts.{e}.{name}.weight"
                                               for e in range(self.n_experts(config)))
        return weights


@dataclass(frozen=True)
class ModelFamily:
    """One family of decoder-only models (module doc). ``model_types``: for a config without ``architectures``
    (built in code). ``model_class``: the SGLang decoder stack (``<causal_lm>.model``) whose own ``forward``
    the repair hooks. ``qkv_bias``: always (Qwen2), else as the config's ``attention_bias``. ``mlp_module``:
    SGLang's and the checkpoint's name (Mixtral: ``block_sparse_moe``). ``fused_hf_weights``: checkpoints
    hold ``qkv_proj`` and ``gate_up_proj`` (Phi-3; SGLang fuses either way)."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    causal_lm_class: str
    model_class: str
    qkv_bias: bool = False
    qk_norm: bool = False
    mlp: Literal["swiglu", "moe"] = "swiglu"
    mlp_module: str = "mlp"
    moe: Optional[MoESpec] = None
    fused_hf_weights: bool = False
    rope: Literal["neox"] = "neox"
    norm: Literal["rms"] = "rms"

    def __post_init__(self) -> None:
        if (self.rope, self.norm) != ("neox", "rms") or self.mlp not in ("swiglu", "moe"):
            raise ValueError(f"family {self.name!r}: only the neox/rms decoder layer with a swiglu or moe MLP has "
                             f"ops (got rope={self.rope!r}, mlp={self.mlp!r}, norm={self.norm!r})")
        if (self.mlp == "moe") != (self.moe is not None):
            raise ValueError(f"family {self.name!r}: an moe MLP needs its MoESpec, and only it has one")

    @property
    def hooked_forward(self) -> str:
        return f"{self.model_class}.forward"

    @property
    def sglang_layer_modules(self) -> tuple[str, ...]:
        norms = ("self_attn.q_norm", "self_attn.k_norm") if self.qk_norm else ()
        return _SGLANG_LAYER_MODULES + (self.mlp_module,) + norms

    def has_qkv_bias(self, config: Mapping[str, Any]) -> bool:
        return self.qkv_bias or bool(config.get("attention_bias", False))

    def hf_layer_weights(self, config: Mapping[str, Any],
                         stacked_experts: bool = False) -> dict[str, str | tuple[str, ...]]:
        """The reference's name (``LlamaWeights.layers``) -> the key under ``model.layers.{i}.`` (a tuple: one
        per expert). Fused ``qkv``, ``gate_up`` and ``experts_gate_up`` the reference splits."""
        weights: dict[str, str | tuple[str, ...]] = dict(_HF_ATTN_WEIGHTS)
        weights.update(_HF_QKV_FUSED if self.fused_hf_weights else _HF_QKV)
        if self.has_qkv_bias(config):
            weights.update(_HF_QKV_BIASES)
        if self.qk_norm:
            weights.update(_HF_QK_NORMS)
        mlp = self.mlp_module
        if self.moe is not None:
            weights.update(self.moe.hf_weights(mlp, config, stacked_experts))
        elif self.fused_hf_weights:
            weights.update(gate_up=f"{mlp}.gate_up_proj.weight", down=f"{mlp}.down_proj.weight")
        else:
            weights.update({part: f"{mlp}.{part}_proj.weight" for part in ("gate", "up", "down")})
        return weights


_LLAMA = "sglang.srt.models.llama"
_QWEN2 = "sglang.srt.models.qwen2"
_QWEN3 = "sglang.srt.models.qwen3"

#: ``forward/repair_stage.py::HOOKS`` is generated from it. Mistral and Phi-3 run LlamaModel's forward;
#: Qwen3Model defines its own; Qwen3MoeModel runs Qwen2MoeModel's (an unregistered Qwen2-MoE: pic).
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), ("llama",), f"{_LLAMA}.LlamaForCausalLM", f"{_LLAMA}.LlamaModel"),
    ModelFamily("mistral", ("MistralForCausalLM",), ("mistral",), "sglang.srt.models.mistral.MistralForCausalLM",
                f"{_LLAMA}.LlamaModel"),
    ModelFamily("phi3", ("Phi3ForCausalLM",), ("phi3",), f"{_LLAMA}.Phi3ForCausalLM", f"{_LLAMA}.LlamaModel",
                fused_hf_weights=True),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), f"{_QWEN2}.Qwen2ForCausalLM", f"{_QWEN2}.Qwen2Model",
                qkv_bias=True),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), f"{_QWEN3}.Qwen3ForCausalLM", f"{_QWEN3}.Qwen3Model",
                qk_norm=True),
    ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
                "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM",
                "sglang.srt.models.qwen2_moe.Qwen2MoeModel", qk_norm=True, mlp="moe",
                moe=MoESpec(("num_experts", "num_local_experts"), "moe_intermediate_size",
                            renormalize="norm_topk_prob")),
    ModelFamily("mixtral", ("MixtralForCausalLM",), ("mixtral",), "sglang.srt.models.mixtral.MixtralForCausalLM",
                "sglang.srt.models.mixtral.MixtralModel", mlp="moe", mlp_module="block_sparse_moe",
                moe=MoESpec(("num_local_experts",), "intermediate_size", experts=("w1", "w3", "w2"))),
)


def family_for_config(config: Mapping[str, Any]) -> ModelFamily:
    """From a HF config dict: the first registered of its ``architectures``, else its ``model_type``."""
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
    raise UnknownModelFamilyError(f"{said}: no registered model family (model/model_family.py: {known})")


def hooked_model_classes() -> dict[str, list[str]]:
    """Each hooked SGLang decoder stack -> its families, in registry order (one hook per class)."""
    hooked: dict[str, list[str]] = {}
    for family in FAMILIES:
        hooked.setdefault(family.model_class, []).append(family.name)
    return hooked


def families_of_model_class(class_path: str) -> list[ModelFamily]:
    """How a stack without a ``config`` (MixtralModel) is told apart."""
    return [family for family in FAMILIES if family.model_class == class_path]


def mlp_width(config: Mapping[str, Any]) -> int:
    """One token's MLP intermediate size, for the repair's cost model (an MoE: top-k times one expert's)."""
    try:
        moe = family_for_config(config).moe
    except UnknownModelFamilyError:
        moe = None
    if moe is None:
        return int(config["intermediate_size"])
    return moe.routing(config)[0] * int(config[moe.width_key])



class LayerOps(Protocol):
    """One decoder layer's pieces, with the module doc's shapes: steps 1 ``input_norm``, 2 ``qkv_proj`` (biases
    included), 3 ``qk_norm``, 4 ``rope``, 6 ``o_proj`` (a [n, H, dv] -> [n, hidden]), 7 ``post_attention_norm``
    and ``mlp``; dtypes the executor's (float32 in the reference)."""

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def qkv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ...

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def o_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        ...

    def post_attention_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
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
    """Steps 6-7: hidden [n, hidden] (the layer's input), attn_out [n, H, dv] -> [n, hidden]."""
    hidden = hidden + ops.o_proj(attn_out)
    return hidden + ops.mlp(ops.post_attention_norm(hidden))
