"""BASTION's SGLang worker: DFlash drafting, best-first trees, one tree-masked verify pass per step.

One decode step for a batch of B requests (each with prefix L_b and root = its bonus token):
1. draft: the DFlash drafter runs on [root, MASK x (γ-1)] at positions L_b..L_b+γ-1 (SGLang's DFlash
   draft path); the target's LM head turns positions 1..h into logits [B, h, V], h <= γ-1 the draft
   horizon (`controller.horizon`: as deep as the recent trees went); `kernels.topk_logprobs` keeps K
   candidates per position.
2. plan: `controller.build_trees` (best-first, N_max nodes), `controller.plan_batch` (one width W for the
   batch), `kernels.flatten_trees` / `build_verify_layout` / `flat_custom_mask`.
3. verify: the target's TARGET_VERIFY forward over the B x W tokens, slots req_to_token[r, L : L + W].
4. accept: each node's logits get the request's output penalties (repetition, frequency, presence,
   min_new_tokens) for the output so far plus the node's own path (`kernels.apply_tree_penalties`), then
   structured-output requests mask them by their grammar along the node's path (SGLang's `GrammarTree`
   over the first-child / next-sibling links), then the request's logit_bias is added: SGLang's order.
   T = 0: `kernels.accept_greedy`; otherwise `kernels.accept_sampling` on the target's processed
   distribution (temperature, top-k, top-p, min-p exactly as SGLang's sampler filters them) with uniforms
   hashed from the request's seed and the sequence position (`kernels.position_uniforms`: seeded output is
   batch-invariant). Emitted: the accepted nodes' tokens, then the bonus (a target sample).
5. commit: the accepted nodes' slots are moved to the front of the window by permuting the request's
   slot ids (no KV is copied; the rejected slots stay in the request's reserve), the accepted positions'
   target hidden states become drafter KV, and the latency model observes the measured verify seconds.

Everything DFlash-specific that is not BASTION's (loading the drafter, its KV pool, the prefill path that
fills the drafter KV from the prompt) is inherited from SGLang's `DFlashWorkerV2`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import kernels
from bastion_sglang import sglang_adapter as sgl
from bastion_sglang.calibration.identity import RuntimeIdentity, model_config_hash
from bastion_sglang.calibration.lookup import (
    ResolvedProfile,
    resolve_acceptance,
    resolve_latency_profile,
)
from bastion_sglang.calibration.lookup import build_latency_model as build_calibrated_latency_model
from bastion_sglang.calibration.microbench import datasheet_or_measured, measure_peaks
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.config import BastionConfig, config_of
from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceTracker, node_log_scores
from bastion_sglang.controller.batched import DraftTreeBatch, build_trees_auto_unchecked
from bastion_sglang.controller.gate import (
    DraftedStep,
    DraftEvidence,
    SpeculationGate,
    horizon_gain,
    speculation_ceiling,
)
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.policies import plain_plan, plan_batch
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import HardwareSpec
from bastion_sglang.controller.step_costs import COLD_STEPS, StepCostTracker, draft_seconds_per_request
from bastion_sglang.draft_context import ContextRows, DeferredDraftContext
from bastion_sglang.draft_protocols import load_draft_logits_rewriter
from bastion_sglang.graph_buckets import (
    VerifyPass,
    VerifyShape,
    padded_verify_pass,
    planning_widths,
    real_rows,
)
from bastion_sglang.graphs import VerifyGraphs, capture_verify_graphs, planned_graph_widths
from bastion_sglang.metrics import (
    BastionMetrics,
    SpeedupLedger,
    scheduler_metric_labels,
)
from bastion_sglang.rank_sync import DraftHead, RankSync, scheduler_group
from bastion_sglang.request_penalties import (
    RecentOutputs,
    has_output_penalty,
    output_penalties,
    sglang_penalty_order,
)
from bastion_sglang.sglang_adapter import (
    CaptureHiddenMode,
    DFlashWorkerV2,
    ForwardBatch,
    ForwardMode,
    GenerationBatchResult,
    GrammarTree,
    SpeculativeAlgorithm,
    build_grammar_vocab_mask,
    compute_spec_logprobs,
    draft_tp_context,
    enable_num_token_non_padded,
    get_exec,
    get_observability,
    get_parallel,
    get_schedule,
    get_spec,
    target_sampling_probs,
)
from bastion_sglang.spec_input import BastionDraftInput, prepare_verify_forward
from bastion_sglang.timing import StageTimer, TimedStep

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_HARDWARE = HardwareSpec(name="cpu", peak_flops=1.0e11, bandwidth=2.0e10)
"""Roofline peaks assumed on a CPU: 100 GFLOP/s and 20 GB/s, the order of a small x86 server under
PyTorch. Only the shape of the uncalibrated roofline depends on them; the EMA factor rescales it."""


PLAIN_DECODE_FIELDS = (
    "forward_mode",
    "spec_info",
    "input_ids",
    "out_cache_loc",
    "seq_lens",
    "seq_lens_cpu",
    "orig_seq_lens",
    "seq_lens_sum",
)
"""The scheduler batch's fields `BastionWorker._decode_plain` sets for its DECODE forward and restores."""


