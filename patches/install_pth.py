"""Write ``relaxkv_patches.pth`` into this interpreter's site-packages.

Python executes ``import`` lines of ``.pth`` files at every interpreter start,
which is how the shims reach SGLang's spawned scheduler and detokenizer
processes. Run by ``make install``: ``python -m relaxkv_patches.install_pth``.
"""

from __future__ import annotations

import pathlib
import sysconfig

PTH_NAME = "relaxkv_patches.pth"
PTH_LINE = "import relaxkv_patches; relaxkv_patches.arm()\n"


def pth_path() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main() -> None:
    path = pth_path()
    if path.exists() and path.read_text() == PTH_LINE:
        print(f"shims already armed: {path}")
        return
    path.write_text(PTH_LINE)
    print(f"shims armed: {path}")


if __name__ == "__main__":
    main()
