"""The ``relaxkv`` attention backend, what one forward carries to it (:mod:`.context`), the anchors' attention.

SGLang files subclassed: ``layers/attention/torch_native_backend.py``, ``layers/attention/flashinfer_backend.py``.
"""
