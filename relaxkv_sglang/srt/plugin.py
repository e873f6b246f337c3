"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``relaxkv``).

SGLang calls :func:`register` in the launching process and again in every
scheduler process it spawns. It only registers things; the adapters
themselves live in the sibling modules and import sglang lazily.
"""

from __future__ import annotations

import os
import sys


def announce(message: str) -> None:
    """One line in the server log. SGLang loads plugins before it configures
    logging in its spawned processes, so a logger here would be dropped."""
    print(f"[relaxkv] {message}", file=sys.stderr, flush=True)


def _check_cpu_shims() -> None:
    import torch

    if torch.cuda.is_available():
        return
    try:
        import relaxkv_patches
    except ImportError as exc:  # the package is installed without `make install`
        raise SystemExit(f"relaxkv-sglang: CPU shims missing ({exc}); run `make install`") from exc
    relaxkv_patches.arm()
    announce(f"CPU shims active in pid {os.getpid()}: {', '.join(relaxkv_patches.activated())}")


def register() -> None:
    """Called by ``sglang.srt.plugins.load_plugins`` in each SGLang process."""
    _check_cpu_shims()
