"""The `sglang` measurement engine: the target in SGLang's own ModelRunner, verified as BASTION's worker does.

Why not through the worker. `BastionWorker` (bastion_sglang/worker.py) runs whole decode steps for a
scheduler batch; it has no entry point for "one verify pass of width W at context c". So this module builds
what the worker's verify stage builds, with SGLang's public pieces:

- server arguments of a BASTION deployment (`--speculative-algorithm BASTION`, the drafter path, the
  BastionConfig with N_max = widest pass - 1, page size 1, overlap off), resolved by SGLang, which runs
  BASTION's own `handle_server_args` (the same validation a server start does: backend, drafter fit);
- the target's `ModelRunner` (the DFlash-family spec algorithm makes it capture the drafter's feature
  layers, as in serving), its KV pools sized for the grid, attention backends, no CUDA graphs (every width
  of the grid runs eagerly; a deployment replays captured graphs at its bucket widths, which the online EMA
  absorbs);
- context: a prefill of c random tokens through SGLang's benchmark `extend` (sglang.benchmark.one_batch);
- verify: `spec_input.prepare_verify_forward` with `kernels.flat_custom_mask` (forward batch and attention
  metadata, the worker's own preparation), then `ModelRunner.forward`, timed from the preparation on;
- decode (L_AR): a DECODE forward of one token at position c, greedy pick;
- T_draft: the reference engine's DFlash drafter (`bastion_sglang.reference`) on the same device, reading
  the SGLang target's embedding and LM head weights; its context K/V come from random features (values do
  not change the cost). The worker drafts through SGLang's DFlash draft runner instead, which has no
  single-pass entry point either; the FLOPs and bytes are the same, the kernels are not.

On the CPU (torch_native attention) BASTION's CPU stand-ins are installed first (`cpu_support`), as the
scheduler hook does in a CPU server. SGLang's runtime context is process-global: open one engine per
process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from bastion_sglang.calibration.identity import dtype_name
from bastion_sglang.calibration.random_inputs import CONTEXT_SEED
from bastion_sglang.kernels.types import DraftTopK, TreeBatch, VerifyLayout

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from bastion_sglang.reference import DFlashProposer

logger = logging.getLogger(__name__)

CPU_MEM_FRACTION = 0.05
"""mem_fraction_static on the CPU, where SGLang's GPU-oriented default would claim most of the host RAM."""


