"""Every cross-reference in the package's docstrings and comments names something that exists.

A Sphinx role (``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``) naming
``relaxkv_sglang.…`` must resolve to a module, or a name a module binds (a definition, an assignment, an
import, a class's method, field or ``self.`` attribute); a bare name must be bound in the module that
names it; a relative one (``~.fold.Fold``) is read as Python reads a relative import from that module
(after a move it would otherwise name nothing, silently). Read
from the source (no import), so it runs in a second.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import pathlib
import re
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "relaxkv_sglang"
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`(?:[^`<]*<)?~?([.\w]+)>?`")


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _bound(body: list[ast.stmt], into: dict[str, set[str]], prefix: str) -> None:
    """Record the names ``body`` binds under ``prefix`` (classes recursively, with their ``self.`` attributes)."""
    names = into.setdefault(prefix, set())
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            _bound(node.body, into, f"{prefix}.{node.name}")
            attrs = into[f"{prefix}.{node.name}"]
            attrs.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                         and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            _bound(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []), into, prefix)


@dataclasses.dataclass
class PackageIndex:
    """What the package's source binds: ``scopes`` (module or class -> names), ``sources`` (module -> text)."""

    scopes: dict[str, set[str]]
    sources: dict[str, str]

    @classmethod
    def read(cls) -> "PackageIndex":
        index = cls({}, {})
        for path in sorted(PACKAGE.rglob("*.py")):
            module = _module_name(path)
            index.sources[module] = path.read_text()
            _bound(ast.parse(index.sources[module]).body, index.scopes, module)
        return index

    def absolute(self, module: str, reference: str) -> str:
        """``reference`` as Python would import it from ``module`` (``.x``: beside it; ``..x``: one package up)."""
        if not reference.startswith("."):
            return reference
        dots = len(reference) - len(reference.lstrip("."))
        package = module if self._is_package(module) else module.rsplit(".", 1)[0]
        for _ in range(dots - 1):
            package = package.rsplit(".", 1)[0]
        return f"{package}.{reference[dots:]}"

    def _is_package(self, module: str) -> bool:
        return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()

    def unresolved(self, module: str, reference: str) -> Optional[str]:
        """Why ``reference`` (as written in ``module``) names nothing, or None."""
        if "." not in reference:
            bound = set().union(*(names for scope, names in self.scopes.items()
                                  if scope == module or scope.startswith(module + ".")))
            return None if reference in bound or reference in dir(builtins) else "not bound in this module"
        name = self.absolute(module, reference)
        if not name.startswith("relaxkv_sglang."):
            return None  # SGLang's, torch's, ...: not this package's to check
        parts = name.split(".")
        cut = next(cut for cut in range(len(parts), 0, -1) if ".".join(parts[:cut]) in self.sources)
        scope = ".".join(parts[:cut])
        for part in parts[cut:]:
            if part not in self.scopes.get(scope, set()):
                return f"{scope} binds no {part}" + (f" (read as {name})" if name != reference else "")
            scope = f"{scope}.{part}"
        return None

    def stale(self, texts: Optional[dict[str, str]] = None) -> list[str]:
        """Each reference in ``texts`` (module -> text; default: the package's source) that names nothing."""
        return [f"{module}: {m.group(0)}: {why}" for module, text in (texts or self.sources).items()
                for m in ROLE.finditer(text) if (why := self.unresolved(module, m.group(1)))]


def test_every_reference_in_the_package_resolves():
    stale = PackageIndex.read().stale()
    assert not stale, "\n".join(stale)


