"""The model-family registry (model/model_family.py): one decoder layer, run by the torch
reference over HF weights and by the server over SGLang-shaped modules, with the same values;
lookups by HF config; the model hooks generated from it."""

from __future__ import annotations

import dataclasses
import pkgutil
from types import SimpleNamespace

import pytest
import torch

from relaxkv_sglang.model.model_family import (
    FAMILIES,
    UnknownModelFamilyError,
    family_for_config,
    hooked_model_classes,
    project_qkv,
)
from relaxkv_sglang.repair.reference import (
    ReferenceLayerOps,
    apply_neox_rope,
    _causal_prefill,
    _finish_layer,
    _logits,
    _project_qkv,
    from_hf_state_dict,
    reference_prefill,
)
from relaxkv_sglang.model.rope import RopeSpec, apply_rope
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config
from relaxkv_sglang.model.sglang import model_layers
from relaxkv_sglang.model.sglang.model_layers import (
    ModelLayers,
    SGLangLayerOps,
    UnsupportedModelError,
    family_line,
    leaves_sum_to_boundary,
    repair_support,
    supports_repair,
)

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
#: What each family's config sets beyond the common tiny sizes: Phi-3 with partial rotary (its
#: pad token inside the tiny vocabulary), the MoEs with 4 experts, 2 per token.
FAMILY_CONFIG = {
    "phi3": dict(pad_token_id=0, partial_rotary_factor=0.5),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}
#: Llama 3.x: the llama family with llama3 RoPE scaling (long wavelengths scaled at every position).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_model(family: str, **overrides):
    """A tiny random HF model of the family (3 layers, GQA 4/2 heads of 16), its biases and norm
    weights away from their initial values so that leaving one out would show."""
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[family])
    torch.manual_seed(0)
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
                    tie_word_embeddings=False, initializer_range=0.1, attn_implementation="eager")
    cfg = config_cls(**{**settings, **FAMILY_CONFIG.get(family, {}), **overrides})
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


def _hf_rope(hf) -> RopeSpec:
    return rope_spec_from_hf_config(hf.config.to_dict())


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


class _MoE(torch.nn.Module):
    """An MoE block called as SGLang's, ``block(x)``, written another way than the reference's: every
    expert on every token, the top-k kept by a mask of the router's softmax."""

    def __init__(self, layer, top_k, renormalize):
        super().__init__()
        self.layer, self.top_k, self.renormalize = layer, top_k, renormalize

    def forward(self, x):
        f, layer = torch.nn.functional, self.layer
        probs = f.linear(x, layer["router"]).softmax(-1)  # [n, E]
        kept = probs * torch.zeros_like(probs).scatter_(1, probs.topk(self.top_k, -1).indices, 1.0)
        if self.renormalize:
            kept = kept / kept.sum(-1, keepdim=True)
        outs = torch.stack([f.linear(f.silu(f.linear(x, g)) * f.linear(x, u), d) for g, u, d in
                            zip(layer["experts_gate"], layer["experts_up"], layer["experts_down"])], 1)  # [n, E, hidden]
        return (kept[..., None] * outs).sum(1)


