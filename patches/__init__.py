"""CPU shims for SGLang 0.5.23 (:mod:`relaxkv_patches.cpu_shims`), importable as ``relaxkv_patches``: each
fills a gap of SGLang's lean CPU install and fails loudly when a release moves what it works around.
``make install`` arms them through a ``relaxkv_patches.pth`` file in the venv, so they reach every
process SGLang spawns (the scheduler is started with ``spawn``).
"""

from relaxkv_patches.cpu_shims import SHIMS, ShimError, activated, arm

__all__ = ["SHIMS", "ShimError", "activated", "arm"]
