"""Architecture rules, read from the source (AST), never by importing it.

* No import cycle among the project's modules (``relaxkv_sglang`` and ``relaxkv_patches``, the
  packages of pyproject.toml): every import counts, at module level or inside a function,
  except under ``if TYPE_CHECKING:``.
* No module rebinds module-level state at run time: no ``global`` statement in a function, no
  assignment to (or ``setattr``/``del`` of) an attribute of one of the project's modules, no
  in-place mutation of a module-level container from a function (a process-wide registry).
* Imports run one way. ``core/`` and ``gpu/`` import nothing of ``srt/``. Inside ``srt/`` the
  packages import only downward (:data:`SRT_MAY_IMPORT`): ``entrypoints`` (the HTTP process) none
  of the scheduler's packages, ``mem_cache`` nothing of ``forward`` or ``scheduler``, and no
  package imports a top module of ``srt`` but the base ones (:data:`SRT_BASE`).
* No module over :data:`MAX_MODULE_LINES` lines outside ``benchmarks/``.
* ``docs/architecture.md`` matches the tree: every ``.py`` file it names exists, and every package
  of ``relaxkv_sglang`` is named in it.
* ``relaxkv_sglang/srt/**.py``: every parameter is annotated (``self``/``cls`` excepted,
  ``*args``/``**kwargs`` included) and every public function or method has a docstring.

Each failure lists every offender as ``path:line``.  Nothing is allow-listed.
"""

from __future__ import annotations

import ast
import contextlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]


# --- the modules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Module:
    name: str  # dotted import name
    path: Path
    is_package: bool  # an __init__.py

    @property
    def package(self) -> str:
        """The package relative imports resolve against."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))

    def tree(self) -> ast.Module:
        return _parse(self.path)


_TREES: dict[Path, ast.Module] = {}


def _parse(path: Path) -> ast.Module:
    if path not in _TREES:
        _TREES[path] = ast.parse(path.read_text(), filename=str(path))
    return _TREES[path]


@contextlib.contextmanager
def _probe(src: str, name: str = "relaxkv_sglang.core._probe_") -> Iterator[tuple[Module, dict[str, Module]]]:
    """A synthetic module ``name`` with source ``src``, next to the real ones (tests of the checks)."""
    path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
    _TREES[path] = ast.parse(src)
    try:
        module = Module(name, path, False)
        yield module, project_modules() | {name: module}
    finally:
        del _TREES[path]


def _top_packages() -> dict[str, Path]:
    """Import name -> source folder of each top-level package pyproject.toml installs.

    ``package-dir`` maps them; setup.py ships each with every subpackage under its folder.
    """
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {top: ROOT / folder for top, folder in sorted(setuptools["package-dir"].items())}


def project_modules() -> dict[str, Module]:
    """Every .py file under the packages' folders (subpackages included, listed or not)."""
    modules = {}
    for top, folder in _top_packages().items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((top,) + (parts[:-1] if is_package else parts))
            modules[name] = Module(name, path, is_package)
    return modules


# --- imports ----------------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk, skipping the body of ``if TYPE_CHECKING:`` (its ``else`` still runs)."""
    yield node
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = [node.test, *node.orelse]
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _walk_runtime(child)


def _longest_module(name: str, modules: dict[str, Module]) -> Optional[str]:
    """The longest prefix of dotted ``name`` that is a project module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def _resolve_from(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: Module, modules: dict[str, Module]) -> list[tuple[str, int]]:
    """(project module imported, line) for every runtime import in ``module``.

    ``import a.b.c`` -> the longest of a.b.c, a.b, a that is a project module; ``from p import
    x`` -> ``p.x`` when that is a module, else ``p``; relative imports resolved against the
    module's package; ``importlib.import_module("...")`` with a constant name counts too.
    """
    found = []
    for node in _walk_runtime(module.tree()):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, node)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            resolved = _longest_module(target, modules)
            if resolved is not None and resolved != module.name:
                found.append((resolved, node.lineno))
    return found


def import_graph() -> tuple[dict[str, Module], dict[str, dict[str, int]]]:
    """modules, and edges module -> {imported module: first line importing it}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, module in modules.items():
        for target, line in imports_of(module, modules):
            graph[name].setdefault(target, line)
    return modules, graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _shortest_cycle(start: str, members: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle start -> ... -> start inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]  # path = [v, parent(v), ..., start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a component but on no cycle")


