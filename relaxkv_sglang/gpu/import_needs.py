"""Which modules outside FlashInfer ``import flashinfer`` needs, read from the sources (``ast``).

The lent GPU machine has no package index: every module FlashInfer imports must be in its image
(:data:`IMAGE_MODULES`: the standard library, torch and torch's own dependencies) or travel in
the bundle (``gpu/bundle.py``). :func:`report` walks the import graph from ``flashinfer`` and the
modules the plugin's fa2 paged prefill runs through (:data:`ROOTS`), into every package the
walked files hold (the bundle's wheels too: what ``requests`` imports counts), and names each
module it needs that is neither in the image nor among the walked packages.

**What runs at import** (:func:`module_imports`): an ``import``/``from ... import`` (or
``importlib.import_module("constant")``) at module level, in ``if``/``for``/``while``/``with``/
``try`` bodies and in class bodies; not inside a function (runs only when called), not under
``if TYPE_CHECKING:``. Both branches of any other ``if`` count (an over-approximation: a branch not
taken here may be taken there), except the body of an **availability test** (an ``if`` whose test
names something ``*available*`` or calls ``find_spec``, e.g. ``if _CUTE_DSL_AVAILABLE:``,
``if is_cute_dsl_available():``): FlashInfer computes those flags with ``find_spec`` or a
``try: import ... except ImportError``, so the body runs only where the optional package is
installed. An import is **guarded** when its failure cannot propagate: in a ``try:`` whose handlers
catch ``ImportError`` (or ``ModuleNotFoundError``, ``Exception``, ``BaseException``, bare
``except``), or in ``with contextlib.suppress(...)`` of one of those. Guarded and availability-gated
imports are not needed and not followed; :attr:`Report.optional` lists them.

**The graph** (:func:`closure`): importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``;
``from .x import y`` runs ``x`` and, when ``x/y.py`` or ``x/y/__init__.py`` exists, ``x.y``;
relative imports resolve against the importing module's package. A module whose file the walk
holds is followed; any other is recorded with its first import site and the chain that reached it.

**Not seen**: an import inside a function that a module-level statement calls, ``__import__`` or
``importlib`` with a computed name, and compiled modules' imports (numpy's C core imports only
numpy and the standard library).

FlashInfer's JIT also runs a program: ``ninja``, by name from ``PATH``
(``flashinfer/jit/cpp_ext.py::run_ninja``); the ``ninja`` wheel installs it as ``bin/ninja``
(:data:`PROGRAMS`).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import sys
from typing import Callable, Iterable, Optional

_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except*, Python 3.11+
# Exception names whose handler catches an ImportError.
CATCHES_IMPORT_ERROR = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})

# What the GPU image is assumed to hold besides the standard library: torch (2.11.0+cu130) and the
# modules of torch's own dependencies (filelock, jinja2 + markupsafe, typing-extensions,
# sympy + mpmath, networkx, fsspec, triton, and the nvidia-* CUDA libraries, all under ``nvidia``).
# Nothing else: numpy, packaging, requests, tqdm, ninja are not torch's dependencies.
IMAGE_MODULES = frozenset({"torch", "torchgen", "functorch", "filelock", "jinja2", "markupsafe",
                           "typing_extensions", "sympy", "mpmath", "networkx", "fsspec", "triton", "nvidia"})
# Modules Python 3.12 (the GPU machine's) no longer has, whatever this Python's list says.
REMOVED_IN_PY312 = frozenset({"distutils", "imp", "asynchat", "asyncore", "smtpd"})
# What the check imports and compiles through: the package (as the plugin's import_flashinfer does)
# and the modules of the fa2 batch paged prefill's plan, run and JIT build (roots in their own
# right, so that a change to flashinfer/__init__.py cannot hide them).
ROOTS = ("flashinfer", "flashinfer.prefill", "flashinfer.jit.core", "flashinfer.jit.cpp_ext",
         "flashinfer.jit.env", "flashinfer.jit.attention.modules")
# Programs FlashInfer's JIT runs by name from PATH, and the wheel member that provides each.
PROGRAMS = {"ninja": "ninja-*.data/scripts/ninja"}


@dataclasses.dataclass(frozen=True)
class ImportSite:
    """One import statement: the module it runs (absolute dotted name), the file and line,
    and whether a failure there is caught."""

    module: str
    path: str
    line: int
    guarded: bool
    condition: Optional[str] = None  # the enclosing ``if`` tests (``not (...)`` in an else), or None
    gated: bool = False  # in the body of an availability test (module doc)


def _names(node: Optional[ast.expr]) -> list[str]:
    """The exception names of an ``except`` clause (``None``: bare ``except``)."""
    if node is None:
        return ["BaseException"]
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _names(elt)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def _catches_import_error(handlers: Iterable[ast.ExceptHandler]) -> bool:
    return any(set(_names(h.type)) & CATCHES_IMPORT_ERROR for h in handlers)


def _suppresses_import_error(item: ast.withitem) -> bool:
    """``with contextlib.suppress(ImportError)`` / ``with suppress(Exception, ...)``."""
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    return name == "suppress" and any(set(_names(a)) & CATCHES_IMPORT_ERROR for a in call.args)


def _flag_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _is_availability_test(test: ast.expr, flags: frozenset = frozenset()) -> bool:
    """``X_AVAILABLE``, ``is_x_available()``, ``find_spec(...) is not None``, a name in ``flags``
    (set by a guarded import in the module), or an ``and`` of tests one of which is one: its body
    runs only where the optional package imports."""
    if isinstance(test, ast.BoolOp):
        return isinstance(test.op, ast.And) and any(_is_availability_test(v, flags) for v in test.values)
    if isinstance(test, ast.Compare):
        return _is_availability_test(test.left, flags)
    name = _flag_name(test)
    return "available" in name.lower() or name == "find_spec" or (isinstance(test, ast.Name) and name in flags)


def _guarded_flags(tree: ast.Module) -> frozenset:
    """Module-level names assigned a constant in the body of a ``try`` that catches ImportError
    (``try: import simplejson; has_simplejson = True / except ImportError: ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, _TRY):
            if _catches_import_error(node.handlers):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
                        names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return frozenset(names)


