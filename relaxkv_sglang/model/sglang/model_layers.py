"""The served model's decoder layers as the repair pass calls them: SGLang's modules as the ops of
:mod:`relaxkv_sglang.model.model_family`.

SGLang modules used: the family's (:attr:`~relaxkv_sglang.model.model_family.ModelFamily.sglang_layer_modules`,
the MLP called as SGLang's layer calls it: an MoE block routes each row itself) and ``config.architectures`` /
``config.model_type``. Under tensor parallelism SGLang 0.5.23's layers leave the o_proj's and the MLP's partial
sums to the layer boundary (``layers/layer_boundary/``), which the repair pass does not run: it sums them itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from relaxkv_sglang.model.sglang.tensor_parallel import served_tensor_parallel
from relaxkv_sglang.model.tensor_parallel import TensorParallel
from relaxkv_sglang.model.model_family import (
    SGLANG_MODEL_MODULES,
    ModelFamily,
    UnknownModelFamilyError,
    families_of_model_class,
    family_for_config,
    finish_layer,
    project_qkv,
)


class UnsupportedModelError(RuntimeError):
    """The model is not of a registered family, or lacks a module its family's layer has."""


def family_of_model(model: torch.nn.Module) -> ModelFamily:
    """The registered family of a decoder stack (``causal_lm.model``): by its HF config, else (MixtralModel) by
    its class when one family alone hooks it; UnsupportedModelError names what the model says."""
    config = getattr(model, "config", None)
    if config is None:
        cls = type(model)
        by_class = families_of_model_class(f"{cls.__module__}.{cls.__qualname__}")
        if len(by_class) == 1:
            return by_class[0]
    described = {key: getattr(config, key, None) for key in ("architectures", "model_type")}
    try:
        return family_for_config(described)
    except UnknownModelFamilyError as exc:
        raise UnsupportedModelError(f"{type(model).__name__}: {exc}") from exc


class SGLangLayerOps:
    """:class:`~relaxkv_sglang.model.model_family.LayerOps` over ``model.layers[i]``, in the served dtype: H / Hkv
    = ``attn.tp_q_head_num`` / ``attn.tp_k_head_num`` (this rank's heads), d = ``attn.head_dim``. ``ranks``: the
    TP group an o_proj or MLP output left partial is summed over."""

    def __init__(self, layer: torch.nn.Module, mlp_module: str = "mlp", ranks: Optional[TensorParallel] = None) -> None:
        self.layer = layer
        self.attn = layer.self_attn
        self.radix = layer.self_attn.attn  # RadixAttention: this rank's head counts and sizes
        self.mlp_block = getattr(layer, mlp_module)
        self.ranks = ranks

    def input_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> [n, hidden]."""
        return self.layer.input_layernorm(hidden)

    def qkv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> q [n, H, d], k [n, Hkv, d], v [n, Hkv, d] (the fused projection, its biases included)."""
        qkv, _ = self.attn.qkv_proj(x)
        q, k, v = qkv.split([self.attn.q_size, self.attn.kv_size, self.attn.kv_size], dim=-1)
        n, r = x.shape[0], self.radix
        return (q.reshape(n, r.tp_q_head_num, r.head_dim), k.reshape(n, r.tp_k_head_num, r.head_dim),
                v.reshape(n, r.tp_v_head_num, r.head_dim))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, H, d], k [n, Hkv, d] -> each head RMS-normed over d (``q_norm``, ``k_norm``), same shapes."""
        d = self.radix.head_dim
        return self.attn.q_norm(q.reshape(-1, d)).view(q.shape), self.attn.k_norm(k.reshape(-1, d)).view(k.shape)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [n]; q [n, H, d], k [n, Hkv, d] -> rotated (``rotary_emb`` takes [n, H * d]), same."""
        n = q.shape[0]
        q_rot, k_rot = self.attn.rotary_emb(positions, q.reshape(n, -1), k.reshape(n, -1))
        return q_rot.reshape(q.shape), k_rot.reshape(k.shape)

    def o_proj(self, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [n, H, dv] -> [n, hidden]."""
        out, _ = self.attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        return self._complete(out, self.attn.o_proj)

    def post_attention_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> [n, hidden]."""
        return self.layer.post_attention_layernorm(hidden)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden] (an MoE block routes the rows itself)."""
        return self._complete(self.mlp_block(x), self.mlp_block)

    def _complete(self, out: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        """``module``'s output, summed over the TP group when the module leaves that sum to the boundary."""
        if self.ranks is None or self.ranks.size == 1 or not leaves_sum_to_boundary(module):
            return out
        return self.ranks.sum(out)


def leaves_sum_to_boundary(module: torch.nn.Module) -> Optional[bool]:
    """Whether a row-parallel output (an o_proj, a dense MLP by its ``down_proj``, a routed-experts MLP by its
    ``experts``) is a partial sum SGLang's layer boundary completes; None: not a module this can tell."""
    down = getattr(module, "down_proj", None)
    if down is not None:
        return leaves_sum_to_boundary(down)
    experts = getattr(module, "experts", None)
    if experts is not None and hasattr(experts, "moe_tp_size") and not hasattr(module, "shared_expert"):
        split = int(experts.moe_tp_size) > 1 or int(getattr(experts, "moe_ep_size", 1)) > 1
        return split and not experts.reduce_results
    if hasattr(module, "reduce_results") and hasattr(module, "input_size_per_partition"):
        return not module.reduce_results and module.input_size_per_partition != module.input_size
    return None


