"""What FlashInfer's JIT reads to compile the paged prefill, derived from its own JIT code (``ast``).

The bundle (:mod:`.bundle`) keeps these files of the wheel and checks an unpacked bundle against them.
Not listed by hand: the fa2 batch paged prefill the plugin plans
(``flashinfer.jit.attention.modules.gen_customize_batch_prefill_module``) reads the ``csrc`` files its
fa2 branch names, and nvcc compiles them with the include directories of ``flashinfer.jit.cpp_ext``,
whose paths ``flashinfer.jit.env`` defines. Needed: those sources and every header of the wheel they
reach through ``#include`` (resolved as nvcc does); one found nowhere in the wheel is CUDA's, the C++
library's or tvm-ffi's (checked in its wheel). Reading every ``#include``, those under an ``#if`` too,
over-approximates: a file kept that a configuration does not read costs bytes, never a failed compile.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import posixpath
import re
import zipfile
from typing import Iterable, Optional

# The JIT code the needs are read from (paths in the wheel).
JIT_ENV = "flashinfer/jit/env.py"
JIT_CPP_EXT = "flashinfer/jit/cpp_ext.py"
JIT_MODULES = "flashinfer/jit/attention/modules.py"
PREFILL_GENERATOR = "gen_customize_batch_prefill_module"  # its backend == "fa2" branch
# tvm-ffi's headers (tvm_ffi.libinfo.find_include_path / find_dlpack_include_path), in its wheel.
TVM_FFI_INCLUDE_DIRS = ("tvm_ffi/include", "tvm_ffi/3rdparty/dlpack/include")
TVM_FFI_PREFIXES = ("tvm/ffi/", "dlpack/")
# Include roots FlashInfer's wheel vendors (an unresolved include under one is missing from the bundle).
VENDORED_ROOTS = frozenset({"flashinfer", "cute", "cutlass", "cub", "thrust", "spdlog"})
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


class BundleError(RuntimeError):
    """The bundle lacks what the GPU check needs, or FlashInfer's JIT code is not as expected."""


def _path_expr(node: ast.AST) -> Optional[str]:
    """``_package_root / "data" / "x"`` -> ``"flashinfer/data/x"``; None for anything else."""
    if isinstance(node, ast.Name) and node.id == "_package_root":
        return "flashinfer"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
        left = _path_expr(node.left)
        return None if left is None else posixpath.join(left, str(node.right.value))
    return None


