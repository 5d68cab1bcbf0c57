"""Let PyPI's torchvision import beside a CPU build of torch (SGLang imports torchvision.transforms).

The PyPI torchvision wheel is built against CUDA torch: its `_C` extension cannot load with a CPU torch,
and torchvision's `_meta_registrations` then fails with "operator torchvision::nms does not exist".
Defining the two op schemas it registers unconditionally (`nms`, `qnms`) before torchvision loads makes
the import succeed; the ops themselves stay unavailable (nothing here uses them).

This is glue for the CPU development and CI environment, not part of the installed package.
`install()` adds an import hook that does this the first time `torchvision` is imported, only when torch
is a CPU build. `scripts/setup-cpu.sh` runs it at interpreter start-up through a one-line `.pth` file that
loads this file by its path (`pth_line`); running this file prints that line:

    python scripts/torchvision_cpu.py > "$site/bastion_sglang_cpu.pth"
"""

from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

MODULE_NAME = "bastion_torchvision_cpu"
"""The name the `.pth` line loads this file under."""

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def pth_line(path: Path) -> str:
    """The `.pth` line that loads the file at `path` (this module, absolute) and calls its `install()`."""
    return (
        f"import importlib.util as u; s = u.spec_from_file_location({MODULE_NAME!r}, {str(path)!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); m.install()\n"
    )


class _TorchvisionSchemaHook(importlib.abc.MetaPathFinder):
    """Runs once, on the first import of torchvision, then lets the normal finders load it."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        define_op_schemas()
        return None


def define_op_schemas() -> None:
    """Define torchvision::nms and torchvision::qnms when torch has no CUDA (no-op when already defined)."""
    import torch

    if torch.version.cuda is not None:
        return
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", _SCHEMA)
        except RuntimeError as error:  # already defined by an earlier call
            if "multiple times" not in str(error):
                raise


def install() -> None:
    """Add the hook unless torchvision is already imported or the hook is already there.

    The hook is recognised by its class name: site-packages reached through two paths (a venv's `lib64`
    link) run the `.pth` line twice, and each run loads this file as a new module with a new class.
    """
    hooked = any(type(f).__qualname__ == _TorchvisionSchemaHook.__qualname__ for f in sys.meta_path)
    if "torchvision" in sys.modules or hooked:
        return
    sys.meta_path.insert(0, _TorchvisionSchemaHook())


if __name__ == "__main__":
    print(pth_line(Path(__file__).resolve()), end="")
