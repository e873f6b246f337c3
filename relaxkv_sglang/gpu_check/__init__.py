"""The GPU check: the plugin's GPU layer (:mod:`relaxkv_sglang.attention.gpu`) and the server's repair pass
run on a GPU against the CPU and the torch reference: :mod:`.repair` (the layer loop, and its timing
against a dense-context repair), :mod:`.kernels` (the FlashInfer calls), :mod:`.run` (steps, budget, JSON,
``python -m relaxkv_sglang.gpu_check``). Above both (no module imports it), in no SGLang process:
``scripts/gpu_check.sh`` on a lent GPU machine, the dry run on any CPU (docs/gpu.md).
"""
