"""The repair inside SGLang's forward: the query pass (:mod:`.query_pass`), the repair stage run by
the model hook after SGLang's layers (:mod:`.repair_stage`), its layer loop over SGLang's modules
(:mod:`.layer_loop`), the request's budget and the served calibration.

SGLang files hooked: each hooked decoder stack's ``forward`` (``models/llama.py``, ``qwen2.py``,
``qwen3.py``, ``qwen2_moe.py``, ``mixtral.py``: ``model.model_family.hooked_model_classes``).
"""