def test_the_reference_check_finds_what_it_looks_for():
    index = PackageIndex.read()
    module = "relaxkv_sglang.forward.fold"
    for good in ("relaxkv_sglang.forward.fold.Fold",
                 "relaxkv_sglang.forward.repair_stage.RepairStage.outcomes",
                 "relaxkv_sglang.repair.policies.SERVER_POLICIES", "Fold", ".finish.finish_forward", "..cache.tiers.TierName"):
        assert index.unresolved(module, good) is None, good
    assert index.unresolved(module, "relaxkv_sglang.forward.fold.NoSuch") == \
        "relaxkv_sglang.forward.fold binds no NoSuch"
    assert index.unresolved(module, "relaxkv_sglang.core.fold") == "relaxkv_sglang binds no core"
    assert index.unresolved(module, ".layer_loop") == \
        "relaxkv_sglang.forward binds no layer_loop (read as relaxkv_sglang.forward.layer_loop)"
    assert index.unresolved(module, "no_such_name") == "not bound in this module"
    stale = index.stale({module: "See :class:`~.folds.Fold`, :func:`~relaxkv_sglang.x.y` and :class:`Fold`."})
    assert len(stale) == 2, stale


ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
PATH_REFERENCE = re.compile(r"`((?:relaxkv_sglang/)?[\w/]+)\.py::([\w.]+)`")  # `cache/pool_index.py::PoolChunkIndex`
DOTTED_REFERENCE = re.compile(r"`((?:[a-z_]\w*\.)+[A-Za-z_]\w*)`")  # `fold.publish_misses`, `repair.reference.X`
NOT_THE_PACKAGES = ("sglang", "relaxkv")  # SGLang's modules; the fields of meta_info.relaxkv and /get_server_info


def architecture_doc_stale(index: PackageIndex, text: str) -> list[str]:
    """Each reference of docs/architecture.md to the package that names nothing: ``path.py::Name`` under
    relaxkv_sglang/, and a dotted name whose first part is a room or a module's own name (``fold.Fold``).
    Dotted names of anything else (``meta_info.relaxkv``, ``req.cached_tokens``) and file names are not checked
    here (the architecture test checks the files)."""
    by_basename: dict[str, list[str]] = {}
    for module in index.sources:
        by_basename.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    stale = []
    for m in PATH_REFERENCE.finditer(text):
        module = "relaxkv_sglang." + m.group(1).removeprefix("relaxkv_sglang/").replace("/", ".")
        if module not in index.sources:
            continue  # a test, a benchmark or a script: the architecture test checks the file exists
        if why := index.unresolved(module, f"{module}.{m.group(2)}"):
            stale.append(f"{m.group(0)}: {why}")
    for m in DOTTED_REFERENCE.finditer(text):
        first, _, rest = m.group(1).partition(".")
        if rest.rsplit(".", 1)[-1] == "py" or first in NOT_THE_PACKAGES:
            continue
        if f"relaxkv_sglang.{first}" in index.sources:
            candidates = [f"relaxkv_sglang.{m.group(1)}"]
        else:
            candidates = [f"{module}.{rest}" for module in by_basename.get(first, [])]
        whys = [index.unresolved("relaxkv_sglang", name) for name in candidates]
        if candidates and all(whys):
            stale.append(f"{m.group(0)}: {whys[0]}")
    return stale


def test_every_reference_in_the_architecture_doc_resolves():
    stale = architecture_doc_stale(PackageIndex.read(), ARCHITECTURE_DOC.read_text())
    assert not stale, "docs/architecture.md names what the package does not hold:\n" + "\n".join(stale)


def test_the_architecture_doc_check_finds_what_it_looks_for():
    index = PackageIndex.read()
    text = ("`forward/fold.py::publish_misses` `fold.publish_misses` `repair.anchor_schedule.schedule_anchors` "
            "`meta_info.relaxkv` `tests/unit/test_x.py::T` `forward/fold.py::NoSuch` `fold.no_such` `repair.nope.X`")
    assert architecture_doc_stale(index, text) == [
        "`forward/fold.py::NoSuch`: relaxkv_sglang.forward.fold binds no NoSuch",
        "`fold.no_such`: relaxkv_sglang.forward.fold binds no no_such",
        "`repair.nope.X`: relaxkv_sglang.repair binds no nope"]
