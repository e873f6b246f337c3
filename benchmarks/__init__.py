"""The evaluation of relaxkv-sglang, kept apart from the server package.

Everything that measures the plugin lives here, next to the benchmark runners, and nothing
in :mod:`relaxkv_sglang` imports it: the workloads (prompt layouts :mod:`benchmarks.prompt_formats`,
documents and the HotpotQA trace :mod:`benchmarks.rag_documents`, quality tasks
:mod:`benchmarks.quality_tasks`), the scoring and statistics (:mod:`benchmarks.metrics`), the demo
(:mod:`benchmarks.demo`), the one replay of a trace that the demo and every benchmark use
(:mod:`benchmarks.replay`), the one table printer every table goes through (:mod:`benchmarks.tables`)
and the benchmarks themselves.

Why a folder of the checkout rather than a second installed package: evaluation runs from a
checkout (``make demo``, ``make bench``, ``python -m benchmarks.*``), with the prepared data
sets and the ``results/`` and ``docs/results/`` folders beside it, and the wheel is what a
server needs. Evaluation reaches the server as any client would: over HTTP through
:mod:`relaxkv_sglang.client`, the frontend of :mod:`relaxkv_sglang.lang`, and server processes
started by :mod:`relaxkv_sglang.server.launch`.
"""
