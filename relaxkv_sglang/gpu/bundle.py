"""Build ``.gpu/``: what the GPU check carries to a machine that cannot reach a package index.

The lent GPU machine has CUDA, nvcc and PyTorch but no FlashInfer, and takes at
most 64 MiB of files per call. FlashInfer 0.7.2's wheel alone is 65 MB, almost
all of it kernel sources for other features, so the bundle keeps the Python
package whole and, of its JIT sources (``flashinfer/data``), only what the
prefill kernels compile from: FlashInfer's headers, CUTLASS, CCCL and spdlog
headers, and the prefill sources of ``csrc``. Both wheels are pinned by sha256
(the same download-and-verify as the model and data assets).

    python -m relaxkv_sglang.gpu.bundle                  # or: make gpu-bundle (builds, then verifies)
    python -m relaxkv_sglang.gpu.bundle --verify SITE    # an unpacked bundle (scripts/gpu_check.sh)

writes ``.gpu/flashinfer-0.7.2-prefill.tar.xz`` and ``.gpu/apache_tvm_ffi-*.whl``;
``scripts/gpu_check.sh`` unpacks them on the GPU machine (docs/gpu.md).

**What the JIT needs** (:func:`jit_needs`), derived from FlashInfer's own JIT code in the bundle,
not listed by hand: the batch paged prefill module the plugin plans (``backend="fa2"``,
``flashinfer.jit.attention.modules.gen_customize_batch_prefill_module``) reads the ``csrc`` files
its fa2 branch names (templates, host sources, the paged header), and nvcc compiles them with the
include directories of ``flashinfer.jit.cpp_ext`` (``get_cccl_includes``,
``get_system_includes``), whose paths ``flashinfer.jit.env`` defines. The needed files are those
sources and every header they reach through ``#include`` (resolved as nvcc does: the including
file's folder for quoted includes, then the include directories in order) that the wheel holds.
An include found nowhere in the wheel is CUDA's, the C++ library's or tvm-ffi's (``tvm/ffi/``,
``dlpack/``: checked in the tvm-ffi wheel). Reading every ``#include``, including those under an
``#if``, over-approximates: a file kept that one configuration does not read costs bytes, never
a failed compile.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import pathlib
import posixpath
import re
import sys
import tarfile
import zipfile
from typing import Iterable, Optional

from relaxkv_sglang import assets

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLE_DIR = ROOT / ".gpu"
DEVICE_PLATFORM = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                   "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
                   "--platform", "manylinux2014_x86_64")

FLASHINFER_WHEEL = assets.PinnedWheel(
    "flashinfer-python", "0.7.2", "flashinfer_python-0.7.2-py3-none-any.whl",
    "770550a0aa92b2f10e6c9a1f048dd43713f0f3bb6a12710186fcf8e4e9c99bd8", 65.2, DEVICE_PLATFORM)
TVM_FFI_WHEEL = assets.PinnedWheel(
    "apache-tvm-ffi", "0.1.12", "apache_tvm_ffi-0.1.12-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "dc0acd7eeb0e451d5e3f686af3ba0b495fdbf97b5b54cf9a0f770cdafe0e691a", 2.7, DEVICE_PLATFORM)
TAR_NAME = f"flashinfer-{FLASHINFER_WHEEL.version}-prefill.tar.xz"

# Members of the flashinfer wheel the bundle keeps (fnmatch patterns on the member path).
KEEP = (
    "flashinfer_python-*.dist-info/*",
    "flashinfer/data/include/*",
    "flashinfer/data/spdlog/include/*",
    "flashinfer/data/cutlass/include/*",
    "flashinfer/data/cutlass/tools/util/include/*",
    "flashinfer/data/cccl/cub/*",
    "flashinfer/data/cccl/libcudacxx/include/*",
    "flashinfer/data/cccl/thrust/*",
    "flashinfer/data/csrc/*.h",
    "flashinfer/data/csrc/*.cuh",
    "flashinfer/data/csrc/*prefill*",
    "flashinfer/data/csrc/*page*",
    "flashinfer/data/*.py",
)
PYTHON_SIDE = (".py", ".jinja", ".json", ".txt", ".typed")

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
    """The bundle lacks what the GPU check needs, or FlashInfer's JIT code is not as expected;
    the message is one line."""


def kept(member: str) -> bool:
    """Whether a wheel member goes into the bundle."""
    if member.startswith("flashinfer/") and not member.startswith("flashinfer/data/"):
        return member.endswith(PYTHON_SIDE)
    return any(fnmatch.fnmatch(member, pattern) for pattern in KEEP)


# --- what FlashInfer's JIT reads to compile the paged prefill -------------------------------------


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
    raise BundleError(f"FlashInfer's JIT code has no {name}() (not flashinfer {FLASHINFER_WHEEL.version}?)")


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
    """Every file of ``files`` reached from ``sources`` through ``#include``.

    Args:
        sources: wheel paths of the sources compiled or rendered.
        files: the wheel paths that exist (where includes resolve).
        include_dirs: wheel paths searched in order after a quoted include's own folder.
        read: wheel path -> its text.
    Returns:
        (reached files, the include names that resolved nowhere in ``files``).
    """
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
    """What FlashInfer's JIT reads to compile the fa2 batch paged prefill (module doc), from the
    JIT code among ``files`` (wheel paths; ``read``: path -> text)."""
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


def missing_from_bundle(flashinfer_wheel: pathlib.Path, kept_member=kept) -> list[str]:
    """The files the JIT needs (:func:`wheel_needs`) that ``kept_member`` leaves out of the bundle."""
    return [path for path in wheel_needs(flashinfer_wheel).files if not kept_member(path)]


def tvm_ffi_missing(tvm_ffi_wheel: pathlib.Path, include_names: Iterable[str]) -> list[str]:
    """Of the unresolved includes, tvm-ffi's that its wheel does not hold."""
    with zipfile.ZipFile(tvm_ffi_wheel) as wheel:
        files = set(wheel.namelist())
    return sorted(name for name in include_names if name.startswith(TVM_FFI_PREFIXES)
                  and not any(posixpath.join(d, name) in files for d in TVM_FFI_INCLUDE_DIRS))


