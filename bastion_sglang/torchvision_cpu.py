"""Let PyPI's torchvision import beside a CPU build of torch (SGLang imports torchvision.transforms).

The PyPI torchvision wheel is built against CUDA torch: its `_C` extension cannot load with a CPU torch,
and torchvision's `_meta_registrations` then fails with "operator torchvision::nms does not exist".
Defining the two op schemas it registers unconditionally (`nms`, `qnms`) before torchvision loads makes
the import succeed; the ops themselves stay unavailable (nothing here uses them).

`install()` adds an import hook that does this the first time `torchvision` is imported, only when torch
is a CPU build. `scripts/setup-cpu.sh` runs it at interpreter start-up through a one-line `.pth` file:

    import bastion_sglang.torchvision_cpu as m; m.install()
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

PTH_LINE = "import bastion_sglang.torchvision_cpu as m; m.install()\n"
"""The line of the `.pth` file that installs the hook in every interpreter of an environment."""

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


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
    """Add the hook unless torchvision is already imported or the hook is already there."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionSchemaHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionSchemaHook())
