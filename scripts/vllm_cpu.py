"""Let plain SGLang build its rotary layers on a CPU device where vllm is not installed.

SGLang 0.5.23's `RotaryEmbedding.__init__` (`layers/rotary_embedding/base.py`) imports
`vllm._custom_ops.rotary_embedding` on a device that is neither CUDA nor SGLang's CPU engine, although it
then runs `forward_native`. The tests compare BASTION with SGLang without speculation on the CPU, and the
bastion plugin only helps processes that serve BASTION (`bastion_sglang.integration.cpu_support`), so the CPU
development and CI environment provides the module itself: a finder placed last on `sys.meta_path` (a real
vllm is found first) that serves `vllm` and `vllm._custom_ops` as placeholders whose functions raise.

This is glue for the CPU development and CI environment, not part of the installed package.
`scripts/setup-cpu.sh` runs `install()` at interpreter start-up through a one-line `.pth` file that loads
this file by its path (`pth_line`); running this file prints that line:

    python scripts/vllm_cpu.py > "$site/bastion_sglang_vllm_cpu.pth"
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

MODULE_NAME = "bastion_vllm_cpu"
"""The name the `.pth` line loads this file under."""

PLACEHOLDER_OPS = ("rotary_embedding", "rms_norm", "fused_add_rms_norm")
"""The `vllm._custom_ops` functions SGLang may import on a plain device; each raises when called."""


def pth_line(path: Path) -> str:
    """The `.pth` line that loads the file at `path` (this module, absolute) and calls its `install()`."""
    return (
        f"import importlib.util as u; s = u.spec_from_file_location({MODULE_NAME!r}, {str(path)!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); m.install()\n"
    )


def _unavailable(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("vllm._custom_ops is a placeholder on this CPU environment; SGLang runs native")


class _VllmPlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `vllm` and `vllm._custom_ops` when no earlier finder does, and loads them as placeholders."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ("vllm", "vllm._custom_ops"):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "vllm")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "vllm":
            module.__path__ = []
            return
        for name in PLACEHOLDER_OPS:
            setattr(module, name, _unavailable)


def install() -> None:
    """Append the finder to `sys.meta_path` unless it is there (recognised by its class name: site-packages
    reached through two paths run the `.pth` line twice, each time loading this file as a new module)."""
    if any(type(f).__qualname__ == _VllmPlaceholderFinder.__qualname__ for f in sys.meta_path):
        return
    sys.meta_path.append(_VllmPlaceholderFinder())


if __name__ == "__main__":
    print(pth_line(Path(__file__).resolve()), end="")
