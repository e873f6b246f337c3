"""The position-independent chunk cache: the chunk tree (:mod:`.chunk_store`) and its lower tiers
(:mod:`.tiers`). No SGLang (its adapter, the tree cache SGLang runs: :mod:`.sglang`)."""