def sglang_model(w, architectures, qk_norm=True, rope=None):
    """An SGLang-shaped decoder stack (``causal_lm.model``) over the reference's weights; rope: its
    RoPE (default: plain, at the weights' theta)."""
    spec = rope or RopeSpec(head_dim=w.head_dim, base=w.rope_theta)
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
        mlp = _MoE(layer, w.top_k, w.renormalize) if "router" in layer else _MLP(layer)
        setattr(decoder, w.family.mlp_module, mlp)
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
    qk_norm = family in ("qwen3", "qwen3_moe")
    assert w.family.qk_norm == qk_norm and w.family.qkv_bias == (family == "qwen2")
    assert w.family.mlp == ("moe" if family in ("qwen3_moe", "mixtral") else "swiglu")
    has_bias = family == "qwen2"
    assert all(("q_bias" in layer) == has_bias and ("q_norm" in layer) == qk_norm for layer in w.layers)
    assert all(("router" in layer) == (w.family.mlp == "moe") for layer in w.layers)
    if family == "phi3":  # fused in the checkpoint, split by the reference; a partial rotary
        assert any("qkv_proj" in key for key in hf.state_dict()) and w.rotary_dim == 8 and "q" in w.layers[0]
    if w.family.mlp == "moe":
        assert (w.top_k, w.renormalize, w.layers[0]["experts_gate"].shape) == (2, True, (4, w.mlp_width // 2, 64))


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
    family, hf, w = model
    layers = ModelLayers(sglang_model(w, [HF_CLASSES[family][1]], rope=_hf_rope(hf)))
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
    with pytest.raises(UnknownModelFamilyError, match="model_type 'gemma' \\(no architectures\\)"):
        family_for_config({"model_type": "gemma"})
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
    from relaxkv_sglang.forward import repair_stage
    from relaxkv_sglang.server.sglang.plugin import hooks

    model_hooks = {hook.target: hook for hook in hooks() if hook.around is repair_stage.around_model_forward}
    assert set(model_hooks.values()) == set(repair_stage.HOOKS)
    assert sorted(model_hooks) == ["sglang.srt.models.llama.LlamaModel.forward",
                                   "sglang.srt.models.mixtral.MixtralModel.forward",
                                   "sglang.srt.models.qwen2.Qwen2Model.forward",
                                   "sglang.srt.models.qwen2_moe.Qwen2MoeModel.forward",
                                   "sglang.srt.models.qwen3.Qwen3Model.forward"]
    assert {family.hooked_forward for family in FAMILIES} == set(model_hooks)
    assert all(hook.params == ("self", "input_ids", "positions", "forward_batch") for hook in model_hooks.values())
    assert hooked_model_classes() == {"sglang.srt.models.llama.LlamaModel": ["llama", "mistral", "phi3"],
                                      "sglang.srt.models.qwen2.Qwen2Model": ["qwen2"],
                                      "sglang.srt.models.qwen3.Qwen3Model": ["qwen3"],
                                      "sglang.srt.models.qwen2_moe.Qwen2MoeModel": ["qwen3_moe"],
                                      "sglang.srt.models.mixtral.MixtralModel": ["mixtral"]}


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
    by_name = {family.name: family for family in FAMILIES}
    for name in ("mistral", "phi3"):
        assert issubclass(pkgutil.resolve_name(by_name[name].causal_lm_class), llama), name
    # Qwen3-MoE's stack runs the forward it inherits from Qwen2MoeModel: that is the hooked one
    qwen3_moe = pkgutil.resolve_name("sglang.srt.models.qwen3_moe.Qwen3MoeModel")
    assert "forward" not in vars(qwen3_moe) and qwen3_moe.forward is pkgutil.resolve_name(
        by_name["qwen3_moe"].model_class).forward


def test_llama3_rope_scaling_is_read_from_the_config_and_matches_hf():
    """Llama 3.x is the llama family; its llama3 RoPE (long wavelengths scaled) is the config's."""
    hf = hf_model("llama", rope_parameters=LLAMA3_ROPE)
    w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert w.family.name == "llama" and w.inv_freq is not None and not torch.allclose(w.inv_freq, plain)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(w, _causal_prefill(w, ids, torch.arange(40))[1]), expected, atol=1e-4, rtol=1e-4)
    layers = ModelLayers(sglang_model(w, ["LlamaForCausalLM"], rope=_hf_rope(hf)))
    hidden, positions = torch.randn(5, 64), torch.tensor([0, 7, 30, 31, 200])
    for a, b in zip(layers.qkv(0, positions, hidden), _project_qkv(w, w.layers[0], hidden, positions)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_moe_routes_each_token_to_its_top_k_as_the_config_says(renormalize):
    """Qwen3-MoE's ``norm_topk_prob`` decides whether the top-k weights are renormalized: the
    reference follows it (and HF), and routing one token alone gives what it gets in a batch."""
    hf = hf_model("qwen3_moe", norm_topk_prob=renormalize)
    w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    assert w.renormalize is renormalize and w.top_k == 2
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    ops = ReferenceLayerOps(w, w.layers[1])
    torch.testing.assert_close(ops.mlp(x), _MoE(w.layers[1], 2, renormalize)(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.mlp(x[4:5]), ops.mlp(x)[4:5], atol=1e-6, rtol=1e-6)
    other = ReferenceLayerOps(dataclasses.replace(w, renormalize=not renormalize), w.layers[1])
    assert float((other.mlp(x) - ops.mlp(x)).abs().max()) > 1e-3  # the flag is not vacuous
    with pytest.raises(ValueError, match="mlp_only_layers"):
        from_hf_state_dict(hf.state_dict(), dict(hf.config.to_dict(), mlp_only_layers=[1]))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "phi3"])
def test_a_saved_checkpoint_reads_as_the_model_in_memory(family, tmp_path):
    """The checkpoint (what SGLang loads: one tensor per expert, Mixtral's ``block_sparse_moe``,
    Phi-3's fused projections) and transformers 5's state dict in memory (experts stacked) give the
    reference the same weights."""
    from safetensors.torch import load_file

    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert any(".experts.0." in key for key in saved) == (family != "phi3")
    a = from_hf_state_dict(saved, hf.config.to_dict())
    b = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    for la, lb in zip(a.layers, b.layers):
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


def test_qwen3_norms_q_and_k_before_rope_so_a_re_rotated_k_is_exact():
    """What the startup gate cannot tell: it runs the plugin's own layer ops on both sides, so an
    ops order that differs from the model's would pass it. Qwen3's (and Qwen3-MoE's) per-head
    k_norm comes before RoPE, as the registry's order says (the reference equals HF,
    test_the_reference_is_the_hf_model); there a cached K re-rotated by p equals K computed at p.
    Normed after RoPE instead, it would not: the norm's weight does not commute with a rotation."""
    for family in ("qwen3", "qwen3_moe"):
        hf = hf_model(family)
        w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
        x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
        p, pos = 1000, torch.arange(6)
        k_at_p = _project_qkv(w, w.layers[0], x, pos + p)[1]
        k_moved = apply_neox_rope(_project_qkv(w, w.layers[0], x, pos)[1], torch.full((6,), p), w.rope_inv_freq())
        torch.testing.assert_close(k_moved, k_at_p, atol=1e-4, rtol=1e-4)
        ops = ReferenceLayerOps(w, w.layers[0])

        def norm_after_rope(positions):
            q, k, _ = ops.qkv_proj(ops.input_norm(x))
            return ops.qk_norm(*ops.rope(positions, q, k))[1]

        moved = apply_neox_rope(norm_after_rope(pos), torch.full((6,), p), w.rope_inv_freq())
        assert float((moved - norm_after_rope(pos + p)).abs().max()) > 1e-2, family


def test_a_stack_without_a_config_is_told_by_its_class_and_the_startup_line_names_the_family(monkeypatch):
    hf = hf_model("mixtral")
    w = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    stack = sglang_model(w, ["MixtralForCausalLM"])
    del stack.config  # SGLang's MixtralModel keeps no config
    stack.__class__ = type("MixtralModel", (torch.nn.Module,), {"__module__": "sglang.srt.models.mixtral"})
    assert ModelLayers(stack).family.name == "mixtral"
    causal_lm = SimpleNamespace(model=stack)
    assert repair_support(causal_lm) == (ModelLayers(stack).family,
                                         "MixtralModel.forward is not the hooked one (the mixtral family's is)")
    line = family_line(causal_lm, chunk_reuse=True)
    assert line.startswith("relaxkv: SimpleNamespace, model family mixtral: chunk reuse yes; repair no, repair "
                           "policies are served as pic"), line
    stack.__class__ = type("MixtralModel", (torch.nn.Module,), {"__module__": "elsewhere"})
    family, reason = repair_support(causal_lm)
    assert family is None and "no registered model family" in reason
    assert "model family none registered: chunk reuse no (the startup gate failed" in family_line(causal_lm, False)
    wrapped = type("Hooked", (torch.nn.Module,), {"forward": lambda self, *args: None})
    wrapped.forward.__wrapped__ = object()
    qwen3 = sglang_model(from_hf_state_dict(*(lambda m: (m.state_dict(), m.config.to_dict()))(hf_model("qwen3"))),
                         ["Qwen3ForCausalLM"])
    qwen3.__class__ = wrapped
    assert family_line(SimpleNamespace(model=qwen3), True).endswith("model family qwen3: chunk reuse yes; repair yes")
    # tensor parallelism: a row-parallel output left to SGLang's layer boundary is summed by the repair pass itself;
    # a module of which that cannot be told (here the stand-in MLP, no row-parallel down_proj) is named
    o_proj = qwen3.layers[0].self_attn.o_proj
    o_proj.reduce_results, o_proj.input_size, o_proj.input_size_per_partition = False, 64, 32
    assert leaves_sum_to_boundary(o_proj) is True
    assert repair_support(SimpleNamespace(model=qwen3))[1] == ""  # one rank: nothing to sum
    monkeypatch.setattr(model_layers, "served_tensor_parallel", lambda: SimpleNamespace(size=2, rank=0))
    reason = repair_support(SimpleNamespace(model=qwen3))[1]
    assert reason.startswith("tensor parallelism: layer 0's mlp (_MLP) is not a row-parallel linear"), reason
    for layer in qwen3.layers:
        for row_parallel in (layer.self_attn.o_proj, layer.mlp):
            row_parallel.reduce_results, row_parallel.input_size, row_parallel.input_size_per_partition = True, 64, 32
    assert leaves_sum_to_boundary(qwen3.layers[1].mlp) is False  # summed inside: SGLang's boundary owes nothing
    assert repair_support(SimpleNamespace(model=qwen3))[1] == ""
    o_proj.input_size_per_partition = 64  # one rank: SGLang's boundary has nothing to sum
    assert repair_support(SimpleNamespace(model=qwen3))[1] == ""