def import_cycles() -> list[str]:
    """One line per cycle: each module with the file:line of the import that leads on."""
    modules, graph = import_graph()
    lines = []
    for comp in _strongly_connected(graph):
        members = set(comp)
        cycle = _shortest_cycle(comp[0], members, graph)
        hops = [f"{a} ({modules[a].rel}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        lines.append(" -> ".join(hops + [cycle[-1]])
                     + (f"  [component of {len(comp)}: {', '.join(comp)}]" if len(comp) > len(cycle) - 1 else ""))
    return lines


def test_import_graph_is_read_from_the_source():
    modules, graph = import_graph()
    assert "relaxkv_sglang.gpu.prefill_inputs" in graph["relaxkv_sglang.gpu.flashinfer_attention"]
    assert "relaxkv_sglang.gpu.flashinfer_attention" in graph["relaxkv_sglang.gpu_check.kernels"]  # in functions
    assert "relaxkv_sglang.core.layout" in graph["relaxkv_sglang.gpu.anchor_inputs"]
    assert "relaxkv_patches.cpu_shims" in graph["relaxkv_patches"]
    assert any(m.startswith("relaxkv_patches.") for m in modules)


def test_imports_are_read_in_every_form():
    src = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import layout\n"                              # from pkg import module (relative)
        "from .attention import block_sparse_attention\n"      # from module import name (relative)
        "from ..gpu import prefill_inputs as pi\n"             # two levels up
        "import relaxkv_sglang.core.rope\n"
        "if TYPE_CHECKING:\n"
        "    from relaxkv_sglang.srt import plan\n"            # not at run time
        "else:\n"
        "    from relaxkv_sglang import schema\n"
        "def f():\n"
        "    from relaxkv_sglang.core.segments import auto_chunk\n"  # inside a function
        "    import importlib\n"
        "    return importlib.import_module('relaxkv_sglang.routing')\n")
    with _probe(src) as (module, modules):
        found = imports_of(module, modules)
    assert sorted({m for m, _ in found}) == [
        "relaxkv_sglang.core.attention", "relaxkv_sglang.core.layout", "relaxkv_sglang.core.rope",
        "relaxkv_sglang.core.segments", "relaxkv_sglang.gpu.prefill_inputs", "relaxkv_sglang.routing",
        "relaxkv_sglang.schema"]
    assert ("relaxkv_sglang.core.segments", 12) in found


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles (module (file:line of the import) -> ...):\n" + "\n".join(cycles)


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _shortest_cycle("a", {"a", "b", "c"}, graph) == ["a", "b", "c", "a"]
    assert _shortest_cycle("a", {"a", "b"}, {"a": {"b": 1}, "b": {"a": 2}}) == ["a", "b", "a"]


# --- which way imports run ---------------------------------------------------------------------

SRT = "relaxkv_sglang.srt"
#: srt package -> the other srt packages it may import (the scheduler's stages reach the cache, not
#: the other way; the HTTP process imports nothing of the scheduler's)
SRT_MAY_IMPORT = {"entrypoints": set(), "scheduler": {"mem_cache"}, "mem_cache": set(), "forward": {"mem_cache"}}
#: top modules of srt any package may import (what requests, failures and calibrations are)
SRT_BASE = {"plan", "failures", "calibration", "state"}


def _srt_place(name: str) -> Optional[tuple[str, str]]:
    """("package", its name) for a module inside an srt package, ("top", its name) for a top module
    of srt, None outside srt."""
    if not name.startswith(SRT + "."):
        return None
    first = name[len(SRT) + 1:].split(".")[0]
    return ("package", first) if first in SRT_MAY_IMPORT else ("top", first)


def upward_imports(modules: dict[str, Module], graph: dict[str, dict[str, int]]) -> list[str]:
    """``path:line module -> imported`` for every import that runs against the rules (module doc)."""
    bad = []
    for name, deps in sorted(graph.items()):
        here = _srt_place(name)
        for dep, line in sorted(deps.items()):
            there = _srt_place(dep)
            if there is None:
                continue
            where = f"{modules[name].rel}:{line} {name} -> {dep}"
            if any(name == top or name.startswith(top + ".") for top in ("relaxkv_sglang.core", "relaxkv_sglang.gpu")):
                bad.append(where + " (core/ and gpu/ import no srt)")
            elif here is not None and here[0] == "package":
                kind, target = there
                if kind == "package" and target != here[1] and target not in SRT_MAY_IMPORT[here[1]]:
                    bad.append(where + f" ({here[1]} may import {sorted(SRT_MAY_IMPORT[here[1]]) or 'no other package'})")
                elif kind == "top" and target not in SRT_BASE:
                    bad.append(where + f" (a package imports only the base modules {sorted(SRT_BASE)})")
            elif here is not None and here[1] in SRT_BASE and there[0] == "package":
                bad.append(where + " (a base module imports no package)")
    return bad


