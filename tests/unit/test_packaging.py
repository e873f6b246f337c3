"""The package as a user installs it: the wheel, not the checkout.

The wheel is built the way ``python -m build`` builds it (an sdist first, then the wheel from the
unpacked sdist, through setuptools' PEP 517 hooks; without build isolation, so offline) from a
copy of the project's files, so nothing is written into the checkout. It is installed without
``-e`` into a fresh venv whose only link to the project's venv is a ``.pth`` line appending that
venv's site-packages (sglang, torch: the dependencies), after the fresh venv's own. A ``.pth``
line adds a folder to ``sys.path`` without running the ``.pth`` files in it, so the checkout's
editable install stays out of reach. Every module of ``relaxkv_sglang`` and ``relaxkv_patches``
(``relaxkv_sglang.attention.gpu`` included: it imports FlashInfer only when a kernel is built) must then
import, from the fresh venv's site-packages.

Also checked here: the wheel's metadata (version, Python range, license, extras, entry points)
and that the extras in ``pyproject.toml`` carry exactly the pins of ``requirements/*.txt``.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import json
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")


def source_version() -> str:
    """``relaxkv_sglang.__version__`` read from the source (the version's one home)."""
    tree = ast.parse((ROOT / PACKAGE_DIRS["relaxkv_sglang"] / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("relaxkv_sglang/__init__.py sets no __version__")


def source_files() -> dict[str, pathlib.Path]:
    """Path inside the wheel -> source file, for every .py file of the packages."""
    files = {}
    for top, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            files["/".join((top,) + path.relative_to(ROOT / folder).parts)] = path
    return files


def module_names() -> list[str]:
    """Every importable module of the packages (``__main__`` runs the CLI, so it is left out)."""
    names = []
    for wheel_path in source_files():
        parts = wheel_path.removesuffix(".py").split("/")
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# Hang guards, not speed checks: on a loaded 2-core machine the import of every module (sglang,
# torch, transformers) took 127 s, and building or installing the wheel about 10-25 s.
RUN_TIMEOUT_S = 600
IMPORT_ALL_TIMEOUT_S = 1200


def _run(cmd: list, cwd: pathlib.Path, timeout: float = RUN_TIMEOUT_S) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _hook(cwd: pathlib.Path, hook: str, out: pathlib.Path) -> pathlib.Path:
    """Call a PEP 517 hook of setuptools' backend in ``cwd``; the file it wrote to ``out``."""
    out.mkdir(exist_ok=True)
    name = _run([sys.executable, "-c", f"import sys, setuptools.build_meta as b; print(b.{hook}(sys.argv[1]))", out],
                cwd).strip().splitlines()[-1]
    return out / name


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    src.mkdir()
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, src / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    sdist = _hook(src, "build_sdist", work / "sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    return _hook(unpacked, "build_wheel", work / "wheel")


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh venv with the wheel installed (not editable) and the CPU shims' .pth written."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", path], path.parent)
    python = path / "bin" / "python"
    site = pathlib.Path(_run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             path.parent).strip())
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # Named to sort before relaxkv_patches.pth: site runs .pth files in name order, and the shims
    # look for torchvision when they are armed.
    (site / "00-project-dependencies.pth").write_text("".join(f"{d}\n" for d in deps))
    # The project's pip installs into the venv (pip --python): no pip, no index, no dependencies.
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install",
          "--no-deps", "--no-index", wheel], path.parent)
    _run([python, "-I", "-m", "relaxkv_patches.install_pth"], path.parent)  # the CPU shim step of the README
    return path


def _venv_site(venv: pathlib.Path) -> pathlib.Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def test_wheel_ships_every_module_the_marker_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(set(source_files()) - names)
    assert not missing, f"source modules missing from {wheel.name}: {missing}"
    assert "relaxkv_sglang/py.typed" in names
    dist_info = f"relaxkv_sglang-{source_version()}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    assert not [n for n in names if n.split("/")[0] not in (*PACKAGE_DIRS, dist_info)], "stray top-level files"


def test_wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        meta = email.parser.Parser().parsestr(zf.read(f"relaxkv_sglang-{source_version()}.dist-info/METADATA").decode())
        entry_points = zf.read(f"relaxkv_sglang-{source_version()}.dist-info/entry_points.txt").decode()
    assert meta["Version"] == source_version()
    assert meta["Requires-Python"] == importlib.metadata.metadata("sglang")["Requires-Python"]
    assert meta["License-Expression"] == "Apache-2.0"
    assert set(meta.get_all("Provides-Extra")) == {"cpu", "gpu", "bench", "dev"}
    assert "relaxkv-sglang = relaxkv_sglang.cli:main" in entry_points
    assert "[sglang.srt.plugins]\nrelaxkv = relaxkv_sglang.server.sglang.plugin:register" in entry_points


def test_every_module_imports_from_the_installed_wheel(venv):
    site = _venv_site(venv)
    script = """
import importlib, json, sys
out = {"errors": {}, "files": {}}
for name in json.loads(sys.argv[1]):
    try:
        out["files"][name] = importlib.import_module(name).__file__
    except Exception as exc:
        out["errors"][name] = f"{type(exc).__name__}: {exc}"
import importlib.metadata as md, pkgutil
from relaxkv_sglang.server.sglang.plugin import hooks
for hook in hooks():  # every hook the plugin registers wraps an SGLang function of the installed release
    pkgutil.resolve_name(hook.target.rpartition(".")[0])
(ep,) = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "relaxkv"]
out["plugin"] = sys.modules[ep.load().__module__].__file__
out["version"] = md.version("relaxkv-sglang")
out["armed_at_start"] = sys.modules["relaxkv_patches"].__file__ if "relaxkv_patches" in sys.modules else None
print(json.dumps(out))
"""
    names = module_names()
    assert "relaxkv_sglang.attention.gpu.flashinfer_attention" in names and "relaxkv_patches.install_pth" in names
    # -I: no PYTHONPATH, no user site, not the current folder on sys.path.
    got = json.loads(_run([venv / "bin" / "python", "-I", "-c", script, json.dumps(names)], venv,
                          timeout=IMPORT_ALL_TIMEOUT_S).strip().splitlines()[-1])
    assert got["errors"] == {}
    elsewhere = {name: f for name, f in got["files"].items() if not f.startswith(f"{site}/")}
    assert not elsewhere, f"imported from outside the installed wheel: {elsewhere}"
    assert sorted(got["files"]) == sorted(names)
    assert got["plugin"].startswith(f"{site}/relaxkv_sglang/server/sglang/")
    assert got["version"] == source_version()
    assert got["armed_at_start"] == f"{site}/relaxkv_patches/__init__.py"  # the .pth the shim step wrote


def test_installed_command_reports_the_version(venv):
    out = _run([venv / "bin" / "relaxkv-sglang", "--version"], venv)
    assert out.strip() == f"relaxkv-sglang {source_version()}"


def test_shim_step_is_undone_before_uninstall(venv):
    pth = _venv_site(venv) / "relaxkv_patches.pth"
    python = venv / "bin" / "python"
    assert pth.is_file()
    try:
        assert "shims disarmed" in _run([python, "-I", "-m", "relaxkv_patches.install_pth", "--remove"], venv)
        assert not pth.exists()
        assert "shims not armed" in _run([python, "-I", "-m", "relaxkv_patches.install_pth", "--remove"], venv)
    finally:
        _run([python, "-I", "-m", "relaxkv_patches.install_pth"], venv)
    assert pth.is_file()


# --- the extras against requirements/*.txt -----------------------------------------------------


def _pins(*files: str) -> set[str]:
    pins = set()
    for name in files:
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):
                assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line), f"{name}: not an exact pin: {line}"
                pins.add(_normal(line))
    return pins


