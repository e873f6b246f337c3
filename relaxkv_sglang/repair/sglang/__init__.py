"""The repair inside SGLang's forward: query pass, repair stage, layer loop, budget and served calibration.

SGLang files hooked: each hooked decoder stack's ``forward`` (``models/llama.py``, ``qwen2.py``,
``qwen3.py``, ``qwen2_moe.py``, ``mixtral.py``: ``model.model_family.hooked_model_classes``).
"""