class SglangMeasurement:
    """The `sglang` engine (module docstring). max_context, max_width: the grid's largest context and
    widest verify pass (the KV pool holds both, the BastionConfig's N_max is max_width - 1)."""

    needs_flat_mask = True

    def __init__(
        self,
        target_path: str | Path,
        draft_path: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
        max_context: int,
        max_width: int,
    ) -> None:
        from bastion_sglang import sglang_adapter

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
        from bastion_sglang import cpu_support
        from bastion_sglang.config import DEFAULT_TOPK
        from bastion_sglang.registration import attach_config, make_config

        self._device = torch.device(device)
        self._max_width = max_width
        bastion_sglang.register()
        budget = max_width - 1
        server_args = ServerArgs(
            model_path=str(target_path),
            speculative_algorithm="BASTION",
            speculative_draft_model_path=str(draft_path),
            device=self._device.type,
            attention_backend=attention_backend,
            dtype=dtype_name(dtype),
            tp_size=1,
            page_size=1,
            disable_cuda_graph=True,
            disable_overlap_schedule=True,
            max_total_tokens=max_context + 2 * max_width + 1,  # context, verify window, one spare
            mem_fraction_static=CPU_MEM_FRACTION if self._device.type == "cpu" else None,
            random_seed=CONTEXT_SEED,
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
        if self._device.type == "cpu":
            cpu_support.install_bastion_stand_ins()
        model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_parallel_runtime(
            server_args=server_args, device=get_device().device, dist_port=port_args.nccl_port
        )
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=resolving_view(server_args).mem_fraction_static,
            gpu_id=self._device.index or 0,
            nccl_port=port_args.nccl_port,
            server_args=server_args,
        )
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()
        self._runner = runner
        self._vocab = int(model_config.vocab_size)
        self._batch: ScheduleBatch | None = None
        self._context = 0
        self._slots = torch.empty(0, dtype=torch.int64, device=self._device)  # [max_width] verify KV slots
        self._prefix = torch.zeros(1, dtype=torch.int64, device=self._device)  # [1] committed tokens
        self._prefix_cpu = torch.zeros(1, dtype=torch.int64)  # [1] host copy
        self._committed = torch.zeros(1, dtype=torch.int64, device=self._device)  # [context + 1] tokens
        self._no_features = torch.empty(0)  # [0, F·h] drafter features: nothing new to ingest
        self._proposer = _drafter_on_target(draft_path, runner, self._vocab, self._device, dtype)
        logger.info(
            "SGLang model runner ready: %s attention, KV pool of %d tokens, eager (no CUDA graphs)",
            attention_backend,
            runner.max_total_num_tokens,
        )

    @property
    def device(self) -> torch.device:
        return self._device

    def vocab_size(self) -> int:
        return self._vocab

    @torch.no_grad()
    def set_context(self, context: int) -> None:
        from sglang.benchmark.one_batch import extend, prepare_synthetic_inputs_for_latency_test

        from bastion_sglang.reference import DraftInput

        runner = self._runner
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        generator = np.random.default_rng(CONTEXT_SEED)
        tokens = generator.integers(0, self._vocab, context + 1).tolist()
        reqs = prepare_synthetic_inputs_for_latency_test(1, context, custom_inputs=[tokens[:context]])
        _, _, batch = extend(reqs, runner)
        slots = runner.token_to_kv_pool_allocator.alloc(self._max_width)
        if slots is None:
            raise ValueError(f"SGLang's KV pool cannot hold {context} + {self._max_width} tokens")
        rows = batch.req_pool_indices.to(torch.int64)
        pool = runner.req_to_token_pool.req_to_token
        pool[rows, context : context + self._max_width] = slots.to(pool.dtype)
        self._batch, self._context, self._slots = batch, context, slots.to(torch.int64)
        self._prefix = batch.seq_lens.clone()
        self._prefix_cpu = batch.seq_lens_cpu.clone()
        self._committed = torch.tensor(tokens, dtype=torch.int64, device=self._device)
        self._proposer.start(context + 1)
        features_generator = torch.Generator(device=self._device).manual_seed(CONTEXT_SEED)
        fc = self._proposer.drafter.fc
        features = torch.randn(
            (context, fc.in_features),
            device=self._device,
            dtype=fc.weight.dtype,
            generator=features_generator,
        )
        self._proposer.propose(DraftInput(self._committed, features), 1)  # ingests the context
        self._no_features = features[:0]

    @torch.no_grad()
    def draft(self, k: int) -> DraftTopK:
        from bastion_sglang.reference import DraftInput

        return self._proposer.propose(DraftInput(self._committed, self._no_features), k)

    def _require_batch(self) -> ScheduleBatch:
        if self._batch is None:
            raise ValueError("set_context must run before a forward")
        return self._batch

    @torch.no_grad()
    def verify(self, rows: TreeBatch, layout: VerifyLayout) -> None:
        from bastion_sglang import kernels
        from bastion_sglang.spec_input import prepare_verify_forward

        batch = self._require_batch()
        mask = kernels.flat_custom_mask(layout.ancestor_mask, self._prefix, seq_lens_sum=self._context)
        slots = self._slots[None, : rows.width]  # [1, W]
        forward_batch, _ = prepare_verify_forward(
            batch, self._runner, rows.tokens, layout.positions, mask, slots, self._prefix_cpu
        )
        self._runner.forward(forward_batch)

    @torch.no_grad()
    def decode(self) -> None:
        from bastion_sglang.sglang_adapter import ForwardBatch, ForwardMode

        batch = self._require_batch()
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = None
        batch.input_ids = self._committed[self._context :]
        batch.out_cache_loc = self._slots[:1]
        batch.seq_lens = self._prefix + 1
        batch.seq_lens_cpu = self._prefix_cpu + 1
        batch.orig_seq_lens = batch.seq_lens.to(batch.orig_seq_lens.dtype)
        batch.seq_lens_sum = None
        forward_batch = ForwardBatch.init_new(batch, self._runner, return_hidden_states_before_norm=False)
        out = self._runner.forward(forward_batch)
        torch.argmax(out.logits_output.next_token_logits, dim=-1)

    def discard(self) -> None:
        """Back to the committed prefix (verify and decode only wrote the reserved slots)."""
        batch = self._require_batch()
        batch.seq_lens = self._prefix.clone()
        batch.seq_lens_cpu = self._prefix_cpu.clone()
        batch.orig_seq_lens = batch.seq_lens.to(batch.orig_seq_lens.dtype)
        batch.seq_lens_sum = self._context

    def close(self) -> None:
        """Tear down SGLang's process groups."""
        from sglang.srt.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


def _drafter_on_target(
    draft_path: str | Path, runner: ModelRunner, vocab: int, device: torch.device, dtype: torch.dtype
) -> DFlashProposer:
    """The reference DFlash drafter for T_draft (module docstring) on the SGLang target's embedding and
    LM head weights (no copy)."""
    from bastion_sglang.reference import DFlashDrafter, DFlashProposer

    model = runner.model
    layers = int(runner.model_config.hf_config.num_hidden_layers)
    drafter = DFlashDrafter.from_pretrained(draft_path, device=device, dtype=dtype, target_num_layers=layers)
    head_weight = model.lm_head.weight[:vocab]
    head = nn.Linear(head_weight.shape[1], vocab, bias=False, device="meta")
    head.weight = nn.Parameter(head_weight, requires_grad=False)
    return DFlashProposer(drafter, model.get_input_embeddings(), head)
