"""Everything BASTION takes from SGLang's internals, in one place, checked against the pinned version.

SGLang has no stable API below its plugin hooks and `sglang.Engine`; BASTION's worker subclasses its DFlash
worker, reads its private attributes and hooks its functions by dotted name. Each of those is declared here
(`Internal`: a module attribute, or a class and one of its attributes) and this module checks them all when
it is imported: anything that moved raises one `SglangMismatchError` that lists every missing internal with
the installed and the pinned SGLang version, instead of an AttributeError deep in the first decode step.

What goes through this module (decided per kind):
- every underscore name, every private attribute of an SGLang object, every private method the worker
  overrides, and every hook target (`CPU_HOOKS`, `REGISTRATION_HOOKS`): declared, and read or called only
  through the functions below;
- every other attribute the glue reads or writes on an SGLang object (the scheduler's batch and requests,
  model runners, forward batches, results, attention layers, process groups, the runtime configuration
  bags: `STATE_INTERNALS`, `FORWARD_INTERNALS`, `RUNTIME_CONFIG_INTERNALS`) and every keyword it passes to
  an SGLang callable (`Internal.parameters`): declared; a use that reaches through several objects or
  depends on an argument order goes through a function below (`committed_kv_len`, `future_map`, ...);
- what a request refusal reads (`REQUEST_FIELDS`): declared and read directly, never through a default, so
  a renamed field fails the check instead of silently accepting the request;
- the server-argument resolution `registration.py` joins (`RESOLUTION_INTERNALS`);
- the SGLang internals the glue modules import (worker, spec_input, graphs, cpu_support, metrics,
  request_penalties, rank_sync): declared and re-exported from here, so the glue imports them from this
  module;
- calibration's measurement engine set-up (`MEASUREMENT_INTERNALS`: ServerArgs, ModelRunner construction, the
  benchmark prefill): declared and checked by `require` when that engine opens, but not imported here,
  since `sglang.benchmark.one_batch` loads SGLang's whole engine entry point into the serving process.
What stays where it is: SGLang's public surface (`sglang.Engine`, the plugin API of `registration.py`:
`SpeculativeAlgorithm.register`, `HookRegistry`, `CustomSpecAlgo`, its server-argument helpers), and imports
under `TYPE_CHECKING`, which never run. `registration.py`'s hook targets are declared here too, and
`tests/test_sglang_adapter.py` checks that every target it registers is one of them.

Version: `PINNED_VERSION` is the `sglang==` pin of pyproject.toml. Another installed version with every
internal in place imports with a `SglangVersionWarning` (a patch release usually keeps them; the internals
check is the gate that matters); with anything missing the error names both versions.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

PINNED_VERSION = "0.5.23"
"""The SGLang release these internals were read from (pyproject.toml: `sglang==0.5.23`)."""


@dataclass(frozen=True)
class Internal:
    """One SGLang internal: `module.name`, or `attribute` of the class `module.name` (a method, a class
    attribute, a dataclass field, or an instance attribute a method of the class or its bases assigns).

    `parameters`: names BASTION passes to it by keyword (a callable; a class: its constructor); each must be
    a named parameter of its signature, so a renamed one is reported here instead of being swallowed or
    raising a TypeError in the first decode step. BASTION calls SGLang with keywords wherever the order of
    positional parameters would otherwise be an unchecked assumption.
    """

    module: str  # dotted module path, e.g. "sglang.srt.speculative.dflash_worker_v2"
    name: str  # attribute of the module, e.g. "DFlashWorkerV2"
    attribute: str | None = None  # attribute of that class, e.g. "_mask_token_id"
    parameters: tuple[str, ...] = ()  # keyword parameters BASTION passes, e.g. ("device", "spec_algo")

    @property
    def target(self) -> str:
        """The dotted path (what SGLang's HookRegistry takes)."""
        tail = f".{self.attribute}" if self.attribute else ""
        return f"{self.module}.{self.name}{tail}"

    def __str__(self) -> str:
        return f"{self.target}({', '.join(self.parameters)})" if self.parameters else self.target


def _internals(module: str, *names: str) -> tuple[Internal, ...]:
    return tuple(Internal(module, name) for name in names)


def _members(module: str, cls: str, *attributes: str) -> tuple[Internal, ...]:
    return tuple(Internal(module, cls, attribute) for attribute in attributes)


def _call(module: str, name: str, attribute: str | None, *parameters: str) -> Internal:
    return Internal(module, name, attribute, parameters)


_DFLASH = "sglang.srt.speculative.dflash_worker_v2"
_RUNNER = "sglang.srt.model_executor.model_runner"
_FORWARD = "sglang.srt.model_executor.forward_batch_info"
_RUNTIME = "sglang.srt.runtime_context"

_DFLASH_MODELS = "sglang.srt.models.dflash"

SERVING_INTERNALS: tuple[Internal, ...] = (
    *_internals(_DFLASH, "DFlashWorkerV2", "_resolve_dflash_embedding_module"),
    _call(_DFLASH, "_selector_lattice", None, "draft_model", "pred_hidden", "anchor_token_ids"),
    *_members(_DFLASH_MODELS, "DFlashDraftModel", "candidate_selector"),
    *_members(
        _DFLASH_MODELS,
        "DFlash2DraftModel",
        "compute_candidates",
        "_transform_unary_logits",
        "candidate_selector",
        "lm_head",
    ),
    *_members(_DFLASH_MODELS, "CandidateSelector", "build_lattice", "top_k"),
    _call(_DFLASH_MODELS, "_radix_topk", None, "scores", "k"),
    *_internals("sglang.srt.lora.layers", "unwrap_lora_layer"),
    *_members(
        _DFLASH,
        "DFlashWorkerV2",
        "_mask_token_id",
        "_noise_embed_scale",
        "_target_logits_processor",
        "_draft_block_spec_info",
        "_append_target_hidden_to_draft_kv_by_loc",
        "_additional_graph_memory_usage",
        "_additional_graph_time_usage",
        "_maybe_build_draft_sampler",
        "_validate_phase1_sampling_support",
        "forward_batch_generation",
        "init_cuda_graphs",
        "block_size",
        "device",
        "draft_model",
        "draft_model_runner",
        "draft_parallel_layout",
        "model_runner",
        "target_worker",
    ),
    *_members(
        "sglang.srt.layers.logits_processor",
        "LogitsProcessor",
        "is_deferred_shard",
        "finish_deferred_gather",
        "keep_last_hidden_states",
    ),
    *_members(
        _RUNNER,
        "ModelRunner",
        "_get_attention_backend",
        "kv_index_translator",
        "decode_cuda_graph_runner",
        "attn_backend",
        "req_to_token_pool",
        "token_to_kv_pool",
    ),
    *_internals("sglang.srt.layers.logprob_processor", "compute_spec_logprobs"),
    *_internals("sglang.srt.layers.dp_attention", "get_dp_tp_group"),
    *_internals("sglang.srt.managers.utils", "GenerationBatchResult"),
    *_internals(_FORWARD, "CaptureHiddenMode", "ForwardBatch", "ForwardMode", "enable_num_token_non_padded"),
    *_internals(_FORWARD, "get_server_return_hidden_states_mode"),
    *_members(_FORWARD, "ForwardBatch", "init_new", "mark_forward_metadata_ready"),
    *_internals(_RUNTIME, "get_context", "get_disagg", "get_exec", "get_observability"),
    *_internals(_RUNTIME, "get_parallel", "get_schedule", "get_server_args", "get_serving", "get_spec"),
    *_internals("sglang.srt.speculative.draft_worker_common", "make_draft_block_spec_info"),
    *_internals("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm", "SpecInput", "SpecInputType"),
    *_internals(
        "sglang.srt.speculative.spec_utils", "GrammarTree", "build_grammar_vocab_mask", "draft_tp_context"
    ),
    *_internals("sglang.srt.speculative.spec_sampling_mask", "SpeculativeSamplingMaskCapture"),
    *_internals("sglang.srt.mem_cache.allocation", "alloc_for_spec_decode"),
    *_internals("sglang.srt.mem_cache.memory_pool", "KVWriteLoc"),
    *_internals(
        "sglang.srt.model_executor.cuda_graph_config", "Backend", "Phase", "check_cuda_graph_backend"
    ),
    *_internals("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner"),
    *_members(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
        "DecodeCudaGraphRunner",
        "get_spec_info",
        "can_run_graph",
        "load_batch",
        "buffers",
        "captured_req_width",
        "capture_bs",
        "max_bs",
    ),
    *_internals("sglang.srt.utils", "get_available_gpu_memory"),
    *_internals("sglang.srt.layers.radix_attention", "AttentionType"),
    *_internals(
        "sglang.srt.arg_groups.choices",
        "DRAFT_ATTENTION_BACKEND_CHOICES",
        "add_draft_attention_backend_choices",
    ),
    *_internals("sglang.srt.plugins.hook_registry", "HookRegistry", "HookType"),
    *_members("sglang.srt.plugins.hook_registry", "HookRegistry", "_patched"),
    *_internals("sglang.srt.disaggregation.utils", "DisaggregationMode"),
    *_internals(
        "sglang.srt.sampling.penaltylib",
        "BatchedFrequencyPenalizer",
        "BatchedMinNewTokensPenalizer",
        "BatchedPresencePenalizer",
        "BatchedRepetitionPenalizer",
    ),
    *_members(
        "sglang.srt.sampling.sampling_batch_info",
        "SamplingBatchInfo",
        "temperatures",
        "top_ks",
        "top_ps",
        "min_ps",
        "need_top_k_sampling",
        "need_top_p_sampling",
        "need_min_p_sampling",
        "is_all_greedy",
        "logit_bias",
        "grammars",
        "grammar_mask",
        "update_regex_vocab_mask",
        "sampling_mask_batch_indices",
        "sampling_mask_top_ks",
        "sampling_support_logprobs_capture_indices",
    ),
)
"""What the serving glue uses; checked when this module is imported."""

_BATCH = "sglang.srt.managers.schedule_batch"
_SAMPLING_PARAMS = "sglang.srt.sampling.sampling_params"
_TRANSLATOR = "sglang.srt.mem_cache.kv_index_translator"
_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
_FIELDS = "sglang.srt.arg_groups.fields"

STATE_INTERNALS: tuple[Internal, ...] = (
    *_members(
        _BATCH,
        "ScheduleBatch",
        "batch_size",
        "maybe_evict_swa",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "req_to_token_pool",
        "reqs",
        "req_pool_indices",
        "device",
        "forward_mode",
        "spec_info",
        "input_ids",
        "out_cache_loc",
        "seq_lens",
        "seq_lens_cpu",
        "seq_lens_sum",
        "orig_seq_lens",
        "can_run_decode_cuda_graph",
        "is_extend_in_batch",
        "has_grammar",
        "return_logprob",
        "return_hidden_states",
        "return_hidden_states_mode",
        "extend_lens",
        "sampling_info",
    ),
    *_members(
        _BATCH,
        "Req",
        "kv",
        "decode_batch_idx",
        "rid",
        "sampling_params",
        "output_ids",
        "origin_input_ids",
        "tokenizer",
        "eos_token_ids",
        "finished",
    ),
    *_members(_BATCH, "ReqKvInfo", "kv_committed_len", "kv_allocated_len"),
    *_members(
        _SAMPLING_PARAMS,
        "SamplingParams",
        "top_k",
        "temperature",
        "sampling_seed",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "stop_token_ids",
    ),
    *_members(
        "sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator", "page_size", "available_size"
    ),
    *_members("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool", "req_to_token"),
    *_members(
        "sglang.srt.mem_cache.memory_pool",
        "KVCache",
        "set_kv_buffer",
        "get_key_buffer",
        "get_value_buffer",
        "page_size",
        "size",
    ),
    _call("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool", "move_kv_cache", "tgt_loc", "src_loc"),
    _call("sglang.srt.mem_cache.memory_pool", "KVWriteLoc", None, "loc", "swa_loc"),
    _call(
        "sglang.srt.managers.overlap_utils",
        "FutureMap",
        None,
        "device",
        "spec_algo",
        "req_to_token_pool",
        "needs_cpu_seq_lens",
        "needs_confidence_relay",
    ),
    _call(
        "sglang.srt.mem_cache.allocation",
        "alloc_for_spec_decode",
        None,
        "reqs",
        "req_pool_indices",
        "cur_kv_lens",
        "cur_kv_lens_cpu",
        "nxt_kv_lens",
        "nxt_kv_lens_cpu",
        "num_needed_tokens",
        "batch",
    ),
    _call(
        _TRANSLATOR,
        "KVIndexTranslator",
        "plan",
        "req_pool_indices",
        "seq_lens",
        "seq_lens_cpu",
        "write_virtual",
        "read_extent",
    ),
    _call(
        _TRANSLATOR,
        "KVIndexTranslator",
        "pack_read_stream",
        "req_pool_indices",
        "seq_lens",
        "indptr",
        "out",
        "kv_start_idx",
        "kind",
    ),
    *_members("sglang.srt.mem_cache.kv_loc_plan", "KVLocPlan", "bind"),
)
"""The scheduler's batch and requests, their sampling parameters and KV bookkeeping, as the glue reads and
writes them (worker, spec_input, request_penalties, registration's future map); checked at import."""

FORWARD_INTERNALS: tuple[Internal, ...] = (
    *_members(
        _RUNNER,
        "ModelRunner",
        "model_config",
        "model",
        "forward",
        "sample",
        "device",
        "gpu_id",
        "server_args",
        "spec_algorithm",
        "is_draft_worker",
    ),
    *_members("sglang.srt.configs.model_config", "ModelConfig", "dtype", "vocab_size", "hf_config"),
    *_members("sglang.srt.models.dflash", "DFlashDraftModel", "set_block_size"),
    *_members("sglang.srt.managers.tp_worker", "TpModelWorker", "model_runner"),
    _call(
        "sglang.srt.managers.tp_worker",
        "TpModelWorker",
        "forward_batch_generation",
        "batch",
        "forward_batch",
        "is_verify",
    ),
    _call(
        _DFLASH,
        "DFlashWorkerV2",
        "_append_target_hidden_to_draft_kv_by_loc",
        "target_hidden",
        "cache_loc",
        "cache_loc_2d",
        "positions",
        "commit_lens",
    ),
    _call(
        "sglang.srt.speculative.draft_worker_common",
        "make_draft_block_spec_info",
        None,
        "draft_token_num",
        "device",
    ),
    *_members("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend", "init_forward_metadata"),
    *_members(
        _FORWARD,
        "ForwardBatch",
        "forward_mode",
        "batch_size",
        "input_ids",
        "req_pool_indices",
        "seq_lens",
        "out_cache_loc",
        "seq_lens_sum",
        "seq_lens_cpu",
        "positions",
        "input_embeds",
        "spec_algorithm",
        "spec_info",
        "capture_hidden_mode",
        "num_token_non_padded",
        "global_num_token_non_padded_cpu",
        "can_run_decode_cuda_graph",
    ),
    _call(_FORWARD, "ForwardBatch", "init_new", "capture_hidden_mode", "return_hidden_states_before_norm"),
    *_members(_FORWARD, "ForwardMode", "DECODE", "TARGET_VERIFY", "is_extend", "is_target_verify"),
    *_members(_FORWARD, "CaptureHiddenMode", "FULL", "NULL", "need_capture", "is_last"),
    *_members("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm", "DFLASH"),
    *_members("sglang.srt.speculative.spec_info", "SpecInputType", "DFLASH_DRAFT", "DFLASH_VERIFY"),
    *_members(
        "sglang.srt.speculative.spec_info",
        "SpecInput",
        "num_tokens_per_req",
        "num_tokens_for_logprob_per_req",
    ),
    _call("sglang.srt.speculative.spec_info", "SpecInput", "__init__", "spec_input_type"),
    _call(
        "sglang.srt.managers.utils",
        "GenerationBatchResult",
        None,
        "logits_output",
        "next_token_ids",
        "accept_lens",
        "can_run_cuda_graph",
        "next_draft_input",
        "speculative_num_draft_tokens",
        "speculative_output_stride",
        "new_seq_lens",
    ),
    *_members(
        "sglang.srt.layers.logits_processor",
        "LogitsProcessorOutput",
        "next_token_logits",
        "next_token_logprobs",
        "hidden_states",
        "last_hidden_states",
        "sampling_mask_output",
    ),
    _call(
        "sglang.srt.speculative.spec_sampling_mask",
        "SpeculativeSamplingMaskCapture",
        None,
        "target_probs",
        "batch_indices",
        "max_top_k",
        "support_capture_indices",
    ),
    _call(
        "sglang.srt.speculative.spec_sampling_mask",
        "SpeculativeSamplingMaskCapture",
        "build_output",
        "out_tokens",
        "commit_lens",
    ),
    _call("sglang.srt.layers.logprob_processor", "compute_spec_logprobs", None, "chain_stride"),
    _call(
        "sglang.srt.speculative.spec_utils",
        "build_grammar_vocab_mask",
        None,
        "reqs",
        "tree",
        "sampling_info",
        "device",
        "barrier",
    ),
    *_members("sglang.srt.speculative.spec_utils", "GrammarTree", "from_device"),
    *_members("sglang.srt.constrained.base_grammar_backend", "GrammarMask", "apply"),
    _call(
        _GRAPH_RUNNER,
        "DecodeCudaGraphRunner",
        "__init__",
        "model_runner",
        "attn_backend",
        "speculative_num_steps",
        "speculative_num_draft_tokens",
        "record_nolora_graph",
    ),
    *_members(
        "sglang.srt.model_executor.runner_utils.buffers",
        "DecodeInputBuffers",
        "input_ids",
        "positions",
        "custom_mask",
    ),
    *_members(
        "sglang.srt.layers.radix_attention",
        "RadixAttention",
        "sliding_window_size",
        "layer_id",
        "is_cross_attention",
        "attn_type",
        "tp_q_head_num",
        "qk_head_dim",
        "v_head_dim",
        "scaling",
    ),
    *_members("sglang.srt.layers.radix_attention", "AttentionType", "ENCODER_ONLY"),
    *_members(
        "sglang.srt.layers.attention.torch_native_backend",
        "TorchNativeAttnBackend",
        "token_to_kv_pool",
        "swa_out_cache_loc",
        "req_to_token_pool",
    ),
    *_members(
        "sglang.srt.distributed.parallel_state",
        "GroupCoordinator",
        "world_size",
        "rank_in_group",
        "ranks",
        "cpu_group",
        "broadcast",
        "all_gather",
    ),
)
"""The model runners, forward batches and results, attention layers and process groups the glue drives
(worker, spec_input, graphs, cpu_support, rank_sync); checked at import."""

RUNTIME_CONFIG_INTERNALS: tuple[Internal, ...] = (
    _call(_RUNTIME, "RuntimeContext", "override", "source"),
    *_members(_RUNTIME, "ParallelContext", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank", "attn_tp_rank"),
    *_members(
        f"{_FIELDS}.spec",
        "Spec",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
        "speculative_dflash_block_size",
    ),
    *_members(f"{_FIELDS}.schedule", "Schedule", "max_running_requests", "page_size"),
    *_members(f"{_FIELDS}.exec_", "ExecKernel", "sampling_backend"),
    *_members(f"{_FIELDS}.observability", "Observability", "enable_metrics", "extra_metric_labels"),
    *_members(f"{_FIELDS}.serving", "Serving", "served_model_name"),
    *_members(f"{_FIELDS}.disagg", "Disagg", "disaggregation_mode", "enable_pd_role_switch"),
    *_members("sglang.srt.disaggregation.utils", "DisaggregationMode", "to_engine_type"),
)
"""The leaves of SGLang's runtime configuration bags the glue reads (the leaf
`get_spec().speculative_dflash_block_size` is the `Spec` field of that name); checked at import."""

REQUEST_FIELDS: tuple[Internal, ...] = (
    *_members(
        _BATCH,
        "Req",
        "sampling_params",
        "custom_logit_processor",
    ),
    *_members(
        _SAMPLING_PARAMS,
        "SamplingParams",
        "watermark",
        "beam_width",
        "ignore_eos",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "temperature",
        "top_k",
        "stop_strs",
        "stop_token_ids",
        "stop_regex_strs",
    ),
)
"""What `request_support` reads of a request to refuse it: each refusal reads one of these, directly, so a
field SGLang renames fails this check (and the refusal raises) instead of turning the refusal off."""

RESOLUTION_INTERNALS: tuple[Internal, ...] = (
    *_internals("sglang.srt.arg_groups.resolution_hooks", "register_resolution_hook"),
    *_internals("sglang.srt.arg_groups.platform_hook", "handle_cpu_backends"),
    *_internals("sglang.srt.arg_groups.overrides", "declare_resolution", "resolving_view", "model_config_of"),
    *_internals("sglang.srt.utils.hf_transformers_utils", "get_config"),
    *_internals("sglang.srt.speculative.dflash_utils", "parse_dflash_draft_config"),
    *_members(
        "sglang.srt.speculative.dflash_utils",
        "DFlashDraftConfig",
        "selector_rank",
        "output_multiplier",
        "final_logit_softcapping",
        "projector_type",
        "is_domino",
    ),
)
"""The server-argument resolution `registration` joins: the pipeline step it wraps (`handle_cpu_backends`,
named to `register_resolution_hook`), the helpers its handler reads the arguments with, and the drafter
config fields it refuses; checked at import."""

TORCH_NATIVE_FORWARD_EXTEND = Internal(
    "sglang.srt.layers.attention.torch_native_backend", "TorchNativeAttnBackend", "forward_extend"
)
ASSIGN_REQ_TO_TOKEN_POOL = Internal("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool_func")
COPY_ALL_LAYER_KV_CACHE = Internal("sglang.kernels.ops.kvcache.cache_move", "copy_all_layer_kv_cache_func")
EXTEND_FORWARD_KWARGS = Internal(_RUNNER, "ModelRunner", "_extend_forward_kwargs")
LOGITS_OF_PASS = Internal("sglang.srt.layers.logits_processor", "LogitsProcessor", "_get_logits")
LM_HEAD_PRODUCT = Internal("sglang.srt.layers.logits_processor", "LogitsProcessor", "_compute_lm_head")
CPU_HOOKS: tuple[Internal, ...] = (
    TORCH_NATIVE_FORWARD_EXTEND,
    ASSIGN_REQ_TO_TOKEN_POOL,
    COPY_ALL_LAYER_KV_CACHE,
    EXTEND_FORWARD_KWARGS,
    LOGITS_OF_PASS,
    LM_HEAD_PRODUCT,
)
"""Targets of the CPU stand-ins (`cpu_support.install_bastion_stand_ins`)."""

REGISTRATION_HOOKS: tuple[Internal, ...] = (
    Internal("sglang.srt.server_args", "ServerArgs", "add_cli_args"),
    Internal("sglang.srt.server_args", "ServerArgs", "from_cli_args"),
    Internal("sglang.srt.managers.scheduler", "Scheduler", "__init__"),
    Internal("sglang.srt.speculative.dflash_utils", "validate_dflash_request"),
    Internal(_RUNNER, "ModelRunner", "_decode_cuda_graph_runner_cls"),
    Internal("sglang.srt.server_args", "ServerArgs", "resolve_once"),
    Internal(
        "sglang.srt.managers.scheduler_components.output_streamer", "SchedulerOutputStreamer", "stream_output"
    ),
)
"""Targets `registration.register_algorithm` hooks (SGLang's HookRegistry skips a missing one with a log
line, so a moved target would silently drop a BASTION feature)."""

PREPARE_FOR_DECODE = Internal(_BATCH, "ScheduleBatch", "prepare_for_decode")
RUN_BATCH = Internal("sglang.srt.managers.scheduler", "Scheduler", "run_batch")
PROCESS_BATCH_RESULT = Internal("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result")
TP_WORKER_STEP = Internal("sglang.srt.managers.tp_worker", "TpModelWorker", "forward_batch_generation")
INIT_FORWARD_BATCH = Internal(_FORWARD, "ForwardBatch", "init_new")
MODEL_FORWARD = Internal(_RUNNER, "ModelRunner", "forward")
MODEL_SAMPLE = Internal(_RUNNER, "ModelRunner", "sample")
STEP_ANATOMY_HOOKS: tuple[Internal, ...] = (
    PREPARE_FOR_DECODE,
    RUN_BATCH,
    PROCESS_BATCH_RESULT,
    TP_WORKER_STEP,
    INIT_FORWARD_BATCH,
    MODEL_FORWARD,
    MODEL_SAMPLE,
)
"""Targets `step_anatomy_hooks` hooks in a scheduler process that `bastion step-anatomy` started; checked by
`require` when it installs them (a measurement, so not at import)."""

MEASUREMENT_INTERNALS: tuple[Internal, ...] = (
    *_internals("sglang.srt.arg_groups.overrides", "resolving_view"),
    *_internals("sglang.srt.configs.model_config", "ModelConfig"),
    *_internals("sglang.srt.distributed", "bootstrap"),
    *_internals("sglang.srt.distributed.bootstrap", "init_parallel_runtime", "init_layer_runtime"),
    *_internals("sglang.srt.layers.moe", "initialize_moe_config"),
    *_internals("sglang.srt.layers.quantization.fp4_utils", "initialize_fp4_gemm_config"),
    *_internals("sglang.srt.layers.quantization.fp8_utils", "initialize_fp8_gemm_config"),
    *_internals("sglang.srt.layers.quantization.unquant", "initialize_bf16_gemm_config"),
    *_internals(_RUNNER, "ModelRunner"),
    *_members(
        _RUNNER, "ModelRunner", "alloc_memory_pool", "init_attention_backends", "init_cuda_graphs", "forward"
    ),
    *_internals(_RUNTIME, "SpawnRanks", "get_device", "publish", "spawn_world_rank"),
    *_internals("sglang.srt.server_args", "PortArgs", "ServerArgs"),
    *_internals(
        "sglang.benchmark.one_batch",
        "extend",
        "prepare_synthetic_inputs_for_latency_test",
        "TreeCacheNamespace",
    ),
    *_members("sglang.srt.managers.schedule_batch", "ScheduleBatch", "init_new", "prepare_for_extend"),
    *_members("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm", "NONE"),
    *_internals(
        "sglang.srt.distributed.parallel_state", "destroy_distributed_environment", "destroy_model_parallel"
    ),
)
"""What calibration's `sglang` measurement engine uses to build a ModelRunner outside a server and to prefill
prompts on it; checked by `require` when that engine opens or a server calibrates itself at start-up."""


class SglangMismatchError(ImportError):
    """The installed SGLang lacks internals BASTION relies on."""


class SglangVersionWarning(UserWarning):
    """The installed SGLang is not the pinned release (its internals all resolved)."""


def installed_version() -> str | None:
    """The installed SGLang's version, or None when SGLang is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def _assigned_attributes(cls: type) -> frozenset[str]:
    """Names the class's own methods assign on `self` (`self.x = ...`, `self.x: T = ...`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # a builtin or a class without source
        return frozenset()
    return frozenset(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def resolves(internal: Internal) -> bool:
    """Whether `internal` exists in the installed SGLang (imports its module)."""
    try:
        module = importlib.import_module(internal.module)
    except ImportError:
        return False
    if not hasattr(module, internal.name):
        return False
    owner = getattr(module, internal.name)
    if internal.attribute is None:
        return _accepts(owner, internal.parameters)
    if hasattr(owner, internal.attribute):
        return _accepts(getattr(owner, internal.attribute), internal.parameters)
    if not isinstance(owner, type) or internal.parameters:
        return False
    return any(
        internal.attribute in vars(cls).get("__annotations__", {})
        or internal.attribute in _assigned_attributes(cls)
        for cls in owner.__mro__
    )


def _accepts(target: Any, parameters: Sequence[str]) -> bool:
    """Whether the callable `target` (a class: its constructor) has a parameter of each name."""
    if not parameters:
        return True
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # not a callable, or one without a signature
        return False
    return all(name in signature.parameters for name in parameters)


def missing_internals(internals: Sequence[Internal]) -> list[Internal]:
    """The entries of `internals` the installed SGLang does not have, in order."""
    return [internal for internal in internals if not resolves(internal)]


def mismatch_message(missing: Sequence[Internal], installed: str | None, pinned: str = PINNED_VERSION) -> str:
    """The error text naming every missing internal and both versions."""
    lines = "\n".join(f"  - {internal}" for internal in missing)
    return (
        f"BASTION needs SGLang {pinned} (installed: {installed or 'none'}); these SGLang internals are "
        f"missing or moved:\n{lines}\nInstall sglang=={pinned}, or update "
        "bastion_sglang/integration/sglang_adapter.py."
    )


def require(
    internals: Sequence[Internal], installed: str | None = None, pinned: str = PINNED_VERSION
) -> None:
    """Raise SglangMismatchError listing every missing entry of `internals`; warn (SglangVersionWarning) when
    they all resolve on a version other than `pinned`. installed: None reads the installed version."""
    version = installed_version() if installed is None else installed
    missing = missing_internals(internals)
    if missing:
        raise SglangMismatchError(mismatch_message(missing, version, pinned))
    if version != pinned:
        warnings.warn(
            f"BASTION was built against SGLang {pinned}, installed is {version}; every internal it uses "
            "resolved, but their behaviour is not checked",
            SglangVersionWarning,
            stacklevel=2,
        )


IMPORT_CHECKED: tuple[Internal, ...] = (
    *SERVING_INTERNALS,
    *STATE_INTERNALS,
    *FORWARD_INTERNALS,
    *RUNTIME_CONFIG_INTERNALS,
    *REQUEST_FIELDS,
    *RESOLUTION_INTERNALS,
    *CPU_HOOKS,
    *REGISTRATION_HOOKS,
)
"""Everything checked when this module is imported (all but `MEASUREMENT_INTERNALS`)."""

require(IMPORT_CHECKED)

from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES, add_draft_attention_backend_choices
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.overlap_utils import FutureMap
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
    get_server_return_hidden_states_mode,
)
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.models.dflash import _radix_topk
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import (
    get_context,
    get_disagg,
    get_exec,
    get_observability,
    get_parallel,
    get_schedule,
    get_server_args,
    get_serving,
    get_spec,
)
from sglang.srt.sampling import penaltylib
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _selector_lattice
from sglang.srt.speculative.dflash_worker_v2 import (
    _resolve_dflash_embedding_module as resolve_dflash_embedding_module,
)
from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType, SpeculativeAlgorithm
from sglang.srt.speculative.spec_sampling_mask import SpeculativeSamplingMaskCapture
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask, draft_tp_context
from sglang.srt.utils import get_available_gpu_memory

from bastion_sglang import kernels

__all__ = [
    "DRAFT_ATTENTION_BACKEND_CHOICES",
    "AttentionType",
    "Backend",
    "CaptureHiddenMode",
    "DFlashWorkerV2",
    "DecodeCudaGraphRunner",
    "DisaggregationMode",
    "ForwardBatch",
    "ForwardMode",
    "FutureMap",
    "GenerationBatchResult",
    "GrammarTree",
    "HookRegistry",
    "HookType",
    "KVWriteLoc",
    "Phase",
    "SpecInput",
    "SpecInputType",
    "SpeculativeAlgorithm",
    "SpeculativeSamplingMaskCapture",
    "add_draft_attention_backend_choices",
    "alloc_for_spec_decode",
    "build_grammar_vocab_mask",
    "check_cuda_graph_backend",
    "compute_spec_logprobs",
    "draft_tp_context",
    "enable_num_token_non_padded",
    "get_available_gpu_memory",
    "get_context",
    "get_disagg",
    "get_dp_tp_group",
    "get_exec",
    "get_observability",
    "get_parallel",
    "get_schedule",
    "get_server_args",
    "get_server_return_hidden_states_mode",
    "get_serving",
    "get_spec",
    "make_draft_block_spec_info",
    "penaltylib",
    "resolve_dflash_embedding_module",
]


# ---- private attributes of SGLang objects ------------------------------------------------------------


def mask_token_id(worker: DFlashWorkerV2) -> int:
    """The drafter's MASK token id (DFlash resolves it from the drafter config at start-up)."""
    return int(worker._mask_token_id)


def noise_embed_scale(worker: DFlashWorkerV2) -> float:
    """The factor DFlash scales the drafter's input embeddings by (1.0: none)."""
    return float(worker._noise_embed_scale)


def install_draft_block_spec_info(worker: DFlashWorkerV2, block_size: int) -> Any:
    """Replace the spec info of the drafter's block forward (DFlash sizes it by its own block) with one of
    `block_size` tokens per request; returns it."""
    worker._draft_block_spec_info = make_draft_block_spec_info(
        draft_token_num=block_size, device=worker.device
    )
    return worker._draft_block_spec_info


def gathered_verify_logits(worker: DFlashWorkerV2, logits: torch.Tensor) -> torch.Tensor:
    """The target's verify logits [rows, V] whole: DFlash defers the vocabulary gather of its target's
    logits processor under tensor parallelism; this finishes it (`logits` itself when none is deferred)."""
    processor = worker._target_logits_processor
    if processor is not None and processor.is_deferred_shard(logits):
        return processor.finish_deferred_gather(logits)
    return logits


def keep_final_hidden_states(worker: DFlashWorkerV2) -> None:
    """Make the target's logits processor return, beside the drafter's aux hidden states, its final-norm
    hidden states of every position of a pass captured in full (`LogitsProcessorOutput.last_hidden_states`,
    a reference to the tensor the LM head reads: no copy). Call before the target's graphs are captured.
    Raises ValueError when the target has several logits processors (DFlash then finds none)."""
    processor = worker._target_logits_processor
    if processor is None:
        raise ValueError(
            "--speculative-algorithm BASTION returns hidden states only for a target with one logits "
            "processor; start this server without --enable-return-hidden-states / --return-hidden-states-mode"
        )
    processor.keep_last_hidden_states = True


def add_graph_usage(worker: DFlashWorkerV2, name: str, memory_gb: float, seconds: float) -> None:
    """Add captured graphs' memory (GiB) and capture time (seconds) to the worker's graph records under
    `name` (SGLang logs them at start-up)."""
    for record, value in (
        (worker._additional_graph_memory_usage, memory_gb),
        (worker._additional_graph_time_usage, seconds),
    ):
        record[name] = record.get(name, 0.0) + value


def append_target_hidden_to_draft_kv(
    worker: DFlashWorkerV2,
    target_hidden: torch.Tensor,
    cache_loc_2d: torch.Tensor,
    positions: torch.Tensor,
    commit_lens: torch.Tensor,
) -> None:
    """Write the committed positions' target hidden states into the drafter's KV (DFlash's commit path).

    target_hidden: [B * W, H] in slot order; cache_loc_2d: [B, W] int64 slots; positions: [B * W] int64;
    commit_lens: [B] int32 tokens committed per request (only the first commit_lens[b] of row b are kept).
    """
    worker._append_target_hidden_to_draft_kv_by_loc(
        target_hidden=target_hidden,
        cache_loc=cache_loc_2d.reshape(-1),
        cache_loc_2d=cache_loc_2d,
        positions=positions,
        commit_lens=commit_lens,
    )


def target_kv_pool(worker: DFlashWorkerV2) -> KVCache:
    """The target's KV pool (every layer's K and V by slot)."""
    return worker.model_runner.token_to_kv_pool


def move_kv(kv_pool: KVCache, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Copy every layer's KV of slots src_loc onto slots tgt_loc, [N] int64 each (SGLang's `move_kv_cache`: on
    CUDA one Triton launch per 128 or 256 slots, each reading its slots before writing them; on the CPU
    `copy_all_layer_kv_cache_func`, BASTION's host stand-in, pair by pair in order)."""
    kv_pool.move_kv_cache(tgt_loc=tgt_loc, src_loc=src_loc)


def attention_backend_of(model_runner: ModelRunner) -> AttentionBackend:
    """A new attention backend of the kind the model runner uses (each graph runner needs its own)."""
    return model_runner._get_attention_backend()


def set_draft_block_size(worker: DFlashWorkerV2, block_size: int) -> None:
    """Make the DFlash draft model run blocks of `block_size` tokens (root + MASK x (block_size - 1))."""
    worker.draft_model.set_block_size(block_size)


def dflash2_selector(worker: DFlashWorkerV2) -> torch.nn.Module | None:
    """The drafter's candidate selector (SGLang's `CandidateSelector`) when it is a DFlash2 drafter; None for
    a plain DFlash drafter."""
    return worker.draft_model.candidate_selector


def attach_selector_head(worker: DFlashWorkerV2, lm_head: torch.nn.Module) -> None:
    """Point the DFlash2 drafter's `lm_head` at the target's head `lm_head` (a LoRA wrapper unwrapped), which
    `compute_candidates` reads. DFlash does this in `_maybe_build_draft_sampler` (or its eager selector
    path), neither of which BASTION runs."""
    worker.draft_model.lm_head = unwrap_lora_layer(lm_head)


def selector_lattice(
    draft_model: torch.nn.Module, hidden: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's DFlash2 lattice (`_selector_lattice`): `compute_candidates` (the target head's top-K of each
    slot, their unary logits transformed by the drafter's multiplier and softcap) then
    `CandidateSelector.build_lattice` with slot 0 anchored at `anchors`.

    hidden: [B, D, H] the drafter's final hidden states of the D slots; anchors: [B] int64 (the roots).
    Returns candidate ids [B, D, K] int64 and scores [B, D, K, K] float32.
    """
    return _selector_lattice(draft_model=draft_model, pred_hidden=hidden, anchor_token_ids=anchors)


def lattice_of_head_logits(
    draft_model: torch.nn.Module, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`selector_lattice` on head logits the caller computed (the LM head applied once per step): SGLang's
    `compute_candidates` on one rank after its matmul (`_radix_topk` of the raw logits, their K values
    transformed by `_transform_unary_logits`), then `CandidateSelector.build_lattice` with slot 0 anchored at
    `anchors`, as `_selector_lattice` calls it.

    logits: [B, D, V] raw head logits of `hidden` over the base vocabulary, contiguous (the matmul SGLang's
    `_project_candidate_logits` makes on one rank); hidden: [B, D, H]; anchors: [B] int64 (the roots).
    Returns candidate ids [B, D, K] int64 and scores [B, D, K, K] float32. `logits` is not modified.
    """
    bs, slots, vocab = logits.shape
    values, ids = _radix_topk(logits.reshape(-1, vocab), draft_model.candidate_selector.top_k)
    candidate_ids = ids.long().view(bs, slots, -1)
    return candidate_ids, draft_model.candidate_selector.build_lattice(
        candidate_ids=candidate_ids,
        unary_logits=draft_model._transform_unary_logits(values).view(bs, slots, -1),
        hidden_states=hidden,
        anchor_token_ids=anchors,
    )


def transform_unary_logits(draft_model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """A DFlash2 drafter's transform of raw head logits [..., V] (`_transform_unary_logits`: the output
    multiplier, then the softcap); float32 [..., V], computed in place when `logits` is float32 already."""
    return draft_model._transform_unary_logits(logits)


def kv_index_translator(model_runner: ModelRunner) -> KVIndexTranslator:
    """The model runner's KV index translator (plans a forward's KV slots, binds them to a ForwardBatch)."""
    return model_runner.kv_index_translator


def target_forward(target_worker: TpModelWorker, forward_batch: ForwardBatch) -> GenerationBatchResult:
    """The target's forward of a ForwardBatch prepared (attention planned) for a verify or decode pass:
    logits of every row and, as the batch's capture mode asks, hidden states."""
    return target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)


def plain_lm_head_product(processor: Any, lm_head: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether SGLang's `LogitsProcessor._compute_lm_head` computes `processor`'s logits of `hidden_states` as
    the plain product hidden @ lm_head.weight.T on the CPU: no LoRA wrapper, no quantized head, no fp32 head,
    no AMX-packed weight, no RL on-policy cast (its last branch)."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
    from sglang.srt.utils.common import use_intel_amx_backend

    return (
        hidden_states.device.type == "cpu"
        and hasattr(lm_head, "weight")
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not processor.use_fp32_lm_head
        and not use_intel_amx_backend(lm_head)
        and processor.rl_on_policy_target is None
    )


def hook_applied(target: Internal) -> bool:
    """Whether SGLang's HookRegistry has patched `target`."""
    return target.target in HookRegistry._patched


# ---- the scheduler's batch and requests -----------------------------------------------------------------


def maybe_evict_swa(batch: ScheduleBatch) -> None:
    """SGLang's sliding-window KV eviction, run before a decode step allocates (no-op without such layers)."""
    batch.maybe_evict_swa()


def committed_kv_len(req: Req) -> int:
    """Tokens of `req` whose KV is committed in the cache (SGLang's `req.kv.kv_committed_len`)."""
    return int(req.kv.kv_committed_len)


def allocated_kv_len(req: Req) -> int:
    """KV slots allocated to `req`, committed or not (SGLang's `req.kv.kv_allocated_len`)."""
    return int(req.kv.kv_allocated_len)


def free_kv_slots(batch: ScheduleBatch) -> int:
    """KV slots the batch's allocator can hand out without evicting the prefix cache."""
    return int(batch.token_to_kv_pool_allocator.available_size())


def count_decode_step(reqs: Sequence[Req]) -> None:
    """Advance each request's decode-step counter (`Req.decode_batch_idx`), as SGLang's own decode
    preparation does once per decode step."""
    for req in reqs:
        req.decode_batch_idx += 1


def future_map(
    device: torch.device,
    spec_algorithm: Any,
    req_to_token_pool: ReqToTokenPool,
    needs_cpu_seq_lens: bool,
    needs_confidence_relay: bool,
) -> FutureMap:
    """SGLang's overlap-scheduler relay (`FutureMap`), built by keyword (its parameters are declared)."""
    return FutureMap(
        device=device,
        spec_algo=spec_algorithm,
        req_to_token_pool=req_to_token_pool,
        needs_cpu_seq_lens=needs_cpu_seq_lens,
        needs_confidence_relay=needs_confidence_relay,
    )


# ---- SGLang's sampling batch --------------------------------------------------------------------------


def target_sampling_probs(
    logits: torch.Tensor, sampling_info: SamplingBatchInfo, width: int, sampling_backend: str
) -> torch.Tensor:
    """The distribution SGLang's sampler draws from after each verify position (`kernels.processed_probs`
    with the filter rule of this batch and SGLang's `sampling_backend`).

    logits: [B * W, V] float (penalties, grammar masks and biases applied). Returns [B, W, V] unnormalised
    non-negative weights (sampling normalises). Each request's parameters ([B, 1] temperatures, [B] top-k,
    top-p, min-p) broadcast over its W positions as [B, 1] views, without a copy per position.
    """
    rows, vocab = logits.shape
    batch = rows // width

    def per_request(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(batch, -1)[:, :1]  # [B, 1], a view

    rule = kernels.filter_rule(
        sampling_backend,
        sampling_info.need_top_k_sampling or sampling_info.need_top_p_sampling,
        sampling_info.need_min_p_sampling,
    )
    return kernels.processed_probs(
        logits.view(batch, width, vocab),
        per_request(sampling_info.temperatures),
        per_request(sampling_info.top_ks),
        per_request(sampling_info.top_ps),
        per_request(sampling_info.min_ps),
        rule,
    )
