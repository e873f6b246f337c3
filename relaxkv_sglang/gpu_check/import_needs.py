"""Which modules outside FlashInfer ``import flashinfer`` needs, read from the sources (``ast``).

The lent GPU machine has no package index: every module FlashInfer imports must be in its image
(:data:`IMAGE_MODULES`) or travel in the bundle. :func:`report` walks the import graph from :data:`ROOTS`
into every package the walked files hold (the bundle's wheels too) and names each module needed that is
neither in the image nor walked. What runs at import (guards, availability tests): :mod:`.import_sites`.

**The graph** (:func:`closure`): importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``; ``from .x import
y`` runs ``x`` and, if it is a module, ``x.y``. A module whose file the walk holds is followed; any
other is recorded with its first import site and chain. **Not seen**: an import inside a function a
module-level statement calls, ``__import__`` or ``importlib`` with a computed name, compiled modules'
imports (numpy's C core imports only numpy and the standard library). The JIT also runs ``ninja`` from
``PATH`` (``flashinfer/jit/cpp_ext.py::run_ninja``; :data:`PROGRAMS`).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from typing import Callable, Iterable, Optional

from relaxkv_sglang.gpu_check.import_sites import ImportSite, module_imports

# Besides the standard library: torch (2.11.0+cu130) and its own dependencies' modules; not numpy,
# packaging, requests, tqdm or ninja.
IMAGE_MODULES = frozenset({"torch", "torchgen", "functorch", "filelock", "jinja2", "markupsafe",
                           "typing_extensions", "sympy", "mpmath", "networkx", "fsspec", "triton", "nvidia"})
# Modules Python 3.12 (the GPU machine's) no longer has, whatever this Python's list says.
REMOVED_IN_PY312 = frozenset({"distutils", "imp", "asynchat", "asyncore", "smtpd"})
# The package and the fa2 paged prefill's plan, run and JIT modules (roots themselves, so that a change
# to flashinfer/__init__.py cannot hide them).
ROOTS = ("flashinfer", "flashinfer.prefill", "flashinfer.jit.core", "flashinfer.jit.cpp_ext",
         "flashinfer.jit.env", "flashinfer.jit.attention.modules")
# Programs FlashInfer's JIT runs by name from PATH, and the wheel member that provides each.
PROGRAMS = {"ninja": "ninja-*.data/scripts/ninja"}


@dataclasses.dataclass
class Closure:
    """``internal``: each module run -> the site that first ran it (None: a root); imports of modules
    outside the walk, ``external`` (``follow`` accepts them) or ``skipped``, -> their first site."""

    internal: dict[str, Optional[ImportSite]]
    external: dict[str, ImportSite]
    skipped: dict[str, ImportSite]

    def chain(self, site: ImportSite) -> list[str]:
        """How the walk reached ``site``: ``["flashinfer", "flashinfer/utils.py:27", ...]``."""
        links = [_link(site)]
        module = path_module(site.path)
        seen = set()
        while module in self.internal and self.internal[module] is not None and module not in seen:
            seen.add(module)
            via = self.internal[module]
            links.append(_link(via))
            module = path_module(via.path)
        return [module] + links[::-1]


def _link(site: ImportSite) -> str:
    return f"{site.path}:{site.line}" + (f" [if {site.condition}]" if site.condition else "")


def path_module(path: str) -> str:
    """``flashinfer/jit/core.py`` -> ``flashinfer.jit.core``; ``a/__init__.py`` -> ``a``."""
    stem = path[: -len("/__init__.py")] if path.endswith("/__init__.py") else path[: -len(".py")]
    return stem.replace("/", ".")


def _module_file(name: str, files: set[str]) -> Optional[tuple[str, bool]]:
    base = name.replace(".", "/")
    if base + "/__init__.py" in files:
        return base + "/__init__.py", True
    if base + ".py" in files:
        return base + ".py", False
    return None


def needed(site: ImportSite) -> bool:
    """An import that can fail the import: neither guarded nor availability-gated."""
    return not site.guarded and not site.gated


def closure(roots: Iterable[str], files: set[str], read: Callable[[str], str],
            follow: Callable[[ImportSite], bool] = needed, preloaded: Iterable[str] = ()) -> Closure:
    """The graph (module doc) from ``roots`` over ``files`` (relative to a ``sys.path`` folder) through the
    sites ``follow`` accepts; ``preloaded``: modules already imported (not run again)."""
    result = Closure({}, {}, {})
    done = set(preloaded)
    todo = collections.deque((root, None) for root in roots)  # breadth first: the chains are shortest

    def run(name: str, site: ImportSite) -> None:
        """``name`` is imported from ``site``: its parents and itself run (if followed)."""
        parts = name.split(".")
        if not follow(site):
            if _module_file(parts[0], files) is None:
                result.skipped.setdefault(name, site)
        elif _module_file(parts[0], files) is None:
            result.external.setdefault(name, site)
        else:
            todo.extend((".".join(parts[:i]), site) for i in range(1, len(parts) + 1))

    while todo:
        name, via = todo.popleft()
        if name in result.internal or name in done:
            continue
        found = _module_file(name, files)
        if found is None:
            continue  # an attribute imported by a dotted name, or a compiled module: nothing to read
        path, is_package = found
        result.internal[name] = via
        for site, names in module_imports(read(path), name, is_package, path):
            run(site.module, site)
            for attr in names:
                if attr != "*" and _module_file(f"{site.module}.{attr}", files) is not None:
                    run(f"{site.module}.{attr}", site)
    for name in list(result.skipped):  # skipped somewhere, followed elsewhere: followed
        if name in result.external:
            del result.skipped[name]
    return result


def is_stdlib(name: str) -> bool:
    """Python 3.12's (this Python's list, less :data:`REMOVED_IN_PY312`)."""
    top = name.split(".")[0]
    return (top in sys.stdlib_module_names or top == "__future__") and top not in REMOVED_IN_PY312


@dataclasses.dataclass
class Report:
    """What ``import flashinfer`` needs outside the walked files. ``needed``: top-level module -> the chain
    to its first import that can fail; ``uncovered``: neither in the image nor walked (the import fails
    there); ``optional``: imported only guarded, -> one site; ``walked``: the packages the walk held."""

    needed: dict[str, list[str]]
    uncovered: list[str]
    optional: dict[str, str]
    walked: list[str]
    modules: int

    def lines(self) -> list[str]:
        out = [f"imports: {self.modules} modules walked from {', '.join(ROOTS[:1])} and the fa2 prefill's "
               f"JIT modules; needed outside them: {', '.join(sorted(self.needed)) or 'nothing'}"]
        out += [f"  {top}: {' -> '.join(chain)}" for top, chain in sorted(self.needed.items())
                if top in self.uncovered]
        out.append(f"imports: optional (guarded or behind an availability test, not needed): "
                   f"{', '.join(f'{t} ({s})' for t, s in sorted(self.optional.items())) or 'none'}")
        return out


def report(files: set[str], read: Callable[[str], str], roots: Iterable[str] = ROOTS,
           image: Iterable[str] = IMAGE_MODULES) -> Report:
    """Each module needed outside ``files`` judged against the standard library and ``image``."""
    graph = closure(roots, files, read)
    walked = sorted({f.split("/")[0].split(".")[0] for f in files if f.endswith(".py")})
    needed: dict[str, list[str]] = {}
    for name, site in sorted(graph.external.items()):
        top = name.split(".")[0]
        if not is_stdlib(top):
            needed.setdefault(top, graph.chain(site))
    image = set(image)
    optional: dict[str, str] = {}
    for name, site in sorted(graph.skipped.items()):
        top = name.split(".")[0]
        if not is_stdlib(top) and top not in needed and top not in image:
            how = "guarded" if site.guarded else f"if {site.condition}" if site.condition else "a fallback"
            optional.setdefault(top, f"{site.path}:{site.line}, {how}")
    # what the availability-gated modules would import in turn (cuda-python, cuDNN, CuTe DSL, ...)
    gated = closure(roots, files, read, follow=lambda site: not site.guarded and site.module not in graph.external)
    for name, site in sorted(gated.external.items()):
        top = name.split(".")[0]
        if not is_stdlib(top) and top not in needed and top not in image and top not in optional:
            optional[top] = " -> ".join(gated.chain(site))
    uncovered = sorted(t for t in needed if t not in image)
    return Report(needed, uncovered, optional, walked, len(graph.internal))


# --- where the files come from ------------------------------------------------------------------


def site_files(site) -> tuple[set[str], Callable[[str], str]]:
    """An unpacked site (a folder on ``sys.path``): its ``.py`` files (relative paths) and a reader."""
    import pathlib

    root = pathlib.Path(site).resolve()
    files = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file()}
    return files, lambda path: (root / path).read_text(encoding="utf-8", errors="replace")


def wheel_files(wheels: Iterable, keep: Optional[Callable[[object, str], bool]] = None
                ) -> tuple[set[str], Callable[[str], str]]:
    """Wheels as installed into one site: their ``.py`` members (those ``keep(wheel, member)``
    accepts) and a reader (a later wheel's member shadows an earlier one's, as a later install would)."""
    import zipfile

    owner: dict[str, str] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if (name.endswith(".py") and not name.split("/")[0].endswith((".data", ".dist-info"))
                        and (keep is None or keep(wheel, name))):
                    owner[name] = str(wheel)
    cache: dict[str, zipfile.ZipFile] = {}

    def read(path: str) -> str:
        if owner[path] not in cache:
            cache[owner[path]] = zipfile.ZipFile(owner[path])
        zf = cache[owner[path]]
        return zf.read(path).decode("utf-8", errors="replace")

    return set(owner), read
