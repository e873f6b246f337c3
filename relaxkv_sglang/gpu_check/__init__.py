"""The GPU check: the plugin's GPU layer (:mod:`relaxkv_sglang.attention.gpu`) and the server's repair pass
(:mod:`relaxkv_sglang.repair.sglang`) run on a GPU, against the CPU and the torch reference.

It sits above both (it imports ``attention/gpu/`` and the adapters; none imports it) and runs in no SGLang
process: ``scripts/gpu_check.sh`` runs it on a lent GPU machine, the dry run on any CPU
(docs/gpu.md).

* :mod:`.repair`: the repair pass (layer loop, anchors, stale shift) on a device against the CPU,
  and its timing against a dense-context repair;
* :mod:`.kernels`: the plugin's FlashInfer calls (anchors, scoped rows) against the torch reference;
* :mod:`.run`: the steps, their budget, the result JSON and the command line
  (``python -m relaxkv_sglang.gpu_check``).
"""