def jit_dirs(env_source: str) -> dict[str, list[str]]:
    """The folders ``flashinfer/jit/env.py`` defines under the package root, by name (wheel paths):
    ``{"FLASHINFER_INCLUDE_DIR": ["flashinfer/data/include"], "CUTLASS_INCLUDE_DIRS": [...], ...}``."""
    dirs: dict[str, list[str]] = {}
    for node in ast.parse(env_source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            paths = [_path_expr(v) for v in values]
            if paths and all(paths):
                for t in targets:
                    if isinstance(t, ast.Name):
                        dirs[t.id] = paths  # type: ignore[assignment]
    return dirs


def _function(source: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise BundleError(f"FlashInfer's JIT code has no {name}() (not the pinned flashinfer?)")


def include_dir_names(cpp_ext_source: str) -> list[str]:
    """The ``jit_env`` names the nvcc include flags come from, in flag order (CCCL's ``-I`` first,
    then the ``-isystem`` list of ``get_system_includes``)."""
    names: list[str] = []
    for fn in ("get_cccl_includes", "get_system_includes"):
        for node in ast.walk(_function(cpp_ext_source, fn)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jit_env"
                    and node.attr not in names):
                names.append(node.attr)
    return names


def prefill_sources(modules_source: str, csrc_files: Iterable[str]) -> list[str]:
    """The ``csrc`` files (names) the fa2 branch of ``gen_customize_batch_prefill_module`` reads:
    the string constants of that branch that name a file ``csrc`` holds (the rest are generated
    files' names, flags and keys)."""
    fn = _function(modules_source, PREFILL_GENERATOR)
    branch = None
    for node in ast.walk(fn):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "backend"
                and any(isinstance(c, ast.Constant) and c.value == "fa2" for c in node.test.comparators)):
            branch = node
            break
    if branch is None:
        raise BundleError(f"{PREFILL_GENERATOR}() has no backend == 'fa2' branch")
    strings = {n.value for stmt in branch.body for n in ast.walk(stmt)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    found = sorted(strings & set(csrc_files))
    if not any(name.endswith(".cu") for name in found) or not any(name.endswith(".jinja") for name in found):
        raise BundleError(f"{PREFILL_GENERATOR}()'s fa2 branch names no .cu / .jinja source of csrc ({found})")
    return found


def include_closure(sources: Iterable[str], files: set[str], include_dirs: list[str],
                    read) -> tuple[set[str], set[str]]:
    """(files of ``files`` reached from ``sources`` through ``#include``, include names resolved nowhere);
    ``include_dirs`` searched in order after a quoted include's own folder."""
    reached: set[str] = set()
    unresolved: set[str] = set()
    todo = list(sources)
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        for kind, name in _INCLUDE.findall(read(path)):
            here = [posixpath.dirname(path)] if kind == '"' else []
            hit = next((c for c in (posixpath.normpath(posixpath.join(d, name)) for d in here + include_dirs)
                        if c in files), None)
            if hit is None:
                unresolved.add(name)
            elif hit not in reached:
                todo.append(hit)
    return reached, unresolved


@dataclasses.dataclass(frozen=True)
class JitNeeds:
    """What the JIT reads for the paged prefill: ``files`` (sorted wheel paths), the include
    names found nowhere (``unresolved``), the include folders searched (``include_dirs``)."""

    files: list[str]
    unresolved: set[str]
    include_dirs: list[str]


def jit_needs(files: set[str], read) -> JitNeeds:
    """From the JIT code among ``files`` (wheel paths; ``read``: path -> text)."""
    for path in (JIT_ENV, JIT_CPP_EXT, JIT_MODULES):
        if path not in files:
            raise BundleError(f"{path} is missing (FlashInfer's JIT code)")
    dirs = jit_dirs(read(JIT_ENV))
    csrc = dirs.get("FLASHINFER_CSRC_DIR", [None])[0]
    if csrc is None:
        raise BundleError(f"{JIT_ENV} defines no FLASHINFER_CSRC_DIR under the package root")
    include_dirs = [d for name in include_dir_names(read(JIT_CPP_EXT)) for d in dirs.get(name, [])]
    csrc_files = {posixpath.basename(f) for f in files if posixpath.dirname(f) == csrc}
    sources = [posixpath.join(csrc, name) for name in prefill_sources(read(JIT_MODULES), csrc_files)]
    reached, unresolved = include_closure(sources, files, include_dirs, read)
    # the JIT code itself: its package (flashinfer/jit/...) and what it imports are the Python side
    return JitNeeds(sorted(reached | {JIT_ENV, JIT_CPP_EXT, JIT_MODULES}), unresolved, include_dirs)


def _zip_reader(wheel: zipfile.ZipFile):
    return lambda path: wheel.read(path).decode("utf-8", errors="replace")


def wheel_needs(flashinfer_wheel: pathlib.Path) -> JitNeeds:
    """:func:`jit_needs` over the whole FlashInfer wheel."""
    with zipfile.ZipFile(flashinfer_wheel) as wheel:
        files = {n for n in wheel.namelist() if not n.endswith("/")}
        return jit_needs(files, _zip_reader(wheel))


def tvm_ffi_missing(tvm_ffi_wheel: pathlib.Path, include_names: Iterable[str]) -> list[str]:
    """Of the unresolved includes, tvm-ffi's that its wheel does not hold."""
    with zipfile.ZipFile(tvm_ffi_wheel) as wheel:
        files = set(wheel.namelist())
    return sorted(name for name in include_names if name.startswith(TVM_FFI_PREFIXES)
                  and not any(posixpath.join(d, name) in files for d in TVM_FFI_INCLUDE_DIRS))
