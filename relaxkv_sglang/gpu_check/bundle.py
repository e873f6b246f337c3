"""Build ``.gpu/``: what the GPU check carries to a machine that cannot reach a package index.

The lent GPU machine has CUDA, nvcc and PyTorch but no FlashInfer, and takes at most 64 MiB of files per
call; FlashInfer 0.7.2's wheel alone is 65 MB, mostly kernel sources for other features. So the bundle
keeps the Python package whole and, of its JIT sources (``flashinfer/data``), what the prefill kernels
compile from (FlashInfer's, CUTLASS, CCCL and spdlog headers, the prefill sources of ``csrc``), beside
the CPython 3.12 manylinux x86_64 wheels ``import flashinfer`` and its JIT need that the image lacks
(:data:`CARRIED_WHEELS`, ninja included), each pinned by sha256.

    python -m relaxkv_sglang.gpu_check.bundle                  # or: make gpu-bundle (builds, then verifies)
    python -m relaxkv_sglang.gpu_check.bundle --verify SITE    # an unpacked bundle (scripts/gpu_check.sh)

writes ``.gpu/flashinfer-0.7.2-prefill.tar.xz`` and ``.gpu/*.whl`` (32.6 MiB in all; docs/gpu.md).

**What the import needs** (:func:`wheel_import_report`): every module ``import flashinfer`` or the fa2
prefill's JIT modules import unguarded, through the carried packages' imports too
(:mod:`.import_needs`), is the standard library's, the image's (``import_needs.IMAGE_MODULES``) or
carried. The optional stacks (CuTe DSL, cuDNN, cuda-python) are imported only guarded, not carried.
**What the JIT needs** (:func:`~.jit_needs.jit_needs`): the files its JIT reads to compile the fa2 batch
paged prefill, every one kept (:func:`kept`, :func:`check_wheels`, :func:`verify_site`).
"""

from __future__ import annotations

import argparse
import fnmatch
import pathlib
import sys
import tarfile
import zipfile
from typing import Iterable, Optional

from relaxkv_sglang import assets
from relaxkv_sglang.gpu_check import import_needs
from relaxkv_sglang.gpu_check.jit_needs import VENDORED_ROOTS, BundleError, jit_needs, tvm_ffi_missing, wheel_needs

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


def _device_wheel(package: str, version: str, filename: str, sha256: str, size_mb: float) -> assets.PinnedWheel:
    return assets.PinnedWheel(package, version, filename, sha256, size_mb, DEVICE_PLATFORM)


