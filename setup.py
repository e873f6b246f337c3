"""The package list for setuptools; every other setting is in ``pyproject.toml``.

Each top-level package that ``pyproject.toml`` maps in ``[tool.setuptools] package-dir`` is
shipped with every subpackage found under its folder, so a new subpackage needs no edit here.
``setuptools``' own ``packages.find`` cannot express this: ``relaxkv_patches`` lives in
``patches/``, a folder whose name is not the package's.
"""

import pathlib
import tomllib

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent


def discover_packages() -> list[str]:
    """``relaxkv_sglang``, ``relaxkv_patches`` and every package below them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    packages = []
    for top, folder in sorted(config["tool"]["setuptools"]["package-dir"].items()):
        packages.append(top)
        packages += [f"{top}.{sub}" for sub in find_packages(where=str(ROOT / folder))]
    return packages


setup(packages=discover_packages())
