"""relaxkv-sglang: position-independent chunk KV reuse and RelaxKV repair, as an SGLang plugin.

``__version__`` is the package's one version: ``pyproject.toml`` reads it from here
(``[tool.setuptools.dynamic]``), so the wheel, ``importlib.metadata`` and
``relaxkv-sglang --version`` all report this string.
"""

__version__ = "0.1.0"