def test_imports_run_one_way():
    bad = upward_imports(*import_graph())
    assert not bad, "imports against the direction of the layers:\n" + "\n".join(bad)


def test_the_direction_check_finds_what_it_looks_for():
    cases = {  # (module, source) -> how many offenders
        ("relaxkv_sglang.srt.mem_cache._probe_", "from relaxkv_sglang.srt.forward import fold\n"): 1,
        ("relaxkv_sglang.srt.entrypoints._probe_", "def f():\n    import relaxkv_sglang.srt.mem_cache.pins\n"): 1,
        ("relaxkv_sglang.srt.forward._probe_", "from relaxkv_sglang.srt import gate\n"): 1,
        ("relaxkv_sglang.gpu._probe_", "from relaxkv_sglang.srt import plan\n"): 1,
        ("relaxkv_sglang.gpu_check_probe_", "from relaxkv_sglang.srt import plan\n"): 0,  # not gpu/
        ("relaxkv_sglang.srt.forward._probe_",
         "from relaxkv_sglang.srt.mem_cache import chunk_cache\nfrom relaxkv_sglang.srt import plan\n"): 0,
    }
    for (name, src), n in cases.items():
        with _probe(src, name) as (module, modules):
            graph = {module.name: {dep: line for dep, line in imports_of(module, modules)}}
            assert len(upward_imports(modules, graph)) == n, (name, src)


# --- module size ---------------------------------------------------------------------------------

MAX_MODULE_LINES = 450


def long_modules() -> list[str]:
    """``path: N lines`` for every project module over :data:`MAX_MODULE_LINES` (benchmarks are not
    a package of pyproject.toml, so they are not read)."""
    return [f"{m.rel}: {n} lines" for m in project_modules().values()
            if (n := len(m.path.read_text().splitlines())) > MAX_MODULE_LINES]


def test_no_module_over_the_line_limit():
    assert not long_modules(), f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long_modules())


# --- docs/architecture.md names the tree ---------------------------------------------------------

ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
_SOURCE_ROOTS = ("", "relaxkv_sglang", "patches")  # a path in the doc is read from one of these


def doc_tree_mismatches(text: Optional[str] = None) -> list[str]:
    """What the architecture doc names that is not in the tree, and packages it leaves out."""
    text = ARCHITECTURE_DOC.read_text() if text is None else text
    files = [p for folder in ("relaxkv_sglang", "patches", "benchmarks", "scripts", "tests")
             for p in (ROOT / folder).rglob("*.py")]
    names = {p.name for p in files}
    bad = []
    for ref in sorted(set(re.findall(r"[\w/]*\w\.py\b", text))):
        found = (any((ROOT / base / ref).is_file() for base in _SOURCE_ROOTS) if "/" in ref
                 else ref in names)
        if not found:
            bad.append(f"names {ref}, which is not in the tree")
    for init in sorted((ROOT / "relaxkv_sglang").rglob("__init__.py")):
        package = init.parent.relative_to(ROOT / "relaxkv_sglang").as_posix()
        if package != "." and f"{package}/" not in text:
            bad.append(f"does not name the package {package}/")
    return bad


def test_the_architecture_doc_matches_the_tree():
    bad = doc_tree_mismatches()
    assert not bad, "docs/architecture.md:\n" + "\n".join(bad)


def test_the_doc_check_finds_what_it_looks_for():
    text = ARCHITECTURE_DOC.read_text()
    before = set(doc_tree_mismatches(text))
    assert set(doc_tree_mismatches(text + "\nsrt/forward/no_such_module.py")) - before == {
        "names srt/forward/no_such_module.py, which is not in the tree"}
    assert "does not name the package srt/mem_cache/" in doc_tree_mismatches(text.replace("mem_cache/", "mem_cache"))


