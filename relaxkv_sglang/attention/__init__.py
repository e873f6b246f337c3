"""Attention: dense, gathered and scoped causal attention (:mod:`.causal`), the block-sparse layout
and executor (:mod:`.layout`, :mod:`.block_sparse`), host staging, and the GPU path
(:mod:`.gpu`). No SGLang (its adapter, the ``relaxkv`` attention backend: :mod:`.sglang`)."""
