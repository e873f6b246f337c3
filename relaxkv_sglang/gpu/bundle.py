"""Build ``.gpu/``: what the GPU check carries to a machine that cannot reach a package index.

The lent GPU machine has CUDA, nvcc and PyTorch but no FlashInfer, and takes at
most 64 MiB of files per call. FlashInfer 0.7.2's wheel alone is 65 MB, almost
all of it kernel sources for other features, so the bundle keeps the Python
package whole and, of its JIT sources (``flashinfer/data``), only what the
prefill kernels compile from: FlashInfer's headers, CUTLASS, CCCL and spdlog
headers, and the prefill sources of ``csrc``. Both wheels are pinned by sha256
(the same download-and-verify as the model and data assets).

    python -m relaxkv_sglang.gpu.bundle        # or: make gpu-bundle

writes ``.gpu/flashinfer-0.7.2-prefill.tar.xz`` and ``.gpu/apache_tvm_ffi-*.whl``;
``scripts/gpu_check.sh`` unpacks them on the GPU machine (docs/gpu.md).
"""

from __future__ import annotations

import fnmatch
import pathlib
import sys
import tarfile
import zipfile

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


def build(out_dir: pathlib.Path = BUNDLE_DIR) -> list[pathlib.Path]:
    """Write the bundle into ``out_dir``; returns its files."""
    out_dir.mkdir(exist_ok=True)
    flashinfer = assets.fetch_wheel(FLASHINFER_WHEEL)
    tvm_ffi = assets.fetch_wheel(TVM_FFI_WHEEL)
    tar_path = out_dir / f"flashinfer-{FLASHINFER_WHEEL.version}-prefill.tar.xz"
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


def main() -> int:
    try:
        files = build()
    except assets.AssetError as exc:
        print(f"relaxkv gpu bundle: {exc}", file=sys.stderr)
        return 1
    total = sum(f.stat().st_size for f in files) / 2**20
    for f in files:
        print(f"{f.relative_to(ROOT)}  {f.stat().st_size / 2**20:.1f} MiB")
    print(f"bundle: {total:.1f} MiB (the GPU machine takes at most 64 MiB per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