# What `import flashinfer` and its JIT need that the GPU image lacks (module doc; versions as
# requirements/cpu-runtime.txt pins them where it does). FlashInfer's other requirements (click,
# tabulate: its CLI; einops: inside functions; cuda-python, cuda-tile, cudnn-frontend, cutlass-dsl,
# nccl4py, nccl-extensions: optional stacks) are not imported on the check's path.
CARRIED_WHEELS = (
    TVM_FFI_WHEEL,
    _device_wheel("numpy", "2.4.6", "numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
                  "90f9849678c75fe7afa2d348ac842c168b0a4d3d61919687216dfc547976d853", 16.6),
    _device_wheel("packaging", "26.4", "packaging-26.4-py3-none-any.whl",
                  "81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2", 0.1),
    _device_wheel("tqdm", "4.70.1", "tqdm-4.70.1-py3-none-any.whl",
                  "c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73", 0.1),
    _device_wheel("nvidia-ml-py", "13.615.71", "nvidia_ml_py-13.615.71-py3-none-any.whl",
                  "959bf4adf6fe1308e4bd739e722236b0d1ec8392e2cefad33ff70c311380b9b6", 0.1),
    _device_wheel("requests", "2.34.2", "requests-2.34.2-py3-none-any.whl",
                  "2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0", 0.1),
    _device_wheel("urllib3", "2.8.0", "urllib3-2.8.0-py3-none-any.whl",
                  "0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3", 0.1),
    _device_wheel("idna", "3.20", "idna-3.20-py3-none-any.whl",
                  "ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c", 0.1),
    _device_wheel("certifi", "2026.10.19.post1", "certifi-2026.10.19.post1-py3-none-any.whl",
                  "1324c476b4811eff41a8bc2122cd0bbd4d9c7234c725446d99ab1612b3a7fdd2", 0.1),
    # requests imports it guarded (without it: a RequestsDependencyWarning); a requirement of requests
    _device_wheel("charset-normalizer", "3.5.3",
                  "charset_normalizer-3.5.3-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64."
                  "manylinux_2_5_x86_64.whl",
                  "e5e4785d8a0adeadfbdf75f4efc357911842674651cbafd7e97f69b11ec3cbc6", 0.3),
    # the `ninja` program flashinfer/jit/cpp_ext.py runs from PATH (installed as bin/ninja)
    _device_wheel("ninja", "1.13.2", "ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                  "65a24341b5ac09fcadcc37082660be40a94174e51a937fabf6e2cae26225fa2c", 0.2),
)
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


def kept(member: str) -> bool:
    """Whether a wheel member goes into the bundle."""
    if member.startswith("flashinfer/") and not member.startswith("flashinfer/data/"):
        return member.endswith(PYTHON_SIDE)
    return any(fnmatch.fnmatch(member, pattern) for pattern in KEEP)


# --- what the bundle holds -------------------------------------------------------------------------


def missing_from_bundle(flashinfer_wheel: pathlib.Path, kept_member=kept) -> list[str]:
    """The files the JIT needs (:func:`~.jit_needs.wheel_needs`) that ``kept_member`` leaves out of the bundle."""
    return [path for path in wheel_needs(flashinfer_wheel).files if not kept_member(path)]


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


def verify_site_imports(site: pathlib.Path) -> import_needs.Report:
    """Check an unpacked bundle with its wheels installed (``site``, as on ``PYTHONPATH``): every
    module ``import flashinfer`` needs is there or in the image, and ``bin/`` holds the programs the
    JIT runs. Returns the import report; raises BundleError naming the first missing."""
    files, read = import_needs.site_files(site)
    report = import_needs.report(files, read)
    programs = [name for name in import_needs.PROGRAMS if not (site / "bin" / name).is_file()
                or not (site / "bin" / name).stat().st_mode & 0o111]
    check_imports(report, programs)
    return report


# --- what `import flashinfer` needs ------------------------------------------------------------------


def wheel_import_report(flashinfer_wheel: pathlib.Path, wheels: Iterable[pathlib.Path]) -> import_needs.Report:
    """The modules ``import flashinfer`` and the prefill's JIT modules need (``gpu_check/import_needs.py``)
    with ``wheels`` installed beside FlashInfer; ``.uncovered``: those the image lacks too."""
    # of FlashInfer's wheel, what the bundle keeps (its other top-level modules do not travel)
    files, read = import_needs.wheel_files([flashinfer_wheel, *wheels],
                                           keep=lambda wheel, member: wheel != flashinfer_wheel or kept(member))
    return import_needs.report(files, read)


def programs_missing(wheels: Iterable[pathlib.Path]) -> list[str]:
    """The programs FlashInfer's JIT runs (``import_needs.PROGRAMS``) that no wheel installs."""
    members = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members += zf.namelist()
    return [name for name, pattern in import_needs.PROGRAMS.items()
            if not any(fnmatch.fnmatch(m, pattern) for m in members)]


def check_imports(report: import_needs.Report, missing_programs: list[str]) -> None:
    """BundleError naming the first module (with the import chain) or program the machine would lack."""
    if report.uncovered:
        top = report.uncovered[0]
        raise BundleError(f"import flashinfer needs {len(report.uncovered)} module(s) neither in the GPU image nor "
                          f"carried ({', '.join(report.uncovered)}): {top} via {' -> '.join(report.needed[top])}")
    if missing_programs:
        raise BundleError(f"FlashInfer's JIT runs {missing_programs[0]} from PATH; no carried wheel installs it")


def install_wheels(wheels: Iterable[pathlib.Path], site: pathlib.Path) -> int:
    """Unpack ``wheels`` into ``site`` as ``pip install --no-deps --target`` lays them out, for a
    Python without pip: the packages at the top, ``*.data/purelib`` and ``platlib`` there too,
    ``*.data/scripts`` into ``bin/`` (executable: ninja's program); console-script wrappers,
    headers and ``.data/data`` are left out (nothing here runs them). Returns the files written."""
    site = site.resolve()
    written = 0
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                parts = info.filename.split("/")
                if info.is_dir() or ".." in parts:
                    continue
                is_script = parts[0].endswith(".data") and parts[1] == "scripts"
                if parts[0].endswith(".data"):
                    if parts[1] not in ("scripts", "purelib", "platlib"):
                        continue
                    dest = site.joinpath("bin" if is_script else "", *parts[2:])
                else:
                    dest = site.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(info))
                if is_script or (info.external_attr >> 16) & 0o111:
                    dest.chmod(0o755)
                written += 1
    return written


