"""SGLang 0.5.23's DFLASH worker (`DFlashWorkerV2`) on a plain CPU, for the bench's `dflash` Engines only.

SGLang runs DFLASH on CUDA, NPU and XPU. `bastion bench --policies dflash` on the CPU runs SGLang's own
worker unchanged (its drafting, its verify at block size, its greedy chain acceptance and its commit) with the
stand-ins below, each for one thing the CPU lacks. Nothing here is installed by the served plugin: the bench
calls `install_in_bench_process` before it builds a `dflash` Engine's ServerArgs, and the marker
`dflash_engine.mark_dflash_engine` puts on that record runs `install_in_scheduler_process` in each scheduler
process the Engine spawns, before the scheduler builds its models. A BASTION or `ar` Engine's record carries
no marker, so its processes get nothing from here.

In the bench process (where SGLang resolves the server arguments):
- **the device check**: `_handle_dflash` refuses every device but CUDA, NPU and XPU; around it, SGLang's
  platform reads as one that supports DFLASH and the draft backends in SGLang's own list
  (`CpuDflashPlatform`), so the rest of the handler (steps 1, topk 1, the drafter's block size, the draft
  attention backend, 48 running requests) runs as on CUDA;
- **the draft attention backend**: `torch_native` joins SGLang's draft backend choices, else the drafter
  falls back to flashinfer;
- **import placeholders** for torchvision and `vllm._custom_ops` (`cpu_support`: resolution imports SGLang's
  multimodal configs; the rotary layer imports vllm off CUDA).

In each scheduler process:
- BASTION's CPU stand-ins (`cpu_support.install_bastion_stand_ins`): the `torch_native` TARGET_VERIFY branch
  (SGLang's backend has none; DFLASH's verify is causal over its block, the drafter's block attends to all of
  it), the torch `assign_req_to_token_pool`, the host KV row copy, `input_embeds` in the model's dtype (the
  drafter's block arrives as bf16 embeddings otherwise) and the draft backend choice;
- **`Tensor.record_stream` on a CPU tensor does nothing** (`DFlashWorkerV2.forward_batch_generation` records
  `seq_lens` on the current stream; `torch.cpu.Stream` is not a `torch.Stream`, so the call raises);
- **`assign_extend_cache_locs_func` by a torch gather** (SGLang's runs Triton on CUDA, sgl-kernel on its CPU
  engine, and returns None on a plain torch CPU; DFLASH's verify takes its KV slots from it).

DFLASH's CPU sampling path verifies greedily whatever the temperature, so the bench runs `dflash` on the CPU
at T = 0 only (`plan.check_dflash_on_cpu`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bastion_sglang.integration import cpu_support
from bastion_sglang.integration.config import CPU_ATTENTION_BACKEND

logger = logging.getLogger(__name__)

DFLASH = "DFLASH"
HANDLE_DFLASH = ("sglang.srt.arg_groups.speculative_hook", "_handle_dflash")
EXTEND_CACHE_LOCS = "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_func"
_PATCHED = "_bastion_bench_dflash_cpu"
"""Attribute set on each function this module installs, so a second install is a no-op."""


class CpuDflashPlatform:
    """SGLang's `current_platform` as `_handle_dflash` reads it on the CPU: out of tree, supporting DFLASH and
    exactly the draft attention backends of SGLang's list, `torch_native` the default. Every other attribute
    is the real platform's."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == DFLASH

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

        return algorithm == DFLASH and backend in DRAFT_ATTENTION_BACKEND_CHOICES

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return CPU_ATTENTION_BACKEND

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


@contextlib.contextmanager
def _platform_admitting_cpu(module: Any) -> Iterator[None]:
    """`module.current_platform` is a `CpuDflashPlatform` over the real one inside the block."""
    real = module.current_platform
    module.current_platform = CpuDflashPlatform(real)
    try:
        yield
    finally:
        module.current_platform = real


def _handle_dflash_on_cpu(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """SGLang's `_handle_dflash`, run with the platform admitting the CPU when the device is the CPU."""
    import sglang.srt.arg_groups.speculative_hook as hook

    def handle(server_args: Any) -> None:
        from sglang.srt.arg_groups.overrides import resolving_view

        if not str(resolving_view(server_args).device or "").startswith("cpu"):
            original(server_args)
            return
        with _platform_admitting_cpu(hook):
            original(server_args)

    setattr(handle, _PATCHED, True)
    return handle


def add_cpu_draft_backend() -> None:
    """`torch_native` joins SGLang's draft attention backend choices (idempotent)."""
    from sglang.srt.arg_groups.choices import (
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_draft_attention_backend_choices,
    )

    if CPU_ATTENTION_BACKEND not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([CPU_ATTENTION_BACKEND])


def install_in_bench_process() -> None:
    """What resolving a CPU `dflash` Engine's server arguments needs in this process (idempotent): the
    import placeholders, the draft backend choice, `_handle_dflash` admitting the CPU."""
    import importlib

    cpu_support.install_import_placeholders()
    add_cpu_draft_backend()
    module = importlib.import_module(HANDLE_DFLASH[0])
    original = getattr(module, HANDLE_DFLASH[1])
    if not getattr(original, _PATCHED, False):
        setattr(module, HANDLE_DFLASH[1], _handle_dflash_on_cpu(original))


def record_stream_skipping_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Tensor.record_stream` that does nothing for a CPU tensor (no stream owns host memory)."""

    def record_stream(tensor: torch.Tensor, stream: Any) -> Any:
        if tensor.device.type == "cpu":
            return None
        return original(tensor, stream)

    setattr(record_stream, _PATCHED, True)
    return record_stream


def assign_extend_cache_locs_torch(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device: Any,
) -> torch.Tensor:
    """Stands in for `sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_func`.

    Returns [batch_size · draft_token_num] int64: request i's KV slots at positions start_offset[i] ..
    start_offset[i] + draft_token_num - 1, read from req_to_token[req_pool_indices[i]] (end_offset is that
    end; every request writes draft_token_num slots, as the Triton kernel's output is laid out).
    """
    del end_offset, device
    if batch_size == 0:
        return torch.empty((0,), dtype=torch.int64, device=req_to_token.device)
    offsets = torch.arange(draft_token_num, device=req_to_token.device)
    positions = start_offset[:batch_size].to(torch.int64).unsqueeze(1) + offsets
    rows = req_pool_indices[:batch_size].to(torch.int64).unsqueeze(1)
    return req_to_token[rows, positions].to(torch.int64).reshape(-1)


def install_in_scheduler_process() -> None:
    """What SGLang's DFLASH worker needs in a CPU scheduler process (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    cpu_support.install_bastion_stand_ins()
    if not getattr(torch.Tensor.record_stream, _PATCHED, False):
        torch.Tensor.record_stream = record_stream_skipping_cpu(torch.Tensor.record_stream)
    if EXTEND_CACHE_LOCS not in HookRegistry._patched:
        HookRegistry.register(EXTEND_CACHE_LOCS, assign_extend_cache_locs_torch, HookType.REPLACE)
        HookRegistry.apply_hooks()
    if EXTEND_CACHE_LOCS not in HookRegistry._patched:
        raise RuntimeError(f"the bench could not replace {EXTEND_CACHE_LOCS} for DFLASH on the CPU")