def verify_site(site: pathlib.Path, flashinfer_wheel: Optional[pathlib.Path] = None) -> list[str]:
    """Check an unpacked bundle (``site``: the folder holding ``flashinfer/``): the JIT's needs,
    derived from the unpacked JIT code, all present. Without the wheel an include that resolves
    nowhere is taken for CUDA's or the C++ library's unless it names a folder the bundle ships
    (``flashinfer/``, ``cute/``, ...); with it (``flashinfer_wheel``), exactly: every needed file
    the wheel holds must be in the site.

    Returns: the needed wheel paths (all present). Raises BundleError naming the first missing."""
    site = site.resolve()
    files = {p.relative_to(site).as_posix() for p in (site / "flashinfer").rglob("*") if p.is_file()}
    needs = jit_needs(files, lambda path: (site / path).read_text(errors="replace"))
    if flashinfer_wheel is not None:
        lacking = [p for p in wheel_needs(flashinfer_wheel).files if p not in files]
    else:
        # every include folder the JIT passes to nvcc, and no include under a vendored root unresolved
        # ("cuda/" is also the toolkit's own libcu++: not decidable by name)
        lacking = [d + "/" for d in needs.include_dirs if not any(f.startswith(d + "/") for f in files)]
        tops = {f[len(d) + 1:].split("/")[0] for d in needs.include_dirs for f in files
                if f.startswith(d + "/") and f.count("/") > d.count("/") + 1}
        lacking += sorted(n for n in needs.unresolved if n.split("/")[0] in (tops | VENDORED_ROOTS) - {"cuda"})
    if lacking:
        raise BundleError(f"the bundle lacks {len(lacking)} file(s) FlashInfer's JIT needs for the paged prefill, "
                          f"first {lacking[0]} (run 'make gpu-bundle' again)")
    return needs.files


# --- building -----------------------------------------------------------------------------------------


def build(out_dir: pathlib.Path = BUNDLE_DIR) -> list[pathlib.Path]:
    """Write the bundle into ``out_dir``; returns its files. Refuses (BundleError) a bundle that
    would lack a file the JIT needs."""
    out_dir.mkdir(exist_ok=True)
    flashinfer = assets.fetch_wheel(FLASHINFER_WHEEL)
    tvm_ffi = assets.fetch_wheel(TVM_FFI_WHEEL)
    check_wheels(flashinfer, tvm_ffi)
    tar_path = out_dir / TAR_NAME
    partial = tar_path.with_suffix(".partial")
    with zipfile.ZipFile(flashinfer) as wheel, tarfile.open(partial, "w:xz") as tar:
        for info in wheel.infolist():
            if info.is_dir() or not kept(info.filename):
                continue
            entry = tarfile.TarInfo(info.filename)
            entry.size = info.file_size
            with wheel.open(info) as src:
                tar.addfile(entry, src)
    partial.replace(tar_path)
    ffi_dest = out_dir / TVM_FFI_WHEEL.filename
    ffi_dest.write_bytes(tvm_ffi.read_bytes())
    return [tar_path, ffi_dest]


def check_wheels(flashinfer: pathlib.Path, tvm_ffi: pathlib.Path) -> int:
    """BundleError unless :func:`kept` keeps every file the JIT needs and tvm-ffi's wheel holds
    the tvm-ffi headers they include; returns the number of needed files."""
    needs = wheel_needs(flashinfer)
    lacking = [p for p in needs.files if not kept(p)]
    if lacking:
        raise BundleError(f"bundle.KEEP leaves out {len(lacking)} file(s) FlashInfer's JIT needs, first {lacking[0]}")
    ffi_lacking = tvm_ffi_missing(tvm_ffi, needs.unresolved)
    if ffi_lacking:
        raise BundleError(f"the tvm-ffi wheel lacks {ffi_lacking[0]}, which the prefill sources include")
    return len(needs.files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_sglang.gpu.bundle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", metavar="SITE", type=pathlib.Path,
                        help="check an unpacked bundle instead of building one (uses the cached wheel if present)")
    args = parser.parse_args(argv)
    try:
        if args.verify is not None:
            cached = assets.cache_root() / "wheels" / FLASHINFER_WHEEL.filename
            wheel = cached if cached.is_file() and assets.sha256_file(cached) == FLASHINFER_WHEEL.sha256 else None
            needed = verify_site(args.verify, wheel)
            how = "against the pinned wheel" if wheel else "by include names (the wheel is not cached here)"
            print(f"bundle: all {len(needed)} files FlashInfer's JIT reads for the fa2 paged prefill are present "
                  f"({how})")
            return 0
        files = build()
    except (assets.AssetError, BundleError) as exc:
        print(f"relaxkv gpu bundle: {exc}", file=sys.stderr)
        return 1
    total = sum(f.stat().st_size for f in files) / 2**20
    for f in files:
        print(f"{f.relative_to(ROOT)}  {f.stat().st_size / 2**20:.1f} MiB")
    print(f"bundle: {total:.1f} MiB (the GPU machine takes at most 64 MiB per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