class ModelLayers:
    """A registered family's decoder stack as the layer loop calls it (UnsupportedModelError: a module missing)."""

    def __init__(self, model: torch.nn.Module, ranks: Optional[TensorParallel] = None) -> None:
        self.model = model
        self.ranks = ranks if ranks is not None else served_tensor_parallel()
        self.family = family_of_model(model)
        for name in SGLANG_MODEL_MODULES:
            if not hasattr(model, name):
                raise UnsupportedModelError(f"{type(model).__name__} has no `{name}`; the {self.family.name} "
                                            "family's decoder stack has one")
        self.start = getattr(model, "start_layer", 0)
        self.end = getattr(model, "end_layer", len(model.layers))
        first = model.layers[self.start]
        for path in self.family.sglang_layer_modules:
            if not _has_path(first, path):
                raise UnsupportedModelError(f"{type(first).__name__} has no `{path}`; the {self.family.name} "
                                            "family's decoder layer has one")

    @property
    def n_layers(self) -> int:
        """Decoder layers this worker runs (its pipeline stage's share)."""
        return self.end - self.start

    def layer(self, l: int) -> torch.nn.Module:
        """The l-th decoder layer of this rank."""
        return self.model.layers[self.start + l]

    def qkv(self, l: int, positions: torch.Tensor,
            hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [n, hidden] (pre-norm), positions int64 [n] -> q [n, H, d], k [n, Hkv, d] post-RoPE, v [n, Hkv, d]."""
        return project_qkv(self._ops(l), self.family, hidden, positions)

    def finish(self, l: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual adds around o_proj and the MLP; hidden [n, hidden], attn_out [n, H, dv] -> [n, hidden]."""
        return finish_layer(self._ops(l), hidden, attn_out)

    def _ops(self, l: int) -> SGLangLayerOps:
        return SGLangLayerOps(self.layer(l), self.family.mlp_module, self.ranks)

    def attention_params(self, l: int) -> tuple[int, float]:
        """(KV-pool layer id, softmax scale) of layer l."""
        radix = self.layer(l).self_attn.attn
        return radix.layer_id, radix.scaling


def _has_path(obj: Any, path: str) -> bool:
    """Whether ``obj.<path>`` (dotted) exists."""
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def repair_support(causal_lm: torch.nn.Module) -> tuple[Optional[ModelFamily], str]:
    """(the model's registered family or None, why it is not repaired: "" when it is). Not repaired: a stack whose
    ``forward`` is not the hooked one, no family or a missing module, and under tensor parallelism an o_proj or
    MLP of which :func:`leaves_sum_to_boundary` cannot tell whether its output is whole."""
    inner = getattr(causal_lm, "model", None)
    if inner is None:
        return None, f"{type(causal_lm).__name__} holds no decoder stack (`.model`)"
    try:
        layers = ModelLayers(inner)
    except UnsupportedModelError as exc:
        return None, str(exc)
    family = layers.family
    if getattr(type(inner).forward, "__wrapped__", None) is None:
        return family, f"{type(inner).__name__}.forward is not the hooked one (the {family.name} family's is)"
    if layers.ranks.size > 1:
        for l in range(layers.n_layers):
            layer = layers.layer(l)
            mlp = getattr(layer, family.mlp_module)
            for name, module in (("o_proj", layer.self_attn.o_proj), (family.mlp_module, mlp)):
                if leaves_sum_to_boundary(module) is None:
                    return family, (f"tensor parallelism: layer {l}'s {name} ({type(module).__name__}) is not a "
                                    "row-parallel linear or routed-experts block, so whether its output is summed "
                                    "over the ranks cannot be told")
    return family, ""


def supports_repair(causal_lm: torch.nn.Module) -> bool:
    """Whether :func:`repair_support` finds no reason (else requests are served as ``pic``, with the reason)."""
    return not repair_support(causal_lm)[1]


def family_line(causal_lm: Optional[torch.nn.Module], chunk_reuse: bool) -> str:
    """The startup log's line on the served model: class, family, chunk reuse (the startup gate), repair (why not)."""
    if causal_lm is None:
        return "relaxkv: no model on the worker: no chunk reuse, no repair"
    family, reason = repair_support(causal_lm)
    reuse = ("chunk reuse yes" if chunk_reuse
             else "chunk reuse no (the startup gate failed: chunk policies get HTTP 400)")
    if not reason:
        repair = "repair yes"
    elif chunk_reuse:
        repair = f"repair no, repair policies are served as pic ({reason})"
    else:
        repair = f"repair no ({reason})"
    name = family.name if family is not None else "none registered"
    return f"relaxkv: {type(causal_lm).__name__}, model family {name}: {reuse}; {repair}"
