"""The target's forwards in a decode step: the tree-masked verify pass and SGLang's plain DECODE pass.

A verify pass runs the verify rows [B, W] padded to a captured CUDA graph's width W_v >= W (`graphs`,
`graph_buckets.padded_verify_pass`) at slots req_to_token[r, L_b : L_b + W_v]; a width-1 step with no grammar
where the target replays no CUDA graph runs SGLang's own DECODE forward of the roots instead, as SGLang
does without speculation (`spec_input.plain_decode_forward`). Both capture the target's hidden states (the
drafter's features) and return SGLang's `GenerationBatchResult`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import kernels
from bastion_sglang.integration import sglang_adapter as sgl
from bastion_sglang.integration.sglang_adapter import DFlashWorkerV2, GenerationBatchResult, GrammarTree
from bastion_sglang.step.draft_context import ContextRows
from bastion_sglang.step.graph_buckets import VerifyPass, VerifyShape, padded_verify_pass, real_rows
from bastion_sglang.step.graphs import VerifyGraphs, capture_verify_graphs, planned_graph_widths
from bastion_sglang.step.spec_input import plain_decode_forward, prepare_verify_forward

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch


@dataclass(frozen=True)
class DecodeInputs:
    """A decode step's batch as the stages read it."""

    batch: ScheduleBatch
    roots: torch.Tensor  # [B] int64 bonus tokens, the trees' roots
    seed_keys: torch.Tensor  # [B] int64 the requests' walk keys (`kernels.seed_keys`)
    prefix: torch.Tensor  # [B] int64 committed tokens with KV
    # [B] host copy: set by prepare_for_decode, or under overlap scheduling copied from the future map after
    # the previous step's publish (`FutureMap.resolve_seq_lens_cpu` waits for it: exact)
    prefix_cpu: torch.Tensor
    rows_index: torch.Tensor  # [B, 1] int64 the requests' req_to_token rows
    on_publish: Any  # the overlap scheduler's callback for the committed lengths (None without overlap)
    grammar_barrier: Any

    @classmethod
    def of(cls, batch: ScheduleBatch, on_publish: Any, grammar_barrier: Any) -> DecodeInputs:
        """The step's inputs from SGLang's batch and the draft input it carries
        (`spec_input.BastionDraftInput`)."""
        draft_input = batch.spec_info
        return cls(
            batch=batch,
            roots=draft_input.bonus_tokens,
            seed_keys=draft_input.seed_keys,
            prefix=batch.seq_lens.to(torch.int64),
            prefix_cpu=batch.seq_lens_cpu,
            rows_index=batch.req_pool_indices.to(torch.int64)[:, None],
            on_publish=on_publish,
            grammar_barrier=grammar_barrier,
        )


@dataclass(frozen=True)
class TreePass:
    """A verify pass, laid out: rows [B, W] real, padded to shape.width W_v."""

    rows: kernels.TreeBatch
    shape: VerifyShape
    window: torch.Tensor  # [B, W_v] int64 req_to_token columns L_b..L_b+W_v-1
    slots: torch.Tensor  # [B, W_v] int64 KV slots, padding last
    verify: VerifyPass
    grammar_tree: GrammarTree | None  # the rows' links for grammar requests (None: none in the batch)
    prefix_sum: int  # Σ L_b, the batch's committed tokens


@dataclass(frozen=True)
class RootsPass:
    """A width-1 step's target forward: each root's forward and the target's logits after it."""

    target_out: GenerationBatchResult
    slots: torch.Tensor  # [B] int64 each root's KV slot, at position L_b
    width: int  # the pass's width: 1, or the captured graph width a verify of the roots was padded to
    grammar_tree: GrammarTree | None  # the roots' links for grammar requests (None: none, or a DECODE pass)

    def context_rows(self, prefix: torch.Tensor) -> ContextRows:
        """The roots' drafter context rows: each root's target features at its slot and position L_b
        (prefix: [B] int64), copied out of a CUDA graph's output buffer, which its next replay overwrites."""
        hidden = real_rows(self.target_out.logits_output.hidden_states, len(prefix), 1)
        if self.target_out.can_run_cuda_graph:
            hidden = hidden.clone()
        return ContextRows(hidden, self.slots, prefix)


