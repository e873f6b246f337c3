"""Architecture rules, read from the source (AST), never by importing it.

* No import cycle among the project's modules (``relaxkv_sglang`` and ``relaxkv_patches``, the
  packages of pyproject.toml): every import counts, at module level or inside a function, and
  under ``if TYPE_CHECKING:`` too (a cycle for the type checker is one for the reader).
* No module rebinds module-level state at run time: no ``global`` statement in a function, no
  assignment to (or ``setattr``/``del`` of) an attribute of one of the project's modules, no
  in-place mutation of a module-level container from a function (a process-wide registry).
* The code is grouped in rooms by subsystem, stacked in :data:`LAYERS` (``runtime`` at the bottom,
  ``server`` at the top): a room imports only itself and the rooms below it, ``TYPE_CHECKING``
  imports included. Each room's SGLang adapter is ``<room>/sglang/``; ``forward`` is SGLang's seam
  as a whole (:data:`SEAM_ROOMS`). Only an adapter imports SGLang at run time (besides ``lang.py``,
  over SGLang's frontend, and the CPU shims) and only an adapter imports an adapter (besides
  ``gpu_check``, which runs them on a GPU). Adapters import one way (:data:`ADAPTER_MAY_IMPORT`),
  and the HTTP process's modules (:data:`HTTP_PROCESS`) import nothing of the scheduler's.
* No module over :data:`MAX_MODULE_LINES` lines outside ``benchmarks/``, no line over :data:`MAX_LINE_CHARS`
  characters.
* ``docs/architecture.md`` matches the tree: every ``.py`` file it names exists, and every package
  of ``relaxkv_sglang`` is named in it.
* ``relaxkv_sglang/<room>/sglang/**.py``: every parameter is annotated (``self``/``cls`` excepted,
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
def _probe(src: str, name: str = "relaxkv_sglang.attention._probe_") -> Iterator[tuple[Module, dict[str, Module]]]:
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


def imports_of(module: Module, modules: dict[str, Module], type_checking: bool = True) -> list[tuple[str, int]]:
    """(project module imported, line) for every import in ``module``.

    ``import a.b.c`` -> the longest of a.b.c, a.b, a that is a project module; ``from p import
    x`` -> ``p.x`` when that is a module, else ``p``; relative imports resolved against the
    module's package; ``importlib.import_module("...")`` with a constant name counts too; imports
    under ``if TYPE_CHECKING:`` unless ``type_checking`` is False.
    """
    found = []
    for node in (ast.walk if type_checking else _walk_runtime)(module.tree()):
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
    assert "relaxkv_sglang.attention.gpu.prefill_inputs" in graph["relaxkv_sglang.attention.gpu.flashinfer_attention"]
    assert "relaxkv_sglang.attention.gpu.flashinfer_attention" in graph["relaxkv_sglang.gpu_check.kernels"]  # in functions
    assert "relaxkv_sglang.attention.layout" in graph["relaxkv_sglang.attention.gpu.anchor_inputs"]
    assert "relaxkv_patches.cpu_shims" in graph["relaxkv_patches"]
    assert any(m.startswith("relaxkv_patches.") for m in modules)


def test_imports_are_read_in_every_form():
    src = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from . import layout\n"                              # from pkg import module (relative)
        "from .causal import dense_causal_attention\n"        # from module import name (relative)
        "from ..model import rope_config as rc\n"              # two levels up
        "import relaxkv_sglang.model.rope\n"
        "if TYPE_CHECKING:\n"
        "    from relaxkv_sglang.request import plan\n"        # not at run time
        "else:\n"
        "    from relaxkv_sglang.request import schema\n"
        "def f():\n"
        "    from relaxkv_sglang.request.segments import auto_chunk\n"  # inside a function
        "    import importlib\n"
        "    return importlib.import_module('relaxkv_sglang.request.routing')\n")
    with _probe(src) as (module, modules):
        found = imports_of(module, modules, type_checking=False)
        assert ("relaxkv_sglang.request.plan", 8) in imports_of(module, modules)  # the type checker's too
    assert sorted({m for m, _ in found}) == [
        "relaxkv_sglang.attention.causal", "relaxkv_sglang.attention.layout", "relaxkv_sglang.model.rope",
        "relaxkv_sglang.model.rope_config", "relaxkv_sglang.request.routing", "relaxkv_sglang.request.schema",
        "relaxkv_sglang.request.segments"]
    assert ("relaxkv_sglang.request.segments", 12) in found


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles (module (file:line of the import) -> ...):\n" + "\n".join(cycles)


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _shortest_cycle("a", {"a", "b", "c"}, graph) == ["a", "b", "c", "a"]
    assert _shortest_cycle("a", {"a", "b"}, {"a": {"b": 1}, "b": {"a": 2}}) == ["a", "b", "a"]


# --- which way imports run ---------------------------------------------------------------------

PACKAGE = "relaxkv_sglang"
ADAPTER = "sglang"  # each room's SGLang adapter: relaxkv_sglang.<room>.sglang
#: the rooms, bottom to top: a room imports only itself and the rooms below it
LAYERS = ("runtime", "attention", "model", "repair", "request", "cache", "forward", "server")
#: rooms that are SGLang's seam as a whole: every module an adapter
SEAM_ROOMS = {"forward"}
#: room -> the rooms whose adapter its own adapter may import (the forward reaches the cache, the
#: attention, the model and the repair, never the other way; the server wires them all)
ADAPTER_MAY_IMPORT = {"request": set(), "cache": set(), "attention": set(), "model": set(),
                      "repair": {"attention", "model"},
                      "forward": {"cache", "attention", "model", "repair"},
                      "server": {"request", "cache", "attention", "model", "repair", "forward"}}
#: the HTTP process's adapter modules: they import no adapter module of the scheduler's
HTTP_PROCESS = {f"{PACKAGE}.request.sglang.{m}" for m in ("api", "chat", "chat_stream_logprobs", "parallel_encoding",
                                                         "join_registry", "sglang_fields", "gate_refusal")}
#: the platform under every room: the CPU shims (imported by the plugin's entry point)
PLATFORM = ("relaxkv_patches",)
#: modules above the adapters (they run the adapters outside SGLang, on a GPU)
ABOVE_ADAPTERS = (f"{PACKAGE}.gpu_check",)
#: modules that import SGLang besides the adapters: SGLang's frontend language, and the CPU shims
SGLANG_ELSEWHERE = (f"{PACKAGE}.lang", "relaxkv_patches")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def room_of(name: str) -> Optional[str]:
    """The room of :data:`LAYERS` holding module ``name``; None above them (top-level modules, gpu_check)."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == PACKAGE and parts[1] in LAYERS else None


