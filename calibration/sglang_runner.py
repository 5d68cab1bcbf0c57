"""Opening the `sglang` measurement engine for `bastion calibrate`: the target in SGLang's own ModelRunner,
built in this process (what it measures and how: `runner_measurement`).

Why not through the worker. `BastionWorker` (bastion_sglang/worker.py) runs whole decode steps for a
scheduler batch; it has no entry point for "one verify pass of width W at context c". So this module builds
what the worker's verify stage builds, with SGLang's public pieces:

- server arguments of a BASTION deployment (`--speculative-algorithm BASTION`, the drafter path, the
  BastionConfig with N_max = widest pass - 1, page size 1, overlap off), resolved by SGLang, which runs
  BASTION's own `handle_server_args` (the same validation a server start does: backend, drafter fit);
- the target's `ModelRunner` (the DFlash-family spec algorithm makes it capture the drafter's feature
  layers, as in serving), its KV pools sized for the grid, attention backends, no CUDA graphs (every width
  of the grid runs eagerly; a deployment replays captured graphs at its bucket widths, which the online EMA
  absorbs).

On the CPU (torch_native attention) BASTION's CPU stand-ins are installed first (`cpu_support`), as the
scheduler hook does in a CPU server. SGLang's runtime context is process-global: open one engine per
process.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from bastion_sglang.calibration.identity import dtype_name
from bastion_sglang.calibration.random_inputs import CONTEXT_SEED
from bastion_sglang.calibration.runner_measurement import SglangMeasurement
from bastion_sglang.calibration.sweep import BATCH_TOKENS, MIN_CONTEXT

logger = logging.getLogger(__name__)

CPU_MEM_FRACTION = 0.05
"""mem_fraction_static on the CPU, where SGLang's GPU-oriented default would claim most of the host RAM."""


def open_sglang_measurement(
    target_path: str | Path,
    draft_path: str | Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    max_context: int,
    max_width: int,
    max_batch: int = 1,
    load_format: str = "auto",
) -> SglangMeasurement:
    """Build the runtime of the module docstring (server arguments, process groups, the target's
    ModelRunner) in this process and measure on it. max_context, max_width: the grid's largest context
    and widest verify pass (the KV pool holds both, the BastionConfig's N_max is max_width - 1); max_batch:
    the most requests of a batched pass (`sweep`: "Batches"; the pools hold that many at the smallest
    context).
    load_format: SGLang's --load-format (`dummy`: random target weights from its config.json alone)."""
    from bastion_sglang.integration import sglang_adapter

    sglang_adapter.require(sglang_adapter.MEASUREMENT_INTERNALS)  # one error naming all that moved
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    import bastion_sglang
    from bastion_sglang.integration import cpu_support
    from bastion_sglang.integration.config import DEFAULT_TOPK
    from bastion_sglang.registration import attach_config, make_config

    device = torch.device(device)
    bastion_sglang.register()
    budget = max_width - 1
    server_args = ServerArgs(
        model_path=str(target_path),
        speculative_algorithm="BASTION",
        speculative_draft_model_path=str(draft_path),
        device=device.type,
        attention_backend=attention_backend,
        dtype=dtype_name(dtype),
        tp_size=1,
        page_size=1,
        disable_cuda_graph=True,
        disable_overlap_schedule=True,
        max_total_tokens=max(
            max_context + 2 * max_width + 1,  # context, verify window, one spare
            max_batch * (MIN_CONTEXT + 2) + BATCH_TOKENS,  # the batched passes (B · width <= BATCH_TOKENS)
        ),
        max_running_requests=max_batch if max_batch > 1 else None,  # None: SGLang's default for the pool
        mem_fraction_static=CPU_MEM_FRACTION if device.type == "cpu" else None,
        random_seed=CONTEXT_SEED,
        load_format=load_format,
    )
    attach_config(server_args, make_config(max_budget=budget, topk=min(DEFAULT_TOPK, budget)))
    server_args.resolve_once()  # runs BASTION's handle_server_args: ValueError names a bad setting
    port_args = PortArgs.init_new(server_args)
    ranks = SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), gpu_id=0)
    publish(server_args, role="scheduler", ranks=ranks)
    for initialize in (
        initialize_moe_config,
        initialize_fp8_gemm_config,
        initialize_bf16_gemm_config,
        initialize_fp4_gemm_config,
    ):
        initialize()
    if device.type == "cpu":
        cpu_support.install_bastion_stand_ins()
    model_config = ModelConfig.from_server_args(server_args)
    bootstrap.init_parallel_runtime(
        server_args=server_args, device=get_device().device, dist_port=port_args.nccl_port
    )
    bootstrap.init_layer_runtime(model_config=model_config)
    runner = ModelRunner(
        model_config=model_config,
        mem_fraction_static=resolving_view(server_args).mem_fraction_static,
        gpu_id=device.index or 0,
        nccl_port=port_args.nccl_port,
        server_args=server_args,
    )
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    logger.info(
        "SGLang model runner ready: %s attention, KV pool of %d tokens, eager (no CUDA graphs)",
        attention_backend,
        runner.max_total_num_tokens,
    )
    return SglangMeasurement(
        runner, draft_path, device=device, dtype=dtype, max_width=max_width, owns_runtime=True
    )
