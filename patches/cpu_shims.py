"""The four CPU shims SGLang 0.5.23 needs on a machine without CUDA.

* ``triton_stub``: ``sglang/srt/utils/common.py`` imports ``triton`` at module level; triton (~1 GB, GPU
  only) is not on the CPU stack. A stub package whose kernels can be *defined* (the decorators pass
  functions through) but never launched.
* ``torchvision_ops``: PyPI's torchvision 0.28.0 is a CUDA build; beside CPU torch its ``_C`` cannot
  load and ``torchvision/_meta_registrations.py`` fails ("operator torchvision::nms does not exist"):
  the two op schemas it registers fake kernels for are defined here.
* ``rotary_is_cpu``: ``sglang/srt/layers/rotary_embedding/base.py`` imports ``vllm._custom_ops`` in
  ``RotaryEmbedding.__init__`` unless its module flag ``_is_cpu`` is true (only with the sgl-kernel CPU
  engine, which PyPI lacks): set, so the native torch RoPE runs.
* ``compile_eager``: beside the triton stub every ``@torch.compile`` function raises on its first call
  (inductor looks up ``triton.backends``), which ended the server (``repetition_penalty`` != 1,
  ``sampling/penaltylib/repetition_penalty.py``): once ``sglang/srt/utils/common.py`` is imported,
  ``torch._dynamo.config.disable`` runs them eagerly (same results).

Each shim checks the text it relies on first and raises :class:`ShimError` naming the file when a
release has moved it. Activations are recorded in :func:`activated` and, when ``RELAXKV_SHIM_REPORT``
names a file, appended to it as JSON lines (pid, shim), so tests see which process each shim reached.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types

from relaxkv_patches.import_hooks import hook_finder

SHIMS = ("triton_stub", "torchvision_ops", "rotary_is_cpu", "compile_eager")
SGLANG_VERSION = "0.5.23"

class ShimError(ImportError):
    """A shimmed file no longer looks the way the shim expects."""


def activated() -> list[str]:
    return list(hook_finder().acted)


def _record(name: str) -> None:
    hook_finder().acted.append(name)
    path = os.environ.get("RELAXKV_SHIM_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "shim": name}) + "\n")


def _require_text(module, needles: list[str], shim: str) -> None:
    """Fail loudly when the source of ``module`` lacks any of ``needles``."""
    path = getattr(module, "__file__", None) or "?"
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as exc:
        raise ShimError(f"relaxkv shim {shim}: cannot read {path}: {exc}") from exc
    missing = [n for n in needles if n not in source]
    if missing:
        raise ShimError(
            f"relaxkv shim {shim}: {path} no longer contains {missing!r}; the shim was "
            f"written for sglang {SGLANG_VERSION}. Update patches/cpu_shims.py for this release."
        )


# --------------------------------------------------------------------------- triton


class _StubClass:
    """Base class for ``class X(triton.something.Y)`` in kernel files."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _TritonStubModule(types.ModuleType):
    """Unknown attributes are child stubs; calling it is a pass-through decorator (``@triton.jit``)."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():  # a class, possibly used as a base class
            value = type(attr, (_StubClass,), {"__module__": self.__name__})
        else:
            value = importlib.import_module(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    def __getitem__(self, grid):  # kernel[grid](...) would launch a kernel
        raise RuntimeError(f"{self.__name__}: triton is stubbed on this CPU install; no kernel can run")


class _TritonStubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _TritonStubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        if module.__name__ == "triton":
            module.__version__ = "3.5.0"
            module.cdiv = lambda a, b: -(a // -b)
            module.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1
            module.Config = _StubClass
            _record("triton_stub")
        elif module.__name__ == "triton.language":
            module.constexpr = type("constexpr", (_StubClass,), {})
            module.dtype = type("dtype", (_StubClass,), {})


class _TritonStubFinder(importlib.abc.MetaPathFinder):
    """Serves ``triton`` and every ``triton.*`` submodule from the stub."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "triton" and not fullname.startswith("triton."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _TritonStubLoader(), is_package=True)


def _arm_triton() -> None:
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return  # a real triton is installed (GPU stack): nothing to do
    sys.meta_path.append(_TritonStubFinder())
    hook_finder().add(COMPILE_EAGER_MODULE, _compile_eager, when="after")


COMPILE_EAGER_MODULE = "sglang.srt.utils.common"  # imports triton; imported by every SGLang process


def _compile_eager(module) -> None:
    _require_text(module, ["import triton"], "compile_eager")
    import torch

    torch._dynamo.config.disable = True
    _record("compile_eager")


# ---------------------------------------------------------------------- torchvision

def _define_torchvision_ops(extension_module) -> None:
    if extension_module._has_ops():
        return  # torchvision's own kernels loaded: the schemas exist
    import torch

    library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    # The definitions live as long as the Library object: the module keeps it.
    extension_module._relaxkv_op_schemas = library
    _record("torchvision_ops")


def _arm_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None:
        return
    finder = hook_finder()

    def after_extension(module) -> None:
        spec = importlib.util.find_spec("torchvision._meta_registrations")
        if spec is not None and spec.origin:
            with open(spec.origin, encoding="utf-8") as f:
                source = f.read()
            for needle in ('register_fake("torchvision::nms")', 'register_fake("torchvision::qnms")'):
                if needle not in source:
                    raise ShimError(
                        f"relaxkv shim torchvision_ops: {spec.origin} no longer contains "
                        f"{needle!r}; update patches/cpu_shims.py for this torchvision release."
                    )
        if not hasattr(module, "_has_ops"):
            raise ShimError(
                f"relaxkv shim torchvision_ops: {module.__file__} has no _has_ops(); "
                "update patches/cpu_shims.py for this torchvision release."
            )
        _define_torchvision_ops(module)

    finder.add("torchvision.extension", after_extension, when="after")


# -------------------------------------------------------------------------- rotary

ROTARY_MODULE = "sglang.srt.layers.rotary_embedding.base"


def _patch_rotary(module) -> None:
    _require_text(
        module,
        ["_is_cpu = is_cpu()", "and not (_is_cpu)", "from vllm._custom_ops import rotary_embedding"],
        "rotary_is_cpu",
    )
    import torch

    if torch.cuda.is_available():
        return  # the CUDA path has its own kernels
    module._is_cpu = True
    _record("rotary_is_cpu")


def _arm_rotary() -> None:
    hook_finder().add(ROTARY_MODULE, _patch_rotary, when="after")


def arm() -> None:
    """Install the import hooks (idempotent). Called from ``relaxkv_patches.pth``."""
    if os.environ.get("RELAXKV_DISABLE_SHIMS") == "1":
        return
    if hook_finder().watches(ROTARY_MODULE):
        return  # armed already (the hooks live on sys.meta_path)
    _arm_triton()
    _arm_torchvision()
    _arm_rotary()
