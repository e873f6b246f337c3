"""The repair pass over SGLang's modules: the layer loop, where the stale shift lands, the served
calibration. Run by :mod:`relaxkv_sglang.forward.repair_stage`."""