def adapter_room(name: str) -> Optional[str]:
    """The room whose SGLang adapter holds module ``name``, None for a module outside every adapter."""
    parts = name.split(".")
    room = room_of(name)
    if room in SEAM_ROOMS or (room in ADAPTER_MAY_IMPORT and len(parts) >= 3 and parts[2] == ADAPTER):
        return room
    return None


def upward_imports(modules: dict[str, Module], graph: dict[str, dict[str, int]]) -> list[str]:
    """``path:line module -> imported`` for every import that runs against the rules (module doc)."""
    bad = []
    for name, deps in sorted(graph.items()):
        here, here_room = adapter_room(name), room_of(name)
        for dep, line in sorted(deps.items()):
            where = f"{modules[name].rel}:{line} {name} -> {dep}"
            if here_room is not None and not _under(dep, PLATFORM):
                there_room = room_of(dep)
                if there_room is None or LAYERS.index(there_room) > LAYERS.index(here_room):
                    bad.append(where + f" ({here_room} sits below {there_room or 'the top-level modules'})")
                    continue
            there = adapter_room(dep)
            if there is None:
                continue
            if here is None:
                if not _under(name, ABOVE_ADAPTERS):
                    bad.append(where + " (only an adapter imports an adapter)")
            elif name in HTTP_PROCESS:
                if dep not in HTTP_PROCESS:
                    bad.append(where + " (the HTTP process imports nothing of the scheduler's)")
            elif there != here and there not in ADAPTER_MAY_IMPORT[here]:
                allowed = sorted(ADAPTER_MAY_IMPORT[here]) or "no other room"
                bad.append(where + f" ({here}'s adapter may import the adapters of {allowed})")
    return bad