def _normal(pin: str) -> str:
    name, version = pin.split("==")
    return f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}"


def _extra(name: str) -> set[str]:
    return {_normal(p) for p in PYPROJECT["project"]["optional-dependencies"][name]}


def test_extras_carry_the_pins_of_the_requirement_files():
    # cpu: what the CPU install resolves normally; sglang and xgrammar go in with --no-deps
    # (their declared requirements pull CUDA wheels and triton), so no extra can carry them.
    no_deps_only = {"sglang==0.5.23", "xgrammar==0.2.7"}
    assert no_deps_only <= _pins("cpu-nodeps.txt")
    assert _extra("cpu") == _pins("cpu-torch.txt", "cpu-nodeps.txt", "cpu-runtime.txt") - no_deps_only
    assert _extra("gpu") == _pins("gpu.txt")
    assert _extra("dev") == _pins("dev.txt")
    # bench: requirements/bench.txt (sglang.bench_serving's `datasets`) plus runtime pins (matplotlib)
    assert _pins("bench.txt") <= _extra("bench")
    assert _extra("bench") - _pins("bench.txt") <= _pins("cpu-runtime.txt")
    assert PYPROJECT["project"]["dependencies"] == []


def test_cpu_torch_is_the_cpu_build():
    (torch,) = [p for p in _pins("cpu-torch.txt") if p.startswith("torch==")]
    assert torch.endswith("+cpu")
