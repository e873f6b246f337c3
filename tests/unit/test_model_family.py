"""The model-family registry (core/model_family.py): one decoder layer, run by the torch
reference over HF weights and by the server over SGLang-shaped modules, with the same values;
lookups by HF config; the model hooks generated from it."""

from __future__ import annotations

import pkgutil
from types import SimpleNamespace

import pytest
import torch

from relaxkv_sglang.core.model_family import (
    FAMILIES,
    UnknownModelFamilyError,
    family_for_config,
    hooked_model_classes,
    project_qkv,
)
from relaxkv_sglang.core.reference import (
    ReferenceLayerOps,
    _causal_prefill,
    _finish_layer,
    _logits,
    _project_qkv,
    from_hf_state_dict,
    reference_prefill,
)
from relaxkv_sglang.core.rope import RopeSpec, apply_rope
from relaxkv_sglang.srt.model_layers import ModelLayers, SGLangLayerOps, UnsupportedModelError, supports_repair

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_model(family: str, **overrides):
    """A tiny random HF model of the family (3 layers, GQA 4/2 heads of 16), its biases and norm
    weights away from their initial values so that leaving one out would show."""
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[family])
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
                     tie_word_embeddings=False, initializer_range=0.1, attn_implementation="eager", **overrides)
    hf = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0, 0.3)
    return hf


@pytest.fixture(scope="module", params=sorted(HF_CLASSES))
def model(request):
    hf = hf_model(request.param)
    return request.param, hf, from_hf_state_dict(hf.state_dict(), hf.config.to_dict())


# --- the SGLang side: modules shaped as SGLang's, over the reference's weights -----------------


class _Linear(torch.nn.Module):
    """SGLang's parallel linear: returns (output, bias-or-None)."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class _RMSNorm(torch.nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Rotary(torch.nn.Module):
    """SGLang's rotary_emb: q [n, H * d], k [n, Hkv * d] flattened; rotated with core.rope (not the
    reference's own RoPE)."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec

    def forward(self, positions, q, k):
        d = self.spec.head_dim
        return (apply_rope(q.reshape(q.shape[0], -1, d), positions, self.spec).reshape(q.shape),
                apply_rope(k.reshape(k.shape[0], -1, d), positions, self.spec).reshape(k.shape))


class _MLP(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.gate_up = torch.cat([layer["gate"], layer["up"]])  # SGLang fuses gate and up
        self.down = layer["down"]

    def forward(self, x):
        gate, up = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down)


def sglang_model(w, architectures, qk_norm=True):
    """An SGLang-shaped decoder stack (``causal_lm.model``) over the reference's weights."""
    spec = RopeSpec(head_dim=w.head_dim, base=w.rope_theta)
    q_size, kv_size = w.n_heads * w.head_dim, w.n_kv_heads * w.head_dim
    layers = []
    for i, layer in enumerate(w.layers):
        biases = [layer.get(f"{x}_bias") for x in "qkv"]
        attn = torch.nn.Module()
        attn.qkv_proj = _Linear(torch.cat([layer["q"], layer["k"], layer["v"]]),
                                torch.cat(biases) if biases[0] is not None else None)
        attn.o_proj = _Linear(layer["o"])
        attn.rotary_emb = _Rotary(spec)
        attn.attn = SimpleNamespace(head_dim=w.head_dim, tp_q_head_num=w.n_heads, tp_k_head_num=w.n_kv_heads,
                                    tp_v_head_num=w.n_kv_heads, layer_id=i, scaling=w.head_dim ** -0.5)
        attn.q_size, attn.kv_size = q_size, kv_size
        if qk_norm and "q_norm" in layer:
            attn.q_norm, attn.k_norm = _RMSNorm(layer["q_norm"], w.rms_eps), _RMSNorm(layer["k_norm"], w.rms_eps)
        decoder = torch.nn.Module()
        decoder.self_attn = attn
        decoder.input_layernorm = _RMSNorm(layer["attn_norm"], w.rms_eps)
        decoder.post_attention_layernorm = _RMSNorm(layer["mlp_norm"], w.rms_eps)
        decoder.mlp = _MLP(layer)
        layers.append(decoder)
    stack = torch.nn.Module()
    stack.config = SimpleNamespace(architectures=list(architectures), model_type=None)
    stack.embed_tokens = torch.nn.Embedding.from_pretrained(w.embed)
    stack.layers = torch.nn.ModuleList(layers)
    stack.norm = _RMSNorm(w.norm, w.rms_eps)
    return stack