@dataclass(frozen=True)
class PendingStep:
    """A decode step's plan, waiting for its accepted counts (`BastionWorker.on_verify_complete_cpu`)."""

    index: int  # decode steps of this worker before it
    expected_drafted: list[float]  # [B] the plan's calibrated expected accepted drafts per request
    greedy: list[bool]  # [B] whether each request decodes greedily
    scales: list[float]  # [B] acceptance corrections the plan used


DRAFT_SHAPE_CONTEXT = 256
"""Cached tokens per request at which the target's latency model shapes the prior drafter cost over batch
sizes (`controller.step_costs.draft_seconds_per_request`)."""


PENDING_STEPS = 4
"""Decode steps whose accepted counts may be outstanding at once: one without overlap scheduling, two with
it (SGLang processes a step's result after launching the next); more means a result never came back, and the
oldest plans are dropped."""


@dataclass(frozen=True)
class StepRecord:
    """What a decode step's measured times are matched with (one step late on CUDA)."""

    index: int  # decode steps of this worker before it
    widths: list[int]  # [B] verify width per request (the padded W_v)
    contexts: list[int]  # [B] cached tokens per request
    estimated_verify_seconds: float  # the plan's prediction for the verify pass
    other_seconds: float | None  # host seconds since the previous decode step ended (None: none just before)
    drafted: bool  # whether the drafter ran


def worker_latency_model(
    config: BastionConfig,
    server_args: ServerArgs,
    target_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    width_buckets: Sequence[int] | None = None,
    resolved: ResolvedProfile | None = None,
) -> tuple[LatencyModel, StepCosts | None]:
    """The verify-latency model and, from a profile, the fixed step costs (None: measured online).

    width_buckets: the widths verify passes run at (`graph_buckets.planning_widths`: a W between captured
    CUDA-graph widths costs the width it is padded to); None: every W runs as it is. resolved: the profile
    `resolve_worker_profile` found (None: resolve it here).

    `--bastion-profile PATH` loads that profile (a profile measured for another device or model: a warning
    naming both; a corrupt or wrong-version file: ProfileError naming it, so the server refuses to start).
    `auto` looks in the profile store for the profile of this device, target config, dtype, attention
    backend and tp; with none, an uncalibrated roofline of the target on this device (CPU_HARDWARE on a
    CPU, the GPU's datasheet otherwise) corrected online by the EMA, and one warning that names the
    `bastion calibrate` command to run.
    """
    if resolved is None:
        resolved = resolve_worker_profile(config, server_args, dtype, device)
    if resolved.profile is not None:
        logger.info("BASTION: planning with latency profile %s", resolved.path)
        hardware = None
    else:
        hardware = planning_hardware(device, dtype)
    latency = build_calibrated_latency_model(
        resolved, target_config, hardware, config.ema_alpha, width_buckets
    )
    return latency, None if resolved.profile is None else resolved.profile.step_costs


def planning_hardware(device: torch.device, dtype: torch.dtype) -> HardwareSpec:
    """Peaks of the uncalibrated roofline: CPU_HARDWARE on a CPU; a GPU's datasheet entry, or, for a GPU the
    table does not list, its peaks measured now (`measure_peaks`, a second or two), with a warning."""
    if device.type == "cpu":
        return CPU_HARDWARE
    name = torch.cuda.get_device_name(device)
    hardware, measured = datasheet_or_measured(name, lambda: measure_peaks(device, dtype, name))
    if measured:
        logger.warning(
            "BASTION: no datasheet entry for GPU %r; the uncalibrated roofline uses peaks measured at "
            "start-up: %.1f TFLOP/s, %.0f GB/s",
            name,
            hardware.peak_flops / 1e12,
            hardware.bandwidth / 1e9,
        )
    return hardware


def resolve_worker_profile(
    config: BastionConfig, server_args: ServerArgs, dtype: torch.dtype, device: torch.device
) -> ResolvedProfile:
    """The calibration profile of this runtime (`--bastion-profile`: a path, or `auto` from the store); its
    warnings are logged here, once."""
    identity = RuntimeIdentity.for_runtime(
        device=device,
        model_path=server_args.model_path,
        dtype=dtype,
        attention_backend=str(server_args.attention_backend),
        tp_size=int(server_args.tp_size),
        engine="sglang",
        draft_model_path=server_args.speculative_draft_model_path,
    )
    spec = "auto" if config.profile_path is None else config.profile_path
    resolved = resolve_latency_profile(spec, identity, ProfileStore.locate(None))
    for warning in resolved.warnings:
        logger.warning("BASTION: %s", warning)
    return resolved


def worker_acceptance(
    resolved: ResolvedProfile, draft_model_path: str | None
) -> AcceptanceCalibration | None:
    """The profile's acceptance calibration when it fits this drafter (else None, with a warning logged)."""
    try:
        drafter_hash = model_config_hash(draft_model_path) if draft_model_path else None
    except ValueError:
        drafter_hash = None  # a hub id not in the local cache: nothing to compare against
    calibration, warnings = resolve_acceptance(resolved, drafter_hash)
    for warning in warnings:
        logger.warning("BASTION: %s", warning)
    if calibration is not None:
        logger.info("BASTION: planning with the acceptance calibration of %s", resolved.path)
    return calibration


def _root_targets(
    logits: torch.Tensor, probs: torch.Tensor | None, uniforms: torch.Tensor | None
) -> torch.Tensor:
    """The target's token after each root of a width-1 step: [B] int64. logits: [B, V] processed; probs
    [B, 1, V] and uniforms [B, 1] of `_sampling_inputs` (None: every request greedy, the argmax)."""
    if probs is None:
        return torch.argmax(logits, dim=-1)
    return kernels.sample_tokens(probs[:, 0], uniforms[:, 0])


