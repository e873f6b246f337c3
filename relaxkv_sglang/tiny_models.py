"""Tiny random-weight models of each registered model family, for tests: built offline in seconds.

Each is a 2-layer model of one family (``model/model_family.py``) built from the family's HF
config class, with the tiny Llama's byte-level BPE tokenizer (copied from ``tiny-llama``), so
the e2e tests serve every family with the real SGLang. What each one exercises beyond the tiny
Llama is in its description: Qwen3's per-head q/k norms, Mistral's config, Llama 3.x's llama3
RoPE scaling, Phi-3's fused projections and partial rotary (Phi-4's architecture), the routed
experts of Qwen3-MoE and Mixtral (4 experts, 2 per token). Weights are drawn from N(0, 0.08)
(as the tiny Llama's, so outputs depend on the context), norm weights from N(1, 0.2) (so a
norm left out shows). Outputs are meaningless but deterministic.

``assets.model_path(name)`` builds and caches them like every other model.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

__all__ = ["TinyModel", "TINY_MODELS", "build_tiny_model"]


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """One tiny model: its HF config and model classes (``transformers`` names) and what its
    config sets beyond the common sizes (hidden 128, 2 layers, 4 heads of 32, 2 KV heads)."""

    name: str
    family: str
    description: str
    config_class: str
    model_class: str
    config: dict[str, Any]


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}

TINY_MODELS: dict[str, TinyModel] = {m.name: m for m in (
    TinyModel("tiny-qwen3", "qwen3", "Qwen3 (dense): per-head q/k RMSNorm before RoPE",
              "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1000000.0)),
    TinyModel("tiny-qwen2", "qwen2", "Qwen2 / Qwen2.5: q/k/v projection biases, RoPE theta 1e6",
              "Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, use_sliding_window=False)),
    TinyModel("tiny-mistral", "mistral", "Mistral: GQA, RoPE theta 1e6, no sliding window (as v0.2 on)",
              "MistralConfig", "MistralForCausalLM", dict(head_dim=32, rope_theta=1000000.0, sliding_window=None)),
    TinyModel("tiny-llama3", "llama", "Llama 3.x: llama3 RoPE scaling (factor 8 beyond 1024 positions)",
              "LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=_LLAMA3_ROPE)),
    TinyModel("tiny-phi3", "phi3", "Phi-3 / Phi-4: fused qkv and gate_up checkpoint, partial rotary (0.75)",
              "Phi3Config", "Phi3ForCausalLM",
              dict(rope_theta=10000.0, partial_rotary_factor=0.75, original_max_position_embeddings=8192,
                   sliding_window=None)),
    TinyModel("tiny-qwen3-moe", "qwen3_moe", "Qwen3-MoE: q/k norms, 4 routed experts, top 2, renormalized",
              "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
              dict(head_dim=32, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                   norm_topk_prob=True)),
    TinyModel("tiny-mixtral", "mixtral", "Mixtral: 4 routed experts (block_sparse_moe), top 2",
              "MixtralConfig", "MixtralForCausalLM",
              dict(rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
                   sliding_window=None)),
)}


def build_tiny_model(name: str, out: pathlib.Path, tokenizer_dir: pathlib.Path) -> None:
    """Write the tiny model ``name`` (safetensors, config, tokenizer) into the folder ``out``.

    Args:
        name: a key of :data:`TINY_MODELS`.
        out: an empty folder.
        tokenizer_dir: the tiny Llama's folder, whose tokenizer every tiny model shares.
    """
    import torch
    import transformers

    spec = TINY_MODELS[name]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    sizes = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    config = getattr(transformers, spec.config_class)(**{**sizes, **spec.config})
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # matrices, stacked experts, biases; else the norms' weights
            param.normal_(0.0, 0.08) if param.dim() >= 2 or name.endswith(".bias") else param.normal_(1.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
