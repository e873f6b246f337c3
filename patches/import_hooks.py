"""Run a callback right before or after a named module executes.

A ``sys.meta_path`` finder that wraps the real loader of a few target modules.
It never changes what is imported, only runs code around it; every other
import goes straight past it (one dict lookup).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable

ModuleCallback = Callable[[object], None]


class _WrappedLoader(importlib.abc.Loader):
    def __init__(self, inner, before: list[ModuleCallback], after: list[ModuleCallback]):
        self._inner = inner
        self._before = before
        self._after = after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        for fn in self._before:
            fn(module)
        self._inner.exec_module(module)
        for fn in self._after:
            fn(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._inner, name)


class ModuleHookFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loaders of registered module names."""

    def __init__(self) -> None:
        self.before: dict[str, list[ModuleCallback]] = {}
        self.after: dict[str, list[ModuleCallback]] = {}
        self.acted: list[str] = []  # what the callbacks report having changed, in order

    def add(self, module: str, fn: ModuleCallback, *, when: str) -> None:
        table = self.before if when == "before" else self.after
        table.setdefault(module, []).append(fn)

    def watches(self, module: str) -> bool:
        return module in self.before or module in self.after

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.before and fullname not in self.after:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrappedLoader(
            spec.loader, self.before.get(fullname, []), self.after.get(fullname, [])
        )
        return spec


def hook_finder() -> ModuleHookFinder:
    """The process-wide finder, first on ``sys.meta_path``, which holds the one instance (no module state)."""
    for finder in sys.meta_path:
        if isinstance(finder, ModuleHookFinder):
            return finder
    finder = ModuleHookFinder()
    sys.meta_path.insert(0, finder)
    return finder
