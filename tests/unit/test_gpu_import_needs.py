"""What ``import flashinfer`` needs on the GPU machine (gpu_check/import_needs.py, gpu_check/import_sites.py,
bundle.CARRIED_WHEELS): the static import walk's rules on small sources, and the pinned FlashInfer
0.7.2 walked with the bundle's wheels: every module it needs is carried or in the image, and the
check fails when a needed wheel is left out."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from relaxkv_sglang import assets
from relaxkv_sglang.gpu_check import bundle, import_needs, import_sites

SOURCE = textwrap.dedent('''
    import sys, contextlib
    import a_top
    from typing import TYPE_CHECKING
    if TYPE_CHECKING:
        import b_typing
    try:
        import c_guarded
        HAS_C = True
    except ImportError:
        import d_fallback
        HAS_C = False
    if HAS_C:
        import e_gated
    if X_AVAILABLE and y:
        import f_gated
    if sys.platform == "win32":
        import g_windows
    else:
        import h_posix
    if sys.version_info < (3, 11):
        import i_old
    if some_flag:
        import j_conditional
    def fn():
        import k_in_function
    class C:
        import l_in_class
    with contextlib.suppress(ImportError):
        import m_suppressed
    try:
        import n_in_try_finally
    finally:
        pass
''')


def test_the_walk_counts_what_runs_at_import_and_can_fail():
    sites = {site.module: site for site, _ in import_sites.module_imports(SOURCE, "pkg.mod", False, "pkg/mod.py")}
    needed = {m for m, s in sites.items() if import_needs.needed(s)} - {"sys", "contextlib", "typing"}
    assert needed == {"a_top", "h_posix", "j_conditional", "l_in_class", "n_in_try_finally"}
    assert sites["c_guarded"].guarded and sites["m_suppressed"].guarded
    assert all(sites[m].gated and not sites[m].guarded for m in ("d_fallback", "e_gated", "f_gated"))
    assert not {"b_typing", "g_windows", "i_old", "k_in_function"} & set(sites)  # never run on the machine
    assert sites["j_conditional"].condition == "some_flag"


def test_the_walk_follows_submodules_relative_imports_and_names_the_chain():
    files = {"pkg/__init__.py": "from .sub import thing\n",
             "pkg/sub.py": ("from . import leaf\nimport numpy.linalg\n"
                            "try:\n    import cutlass\nexcept ImportError:\n    pass\n"),
             "pkg/leaf.py": "import os\nimport requests\n",
             "pkg/unused.py": "import never_imported\n",
             "requests/__init__.py": "from . import api\nimport urllib3\n", "requests/api.py": "import json\n"}
    report = import_needs.report(set(files), files.__getitem__, roots=["pkg"], image=["urllib3"])
    assert set(report.needed) == {"numpy", "urllib3"} and report.uncovered == ["numpy"]
    assert report.needed["urllib3"] == ["pkg", "pkg/__init__.py:1", "pkg/sub.py:1", "pkg/leaf.py:2",
                                        "requests/__init__.py:2"]
    assert report.optional == {"cutlass": "pkg/sub.py:4, guarded"}
    assert report.modules == 5  # pkg, pkg.sub, pkg.leaf, requests, requests.api; not pkg.unused


@pytest.fixture(scope="module")
def wheels() -> tuple[pathlib.Path, list[pathlib.Path]]:
    return assets.fetch_wheel(bundle.FLASHINFER_WHEEL), [assets.fetch_wheel(w) for w in bundle.CARRIED_WHEELS]


def test_every_module_import_flashinfer_needs_is_carried_or_in_the_image(wheels):
    flashinfer, carried = wheels
    report = bundle.wheel_import_report(flashinfer, carried)
    assert report.uncovered == [], "\n".join(report.lines())
    assert set(report.needed) <= import_needs.IMAGE_MODULES and {"torch", "jinja2", "filelock"} <= set(report.needed)
    assert bundle.programs_missing(carried) == []
    bundle.check_imports(report, [])
    # the large optional stacks are imported only guarded or behind FlashInfer's availability tests
    assert {"cutlass", "cudnn", "cuda"} <= set(report.optional)
    assert "_CUTE_DSL_AVAILABLE" in report.optional["cutlass"] and "is_cute_dsl_available()" in report.optional["cuda"]


def test_leaving_out_the_carried_wheels_is_caught_with_the_import_chain(wheels):
    flashinfer, carried = wheels
    tvm_ffi_only = [w for w in carried if w.name == bundle.TVM_FFI_WHEEL.filename]
    report = bundle.wheel_import_report(flashinfer, tvm_ffi_only)
    assert report.uncovered == ["numpy", "packaging", "pynvml", "requests", "tqdm"]
    assert report.needed["pynvml"][-1] == "flashinfer/utils.py:27"
    assert report.needed["packaging"] == ["flashinfer.jit.cpp_ext", "flashinfer/jit/cpp_ext.py:10"]
    assert bundle.programs_missing(tvm_ffi_only) == ["ninja"]
    with pytest.raises(bundle.BundleError, match=r"numpy, packaging, pynvml, requests, tqdm\): numpy via flashinfer"):
        bundle.check_imports(report, [])
    # requests' own needs count too: without urllib3 the walk goes on into requests and stops there
    no_urllib3 = bundle.wheel_import_report(flashinfer, [w for w in carried if not w.name.startswith("urllib3-")])
    assert no_urllib3.uncovered == ["urllib3"] and no_urllib3.needed["urllib3"][-1].startswith("requests/")


def test_the_carried_wheels_are_for_the_gpu_machine():
    for wheel in bundle.CARRIED_WHEELS:
        assert wheel.download_args == bundle.DEVICE_PLATFORM
        tags = wheel.filename[:-len(".whl")].split("-")[-3:]
        assert tags[0] in ("py3", "cp312") and (tags[2] == "any" or "x86_64" in tags[2]), wheel.filename
    assert len({w.package for w in bundle.CARRIED_WHEELS}) == len(bundle.CARRIED_WHEELS)


def test_an_unpacked_site_lacking_a_carried_package_is_named(wheels, tmp_path):
    """The dry run's and the GPU run's check (`bundle --verify SITE`) on a site laid out by
    `bundle --install` (the script's way without pip), first without numpy and ninja."""
    import zipfile

    flashinfer, carried = wheels
    with zipfile.ZipFile(flashinfer) as zf:  # FlashInfer's Python side, as the bundle's archive holds it
        zf.extractall(tmp_path, [m for m in zf.namelist() if m.endswith(".py") and bundle.kept(m)])
    later = [w for w in carried if w.name.startswith(("numpy-", "ninja-"))]
    assert bundle.install_wheels([w for w in carried if w not in later], tmp_path) > 100
    with pytest.raises(bundle.BundleError, match=r"needs 1 module\(s\) neither in the GPU image nor carried \(numpy\)"):
        bundle.verify_site_imports(tmp_path)
    bundle.install_wheels([w for w in later if w.name.startswith("numpy-")], tmp_path)
    with pytest.raises(bundle.BundleError, match="runs ninja from PATH"):
        bundle.verify_site_imports(tmp_path)
    bundle.install_wheels([w for w in later if w.name.startswith("ninja-")], tmp_path)
    assert (tmp_path / "bin" / "ninja").stat().st_mode & 0o111 and (tmp_path / "ninja" / "__init__.py").is_file()
    assert bundle.verify_site_imports(tmp_path).uncovered == []


def test_the_checks_own_modules_import_only_the_image_and_the_bundle(wheels):
    """`python -m relaxkv_sglang.gpu_check` and `python -m relaxkv_sglang.gpu_check.bundle` run on the GPU machine
    from the checkout."""
    import zipfile

    root = pathlib.Path(bundle.__file__).resolve().parents[2]
    files = {p.relative_to(root).as_posix() for p in (root / "relaxkv_sglang").rglob("*.py")}
    report = import_needs.report(files, lambda path: (root / path).read_text(),
                                 roots=["relaxkv_sglang.gpu_check.run", "relaxkv_sglang.gpu_check.bundle"])
    carried = {m.split("/")[0].split(".")[0] for w in wheels[1] for m in zipfile.ZipFile(w).namelist()}
    assert set(report.uncovered) <= carried, "\n".join(report.lines())
    assert "torch" in report.needed
