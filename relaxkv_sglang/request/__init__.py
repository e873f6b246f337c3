"""A request: its fields (:mod:`.schema`), its prompt's parts (:mod:`.segments`; discovery in
:mod:`.doc_blocks`, :mod:`.doc_index`) and its plan (:mod:`.plan`). No SGLang (its adapter: :mod:`.sglang`)."""