def test_each_family_is_looked_up_by_its_architecture_and_model_type(model):
    family, hf, w = model
    assert w.family.name == family  # a config built in code has no architectures: its model_type
    assert family_for_config({"architectures": [HF_CLASSES[family][1]]}).name == family
    assert family_for_config(hf.config.to_dict()).name == family
    assert w.family.qk_norm == (family == "qwen3") and w.family.qkv_bias == (family == "qwen2")
    has_bias = family == "qwen2"
    assert all(("q_bias" in layer) == has_bias and ("q_norm" in layer) == (family == "qwen3") for layer in w.layers)


def test_the_reference_is_the_hf_model(model):
    """Every family's layer, run by the reference in the registry's order, gives HF's logits."""
    family, hf, w = model
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    _, h = _causal_prefill(w, ids, torch.arange(24))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(w, h), expected, atol=1e-4, rtol=1e-4)
    full = reference_prefill(w, ids, [(4, 12), (12, 20)], 20, "full")
    torch.testing.assert_close(full.last_logits, expected[-1], atol=1e-4, rtol=1e-4)


def test_sglang_ops_agree_with_the_reference_ops(model):
    family, _, w = model
    layers = ModelLayers(sglang_model(w, [HF_CLASSES[family][1]]))
    assert layers.family is w.family and layers.n_layers == 3
    gen = torch.Generator().manual_seed(2)
    hidden, positions = torch.randn(7, 64, generator=gen), torch.tensor([0, 3, 4, 9, 10, 40, 41])
    attn_out = torch.randn(7, 4, 16, generator=gen)
    for l in range(3):
        got, expected = layers.qkv(l, positions, hidden), _project_qkv(w, w.layers[l], hidden, positions)
        assert [t.shape for t in got] == [(7, 4, 16), (7, 2, 16), (7, 2, 16)]
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layers.finish(l, hidden, attn_out), _finish_layer(w, w.layers[l], hidden, attn_out),
                                   atol=1e-5, rtol=1e-5)
        assert layers.attention_params(l) == (l, 0.25)


