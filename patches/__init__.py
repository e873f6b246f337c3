"""CPU shims for SGLang 0.5.23, importable as ``relaxkv_patches``.

SGLang's lean CPU install lacks three things the CUDA install has. Each shim in
:mod:`relaxkv_patches.cpu_shims` fills one gap, checks that the code it works
around is still what it expects, and fails loudly (naming the file) when a new
release moves it. The shims are armed at interpreter start by the
``relaxkv_patches.pth`` file that ``make install`` writes into the venv, so they
reach every process SGLang spawns (the scheduler is started with ``spawn``).
"""

from relaxkv_patches.cpu_shims import SHIMS, ShimError, activated, arm

__all__ = ["SHIMS", "ShimError", "activated", "arm"]