# The GPU machine, for tests Python would evaluate there: Linux, CPython 3.12.
TARGET = {"sys.platform": "linux", "os.name": "posix", "platform.system()": "Linux", "sys.version_info": (3, 12)}


def _static_value(node: ast.expr):
    """``sys.platform``, ``os.name``, ``platform.system()``, ``sys.version_info`` (or
    ``sys.version_info[:2]``) on the GPU machine, a constant, or ``...`` (unknown)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
        return tuple(e.value for e in node.elts)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.version_info":
        return TARGET["sys.version_info"]
    return TARGET.get(ast.unparse(node), ...)


def _static_test(test: ast.expr):
    """True/False when ``test`` is decided by the GPU machine's platform and Python version
    (comparisons, ``startswith``, ``not``/``and``/``or`` of those); None when it is not."""
    import operator

    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _static_test(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [_static_test(v) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in values else None if None in values else True
        return True if True in values else None if None in values else False
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        ops = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
               ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
               ast.NotIn: lambda a, b: a not in b}
        left, right = _static_value(test.left), _static_value(test.comparators[0])
        op = ops.get(type(test.ops[0]))
        if op is None or left is ... or right is ... or ast.unparse(test.left) not in TARGET and not (
                isinstance(test.left, ast.Subscript) and ast.unparse(test.left.value) == "sys.version_info"):
            return None
        try:
            return bool(op(left, right))
        except TypeError:
            return None
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "startswith"
            and test.args and isinstance(test.args[0], ast.Constant)):
        value = _static_value(test.func.value)
        if isinstance(value, str) and ast.unparse(test.func.value) in TARGET:
            return value.startswith(test.args[0].value)
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _and(cond: Optional[str], test: str) -> str:
    return test if cond is None else f"{cond} and {test}"


def _resolve(module: Optional[str], level: int, package: str) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``package``."""
    if level == 0:
        return module or ""
    base = package.split(".")
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