def is_greedy(req: Req) -> bool:
    """Whether the request decodes greedily (SGLang normalises temperature 0 to top_k = 1)."""
    params = req.sampling_params
    return params.top_k == 1 or params.temperature <= 0.0


class BastionWorker(DFlashWorkerV2):
    """The spec-v2 worker behind `--speculative-algorithm BASTION` (see the module docstring).

    Inherits from DFlashWorkerV2: the drafter runner and its KV pool, the mask token, the prefill path.
    Replaces: the decode step, the draft inputs it hands to the scheduler, the drafter's block size (the
    verify width cap and the drafter block differ here), and its greedy draft sampler (BASTION needs the
    drafter's full distribution).
    """

    def __init__(self, server_args: ServerArgs, gpu_id: int, nccl_port: int, target_worker: TpModelWorker):
        super().__init__(
            server_args=server_args, gpu_id=gpu_id, nccl_port=nccl_port, target_worker=target_worker
        )
        self.config: BastionConfig = config_of(server_args)
        block_size = int(get_spec().speculative_dflash_block_size)  # resolved by handle_server_args
        self.block_size = block_size
        self.draft_model.set_block_size(block_size)
        self._block_spec_info = sgl.install_draft_block_spec_info(self, block_size)
        self._block_offsets = torch.arange(block_size, dtype=torch.int64, device=self.device)
        max_batch = int(get_schedule().max_running_requests)
        # [max_batch, γ] int64 drafter blocks: column 0 takes each step's roots, the rest stay MASK.
        self._block_ids = torch.full(
            (max_batch, block_size), sgl.mask_token_id(self), dtype=torch.int64, device=self.device
        )
        self._width_offsets = torch.arange(
            self.config.verify_width_cap, dtype=torch.int64, device=self.device
        )
        self._reserve = 2 * max(block_size, self.config.verify_width_cap)
        self._vocab_size = int(self.model_runner.model_config.vocab_size)
        self._sampling_backend = str(get_exec().kernel.sampling_backend)  # resolved by SGLang's server args
        kernels.filter_rule(self._sampling_backend, False, False)  # refuses a backend it cannot reproduce
        self._penalty_order = sglang_penalty_order()
        self._recent_outputs = RecentOutputs()  # what the requests' output_ids lack under overlap scheduling
        group = scheduler_group()  # None with one TP rank
        self._rank_sync = RankSync(group)
        self._draft_head = DraftHead.of(target_worker.model_runner.model.lm_head, self._vocab_size, group)
        self._embed = sgl.resolve_dflash_embedding_module(self.draft_model, target_worker.model_runner.model)
        self._noise_scale = sgl.noise_embed_scale(self)
        self._graph_widths = planned_graph_widths(torch.device(self.device), self.config.width_buckets)
        self._verify_graphs = VerifyGraphs({})  # captured in init_cuda_graphs
        dtype = self.model_runner.model_config.dtype
        resolved = resolve_worker_profile(self.config, server_args, dtype, torch.device(self.device))
        self.latency, profile_costs = worker_latency_model(
            self.config,
            server_args,
            self.model_runner.model_config.hf_config.to_dict(),
            dtype,
            torch.device(self.device),
            planning_widths(self._graph_widths, self.config.verify_width_cap),
            resolved,
        )
        self._acceptance = worker_acceptance(resolved, server_args.speculative_draft_model_path)
        self._acceptance_tracker = AcceptanceTracker()
        self._pending_steps: deque[PendingStep] = deque(maxlen=PENDING_STEPS)  # oldest first
        self._speedups = SpeedupLedger()
        self._step_index = 0
        self._last_decode_end: float | None = None  # host clock at the end of the last decode step
        self._rewriter = load_draft_logits_rewriter(self.config)
        self._timer: StageTimer[StepRecord] = StageTimer(torch.device(self.device))
        self._costs = StepCostTracker(
            prior=profile_costs,
            prior_weight=1.0 / self.config.ema_alpha,
            warmup_steps=COLD_STEPS,
            prior_draft_per_request=0.0
            if profile_costs is None
            else draft_seconds_per_request(
                profile_costs.t_draft,
                self.latency,
                min(block_size, self.config.verify_width_cap),
                DRAFT_SHAPE_CONTEXT,
            ),
        )
        self._gate = SpeculationGate()
        # drafted positions the LM head scores; fixed-size policies keep all (their trees stay DDTree's)
        depth = block_size - 1
        self._horizon = DraftHorizon(depth) if self.config.policy.may_decline else DraftHorizon.full(depth)
        self._deferred_context = DeferredDraftContext()  # drafter KV rows of steps that skipped the drafter
        self._evidence = DraftEvidence()  # what the recent drafted steps said of their text
        self._seed_source = torch.Generator().manual_seed(int(server_args.random_seed or 0))
        self._metrics = (
            BastionMetrics(scheduler_metric_labels())
            if get_observability().enable_metrics and get_parallel().attn_tp_rank == 0
            else None
        )
        logger.info(
            "BASTION worker: drafter block %d, N_max %d (verify width cap %d), K %d, policy %s",
            block_size,
            self.config.max_budget,
            self.config.verify_width_cap,
            self.config.branching,
            self.config.policy,
        )

    # ---- DFlashWorkerV2 parts BASTION replaces ---------------------------------------------------

    def init_cuda_graphs(self) -> None:
        """SGLang's DFlash drafter graphs, then a target-verify graph runner per width bucket (`graphs`)."""
        super().init_cuda_graphs()
        self._verify_graphs = capture_verify_graphs(self.target_worker.model_runner, self._graph_widths)
        graphs = self._verify_graphs
        sgl.add_graph_usage(self, "target_verify", graphs.extra_memory_gb, graphs.capture_seconds)

    def _maybe_build_draft_sampler(self) -> None:
        """No in-graph greedy draft sampler: BASTION reads the drafter's hidden states for every token."""
        return None

    def _validate_phase1_sampling_support(self, batch: ScheduleBatch) -> None:
        """Every temperature is supported: the sampling walk below is BASTION's own."""
        return None

    def forward_batch_generation(
        self,
        batch: ScheduleBatch,
        on_publish: Any = None,
        grammar_barrier: Any = None,
        pp_proxy_tensors: Any = None,
    ) -> GenerationBatchResult:
        """Prefill (SGLang's DFlash path, which also fills the drafter KV) or one BASTION decode step."""
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            self._last_decode_end = None  # the next decode step does not follow a decode step
            self._write_context(self._deferred_context.take())
            result = super().forward_batch_generation(batch, on_publish, grammar_barrier, pp_proxy_tensors)
            prefill_tokens = result.next_token_ids.to(torch.int64)
            self._recent_outputs.record(batch.reqs, prefill_tokens[:, None], torch.ones_like(prefill_tokens))
            result.next_draft_input = BastionDraftInput(
                bonus_tokens=prefill_tokens,
                new_seq_lens=batch.seq_lens.to(torch.int64),
                seeds=torch.tensor(
                    [self._seed_for(req) for req in batch.reqs], dtype=torch.int64, device=self.device
                ),
                reserve=self._reserve,
            )
            return result
        return self._decode_step(batch, on_publish, grammar_barrier)

    # ---- one decode step -------------------------------------------------------------------------

    def _decode_step(
        self, batch: ScheduleBatch, on_publish: Any, grammar_barrier: Any
    ) -> GenerationBatchResult:
        """One decode step (module docstring). on_publish: the overlap scheduler's callback taking the [B]
        committed lengths after this step (None without overlap); it is called as soon as they are known,
        before the commit stage, so the scheduler can prepare the next step while the commit runs."""
        step_start = time.perf_counter()
        other = None if self._last_decode_end is None else step_start - self._last_decode_end
        draft_input: BastionDraftInput = batch.spec_info
        bs = batch.batch_size()
        prefix = batch.seq_lens.to(torch.int64)  # [B] committed tokens with KV
        # [B] host copy: set by prepare_for_decode, or under overlap scheduling copied from the future map
        # after the previous step's publish (`FutureMap.resolve_seq_lens_cpu` waits for it: exact)
        prefix_cpu = batch.seq_lens_cpu
        contexts = prefix_cpu.tolist()
        greedy = [is_greedy(req) for req in batch.reqs]
        # priced once, and only when a ceiling or a plan needs them (most steps that skip the drafter do not)
        step_costs = functools.cache(functools.partial(self._step_costs, contexts))
        drafting = True
        if self.config.policy.may_decline and self._rank_sync.leads:
            curve = self._evidence.curve_for(req.rid for req in batch.reqs)
            drafting = self._gate.should_draft(
                None
                if curve is None
                else lambda: speculation_ceiling(curve, contexts, self.latency, step_costs())
            )
        # drafting is a collective under TP: every rank scores rank 0's horizon (0: no drafter pass)
        horizon = self._rank_sync.share_horizon(self._horizon.horizon if drafting else 0)
        if horizon == 0 and not batch.has_grammar and self._runs_plain_decode():
            return self._skipped_step(batch, on_publish, prefix, prefix_cpu, contexts, greedy, other)
        rows_index = batch.req_pool_indices.to(torch.int64)[:, None]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        l_ar = self.latency.predict_plain_batch(contexts)  # a plain step now (costs.l_ar: for the planner)
        top: kernels.DraftTopK | None = None
        if horizon > 0:
            with self._timer.stage("draft"):
                self._write_context(self._deferred_context.take())  # the drafter reads every committed token
                draft_logits = self._draft_logits(batch, draft_input.bonus_tokens, prefix, horizon)
                if self._rewriter is not None:
                    draft_logits = self._rewriter(batch.reqs, draft_logits, contexts)
                top = kernels.topk_logprobs(draft_logits, self.config.branching)
        with self._timer.stage("plan"):
            bonus_tokens = draft_input.bonus_tokens
            if top is None or not self._rank_sync.leads:  # other TP ranks take rank 0's rows below
                trees, scales = None, [1.0] * bs
                plan = plain_plan(bs, l_ar)
                local_rows = kernels.root_rows(bonus_tokens)
            else:
                calibrated = (
                    top.logprobs if self._acceptance is None else self._acceptance.apply(top.logprobs)
                )
                trees = build_trees_auto_unchecked(calibrated, top.token_ids, self.config.max_budget)
                scales = self._acceptance_tracker.corrections(greedy)
                plan = plan_batch(
                    trees,
                    contexts,
                    self.latency,
                    step_costs(),
                    self.config.policy,
                    accept_scale=scales,
                    # a backoff probe verifies its tree whatever the estimate, so the acceptance correction
                    # sees fresh evidence and speculation can resume; a refresh probe only re-drafts
                    allow_plain=not self._gate.verifies_probe,
                )
                self._gate.record(plan.speculative_speedup)
                self._evidence.record(
                    DraftedStep(
                        plan.accept_curve,
                        horizon_gain(trees, horizon, self._horizon.depth, scales),
                        frozenset(req.rid for req in batch.reqs),
                    )
                )
                local_rows = kernels.flatten_trees(trees, bonus_tokens, plan.width)
            # rank 0's rows on every TP rank: roots, then the first W - 1 nodes of each planned tree
            rows = self._rank_sync.share_rows(local_rows, top is not None)
            if top is not None and self._rank_sync.leads:
                self._horizon.observe(int(rows.depths.max()))
            width = rows.width
            shape = self._verify_graphs.shape_for(width, bs)  # W_v: a captured graph's width >= W, or W
            self._pending_steps.append(
                PendingStep(self._step_index, list(plan.expected_drafted), greedy, scales)
            )
            self._speedups.plan(self._step_index, l_ar, bs)
            if self._metrics is not None:
                mode = "skipped" if top is None else "speculative" if plan.speculates else "declined"
                raw = [1.0] * bs if trees is None else self._raw_expected_accept(trees, top, plan.node_counts)
                self._metrics.observe_plan(
                    plan.node_counts,
                    plan.expected_accept,
                    raw,
                    plan.estimated_speedup,
                    self.latency.calibrated,
                    mode,
                )
            window = prefix[:, None] + self._width_offsets[: shape.width]  # [B, W_v] req_to_token columns
            slots = req_to_token[rows_index, window].to(torch.int64)  # [B, W_v] KV slots, padding last
            # a plain step with no grammar decodes as SGLang does: no verify layout, mask or grammar tree
            plain_decode = width == 1 and not batch.has_grammar and self._runs_plain_decode()
            grammar_tree = None
            if not plain_decode:
                verify = padded_verify_pass(rows, prefix, shape.width, seq_lens_sum=int(sum(contexts)))
                if batch.has_grammar:
                    layout = verify.layout
                    grammar_tree = GrammarTree.from_device(
                        layout.first_child, layout.next_sibling, rows.tokens
                    )
        with self._timer.stage("verify"):
            if plain_decode:
                target_out = self._decode_plain(batch, rows.tokens[:, 0], slots[:, 0], prefix, prefix_cpu)
            else:
                target_out = self._verify(batch, verify, slots, prefix_cpu, shape)
        with self._timer.stage("accept"):
            logits_output = target_out.logits_output
            # [B * W, V] of the real positions; contiguous so the in-place adjustments below land in the
            # tensor used after them
            next_logits = real_rows(logits_output.next_token_logits, bs, width)[:, : self._vocab_size]
            next_logits = next_logits.contiguous()
            ancestors = None if plain_decode else verify.layout.ancestor_mask
            self._process_logits(
                batch, next_logits, rows.tokens, ancestors, contexts, grammar_tree, grammar_barrier
            )
            probs, uniforms = self._sampling_inputs(
                batch, next_logits, width, draft_input.seeds, prefix[:, None] + 1 + rows.depths
            )
            if width == 1:  # roots only (a plain step): the target's token is the step's one token
                targets = _root_targets(next_logits, probs, uniforms)
                accept = kernels.accept_roots(targets)
                order, out_tokens = accept.accept_index, targets[:, None]
            else:
                accept = (
                    kernels.accept_greedy(rows, next_logits.view(bs, width, -1))
                    if probs is None
                    else kernels.accept_sampling(rows, probs, uniforms)
                )
                order = kernels.compaction_order(accept.accept_index, accept.accept_length)
                out_tokens = kernels.committed_tokens(rows.tokens, order, accept)
            commit_lens = (accept.accept_length + 1).to(torch.int32)  # [B] tokens emitted
            new_seq_lens = prefix + commit_lens.to(torch.int64)
            self._recent_outputs.record(batch.reqs, out_tokens, commit_lens)
        if on_publish is not None:
            on_publish(new_seq_lens)  # the next step's seq_lens, through SGLang's future map
        with self._timer.stage("commit"):
            real_window = window[:, :width]  # [B, W]: padding slots stay uncommitted in the reserve
            hidden = real_rows(logits_output.hidden_states, bs, width).view(bs, width, -1)
            if top is None:  # one token per request, already in place: its drafter KV can wait
                self._defer_context(batch, ContextRows(hidden[:, 0].clone(), slots[:, 0], real_window[:, 0]))
            else:
                compacted = slots[:, :width].gather(1, order)
                req_to_token[rows_index, real_window] = compacted.to(req_to_token.dtype)
                path_hidden = hidden.gather(1, order[:, :, None].expand(-1, -1, hidden.shape[-1]))
                sgl.append_target_hidden_to_draft_kv(
                    self,
                    target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
                    cache_loc_2d=compacted,
                    positions=real_window.reshape(-1),
                    commit_lens=commit_lens,
                )
            logits_output.hidden_states = None
            if batch.return_logprob:
                chain_logits = next_logits.view(bs, width, -1).gather(
                    1, order[:, :, None].expand(-1, -1, next_logits.shape[-1])
                )
                logits_output.next_token_logits = chain_logits.reshape(bs * width, -1)
                compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=width)
        record = StepRecord(
            index=self._step_index,
            widths=[shape.width] * bs,
            contexts=contexts,
            estimated_verify_seconds=plan.estimated_verify_seconds if plan.speculates else l_ar,
            other_seconds=other,
            drafted=top is not None,
        )
        self._end_step(record)
        return self._step_result(
            target_out, out_tokens, commit_lens, accept.bonus_tokens, new_seq_lens, draft_input.seeds, width
        )

    def _skipped_step(
        self,
        batch: ScheduleBatch,
        on_publish: Any,
        prefix: torch.Tensor,
        prefix_cpu: torch.Tensor,
        contexts: list[int],
        greedy: list[bool],
        other: float | None,
    ) -> GenerationBatchResult:
        """A decode step without the drafter where the target runs SGLang's own DECODE forward: each root's
        forward and the target's token after it, as `_decode_step` makes of a plan of width 1 but without the
        plan, verify rows and accept walk it would build for it (no grammar: its tree needs the rows).

        Such steps are where BASTION must cost what plain decoding costs, so they do only what the output and
        the online state need: the token (penalties, logit bias, sampling as in any step), the roots' drafter
        context (deferred), the latency model's plain observation, the pending acceptance record, and the
        metrics. prefix: [B] committed lengths (prefix_cpu, contexts: host copies); greedy: [B] per request;
        other: host seconds since the last decode step (None: none just before).
        """
        draft_input: BastionDraftInput = batch.spec_info
        bs = len(contexts)
        roots = draft_input.bonus_tokens
        with self._timer.stage("plan"):
            l_ar = self.latency.predict_plain_batch(contexts)
            self._pending_steps.append(PendingStep(self._step_index, [0.0] * bs, greedy, [1.0] * bs))
            self._speedups.plan(self._step_index, l_ar, bs)
            if self._metrics is not None:
                ones = [1.0] * bs
                self._metrics.observe_plan([0] * bs, ones, ones, 1.0, self.latency.calibrated, "skipped")
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            # [B] each root's KV slot, at position L_b
            slots = req_to_token[batch.req_pool_indices.to(torch.int64), prefix].to(torch.int64)
        with self._timer.stage("verify"):
            target_out = self._decode_plain(batch, roots, slots, prefix, prefix_cpu)
        with self._timer.stage("accept"):
            logits_output = target_out.logits_output
            next_logits = logits_output.next_token_logits[:, : self._vocab_size].contiguous()  # [B, V]
            self._process_logits(batch, next_logits, roots[:, None], None, contexts, None, None)
            positions = (prefix + 1)[:, None]  # [B, 1] the position of each target token
            probs, uniforms = self._sampling_inputs(batch, next_logits, 1, draft_input.seeds, positions)
            targets = _root_targets(next_logits, probs, uniforms)
            commit_lens = torch.ones_like(targets, dtype=torch.int32)  # [B] one token each
            new_seq_lens = prefix + 1
            self._recent_outputs.record(batch.reqs, targets[:, None], commit_lens)
        if on_publish is not None:
            on_publish(new_seq_lens)
        with self._timer.stage("commit"):
            self._defer_context(batch, ContextRows(logits_output.hidden_states.clone(), slots, prefix))
            logits_output.hidden_states = None
            if batch.return_logprob:
                logits_output.next_token_logits = next_logits
                compute_spec_logprobs(batch, logits_output, targets, chain_stride=1)
        self._end_step(
            StepRecord(self._step_index, [1] * bs, contexts, l_ar, other_seconds=other, drafted=False)
        )
        return self._step_result(
            target_out, targets[:, None], commit_lens, targets, new_seq_lens, draft_input.seeds, 1
        )

    def _process_logits(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        ancestors: torch.Tensor | None,
        contexts: list[int],
        grammar_tree: GrammarTree | None,
        grammar_barrier: Any,
    ) -> None:
        """In place, in SGLang's order: the requests' output penalties for the output so far plus each node's
        path, their grammar along the path, their logit_bias.

        logits: [B * W, V] of the verify rows tokens [B, W]; ancestors: [B, W, W] bool (None: W = 1, the
        roots alone); contexts: [B] committed lengths (host); grammar_tree: the rows' links (None: none).
        """
        bs, width = tokens.shape
        if any(has_output_penalty(req) for req in batch.reqs):
            outputs = self._recent_outputs.outputs(batch.reqs, contexts)
            penalties = output_penalties(batch.reqs, outputs, self._vocab_size, logits.device)
            if ancestors is None:
                ancestors = torch.ones((bs, 1, 1), dtype=torch.bool, device=logits.device)
            kernels.apply_tree_penalties(
                logits.view(bs, width, -1), tokens, ancestors, penalties, self._penalty_order
            )
        sampling_info = batch.sampling_info
        if grammar_tree is not None:
            grammar_mask = build_grammar_vocab_mask(
                reqs=batch.reqs,
                tree=grammar_tree,
                sampling_info=sampling_info,
                device=logits.device,
                barrier=grammar_barrier,
            )
            if grammar_mask is not None:
                grammar_mask.apply(logits)
        if sampling_info.logit_bias is not None:
            logits.view(bs, width, -1).add_(sampling_info.logit_bias[:, None, :])

    def _sampling_inputs(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        width: int,
        seeds: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The target's distributions [B, W, V] after each row (`target_sampling_probs`) and the walk's
        uniforms [B, W] at `positions` [B, W] (the position of each row's next token); (None, None) when every
        request is greedy. logits: [B * W, V] processed (`_process_logits`); seeds: [B] int64."""
        sampling_info = batch.sampling_info
        if sampling_info.is_all_greedy:
            return None, None
        probs = target_sampling_probs(logits, sampling_info, width, self._sampling_backend)
        return probs, kernels.position_uniforms(seeds, positions)

    def _defer_context(self, batch: ScheduleBatch, rows: ContextRows) -> None:
        """Hold a step's drafter context rows (one per request of `batch`) until the drafter needs them,
        writing the rows held so far first when they are due (`DeferredDraftContext.due`)."""
        if self._deferred_context.due(batch.reqs):
            self._write_context(self._deferred_context.take())
        self._deferred_context.defer(batch.reqs, rows)

    def _end_step(self, record: StepRecord) -> None:
        """Close the decode step `record` describes: its times to the latency model, costs and metrics."""
        self._observe(self._timer.finish_step(record))
        if self._metrics is not None:
            self._metrics.end_step()
        self._step_index += 1
        self._last_decode_end = time.perf_counter()

    def _step_result(
        self,
        target_out: GenerationBatchResult,
        out_tokens: torch.Tensor,
        commit_lens: torch.Tensor,
        bonus_tokens: torch.Tensor,
        new_seq_lens: torch.Tensor,
        seeds: torch.Tensor,
        width: int,
    ) -> GenerationBatchResult:
        """What a decode step hands the scheduler: out_tokens [B, W] (the first commit_lens [B] int32 of each
        row are emitted), the next roots bonus_tokens [B], the committed lengths new_seq_lens [B], the
        requests' walk seeds [B] (carried on)."""
        return GenerationBatchResult(
            logits_output=target_out.logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=BastionDraftInput(
                bonus_tokens=bonus_tokens,
                new_seq_lens=new_seq_lens,
                seeds=seeds,
                reserve=self._reserve,
            ),
            speculative_num_draft_tokens=width,
            speculative_output_stride=width,
            new_seq_lens=new_seq_lens,
        )

    def _draft_logits(
        self, batch: ScheduleBatch, bonus_tokens: torch.Tensor, prefix: torch.Tensor, horizon: int
    ) -> torch.Tensor:
        """Drafter logits [B, h, V] for the first h = `horizon` of the γ-1 positions after each root (SGLang's
        DFlash draft forward over the whole block, then the LM head over h positions: `controller.horizon`).

        bonus_tokens: [B] roots; prefix: [B] committed lengths. The block [root, MASK x (γ-1)] is written to
        the drafter KV at slots req_to_token[r, L : L + γ] (overwritten by the commit later).
        """
        bs = bonus_tokens.shape[0]
        block = self.block_size
        block_ids = self._block_ids[:bs]
        block_ids[:, 0] = bonus_tokens
        positions = prefix[:, None] + self._block_offsets  # [B, γ]
        rows_index = batch.req_pool_indices.to(torch.int64)[:, None]
        cache_loc = self.model_runner.req_to_token_pool.req_to_token[rows_index, positions].to(torch.int64)
        embeds = self._embed(block_ids)
        if self._noise_scale != 1.0:
            embeds = embeds * self._noise_scale
        seq_lens_cpu = batch.seq_lens_cpu + block  # host bound on what the block attends to
        plan = self.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            seq_lens_cpu=batch.seq_lens_cpu,
            write_virtual=cache_loc.reshape(-1),
            read_extent=block,
        )
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.reshape(-1),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            out_cache_loc=cache_loc.reshape(-1),
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions.reshape(-1),
            input_embeds=embeds.reshape(bs * block, -1),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * block, dtype=torch.int32, device=self.device)
                if enable_num_token_non_padded()
                else None
            ),
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(forward_batch)
            hidden = draft_out.logits_output.hidden_states.view(bs, block, -1)[:, 1 : 1 + horizon]
            return self._draft_head(hidden)

    def _runs_plain_decode(self) -> bool:
        """Whether a plain step (no draft node) runs SGLang's own DECODE forward: where the target replays no
        CUDA graph (a graph captured for verify widths must not replay a one-token decode). Elsewhere a plain
        step verifies a width of 1."""
        return self.target_worker.model_runner.decode_cuda_graph_runner is None

    def _decode_plain(
        self,
        batch: ScheduleBatch,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        prefix: torch.Tensor,
        prefix_cpu: torch.Tensor,
    ) -> GenerationBatchResult:
        """The target's plain DECODE forward of one token per request, as SGLang runs it without speculation
        (no tree mask, no verify layout), with the drafter's feature layers captured for the commit.

        tokens: [B] the roots (bonus tokens); slots: [B] KV slots at position L_b; prefix: [B] committed
        lengths L_b (prefix_cpu: their host copy). Returns the result of a verify of width 1: logits [B, V],
        hidden states [B, H]. The scheduler's batch fields it changes are restored before it returns.
        """
        saved = {name: getattr(batch, name) for name in PLAIN_DECODE_FIELDS}
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = None
        batch.input_ids = tokens
        batch.out_cache_loc = slots
        batch.seq_lens = (prefix + 1).to(saved["seq_lens"].dtype)
        batch.seq_lens_cpu = prefix_cpu + 1
        batch.orig_seq_lens = batch.seq_lens.to(saved["orig_seq_lens"].dtype)
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        try:
            forward_batch = ForwardBatch.init_new(
                batch,
                self.target_worker.model_runner,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                return_hidden_states_before_norm=False,
            )
            return self.target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True
            )
        finally:
            for name, value in saved.items():
                setattr(batch, name, value)

    def _verify(
        self,
        batch: ScheduleBatch,
        verify: VerifyPass,
        slots: torch.Tensor,
        prefix_cpu: torch.Tensor,
        shape: VerifyShape,
    ) -> GenerationBatchResult:
        """The target's TARGET_VERIFY forward over the padded verify rows [B, W_v] at `slots` [B, W_v],
        through the graph captured at W_v when `shape` says so (SGLang's `can_run_graph` decides)."""
        rows = verify.rows
        model_runner = self.target_worker.model_runner
        with self._verify_graphs.installed(model_runner, shape):
            forward_batch, _ = prepare_verify_forward(
                batch, model_runner, rows.tokens, rows.positions, verify.custom_mask, slots, prefix_cpu
            )
            result = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True
            )
        if result.can_run_cuda_graph:
            self._verify_graphs.note_replay(rows.width, len(prefix_cpu))
        logits_output = result.logits_output
        logits_output.next_token_logits = sgl.gathered_verify_logits(self, logits_output.next_token_logits)
        return result

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _write_context(self, rows: ContextRows | None) -> None:
        """Write held context rows (`draft_context`) into the drafter KV, one token per row; None: nothing."""
        if rows is not None:
            sgl.append_target_hidden_to_draft_kv(
                self,
                target_hidden=rows.hidden,
                cache_loc_2d=rows.slots[:, None],
                positions=rows.positions,
                commit_lens=torch.ones_like(rows.slots, dtype=torch.int32),
            )

    def _seed_for(self, req: Req) -> int:
        """Seed of the request's sampling walk: its sampling_seed, else one drawn from the server seed; as
        a two's-complement int64."""
        seed = req.sampling_params.sampling_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._seed_source))
        return (int(seed) + 2**63) % 2**64 - 2**63

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        """SGLang's hook once a decode step's accepted counts are on the host: the realised accept lengths.

        Results come back in launch order, one per decode step: without overlap scheduling before the next
        step runs, with it after the next step is launched. Each is matched with the oldest pending plan.
        """
        if self._pending_steps:
            pending = self._pending_steps.popleft()
            tracker = self._acceptance_tracker
            tracker.observe(
                pending.expected_drafted, num_correct_drafts_per_req, pending.greedy, pending.scales
            )
            if self._metrics is not None:
                self._metrics.observe_acceptance(
                    tracker.calibration_error, tracker.correction(True), tracker.correction(False)
                )
            committed = sum(num_correct_drafts_per_req) + len(num_correct_drafts_per_req)
            self._report_speedup(self._speedups.committed(pending.index, committed))
        if self._metrics is not None:
            self._metrics.observe_accepted(num_correct_drafts_per_req)

    def _step_costs(self, contexts: list[int]) -> StepCosts:
        """Per-step costs for the planner: this worker's measured stages (the profile's costs until they
        warm up) and L_AR, the latency model's plain decode step of the whole batch as of its last verify
        observation (`LatencyModel.predict_plain_batch_as_of_verify`: Ŝ compares it with verify passes)."""
        l_ar = self.latency.predict_plain_batch_as_of_verify(contexts)
        return self._costs.costs(l_ar=l_ar, batch=len(contexts))

    def _raw_expected_accept(
        self, trees: DraftTreeBatch, top: kernels.DraftTopK, counts: Sequence[int]
    ) -> list[float]:
        """Raw Â per request of the planned trees: 1 + Σ of the drafter's uncalibrated path probabilities."""
        if self._acceptance is None:
            scores = trees.log_scores
        else:
            scores = node_log_scores(trees.tokens, trees.parents, trees.depths, top.logprobs, top.token_ids)
        gains = torch.exp(scores).cumsum(1).cpu()  # host copy for the metric
        return [1.0 + (float(gains[i, n - 1]) if n > 0 else 0.0) for i, n in enumerate(counts)]

    def _report_speedup(self, speedup: float | None) -> None:
        if speedup is not None and self._metrics is not None:
            self._metrics.observe_realised_speedup(speedup)

    def _observe(self, finished: TimedStep[StepRecord] | None) -> None:
        """Feed a finished step's measured seconds to the latency model's online correction, the step-cost
        tracker and the metrics. finished: the step's record and its stage times, or None."""
        if finished is None:
            return
        record, times = finished.record, finished.times
        step_seconds = times.draft + times.verify + times.aux + (record.other_seconds or 0.0)
        self._report_speedup(self._speedups.timed(record.index, step_seconds))
        if self._metrics is not None:
            self._metrics.observe_stages(times, record.other_seconds)
        if times.verify > 0:
            if max(record.widths) == 1:
                self.latency.observe_plain_batch(record.contexts, times.verify)
            else:
                self.latency.observe_batch(record.widths, record.contexts, times.verify)
            if self._metrics is not None:
                self._metrics.observe_verify(
                    record.estimated_verify_seconds, times.verify, self.latency.ema_factor
                )
        if record.drafted:
            self._costs.observe(times.draft, times.aux, sum(record.widths), len(record.widths))
