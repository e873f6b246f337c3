"""The served model's maths: the family registry and one decoder layer's ops
(:mod:`.model_family`), RoPE (:mod:`.rope`, :mod:`.rope_config`) and the torch reference's weights
and ops (:mod:`.reference_model`). No SGLang (its adapter, the family over SGLang's modules: :mod:`.sglang`)."""
