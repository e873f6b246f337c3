"""The repair: policies, anchors' schedule, knobs and budget, calibration, stale shift and the torch reference prefill
per policy (:mod:`.reference`); no SGLang (its adapter, the repair inside SGLang's forward: :mod:`.sglang`)."""
