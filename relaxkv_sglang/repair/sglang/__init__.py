"""The repair pass over SGLang's modules, where the stale shift lands, the served calibration."""
