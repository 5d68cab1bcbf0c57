"""BASTION's SGLang worker: DFlash drafting, best-first trees, one tree-masked verify pass per step.

One decode step for a batch of B requests (each with prefix L_b and root = its bonus token), as stages
(`docs/architecture.md`, "One decode step"):
1. gate and draft: the step controller decides whether the drafter runs (`step_controller.StepController`);
   if so, the DFlash drafter scores the draft horizon after each root (`drafter_forward.DrafterForward`).
2. plan: the controller's best-first trees and batch plan give one width W for the batch; the verify rows
   are laid out (`graph_buckets.padded_verify_pass`) and padded to a captured graph width.
3. verify: the target's TARGET_VERIFY forward over the B x W tokens at slots req_to_token[r, L : L + W]; a
   step of width 1 with no grammar runs SGLang's own DECODE forward instead (`target_forward`).
4. accept: logit processing and the accept walk (`accept.Acceptor`).
5. commit: the accepted path moves to the front of the window (slot ids permuted with pages of one token, KV
   copied with larger pages) and becomes drafter KV (`commit.TreeCommit`);
   a width-1 step's drafter row is held until the drafter needs it (`commit.DraftContextWriter`); the
   committed tokens' hidden states and sampling masks go to the requests that ask for them
   (`request_outputs`).
6. observe: the controller matches the step's measured times and accepted counts with its plan.

Everything DFlash-specific that is not BASTION's (loading the drafter, its KV pool, the prefill path that
fills the drafter KV from the prompt) is inherited from SGLang's `DFlashWorkerV2`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang.calibration.startup import StartupCalibration
from bastion_sglang.integration.config import BastionConfig, config_of
from bastion_sglang.integration.sglang_adapter import (
    DFlashWorkerV2,
    GenerationBatchResult,
    dflash2_selector,
    get_exec,
    get_observability,
    get_parallel,
    get_schedule,
    get_spec,
)
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.accept import RowLogits, is_greedy
from bastion_sglang.step.commit import DraftContextWriter, TreeCommit
from bastion_sglang.step.drafter_forward import DrafterForward, draft_head
from bastion_sglang.step.graph_buckets import planning_widths, real_rows
from bastion_sglang.step.metrics import BastionMetrics, scheduler_metric_labels
from bastion_sglang.step.plan_stage import plan_step
from bastion_sglang.step.planning_setup import worker_step_controller
from bastion_sglang.step.prefill import Prefill
from bastion_sglang.step.rank_sync import RankSync, scheduler_group
from bastion_sglang.step.request_outputs import attach_step_outputs, capture_final_hidden_states
from bastion_sglang.step.spec_input import step_result
from bastion_sglang.step.step_controller import StepController, StepPlan, StepRecord, StepStart
from bastion_sglang.step.synthetic_acceptance import draft_seams
from bastion_sglang.step.target_forward import DecodeInputs, TargetForward, TreePass

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


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
        config: BastionConfig = config_of(server_args)
        self.config = config
        block_size = int(get_spec().speculative_dflash_block_size)  # resolved by handle_server_args
        self.block_size = block_size
        self._reserve = 2 * max(block_size, config.verify_width_cap)
        capture_final_hidden_states(self)  # before the target's graphs are captured
        vocab_size = int(self.model_runner.model_config.vocab_size)
        backend = str(get_exec().kernel.sampling_backend)
        seams = draft_seams(config, int(server_args.tp_size), vocab_size, backend)
        self._acceptor = seams.acceptor
        server_seed = int(server_args.random_seed or 0)
        self._prefill = Prefill(self._acceptor, self.model_runner, server_seed, self.device, self._reserve)
        group = scheduler_group()  # None with one TP rank
        self._rank_sync = RankSync(group)
        self._drafter = DrafterForward(
            self,
            block_size,
            int(get_schedule().max_running_requests),
            draft_head(
                config,
                server_args,
                target_worker.model_runner.model.lm_head,
                vocab_size,
                group,
                lattice_drafter=dflash2_selector(self) is not None,
            ),
            config.branching,
            seams.rewriter,
            seams.top_k,
        )
        self._context = DraftContextWriter(self)  # drafter KV rows of width-1 steps
        self._page_size = int(get_schedule().page_size)
        self._commit = TreeCommit(self, self._page_size)
        self._target = TargetForward(self, config.verify_width_cap, config.width_buckets)
        self._metrics = (
            BastionMetrics(scheduler_metric_labels())
            if get_observability().enable_metrics and get_parallel().attn_tp_rank == 0
            else None
        )
        self._server_args = server_args
        self._controller: StepController  # built in init_cuda_graphs, once the KV pools exist
        logger.info(
            "BASTION worker: drafter block %d, N_max %d (verify width cap %d), K %d, policy %s",
            block_size,
            config.max_budget,
            config.verify_width_cap,
            config.branching,
            config.policy,
        )

    # ---- DFlashWorkerV2 parts BASTION replaces ---------------------------------------------------

    def init_cuda_graphs(self) -> None:
        """SGLang's DFlash drafter graphs, a target-verify graph runner per width bucket (`graphs`), then the
        step controller. The scheduler calls this last in its model set-up, after the KV pools and attention
        backends exist, so a server with no profile for its runtime can first measure one (`planning_setup`,
        `calibration.startup`)."""
        super().init_cuda_graphs()
        self._target.capture_graphs()
        config, server_args = self.config, self._server_args
        self._controller = worker_step_controller(
            config,
            server_args,
            self.model_runner.model_config.hf_config.to_dict(),
            self.model_runner.model_config.dtype,
            torch.device(self.device),
            self.block_size,
            planning_widths(self._target.graph_widths, config.verify_width_cap),
            self._metrics,
            self._startup_calibration(),
            self._drafter.drafts_lattices,
            self._drafter.draft_vocab_size,
        )
        self._commit.price_copies(self._controller.costs, config.verify_width_cap)

    def _startup_calibration(self) -> StartupCalibration | None:
        """How this server measures its own profile at start-up (`calibration.startup`): on the target's
        runner, at its width buckets (its CUDA-graph widths) and cap; None with
        `--bastion-startup-calibration off`."""
        config, server_args = self.config, self._server_args
        if config.startup_calibration == "off":
            return None
        runner = self.model_runner
        return StartupCalibration(
            mode=config.startup_calibration,
            runner=runner,
            draft_path=str(server_args.speculative_draft_model_path),
            tokenizer_path=str(server_args.tokenizer_path or server_args.model_path),
            device=torch.device(self.device),
            dtype=runner.model_config.dtype,
            planning_widths=(*config.width_buckets, config.verify_width_cap),
            topk=config.topk,
            verify_context=self._target.verify_graph,
            draft_vocab=config.draft_vocab,
        )

    def _maybe_build_draft_sampler(self) -> None:
        """No in-graph greedy draft sampler: BASTION reads the drafter's hidden states for every token."""
        return None

    def _validate_phase1_sampling_support(self, batch: ScheduleBatch) -> None:
        """Every temperature is supported: the sampling walk is BASTION's own (`accept`)."""
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
            self._controller.after_prefill()
            self._context.write_held()
            prefill = super().forward_batch_generation
            return self._prefill.run(
                batch, lambda: prefill(batch, on_publish, grammar_barrier, pp_proxy_tensors)
            )
        return self._decode_step(batch, on_publish, grammar_barrier)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        """SGLang's hook once a decode step's accepted counts are on the host: the realised accept lengths
        (matched with the oldest pending plan, `StepController.verified`)."""
        self._controller.verified(num_correct_drafts_per_req)

    # ---- one decode step -------------------------------------------------------------------------

    def _decode_step(
        self, batch: ScheduleBatch, on_publish: Any, grammar_barrier: Any
    ) -> GenerationBatchResult:
        """One decode step (module docstring). on_publish: the overlap scheduler's callback taking the [B]
        committed lengths after this step (None without overlap); it is called as soon as they are known,
        before the commit stage, so the scheduler can prepare the next step while the commit runs."""
        step_inputs = DecodeInputs.of(batch, on_publish, grammar_barrier)
        controller = self._controller
        contexts = step_inputs.prefix_cpu.tolist()
        step = controller.begin(
            contexts, [is_greedy(req) for req in batch.reqs], [req.rid for req in batch.reqs]
        )
        # drafting is a collective under TP: every rank scores rank 0's horizon (0: no drafter pass)
        horizon = self._rank_sync.share_horizon(controller.draft_horizon(step, self._rank_sync.leads))
        draft = None
        if horizon > 0:
            with controller.timer.stage("draft"):
                self._context.write_held()  # the drafter reads every committed token
                draft = self._drafter.draft(step_inputs, horizon, contexts)
        with controller.timer.stage("plan"):
            planned, tree_pass = self._plan(step_inputs, step, draft)
        if tree_pass is None:
            return self._plain_step(step_inputs, step, drafted=draft is not None)
        return self._tree_step(step_inputs, step, planned, tree_pass)

    def _plan(
        self, inputs: DecodeInputs, step: StepStart, draft: DraftTopK | DraftLattice | None
    ) -> tuple[StepPlan | None, TreePass | None]:
        """The step's plan (None: the drafter did not run) and, when it verifies draft nodes, its laid-out
        verify pass (None: a width-1 step). draft: [B, h, K] top-K (DFlash) or a [B, h, K, K] lattice
        (DFlash2); under TP rank 0 plans and every rank takes its rows (`plan_stage.plan_step`)."""
        if draft is None:
            self._controller.record(step, None)
            return None, None
        planned, rows = plan_step(
            self._controller, self._rank_sync, step, draft, inputs.roots, self.config.branching
        )
        if rows.width == 1:
            return planned, None
        return planned, self._target.layout(inputs, rows, step.contexts)

    def _plain_step(self, inputs: DecodeInputs, step: StepStart, drafted: bool) -> GenerationBatchResult:
        """A step of width 1 (the drafter skipped, or its plan declined): each root's forward and the
        target's token after it. With no grammar and no captured graph it runs SGLang's own DECODE forward;
        otherwise a verify pass of the roots (padded to its graph width, with the grammar's links). The
        roots' drafter rows are held for the next drafter pass."""
        batch, timer = inputs.batch, self._controller.timer
        bs = len(step.contexts)
        with timer.stage("verify"):
            new_seq_lens = inputs.prefix + 1  # [B] the lengths with the roots, the step's commit
            roots_pass = self._target.roots(inputs, step.contexts, new_seq_lens)
        target_out, links = roots_pass.target_out, roots_pass.grammar_tree
        with timer.stage("accept"):
            logits_output = target_out.logits_output
            logits = self._acceptor.pass_logits(logits_output, bs, 1)  # [B, V]
            row_logits = RowLogits(inputs.roots[:, None], None, links, inputs.grammar_barrier)
            root_targets = self._acceptor.root_targets(
                batch, logits, row_logits, step.contexts, inputs.seed_keys, new_seq_lens
            )
            targets, commit_lens = root_targets.tokens, root_targets.commit_lens  # [B], [B] int32 ones
        if inputs.on_publish is not None:
            inputs.on_publish(new_seq_lens)  # the next step's seq_lens, through SGLang's future map
        with timer.stage("commit"):
            self._context.defer(batch, roots_pass.context_rows(inputs.prefix))  # held for the drafter
            attach_step_outputs(
                batch, logits_output, logits, root_targets.target_probs, targets[:, None], None, commit_lens
            )
        widths = [roots_pass.width] * bs
        record = StepRecord(step.index, widths, step.contexts, step.l_ar, step.other_seconds, drafted)
        self._controller.end(record)
        return step_result(
            target_out, targets[:, None], commit_lens, targets, new_seq_lens, inputs.seed_keys, self._reserve
        )

    def _tree_step(
        self, inputs: DecodeInputs, step: StepStart, planned: StepPlan, tree_pass: TreePass
    ) -> GenerationBatchResult:
        """A step that verifies draft nodes: the verify pass, the accept walk, the commit of the accepted
        paths."""
        batch, timer = inputs.batch, self._controller.timer
        rows = tree_pass.rows
        bs, width = rows.tokens.shape
        with timer.stage("verify"):
            target_out = self._target.verify(batch, tree_pass, inputs.prefix_cpu)
        with timer.stage("accept"):
            logits_output = target_out.logits_output
            logits = self._acceptor.pass_logits(logits_output, bs, width)  # [B * W, V]
            ancestors = tree_pass.verify.layout.ancestor_mask
            row_logits = RowLogits(rows.tokens, ancestors, tree_pass.grammar_tree, inputs.grammar_barrier)
            accept = self._acceptor.walk(
                batch, logits, rows, row_logits, step.contexts, inputs.seed_keys, inputs.prefix
            )
            new_seq_lens = inputs.prefix + accept.commit_counts
        if inputs.on_publish is not None:
            inputs.on_publish(new_seq_lens)  # the next step's seq_lens, through SGLang's future map
        with timer.stage("commit"):
            real_window = tree_pass.window[:, :width]  # [B, W]: padding slots stay uncommitted in the reserve
            hidden = real_rows(logits_output.hidden_states, bs, width).view(bs, width, -1)
            self._commit.commit(
                inputs.rows_index,
                tree_pass.slots[:, :width],
                real_window,
                accept.order,
                hidden,
                accept.commit_lens,
            )
            attach_step_outputs(
                batch,
                logits_output,
                logits,
                accept.target_probs,
                accept.out_tokens,
                accept.order,
                accept.commit_lens,
            )
        plan = planned.plan
        estimated = plan.estimated_verify_seconds if plan.speculates else step.l_ar
        widths = [tree_pass.shape.width] * bs
        self._controller.end(
            StepRecord(step.index, widths, step.contexts, estimated, step.other_seconds, True)
        )
        return step_result(
            target_out,
            accept.out_tokens,
            accept.commit_lens,
            accept.bonus_tokens,
            new_seq_lens,
            inputs.seed_keys,
            self._reserve,
        )
