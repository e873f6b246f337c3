"""Write ``relaxkv_patches.pth`` into this interpreter's site-packages (``--remove``: delete it).

Python runs a ``.pth`` file's ``import`` lines at every interpreter start: how the shims reach SGLang's
spawned processes. Run by ``make install`` (by hand after a pip install on a CPU machine). Not in the
wheel: run ``--remove`` before ``pip uninstall relaxkv-sglang``, which would leave it behind.
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig

PTH_NAME = "relaxkv_patches.pth"
PTH_LINE = "import relaxkv_patches; relaxkv_patches.arm()\n"


def pth_path() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m relaxkv_patches.install_pth", description=__doc__.split("\n")[0])
    parser.add_argument("--remove", action="store_true", help="delete the .pth file (before pip uninstall)")
    args = parser.parse_args(argv)
    path = pth_path()
    if args.remove:
        if path.exists():
            path.unlink()
            print(f"shims disarmed: removed {path}")
        else:
            print(f"shims not armed: no {path}")
        return
    if path.exists() and path.read_text() == PTH_LINE:
        print(f"shims already armed: {path}")
        return
    path.write_text(PTH_LINE)
    print(f"shims armed: {path}")


if __name__ == "__main__":
    main()