# --- building -----------------------------------------------------------------------------------------


def build(out_dir: pathlib.Path = BUNDLE_DIR) -> list[pathlib.Path]:
    """Write the bundle into ``out_dir``; returns its files. Refuses (BundleError) a bundle that
    would lack a file the JIT needs."""
    out_dir.mkdir(exist_ok=True)
    flashinfer = assets.fetch_wheel(FLASHINFER_WHEEL)
    wheels = [assets.fetch_wheel(w) for w in CARRIED_WHEELS]
    check_wheels(flashinfer, wheels[0], wheels)
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
    for stale in out_dir.glob("*.whl"):  # a wheel no longer pinned would be installed too
        if stale.name not in {w.filename for w in CARRIED_WHEELS}:
            stale.unlink()
    copies = []
    for wheel in wheels:
        dest = out_dir / wheel.name
        if not dest.is_file() or assets.sha256_file(dest) != assets.sha256_file(wheel):
            dest.write_bytes(wheel.read_bytes())
        copies.append(dest)
    return [tar_path, *copies]


def check_wheels(flashinfer: pathlib.Path, tvm_ffi: pathlib.Path, carried: Optional[list[pathlib.Path]] = None) -> int:
    """BundleError unless :func:`kept` keeps every file the JIT needs, tvm-ffi's wheel holds the
    tvm-ffi headers they include and, given the ``carried`` wheels, they cover what
    ``import flashinfer`` needs (:func:`check_imports`); returns the number of needed files."""
    needs = wheel_needs(flashinfer)
    lacking = [p for p in needs.files if not kept(p)]
    if lacking:
        raise BundleError(f"bundle.KEEP leaves out {len(lacking)} file(s) FlashInfer's JIT needs, first {lacking[0]}")
    ffi_lacking = tvm_ffi_missing(tvm_ffi, needs.unresolved)
    if ffi_lacking:
        raise BundleError(f"the tvm-ffi wheel lacks {ffi_lacking[0]}, which the prefill sources include")
    if carried is not None:
        check_imports(wheel_import_report(flashinfer, carried), programs_missing(carried))
    return len(needs.files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_sglang.gpu_check.bundle",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", metavar="SITE", type=pathlib.Path,
                        help="check an unpacked bundle instead of building one (uses the cached wheel if present)")
    parser.add_argument("--install", metavar=("SITE", "WHEEL"), nargs="+", type=pathlib.Path,
                        help="unpack wheels into SITE as pip --target would (for a Python without pip)")
    args = parser.parse_args(argv)
    try:
        if args.install is not None:
            site, *wheels = args.install
            print(f"bundle: {install_wheels(wheels, site)} files of {len(wheels)} wheels unpacked into {site}")
            return 0
        if args.verify is not None:
            cached = assets.cache_root() / "wheels" / FLASHINFER_WHEEL.filename
            wheel = cached if cached.is_file() and assets.sha256_file(cached) == FLASHINFER_WHEEL.sha256 else None
            needed = verify_site(args.verify, wheel)
            how = "against the pinned wheel" if wheel else "by include names (the wheel is not cached here)"
            print(f"bundle: all {len(needed)} files FlashInfer's JIT reads for the fa2 paged prefill are present "
                  f"({how})")
            report = verify_site_imports(args.verify.resolve())
            print("\n".join(report.lines()))
            print(f"bundle: every module import flashinfer needs is carried or in the GPU image "
                  f"({', '.join(sorted(report.needed))}), and bin/ has {', '.join(import_needs.PROGRAMS)}")
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
