"""A request: its fields (:mod:`.schema`), its prompt's parts (:mod:`.segments`, discovery in
:mod:`.doc_blocks` and :mod:`.doc_index`), its plan (:mod:`.plan`) and its report (:mod:`.report`).
Torch-free but for the report; no SGLang (its adapter: :mod:`.sglang`)."""
