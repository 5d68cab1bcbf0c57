"""Serve `sgl_kernel` from BASTION's torch stand-ins on an offline GPU machine where sglang-kernel is absent.

SGLang 0.5.23 on CUDA imports `sgl_kernel` at module level throughout its layers, and its scheduler
processes import those layers before any plugin runs, so the stand-in has to be findable from
interpreter start-up. `install()` appends `SglKernelFallbackFinder` to the end of `sys.meta_path`:
Python asks it only after every other finder (site-packages included) has failed, so an installed
sglang-kernel always wins and the stand-in is used only where it is absent. The modules it serves, and
their contents, are `offline_gpu.sgl_kernel_ops.MODULES` and `module_namespace`.

Never active by accident:
- this module is not part of the installed package (a wheel of bastion-sglang has no finder and no hook);
- the hook exists only where `write_pth` put it: `tools/offline_gpu/gpu-install.sh` runs
  `python -m offline_gpu.sgl_kernel_finder write-pth` on the GPU machine, which writes
  `PTH_NAME` into site-packages (the checkout's `tools/` folder, then the line that calls `install`);
  `python -m offline_gpu.sgl_kernel_finder remove-pth` deletes it;
- the first time a process imports the stand-in `sgl_kernel`, the finder logs a WARNING naming the `.pth`
  file that installed it and saying that SGLang's kernels then run as torch fallbacks (once per process).

This module imports nothing heavy (torch loads only when `sgl_kernel` is first imported).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import logging
import sys
import sysconfig
import types
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "sgl_kernel"
PTH_NAME = "bastion_sgl_kernel_standin.pth"
"""The `.pth` file `write_pth` puts into site-packages."""
TOOLS_DIR = Path(__file__).resolve().parents[1]
"""The checkout's `tools/` folder (the one holding this package)."""


class SglKernelFallbackFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `sgl_kernel` and the submodules the stand-in serves; last in `sys.meta_path`.

    origin: what installed it (the `.pth` file's path, or a description), named in the warning.
    """

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.warned = False

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] != PACKAGE:  # before importing the ops: torch's own imports come here
            return None
        from offline_gpu.sgl_kernel_ops import MODULES

        if fullname not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == PACKAGE)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"BASTION's torch stand-in for {spec.name} (tools/offline_gpu)")
        if spec.name == PACKAGE:
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        from offline_gpu.sgl_kernel_ops import module_namespace

        if not self.warned:
            self.warned = True
            logger.warning(
                "sgl_kernel is BASTION's torch stand-in (tools/offline_gpu/sgl_kernel_ops.py), not "
                "sglang-kernel: SGLang's kernels run as slow torch fallbacks in this process. Installed by "
                "%s; for a real deployment install sglang-kernel or remove that file.",
                self.origin,
            )
        module.__dict__.update(module_namespace(module.__name__))
        if module.__name__ != PACKAGE:
            setattr(sys.modules[PACKAGE], module.__name__.rsplit(".", 1)[-1], module)


def installed() -> bool:
    """True when the fallback finder is in `sys.meta_path`."""
    return any(isinstance(finder, SglKernelFallbackFinder) for finder in sys.meta_path)


def install(origin: str) -> None:
    """Append the fallback finder to `sys.meta_path` (idempotent); `origin` says what installed it."""
    if not installed():
        sys.meta_path.append(SglKernelFallbackFinder(origin))


def uninstall() -> None:
    """Remove the fallback finder from `sys.meta_path` (modules it already served stay imported)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, SglKernelFallbackFinder)]


def pth_text(pth: Path, tools_dir: Path = TOOLS_DIR) -> str:
    """The `.pth` file at `pth`: `tools_dir` (put on sys.path), then the line that installs the finder."""
    return f"{tools_dir}\nimport offline_gpu.sgl_kernel_finder as m; m.install({str(pth)!r})\n"


def default_site() -> Path:
    """The site-packages folder of this interpreter's environment (purelib)."""
    return Path(sysconfig.get_paths()["purelib"])


def write_pth(site: Path) -> Path:
    """Write `PTH_NAME` into `site` (every interpreter of that environment then installs the finder)."""
    pth = site / PTH_NAME
    pth.write_text(pth_text(pth))
    return pth


def remove_pth(site: Path) -> bool:
    """Delete `site`'s `PTH_NAME`; True when there was one."""
    pth = site / PTH_NAME
    if not pth.exists():
        return False
    pth.unlink()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m offline_gpu.sgl_kernel_finder",
        description="Install (write-pth) or remove (remove-pth) the .pth hook that serves BASTION's "
        "sgl_kernel stand-in where sglang-kernel is absent. Only for the offline GPU machine.",
    )
    parser.add_argument("action", choices=["write-pth", "remove-pth"])
    parser.add_argument("--site", type=Path, default=None, help="site-packages (default: this interpreter's)")
    args = parser.parse_args(argv)
    site = args.site if args.site is not None else default_site()
    if args.action == "write-pth":
        print(f"wrote {write_pth(site)}: sgl_kernel falls back to BASTION's torch stand-ins there")
    else:
        print(f"removed {site / PTH_NAME}" if remove_pth(site) else f"no {site / PTH_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
