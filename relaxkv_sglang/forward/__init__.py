"""One folded forward, top to bottom: :mod:`.pipeline` runs :mod:`.fold` (chunk hits copied, misses scoped),
:mod:`.query_pass` (every request's rows), :mod:`.repair_stage` (anchors, after SGLang's layers; its budget:
:mod:`.budget`), SGLang's forward under :mod:`.context`, and :mod:`.finish` (misses published, reuse counted,
:mod:`.report`). The whole room is SGLang's seam (an adapter); each module names the SGLang files it hooks."""
