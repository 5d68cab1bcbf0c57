"""Import SGLang's serving path from a trimmed source tree; run as a script by test_gpu_bundle.py.

    PYTHONPATH=ROOT:tools python tests/offline_gpu/gpu_bundle_imports.py ROOT {cpu,cuda-imports}

ROOT is TRIMMED_ROOT below.

TRIMMED_ROOT (the folder holding the trimmed `sglang/`) must be first on PYTHONPATH, so it shadows any
installed SGLang; the script checks that every `sglang` module came from it. The checkout's `tools/` must be
on PYTHONPATH too (the stand-in finder is `offline_gpu.sgl_kernel_finder`). Modes:
- cpu: BASTION's plugin registration (CPU placeholders), the serving modules, the model classes of the
  dense targets and the drafter, and BASTION's CPU stand-ins installed through SGLang's HookRegistry;
- cuda-imports: torch reports one CUDA device (nothing runs on it), so SGLang's modules take their CUDA
  import branches; `sgl_kernel` is then served by BASTION's stand-in finder (sglang-kernel is absent).
Prints `OK <number of sglang modules>` on success; any failure raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

SERVING_MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.speculative.dflash_worker_v2",
    "bastion_sglang.registration",
    "bastion_sglang.worker",
    "bastion_sglang.step.graphs",
    "sglang.benchmark.one_batch",
    "sglang.kernels.ops.gemm.cutedsl_dual_gemm",
)
CUDA_ONLY_MODULES = (
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
    "sglang.srt.layers.attention.deepseek_v4_backend",
)
"""Imported by SGLang's CUDA graph runners (the DeepSeek-V4 backend while capturing decode graphs); raise at
import on a CPU device."""
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DFlashDraftModel")
TORCHVISION_CPU = Path(__file__).resolve().parents[2] / "scripts" / "torchvision_cpu.py"
"""The CPU environment's torchvision fix (loaded by path, as its `.pth` line does)."""


def define_op_schemas() -> None:
    """`scripts/torchvision_cpu.py`'s `define_op_schemas`: the torchvision op schemas of a CPU torch."""
    spec = importlib.util.spec_from_file_location("bastion_torchvision_cpu", TORCHVISION_CPU)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.define_op_schemas()


def simulate_cuda_imports() -> None:
    """Make torch report one Hopper CUDA device, for module-level branches only (never launch work)."""
    import torch

    define_op_schemas()  # before torch.version.cuda is set: torchvision's CPU import fix checks it
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"
    torch.version.cuda = "13.0"


def main(root: Path, mode: str) -> None:
    if mode == "cuda-imports":
        from offline_gpu import sgl_kernel_finder

        simulate_cuda_imports()
        sgl_kernel_finder.install("tests/offline_gpu/gpu_bundle_imports.py")
    import bastion_sglang

    bastion_sglang.register()
    for name in SERVING_MODULES + (CUDA_ONLY_MODULES if mode == "cuda-imports" else ()):
        importlib.import_module(name)
    from sglang.srt.models.registry import ModelRegistry

    for architecture in ARCHITECTURES:
        model_class, _ = ModelRegistry.resolve_model_cls([architecture])
        assert model_class.__name__ == architecture, (architecture, model_class)
    if mode == "cpu":
        from bastion_sglang.integration.cpu_support import install_bastion_stand_ins

        install_bastion_stand_ins()
    else:
        kernel = sys.modules["sgl_kernel"]
        assert "BASTION" in (kernel.__doc__ or ""), kernel
        sampler = sys.modules["sglang.srt.layers.sampler"]
        assert sampler.top_k_renorm_prob.__module__ == "offline_gpu.sgl_kernel_ops"
    modules = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "sglang"}
    outside = sorted(
        name
        for name, module in modules.items()
        if getattr(module, "__file__", None) and not Path(module.__file__).resolve().is_relative_to(root)
    )
    assert not outside, f"sglang modules loaded from outside {root}: {outside[:5]}"
    print("OK", len(modules))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), sys.argv[2])