# --- module-level state -----------------------------------------------------------------------


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add",
             "discard", "remove", "__setitem__", "__delitem__"}


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function, nested ones included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTIONS):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _own_nodes(func: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a function's body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*_FUNCTIONS, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def global_statements(modules: Optional[dict[str, Module]] = None) -> list[str]:
    offenders = []
    for module in (modules or project_modules()).values():
        for qualname, func in _functions(module.tree()):
            for node in _own_nodes(func):
                if isinstance(node, ast.Global):
                    offenders.append(f"{module.rel}:{node.lineno} {qualname}(): global {', '.join(node.names)}")
    return sorted(offenders)


def _module_aliases(module: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local name -> project module, for names bound by imports anywhere in ``module``."""
    aliases = {}
    for node in ast.walk(module.tree()):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    aliases[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in modules:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _as_module(expr: ast.expr, aliases: dict[str, str], modules: dict[str, Module]) -> Optional[str]:
    """The project module an expression like ``name`` or ``pkg.sub`` denotes, if any."""
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _as_module(expr.value, aliases, modules)
        if base is not None and f"{base}.{expr.attr}" in modules:
            return f"{base}.{expr.attr}"
    return None


def foreign_module_writes(modules: Optional[dict[str, Module]] = None) -> list[str]:
    """Assignments to, ``del`` of, or ``setattr`` on an attribute of a project module."""
    modules = modules or project_modules()
    offenders = []
    for module in modules.values():
        aliases = _module_aliases(module, modules)
        for node in ast.walk(module.tree()):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del)):
                        owner = _as_module(t.value, aliases, modules)
                        if owner is not None:
                            offenders.append(f"{module.rel}:{node.lineno} writes {owner}.{t.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("setattr", "delattr") and node.args):
                owner = _as_module(node.args[0], aliases, modules)
                if owner is not None:
                    offenders.append(f"{module.rel}:{node.lineno} {node.func.id}({owner}, ...)")
    return sorted(offenders)


def _module_level_names(tree: ast.Module) -> set[str]:
    """Names assigned at module level (outside functions and classes)."""
    names = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {t.id for t in ast.walk(target) if isinstance(t, ast.Name)}
        else:
            stack.extend(ast.iter_child_nodes(node))
    return names


def _local_names(func: ast.AST) -> set[str]:
    """Parameters and names a function binds itself (they shadow module-level names)."""
    args = func.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    declared_global = {n for node in _own_nodes(func) if isinstance(node, ast.Global) for n in node.names}
    for node in _own_nodes(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names - declared_global


def module_state_mutations(modules: Optional[dict[str, Module]] = None) -> list[str]:
    """In-place changes from a function to a container bound at module level
    (``X[k] = v``, ``del X[k]``, ``X.append/update/pop/...(...)``): a process-wide registry."""
    offenders = []
    for module in (modules or project_modules()).values():
        tree = module.tree()
        module_names = _module_level_names(tree)
        for qualname, func in _functions(tree):
            shared = module_names - _local_names(func)
            for node in _own_nodes(func):
                name = None
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    name = node.value.id if isinstance(node.value, ast.Name) else None
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name)):
                    name = node.func.value.id
                if name in shared:
                    offenders.append(f"{module.rel}:{node.lineno} {qualname}() mutates module-level {name}")
    return sorted(set(offenders))


def test_no_global_statements():
    offenders = global_statements()
    assert not offenders, "functions rebinding module-level names (`global`):\n" + "\n".join(offenders)


def test_no_module_writes_another_modules_attributes():
    offenders = foreign_module_writes()
    assert not offenders, "attributes of project modules rebound from outside:\n" + "\n".join(offenders)


def test_no_module_level_container_mutated_at_run_time():
    offenders = module_state_mutations()
    assert not offenders, "module-level containers mutated from functions (process-wide state):\n" + "\n".join(
        offenders)


def test_state_checks_find_what_they_look_for():
    src = (
        "import relaxkv_sglang.core.layout as L\n"
        "from relaxkv_sglang.core import attention\n"
        "import relaxkv_sglang.core.rope\n"
        "REG = {}\n"
        "def f(x):\n"
        "    global G\n"
        "    REG[x] = 1\n"
        "    L.page_scores = None\n"
        "    setattr(attention, 'y', 1)\n"
        "    relaxkv_sglang.core.rope.X = 2\n"
        "    def g(REG):\n"
        "        REG[0] = 1\n"
        "        REG.update(a=1)\n")
    with _probe(src) as (module, modules):
        aliases = _module_aliases(module, modules)
        assert aliases == {"L": "relaxkv_sglang.core.layout", "attention": "relaxkv_sglang.core.attention",
                           "relaxkv_sglang": "relaxkv_sglang"}
        assert _as_module(ast.parse("relaxkv_sglang.core.rope", mode="eval").body, aliases, modules) == \
            "relaxkv_sglang.core.rope"
        funcs = dict(_functions(module.tree()))
        assert set(funcs) == {"f", "f.<locals>.g"}
        assert sum(isinstance(n, ast.Global) for n in _own_nodes(funcs["f"])) == 1
        assert "REG" in _module_level_names(module.tree()) - _local_names(funcs["f"])
        assert "REG" in _local_names(funcs["f.<locals>.g"])  # a parameter shadows it
        mine = lambda found: [o for o in found if o.startswith(module.rel)]  # noqa: E731
        assert mine(global_statements(modules)) == [f"{module.rel}:6 f(): global G"]
        assert mine(foreign_module_writes(modules)) == [
            f"{module.rel}:10 writes relaxkv_sglang.core.rope.X",
            f"{module.rel}:8 writes relaxkv_sglang.core.layout.page_scores",
            f"{module.rel}:9 setattr(relaxkv_sglang.core.attention, ...)"]
        assert mine(module_state_mutations(modules)) == [f"{module.rel}:7 f() mutates module-level REG"]


# --- srt/: annotations and docstrings ---------------------------------------------------------


def _srt_files() -> list[Path]:
    return sorted((ROOT / "relaxkv_sglang" / "srt").rglob("*.py"))


def _methods_and_functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST, bool]]:
    """(qualified name, node, is a method) of every function, nested ones included."""

    def walk(node: ast.AST, prefix: str, in_class: bool) -> Iterator[tuple[str, ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTIONS):
                name = f"{prefix}{child.name}"
                yield name, child, in_class
                yield from walk(child, f"{name}.<locals>.", False)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.", True)
            elif not isinstance(child, ast.Lambda):
                yield from walk(child, prefix, in_class)

    yield from walk(tree, "", False)


def _is_staticmethod(func: ast.AST) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in func.decorator_list)


def unannotated_parameters(path: Path) -> list[str]:
    offenders = []
    rel = path.relative_to(ROOT)
    for qualname, func, is_method in _methods_and_functions(_parse(path)):
        args = func.args
        params = [*args.posonlyargs, *args.args]
        if is_method and not _is_staticmethod(func) and params and params[0].arg in ("self", "cls"):
            params = params[1:]
        params += args.kwonlyargs
        params += [p for p in (args.vararg, args.kwarg) if p is not None]
        for p in params:
            if p.annotation is None:
                star = "*" if p is args.vararg else "**" if p is args.kwarg else ""
                offenders.append(f"{rel}:{p.lineno} {qualname}(): parameter {star}{p.arg} has no annotation")
    return offenders


def missing_docstrings(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    return [f"{rel}:{func.lineno} {qualname}(): public, no docstring"
            for qualname, func, _ in _methods_and_functions(_parse(path))
            if not func.name.startswith("_") and ast.get_docstring(func) is None]


def test_srt_checks_find_what_they_look_for():
    src = (
        "class C:\n"
        "    def method(self, a: int, b, *args, c: int = 0, **kw) -> None:\n"
        "        'Doc.'\n"
        "    @classmethod\n"
        "    def make(cls, x: int):\n"
        "        pass\n"
        "    @staticmethod\n"
        "    def util(self):\n"
        "        'Doc.'\n"
        "    def _private(self, y):\n"
        "        def inner(z: int):\n"
        "            pass\n"
        "def top(q: int) -> int:\n"
        "    'Doc.'\n"
        "    return (lambda u: u)(q)\n")
    with _probe(src, "relaxkv_sglang.srt._probe_") as (module, _):
        rel = module.rel
        assert unannotated_parameters(module.path) == [
            f"{rel}:2 C.method(): parameter b has no annotation",
            f"{rel}:2 C.method(): parameter *args has no annotation",
            f"{rel}:2 C.method(): parameter **kw has no annotation",
            f"{rel}:8 C.util(): parameter self has no annotation",
            f"{rel}:10 C._private(): parameter y has no annotation"]
        assert missing_docstrings(module.path) == [
            f"{rel}:5 C.make(): public, no docstring",
            f"{rel}:11 C._private.<locals>.inner(): public, no docstring"]


def test_srt_parameters_are_annotated():
    offenders = [o for path in _srt_files() for o in unannotated_parameters(path)]
    assert not offenders, f"{len(offenders)} unannotated parameters in srt/:\n" + "\n".join(offenders)


def test_srt_public_functions_have_docstrings():
    offenders = [o for path in _srt_files() for o in missing_docstrings(path)]
    assert not offenders, f"{len(offenders)} public functions without a docstring in srt/:\n" + "\n".join(offenders)
