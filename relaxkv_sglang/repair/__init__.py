"""The repair: the policies (:mod:`.policies`), the anchors' schedule (:mod:`.anchor_schedule`), the
knobs and budget (:mod:`.repair_config`, :mod:`.auto_budget`), a model's calibration, the stale
shift and the whole-model torch reference prefill per policy (:mod:`.reference`). Torch and the
standard library; no SGLang (its adapter, the repair inside SGLang's forward: :mod:`.sglang`)."""