class TargetForward:
    """The target's forwards of `worker` (a DFlashWorkerV2), with verify rows of at most `width_cap` tokens
    and, on CUDA, a captured verify graph per width of `width_buckets` (`graphs.planned_graph_widths`)."""

    def __init__(self, worker: DFlashWorkerV2, width_cap: int, width_buckets: Any) -> None:
        self._worker = worker
        device = torch.device(worker.device)
        self._width_offsets = torch.arange(width_cap, dtype=torch.int64, device=device)
        self.graph_widths = planned_graph_widths(device, width_buckets)
        self._graphs = VerifyGraphs({})  # captured in capture_graphs

    def capture_graphs(self) -> None:
        """Capture a target-verify graph runner per width bucket (`graphs`), recorded in SGLang's graph
        usage."""
        worker = self._worker
        self._graphs = capture_verify_graphs(worker.target_worker.model_runner, self.graph_widths)
        sgl.add_graph_usage(
            worker, "target_verify", self._graphs.extra_memory_gb, self._graphs.capture_seconds
        )

    def verify_graph(self, width: int, batch: int) -> AbstractContextManager[None]:
        """Within the block, a verify pass of exactly `width` tokens for each of `batch` requests runs as
        a decode step runs it: through the graph captured at `width`, else eagerly (a width between buckets
        would be padded, which a measurement of `width` must not be; a batch above the captured sizes runs
        eagerly in serving too). For the start-up calibration's timings."""
        shape = self._graphs.shape_for(width, batch)
        if shape.width != width:
            return nullcontext()
        return self._graphs.installed(self._worker.target_worker.model_runner, shape)

    @property
    def runs_plain_decode(self) -> bool:
        """Whether a plain step (no draft node) runs SGLang's own DECODE forward: where the target replays no
        CUDA graph (a graph captured for verify widths must not replay a one-token decode). Elsewhere a plain
        step verifies a width of 1."""
        return self._worker.target_worker.model_runner.decode_cuda_graph_runner is None

    def root_slots(self, inputs: DecodeInputs) -> torch.Tensor:
        """[B] int64: each root's KV slot, at position L_b."""
        req_to_token = self._worker.model_runner.req_to_token_pool.req_to_token
        return req_to_token[inputs.rows_index[:, 0], inputs.prefix].to(torch.int64)

    def layout(self, inputs: DecodeInputs, rows: kernels.TreeBatch, contexts: list[int]) -> TreePass:
        """Lay out verify rows [B, W]: padded to a captured graph's width W_v >= W (or W), their KV slots,
        ancestor mask and, for grammar requests, the rows' first-child / next-sibling links."""
        shape = self._graphs.shape_for(rows.width, len(contexts))
        window = inputs.prefix[:, None] + self._width_offsets[: shape.width]
        req_to_token = self._worker.model_runner.req_to_token_pool.req_to_token
        slots = req_to_token[inputs.rows_index, window].to(torch.int64)
        prefix_sum = sum(contexts)
        verify = padded_verify_pass(rows, inputs.prefix, shape.width, seq_lens_sum=prefix_sum)
        grammar_tree = None
        if inputs.batch.has_grammar:
            layout = verify.layout
            grammar_tree = GrammarTree.from_device(layout.first_child, layout.next_sibling, rows.tokens)
        return TreePass(rows, shape, window, slots, verify, grammar_tree, prefix_sum)

    def verify(
        self, batch: ScheduleBatch, tree_pass: TreePass, prefix_cpu: torch.Tensor
    ) -> GenerationBatchResult:
        """The target's TARGET_VERIFY forward over the padded verify rows [B, W_v], through the graph
        captured at W_v when the pass's shape says so (SGLang's `can_run_graph` decides)."""
        worker = self._worker
        rows = tree_pass.verify.rows
        model_runner = worker.target_worker.model_runner
        with self._graphs.installed(model_runner, tree_pass.shape):
            forward_batch, _ = prepare_verify_forward(
                batch,
                model_runner,
                rows.tokens,
                rows.positions,
                tree_pass.verify.custom_mask,
                tree_pass.slots,
                prefix_cpu,
                tree_pass.prefix_sum,
            )
            result = sgl.target_forward(worker.target_worker, forward_batch)
        if result.can_run_cuda_graph:
            self._graphs.note_replay(rows.width, len(prefix_cpu))
        logits_output = result.logits_output
        logits_output.next_token_logits = sgl.gathered_verify_logits(worker, logits_output.next_token_logits)
        return result

    def roots(self, inputs: DecodeInputs, contexts: list[int], new_seq_lens: torch.Tensor) -> RootsPass:
        """A width-1 step's forward of the roots: SGLang's own DECODE forward where no grammar and no captured
        graph need the verify layout, else a verify pass of the roots (padded to its graph width, with the
        grammar's links). contexts: [B] host L_b; new_seq_lens: [B] int64 L_b + 1."""
        batch = inputs.batch
        if batch.has_grammar or not self.runs_plain_decode:
            tree_pass = self.layout(inputs, kernels.root_rows(inputs.roots), contexts)
            target_out = self.verify(batch, tree_pass, inputs.prefix_cpu)
            return RootsPass(target_out, tree_pass.slots[:, 0], tree_pass.shape.width, tree_pass.grammar_tree)
        slots = self.root_slots(inputs)
        target_out = self.decode_plain(inputs, slots, new_seq_lens, sum(contexts) + len(contexts))
        return RootsPass(target_out, slots, 1, None)

    def decode_plain(
        self, inputs: DecodeInputs, slots: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int
    ) -> GenerationBatchResult:
        """The target's plain DECODE forward of the roots at `slots` [B], as SGLang runs it without
        speculation, with the drafter's feature layers captured for the commit. seq_lens: [B] L_b + 1;
        seq_lens_sum: their sum (host int). Returns the result of a verify of width 1: logits [B, V], hidden
        states [B, H]."""
        target_worker = self._worker.target_worker
        with plain_decode_forward(
            inputs.batch,
            target_worker.model_runner,
            inputs.roots,
            slots,
            seq_lens,
            inputs.prefix_cpu,
            seq_lens_sum,
        ) as forward_batch:
            return sgl.target_forward(target_worker, forward_batch)
