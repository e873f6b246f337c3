"""The ``relaxkv`` attention backend, the rows of a folded forward it reads
(:class:`~relaxkv_sglang.attention.extend_rows.FoldedRows`), the anchors' attention.

SGLang files subclassed: ``layers/attention/torch_native_backend.py``, ``layers/attention/flashinfer_backend.py``.
"""
