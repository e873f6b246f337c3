"""The position-independent chunk cache: one key (:mod:`.chunk_key`), the KV pool's index of chunks
(:mod:`.pool_index`) and its lower tiers (:mod:`.tiers`). No SGLang (its adapter, the tree cache
SGLang runs: :mod:`.sglang`)."""