def test_step_by_step_the_two_ops_agree_and_the_qk_norm_is_not_vacuous():
    hf = hf_model("qwen3")
    w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    ref, served = ReferenceLayerOps(w, w.layers[0]), SGLangLayerOps(sglang_model(w, ["Qwen3ForCausalLM"]).layers[0])
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(5) * 7
    for a, b in zip(ref.qkv_proj(ref.input_norm(x)), served.qkv_proj(served.input_norm(x))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    q, k, _ = ref.qkv_proj(x)
    for a, b in zip(ref.qk_norm(q, k), served.qk_norm(q, k)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(a, q if a.shape == q.shape else k, atol=1e-2)
    for a, b in zip(ref.rope(pos, q, k), served.rope(pos, q, k)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.mlp(x), served.mlp(x), atol=1e-5, rtol=1e-5)
    # The family's qk_norm decides: the same weights under a family without it project another q.
    q_plain = project_qkv(ref, family_for_config({"model_type": "llama"}), x, pos)[0]
    assert float((q_plain - _project_qkv(w, w.layers[0], x, pos)[0]).abs().max()) > 0.1


def test_an_unregistered_architecture_is_named_in_the_error():
    with pytest.raises(UnknownModelFamilyError, match=r"architectures \['GemmaForCausalLM'\]: no registered model "
                                                        r"family .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        family_for_config({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    with pytest.raises(UnknownModelFamilyError, match="LlamaForSequenceClassification"):  # the architecture decides
        family_for_config({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"})
    with pytest.raises(UnknownModelFamilyError, match="model_type 'phi3' \\(no architectures\\)"):
        family_for_config({"model_type": "phi3"})
    assert family_for_config({"architectures": ["Foo", "MistralForCausalLM"]}).name == "mistral"
    hf = hf_model("llama")
    cfg = dict(hf.config.to_dict(), architectures=["GemmaForCausalLM"])
    with pytest.raises(UnknownModelFamilyError, match="GemmaForCausalLM"):
        from_hf_state_dict(hf.state_dict(), cfg)


def test_the_server_refuses_a_model_of_no_family_or_missing_a_module_its_family_has():
    hf = hf_model("qwen3")
    w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    with pytest.raises(UnsupportedModelError, match="GemmaForCausalLM"):
        ModelLayers(sglang_model(w, ["GemmaForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="`self_attn.q_norm`; the qwen3 family's decoder layer has one"):
        ModelLayers(sglang_model(w, ["Qwen3ForCausalLM"], qk_norm=False))
    ModelLayers(sglang_model(w, ["Qwen2ForCausalLM"], qk_norm=False))  # the same modules are a qwen2 layer
    # supports_repair: the decoder stack's forward must be the hooked one, and its family known.
    stack = sglang_model(w, ["Qwen3ForCausalLM"])

    def wrapped(self, *args):
        return None

    wrapped.__wrapped__ = object()
    hooked = type("Hooked", (torch.nn.Module,), {"forward": wrapped})
    plain = type("Plain", (torch.nn.Module,), {"forward": lambda self, *args: None})
    for cls, architectures, expected in [(hooked, ["Qwen3ForCausalLM"], True), (plain, ["Qwen3ForCausalLM"], False),
                                         (hooked, ["GemmaForCausalLM"], False)]:
        stack.__class__ = cls
        stack.config.architectures = architectures
        assert supports_repair(SimpleNamespace(model=stack)) is expected, (cls, architectures)


def test_hooks_hold_one_model_forward_per_hooked_class():
    from relaxkv_sglang.srt.plugin import HOOKS, MODEL_FORWARD_HOOKS

    model_hooks = {target: entry for target, entry in HOOKS.items()
                   if entry[0] == "relaxkv_sglang.srt.repair:around_model_forward"}
    assert model_hooks == MODEL_FORWARD_HOOKS
    assert sorted(model_hooks) == ["sglang.srt.models.llama.LlamaModel.forward",
                                   "sglang.srt.models.qwen2.Qwen2Model.forward",
                                   "sglang.srt.models.qwen3.Qwen3Model.forward"]
    assert {family.hooked_forward for family in FAMILIES} == set(model_hooks)
    assert all(params == ("self", "input_ids", "positions", "forward_batch") for _, params in model_hooks.values())
    assert hooked_model_classes() == {"sglang.srt.models.llama.LlamaModel": ["llama", "mistral"],
                                      "sglang.srt.models.qwen2.Qwen2Model": ["qwen2"],
                                      "sglang.srt.models.qwen3.Qwen3Model": ["qwen3"]}


def test_the_registry_matches_the_installed_sglang():
    """Each hooked class defines ``forward`` itself (a hook on an inherited one would wrap its
    parent's); each family's SGLang class is the one its architecture names, and a class that
    shares a hooked forward holds that decoder stack (Mistral: a LlamaForCausalLM)."""
    pytest.importorskip("sglang")
    for family in FAMILIES:
        stack, causal_lm = pkgutil.resolve_name(family.model_class), pkgutil.resolve_name(family.causal_lm_class)
        assert "forward" in vars(stack), family.model_class
        assert causal_lm.__name__ in family.architectures
    llama = pkgutil.resolve_name("sglang.srt.models.llama.LlamaForCausalLM")
    assert issubclass(pkgutil.resolve_name(FAMILIES[1].causal_lm_class), llama) and FAMILIES[1].name == "mistral"
