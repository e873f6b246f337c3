"""The ``relaxkv`` attention backend (:mod:`.attention_backend`) and what one forward carries to it
(:mod:`.context`); the anchors' attention (:mod:`.anchor_attention`).

SGLang files subclassed: ``layers/attention/torch_native_backend.py``,
``layers/attention/flashinfer_backend.py``.
"""
