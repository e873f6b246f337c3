"""The served model's maths (:mod:`.model_family`, :mod:`.rope`, :mod:`.rope_config`, :mod:`.reference_model`),
no SGLang; its adapter, the family over SGLang's modules: :mod:`.sglang`."""