def sglang_imports(modules: dict[str, Module]) -> list[str]:
    """``path:line module`` for every run-time import of SGLang outside the adapters (module doc)."""
    bad = []
    for name, module in sorted(modules.items()):
        if adapter_room(name) is not None or _under(name, SGLANG_ELSEWHERE):
            continue
        for node in _walk_runtime(module.tree()):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(t == "sglang" or t.startswith("sglang.") for t in targets):
                bad.append(f"{module.rel}:{node.lineno} {name}")
    return bad


def test_imports_run_one_way():
    bad = upward_imports(*import_graph())
    assert not bad, "imports against the direction of the layers:\n" + "\n".join(bad)


def test_only_the_adapters_import_sglang():
    bad = sglang_imports(project_modules())
    assert not bad, "SGLang imported outside the adapters:\n" + "\n".join(bad)


def test_the_direction_check_finds_what_it_looks_for():
    cases = {  # (module, source) -> how many offenders
        ("relaxkv_sglang.cache.sglang._probe_", "from relaxkv_sglang.forward import query_pass\n"): 1,
        ("relaxkv_sglang.request.sglang.api", "def f():\n    import relaxkv_sglang.cache.sglang.pins\n"): 1,
        ("relaxkv_sglang.request.sglang.api", "from relaxkv_sglang.request.sglang import gate_refusal\n"): 0,
        ("relaxkv_sglang.request.sglang._probe_", "from relaxkv_sglang.server.sglang import gate\n"): 1,
        ("relaxkv_sglang.attention.gpu._probe_", "from relaxkv_sglang.attention.sglang import anchor_attention\n"): 1,
        ("relaxkv_sglang.gpu_check._probe_", "from relaxkv_sglang.repair.sglang import layer_loop\n"): 0,
        ("relaxkv_sglang.forward._probe_",
         "from relaxkv_sglang.cache.sglang import relaxkv_cache\nfrom relaxkv_sglang.request import plan\n"): 0,
        # the layers, maths and TYPE_CHECKING alike
        ("relaxkv_sglang.model._probe_", "from relaxkv_sglang.repair import repair_config\n"): 1,
        ("relaxkv_sglang.repair._probe_", "if TYPE_CHECKING:\n    from relaxkv_sglang.request import plan\n"): 1,
        ("relaxkv_sglang.runtime._probe_", "from relaxkv_sglang.request import routing\n"): 1,
        ("relaxkv_sglang.request._probe_", "from relaxkv_sglang import assets\n"): 1,
        ("relaxkv_sglang.server.sglang._probe_", "import relaxkv_patches\nfrom relaxkv_sglang.runtime import records\n"): 0,
        ("relaxkv_sglang._probe_", "from relaxkv_sglang.server import cluster\n"): 0,
    }
    for (name, src), n in cases.items():
        with _probe(src, name) as (module, modules):
            graph = {module.name: {dep: line for dep, line in imports_of(module, modules)}}
            assert len(upward_imports(modules, graph)) == n, (name, src)


def test_the_sglang_check_finds_what_it_looks_for():
    src = "import torch\nif TYPE_CHECKING:\n    import sglang\ndef f():\n    from sglang.srt import utils\n"
    for name, n in (("relaxkv_sglang.repair._probe_", 1), ("relaxkv_sglang.repair.sglang._probe_", 0)):
        with _probe(src, name) as (module, modules):
            assert len([b for b in sglang_imports(modules) if "_probe_" in b]) == n, name


# --- module size ---------------------------------------------------------------------------------

MAX_MODULE_LINES = 450