@functools.lru_cache(maxsize=8192)
def module_imports(source: str, module: str, is_package: bool,
                   path: str = "") -> tuple[tuple[ImportSite, tuple[str, ...]], ...]:
    """The imports that run when ``module`` is imported (module doc: what counts).

    Returns: ``(site, names)`` per import: ``names`` are the ``from`` list (``()`` for ``import``),
    so the caller can tell a submodule from an attribute. Cached: the walks of one check read
    the same files more than once."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[ImportSite, tuple[str, ...]]] = []

    def visit(stmts: list[ast.stmt], guarded: bool, cond: Optional[str] = None, gated: bool = False) -> None:
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append((ImportSite(alias.name, path, node.lineno, guarded, cond, gated), ()))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node.module, node.level, package)
                names = tuple(a.name for a in node.names)
                found.append((ImportSite(target, path, node.lineno, guarded, cond, gated), names))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, guarded, cond, gated)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                known = _static_test(node.test)
                if not _is_type_checking(node.test) and known is not False:
                    visit(node.body, guarded, _and(cond, test), gated or _is_availability_test(node.test, flags))
                if known is not True:
                    visit(node.orelse, guarded, _and(cond, f"not ({test})"), gated)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                visit(node.body, guarded, cond, gated)
                visit(node.orelse, guarded, cond, gated)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                visit(node.body, guarded or any(_suppresses_import_error(i) for i in node.items), cond, gated)
            elif isinstance(node, _TRY):
                catches = _catches_import_error(node.handlers)
                visit(node.body, guarded or catches, cond, gated)
                for handler in node.handlers:
                    # a fallback for a failed import (``except ImportError: from _dummy_thread import``)
                    # runs only where the guarded import failed: gated as behind an availability test
                    fallback = bool(set(_names(handler.type)) & {"ImportError", "ModuleNotFoundError"})
                    visit(handler.body, guarded, cond, gated or fallback)
                visit(node.orelse, guarded, cond, gated)
                visit(node.finalbody, guarded, cond, gated)
            elif isinstance(node, ast.Match):
                for case in node.cases:
                    visit(case.body, guarded, cond, gated)
            # importlib.import_module("x") / import_module("x") with a constant name, as a statement
            # or an assignment's value
            value = node.value if isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Constant):
                fn = value.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
                if name == "import_module" and isinstance(value.args[0].value, str):
                    target = value.args[0].value
                    if target.startswith("."):
                        level = len(target) - len(target.lstrip("."))
                        target = _resolve(target.lstrip(".") or None, level, package)
                    found.append((ImportSite(target, path, node.lineno, guarded, cond, gated), ()))

    tree = ast.parse(source, filename=path or module)
    flags = _guarded_flags(tree)
    visit(tree.body, False)
    return tuple(found)


@dataclasses.dataclass
class Closure:
    """The walk's result: the walked modules that run (``internal``: dotted name -> the site that
    first ran it, None for a root), and the imports of modules the walk does not hold: those
    ``follow`` accepts (``external``) and the rest (``skipped``), each name to its first site."""

    internal: dict[str, Optional[ImportSite]]
    external: dict[str, ImportSite]
    skipped: dict[str, ImportSite]

    def external_tops(self) -> dict[str, ImportSite]:
        """``external`` by top-level name (``numpy.typing`` -> ``numpy``), first site each."""
        tops: dict[str, ImportSite] = {}
        for name, site in sorted(self.external.items()):
            tops.setdefault(name.split(".")[0], site)
        return tops

    def chain(self, site: ImportSite) -> list[str]:
        """How the walk reached ``site``: ``["flashinfer", "flashinfer/utils.py:27", ...]``
        (each link the import site that ran the next module)."""
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
    """Follow an import that can fail the import: neither guarded nor availability-gated."""
    return not site.guarded and not site.gated


def closure(roots: Iterable[str], files: set[str], read: Callable[[str], str],
            follow: Callable[[ImportSite], bool] = needed, preloaded: Iterable[str] = ()) -> Closure:
    """Walk the imports from ``roots`` (dotted module names) over ``files`` (paths relative to the
    folder the packages sit in, as on ``sys.path``; ``read``: path -> text), through the import
    sites ``follow`` accepts; ``preloaded``: modules already imported (not run again).
    Module doc: the graph."""
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
    """Whether ``name`` is Python 3.12's standard library (judged by this Python's list, less
    :data:`REMOVED_IN_PY312`)."""
    top = name.split(".")[0]
    return (top in sys.stdlib_module_names or top == "__future__") and top not in REMOVED_IN_PY312


@dataclasses.dataclass
class Report:
    """What ``import flashinfer`` needs outside the walked files.

    ``needed``: top-level module -> the chain to its first import that can fail (``[root, site,
    ...]``); ``uncovered``: those neither in the image nor walked (the import fails there);
    ``optional``: top-level modules imported only guarded or availability-gated, -> one site;
    ``walked``: the top-level packages the walk held (FlashInfer and what the bundle carries);
    ``modules``: how many modules the walk read."""

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
    """Walk ``roots`` over ``files`` (module doc) and judge each module needed outside them
    against the standard library and ``image``."""
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
