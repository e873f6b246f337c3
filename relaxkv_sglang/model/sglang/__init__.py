"""The served model's family over SGLang's modules (:mod:`.model_layers`)."""