def long_modules() -> list[str]:
    """``path: N lines`` for every project module over :data:`MAX_MODULE_LINES` (benchmarks are not
    a package of pyproject.toml, so they are not read)."""
    return [f"{m.rel}: {n} lines" for m in project_modules().values()
            if (n := len(m.path.read_text().splitlines())) > MAX_MODULE_LINES]


def test_no_module_over_the_line_limit():
    assert not long_modules(), f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long_modules())


MAX_LINE_CHARS = 120


def long_lines() -> list[str]:
    """``path:line`` of every line of a project module over :data:`MAX_LINE_CHARS` characters."""
    return [f"{m.rel}:{i}" for m in project_modules().values()
            for i, line in enumerate(m.path.read_text().splitlines(), 1) if len(line) > MAX_LINE_CHARS]


def test_no_line_over_the_width():
    assert not long_lines(), f"lines over {MAX_LINE_CHARS} characters:\n" + "\n".join(long_lines())


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
    assert set(doc_tree_mismatches(text + "\nrepair/sglang/no_such_module.py")) - before == {
        "names repair/sglang/no_such_module.py, which is not in the tree"}
    assert "does not name the package model/sglang/" in doc_tree_mismatches(text.replace("model/sglang/", "model/sglang"))


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
        "import relaxkv_sglang.attention.layout as L\n"
        "from relaxkv_sglang.attention import causal as attention\n"
        "import relaxkv_sglang.model.rope\n"
        "REG = {}\n"
        "def f(x):\n"
        "    global G\n"
        "    REG[x] = 1\n"
        "    L.page_scores = None\n"
        "    setattr(attention, 'y', 1)\n"
        "    relaxkv_sglang.model.rope.X = 2\n"
        "    def g(REG):\n"
        "        REG[0] = 1\n"
        "        REG.update(a=1)\n")
    with _probe(src) as (module, modules):
        aliases = _module_aliases(module, modules)
        assert aliases == {"L": "relaxkv_sglang.attention.layout", "attention": "relaxkv_sglang.attention.causal",
                           "relaxkv_sglang": "relaxkv_sglang"}
        assert _as_module(ast.parse("relaxkv_sglang.model.rope", mode="eval").body, aliases, modules) == \
            "relaxkv_sglang.model.rope"
        funcs = dict(_functions(module.tree()))
        assert set(funcs) == {"f", "f.<locals>.g"}
        assert sum(isinstance(n, ast.Global) for n in _own_nodes(funcs["f"])) == 1
        assert "REG" in _module_level_names(module.tree()) - _local_names(funcs["f"])
        assert "REG" in _local_names(funcs["f.<locals>.g"])  # a parameter shadows it
        mine = lambda found: [o for o in found if o.startswith(module.rel)]  # noqa: E731
        assert mine(global_statements(modules)) == [f"{module.rel}:6 f(): global G"]
        assert mine(foreign_module_writes(modules)) == [
            f"{module.rel}:10 writes relaxkv_sglang.model.rope.X",
            f"{module.rel}:8 writes relaxkv_sglang.attention.layout.page_scores",
            f"{module.rel}:9 setattr(relaxkv_sglang.attention.causal, ...)"]
        assert mine(module_state_mutations(modules)) == [f"{module.rel}:7 f() mutates module-level REG"]


# --- the adapters: annotations and docstrings -------------------------------------------------


def _adapter_files() -> list[Path]:
    return sorted(p for room in ADAPTER_MAY_IMPORT for p in (ROOT / PACKAGE / room / ADAPTER).rglob("*.py"))


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


def test_adapter_checks_find_what_they_look_for():
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
    with _probe(src, "relaxkv_sglang.cache.sglang._probe_") as (module, _):
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


def test_adapter_parameters_are_annotated():
    offenders = [o for path in _adapter_files() for o in unannotated_parameters(path)]
    assert not offenders, f"{len(offenders)} unannotated parameters in the adapters:\n" + "\n".join(offenders)


def test_adapter_public_functions_have_docstrings():
    offenders = [o for path in _adapter_files() for o in missing_docstrings(path)]
    assert not offenders, f"{len(offenders)} public functions without a docstring in the adapters:\n" + "\n".join(
        offenders)
