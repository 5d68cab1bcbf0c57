"""Serve `sgl_kernel` from BASTION's torch stand-ins where sglang-kernel is not installed.

SGLang 0.5.23 on CUDA imports `sgl_kernel` at module level throughout its layers, and its scheduler
processes import those layers before any plugin runs, so the stand-in has to be findable from
interpreter start-up. `install()` appends `SglKernelFallbackFinder` to the end of `sys.meta_path`:
Python asks it only after every other finder (site-packages included) has failed, so an installed
sglang-kernel always wins and the stand-in is used only where it is absent. The modules it serves, and
their contents, are `bastion_sglang.sgl_kernel_ops.MODULES` and `module_namespace`.

On the GPU machine `scripts/gpu-install.sh` runs `install()` at every interpreter start through a
one-line `.pth` file in site-packages:

    import bastion_sglang.sgl_kernel_finder as m; m.install()

This module imports nothing heavy (torch loads only when `sgl_kernel` is first imported).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

PTH_LINE = "import bastion_sglang.sgl_kernel_finder as m; m.install()\n"
"""The line of the `.pth` file that installs the finder in every interpreter of an environment."""

PACKAGE = "sgl_kernel"


class SglKernelFallbackFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `sgl_kernel` and the submodules the stand-in serves; last in `sys.meta_path`."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        from bastion_sglang.sgl_kernel_ops import MODULES

        if fullname not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == PACKAGE)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"BASTION's torch stand-in for {spec.name} (bastion_sglang)")
        if spec.name == PACKAGE:
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        from bastion_sglang.sgl_kernel_ops import module_namespace

        module.__dict__.update(module_namespace(module.__name__))
        if module.__name__ != PACKAGE:
            setattr(sys.modules[PACKAGE], module.__name__.rsplit(".", 1)[-1], module)


def installed() -> bool:
    """True when the fallback finder is in `sys.meta_path`."""
    return any(isinstance(finder, SglKernelFallbackFinder) for finder in sys.meta_path)


def install() -> None:
    """Append the fallback finder to `sys.meta_path` (idempotent)."""
    if not installed():
        sys.meta_path.append(SglKernelFallbackFinder())


def uninstall() -> None:
    """Remove the fallback finder from `sys.meta_path` (modules it already served stay imported)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, SglKernelFallbackFinder)]
