"""The imports that run when a module is imported, read from its source (``ast``).

:func:`module_imports` lists one module's import sites for the walk of :mod:`.import_needs`, with
whether each can fail the import (guarded, availability-gated) and the ``if`` tests around it.

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
imports are not needed and not followed; :attr:`~relaxkv_sglang.gpu_check.import_needs.Report.optional` lists them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Iterable, Optional

_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # try/except*, Python 3.11+
# Exception names whose handler catches an ImportError.
CATCHES_IMPORT_ERROR = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


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
