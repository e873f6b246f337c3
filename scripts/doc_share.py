"""Share of docstring and comment lines among non-blank lines, per folder.

    python scripts/doc_share.py                        # every room of relaxkv_sglang, the top-level modules,
                                                       # the adapters together and the package
    python scripts/doc_share.py relaxkv_sglang/repair  # any folders or files

A room is a top-level subpackage of relaxkv_sglang (its adapter, ``<room>/sglang/``, included).
A docstring line is a line of a module, class or function docstring; a comment line is a line
holding a ``#`` comment (code with a trailing comment counts as a comment line too). Also prints
the module docstrings longer than 25 lines.
"""

import ast
import io
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relaxkv_sglang"
MAX_SHARE = 0.20  # a room's docstring and comment lines among its non-blank lines (tests/unit/test_doc_share.py)
MAX_MODULE_DOC_LINES = 25


def counts(path: Path) -> tuple[int, int, int]:
    """(non-blank lines, docstring or comment lines, module docstring lines)."""
    text = path.read_text()
    lines = text.splitlines()
    non_blank = {i + 1 for i, line in enumerate(lines) if line.strip()}
    doc_lines: set[int] = set()
    tree = ast.parse(text)
    module_doc = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                span = range(body[0].lineno, body[0].end_lineno + 1)
                doc_lines.update(span)
                if isinstance(node, ast.Module):
                    module_doc = len(span)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            doc_lines.add(token.start[0])
    return len(non_blank), len(doc_lines & non_blank), module_doc


def _python_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def rooms() -> dict[str, list[Path]]:
    """Each room of the package (a top-level subpackage, its adapter included) and the top-level modules."""
    found = {str(room.relative_to(PACKAGE.parent)): _python_files(room)
             for room in sorted(PACKAGE.iterdir()) if room.is_dir() and (room / "__init__.py").exists()}
    return {**found, "the top-level modules": sorted(PACKAGE.glob("*.py"))}


def share(paths: list[Path]) -> tuple[int, int, list[str]]:
    """(docstring or comment lines, non-blank lines, ``path:lines`` of each module docstring over the limit)."""
    total = doc = 0
    long_docs = []
    for path in paths:
        n, d, m = counts(path)
        total += n
        doc += d
        if m > MAX_MODULE_DOC_LINES:
            long_docs.append(f"{path}:{m}")
    return doc, total, long_docs


def _report(name: str, paths: list[Path], long_docs_listed: bool = True) -> None:
    doc, total, long_docs = share(paths)
    print(f"{name}: {doc}/{total} non-blank lines are docstring or comment = {doc / total if total else 0.0:.1%}")
    for item in long_docs if long_docs_listed else []:
        print(f"  module docstring over {MAX_MODULE_DOC_LINES} lines: {item}")


def main(folders: list[str]) -> None:
    if folders:
        for folder in folders:
            _report(folder, _python_files(Path(folder)))
        return
    for name, paths in rooms().items():
        _report(name, paths)
    _report("the adapters together", sorted(PACKAGE.glob("*/sglang/**/*.py")), long_docs_listed=False)
    _report("the package", _python_files(PACKAGE), long_docs_listed=False)


if __name__ == "__main__":
    main(sys.argv[1:])
