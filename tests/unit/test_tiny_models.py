"""The tiny random-weight model of each registered family (relaxkv_sglang/tiny_models.py): built
offline in seconds, of the family it is named for, with the tiny Llama's tokenizer, and read by
the torch reference as that family's layer (what each one exercises: its config)."""

from __future__ import annotations

import json

import pytest

from relaxkv_sglang import assets
from relaxkv_sglang.model.model_family import FAMILIES, family_for_config
from relaxkv_sglang.model.rope_config import rope_spec_from_hf_config
from relaxkv_sglang.tiny_models import TINY_MODELS, build_tiny_model

pytest.importorskip("transformers")


def test_every_tiny_model_is_an_asset_and_covers_a_family():
    assert set(TINY_MODELS) == set(assets.TINY_FAMILY_MODELS) <= set(assets.MODELS)
    families = {m.family for m in TINY_MODELS.values()}
    assert families == {f.name for f in FAMILIES}  # every registered family has one


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_a_tiny_model_builds_offline_as_its_family(name, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from relaxkv_sglang.repair.reference import from_hf_state_dict

    tokenizer_dir = assets.model_path("tiny-llama")
    build_tiny_model(name, tmp_path, tokenizer_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    assert family_for_config(config).name == TINY_MODELS[name].family
    assert config["num_hidden_layers"] == 2
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("The river rises.") == AutoTokenizer.from_pretrained(tokenizer_dir).encode("The river rises.")
    saved = load_file(str(tmp_path / "model.safetensors"))
    weights = from_hf_state_dict(saved, config)
    rope = rope_spec_from_hf_config(config)
    if name == "tiny-llama3":
        assert rope.scaling_type == "llama3" and weights.inv_freq is not None
    if name == "tiny-phi3":
        assert rope.rotary_dim == weights.rotary_dim == 24 and "model.layers.0.self_attn.qkv_proj.weight" in saved
    if weights.family.mlp == "moe":
        assert weights.top_k == 2 and weights.layers[0]["experts_gate"].shape[0] == 4 and weights.renormalize
