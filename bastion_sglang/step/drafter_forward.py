"""The draft stage of a decode step: the DFlash drafter's one pass, then the top-K candidates per position or,
for a DFlash2 drafter, its candidate lattice.

The drafter runs over each request's block [root, MASK x (γ-1)] at positions L_b..L_b+γ-1 (SGLang's DFlash
draft forward, `spec_input.prepare_draft_forward`); the first h of the γ-1 positions after the root are
drafted (h: the draft horizon, `controller.horizon`).
- DFlash: the target's LM head turns their hidden states into logits [B, h, V] (under TP the head is sharded
  by vocabulary, `rank_sync.DraftHead`); a configured `DraftLogitsRewriter` may rewrite them; the
  `DraftTopKReader` keeps K candidates per position (`DraftTopK`): `kernels.topk_logprobs`, or under synthetic
  acceptance the profile's stated probabilities at the drafter's own top ids. With a draft vocabulary
  (`integration.draft_vocab`) the head scores its Vd tokens only: without a rewriter or a synthetic reader
  the top-K is taken over those Vd logits (`DraftHead.top_k`), otherwise over [B, h, V] logits that are
  -inf outside it.
- DFlash2: the target's LM head turns the hidden states into logits [B, h, V] once; SGLang's own selector
  path on them (`sglang_adapter.lattice_of_head_logits`: `compute_candidates` after its matmul, SGLang's
  top-K of the raw logits and the drafter's transform of their values, then
  `CandidateSelector.build_lattice` anchored at the roots) gives the K candidates of each position and the
  scores between adjacent positions' candidates; the transitions are their temperature-1 log-probs
  (`controller.lattice_tree.selector_logprobs`) and the unary log-probs the log-softmax over the vocabulary
  of the same logits transformed, read at the candidates, as the reference engine's `DFlash2Proposer`
  computes them (`DraftLattice`). SGLang's `compute_candidates` would apply the head a second time; on one
  rank its matmul is the draft head's, so the candidates and scores are the ones it gives.
Nothing is read back to the host here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import kernels
from bastion_sglang.controller.lattice_tree import selector_logprobs
from bastion_sglang.integration import sglang_adapter as sgl
from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.integration.draft_vocab import resolve_draft_vocabulary
from bastion_sglang.integration.sglang_adapter import DFlashWorkerV2, draft_tp_context
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.draft_protocols import DraftLogitsRewriter, DraftTopKReader
from bastion_sglang.step.rank_sync import DraftHead, RankGroup
from bastion_sglang.step.spec_input import prepare_draft_forward

if TYPE_CHECKING:
    from bastion_sglang.step.target_forward import DecodeInputs

logger = logging.getLogger(__name__)


def draft_head(
    config: BastionConfig,
    server_args: Any,
    lm_head: torch.nn.Module,
    vocab_size: int,
    group: RankGroup | None,
    lattice_drafter: bool,
) -> DraftHead:
    """The draft step's head over the target's `lm_head` (V = `vocab_size`; group: the TP group, None with
    one rank): over the draft vocabulary `--bastion-draft-vocab` resolves to for the drafter of
    `server_args` (lattice_drafter: whether it is a DFlash2 drafter), else the whole vocabulary. Logs
    which."""
    vocabulary, path = resolve_draft_vocabulary(
        config.draft_vocab, server_args.speculative_draft_model_path, vocab_size, config.topk, lattice_drafter
    )
    if vocabulary is None:
        logger.info("BASTION: the draft step scores the whole vocabulary (%d tokens)", vocab_size)
        return DraftHead.of(lm_head, vocab_size, group)
    logger.info(
        "BASTION: the draft step scores the draft vocabulary of %s: %d of %d tokens (%.1f %% of the %d "
        "tokens it counted)",
        path,
        len(vocabulary.token_ids),
        vocab_size,
        100.0 * vocabulary.coverage,
        vocabulary.counted_tokens,
    )
    return DraftHead.of(lm_head, vocab_size, group, vocabulary.token_ids)


class DrafterForward:
    """The draft stage of `worker` (a DFlashWorkerV2 whose drafter runs blocks of `block_size` tokens).

    Holds the persistent block buffer ([max_batch, γ] int64: column 0 takes each step's roots, the rest stay
    MASK), the embedding the drafter reads, the target's LM head as the draft head, the rewriter, and a
    DFlash2 drafter's candidate selector (None for DFlash). A DFlash2 drafter's `lm_head` is pointed at the
    target's here; its lattice takes no rewriter (ValueError).
    """

    def __init__(
        self,
        worker: DFlashWorkerV2,
        block_size: int,
        max_batch: int,
        draft_head: DraftHead,
        branching: int,
        rewriter: DraftLogitsRewriter | None,
        top_k: DraftTopKReader = kernels.topk_logprobs,
    ) -> None:
        self._worker = worker
        device = torch.device(worker.device)
        sgl.set_draft_block_size(worker, block_size)
        self._block_spec_info = sgl.install_draft_block_spec_info(worker, block_size)
        self._block_offsets = torch.arange(block_size, dtype=torch.int64, device=device)
        self._block_ids = torch.full(
            (max_batch, block_size), sgl.mask_token_id(worker), dtype=torch.int64, device=device
        )
        self._embed = sgl.resolve_dflash_embedding_module(worker.draft_model, worker.model_runner.model)
        self._noise_scale = sgl.noise_embed_scale(worker)
        self._draft_head = draft_head
        self._branching = branching
        self._rewriter = rewriter
        self._top_k = top_k
        self._selector = sgl.dflash2_selector(worker)
        if self._selector is not None:
            if rewriter is not None or top_k is not kernels.topk_logprobs:
                raise ValueError(
                    "a DraftLogitsRewriter (BastionConfig.draft_proposer) or synthetic acceptance rewrites "
                    "DFlash draft logits [B, h, V]; this DFlash2 drafter drafts a candidate lattice, which "
                    "it cannot rewrite"
                )
            sgl.attach_selector_head(worker, worker.model_runner.model.lm_head)

    @property
    def draft_vocab_size(self) -> int | None:
        """The tokens the draft head scores: its draft vocabulary's size, None for the whole vocabulary."""
        ids = self._draft_head.token_ids
        return None if ids is None else int(ids.shape[0])

    @property
    def drafts_lattices(self) -> bool:
        """Whether the drafter is a DFlash2 drafter (its drafts are `DraftLattice`s)."""
        return self._selector is not None

    def draft(self, inputs: DecodeInputs, horizon: int, contexts: Sequence[int]) -> DraftTopK | DraftLattice:
        """The draft of the first h = `horizon` positions after each root of the step's batch: DraftTopK
        [B, h, K] log-probs and ids (DFlash), or DraftLattice [B, h, K] candidates with [B, h, K, K]
        transitions (DFlash2, K its selector's top_k). contexts: [B] committed lengths (host), for the
        rewriter."""
        hidden = self._hidden_states(inputs, horizon, sum(contexts))
        with torch.inference_mode(), draft_tp_context(self._worker.draft_parallel_layout):
            if self._selector is not None:
                return self._lattice(hidden, inputs.roots)
            if self._rewriter is None and self._top_k is kernels.topk_logprobs:
                return self._draft_head.top_k(hidden, self._branching)
            logits = self._draft_head(hidden)
        if self._rewriter is not None:
            logits = self._rewriter(inputs.batch.reqs, logits, contexts)
        return self._top_k(logits, self._branching)

    def _hidden_states(self, inputs: DecodeInputs, horizon: int, prefix_sum: int) -> torch.Tensor:
        """The drafter's final hidden states [B, h, H] of the first h = `horizon` of the γ-1 positions after
        each root. prefix_sum: Σ L_b, the batch's committed tokens.

        The block [root, MASK x (γ-1)] is written to the drafter KV at slots req_to_token[r, L : L + γ]
        (overwritten by the commit later).
        """
        worker = self._worker
        bs = inputs.roots.shape[0]
        block_ids = self._block_ids[:bs]
        block_ids[:, 0] = inputs.roots
        embeds = self._embed(block_ids)
        if self._noise_scale != 1.0:
            embeds = embeds * self._noise_scale
        forward_batch = prepare_draft_forward(
            inputs.batch,
            worker.model_runner,
            worker.draft_model_runner,
            block_ids,
            embeds,
            inputs.prefix,
            prefix_sum,
            inputs.rows_index,
            self._block_offsets,
            self._block_spec_info,
        )
        with torch.inference_mode(), draft_tp_context(worker.draft_parallel_layout):
            draft_out = worker.draft_model_runner.forward(forward_batch)
            return draft_out.logits_output.hidden_states.view(bs, block_ids.shape[1], -1)[:, 1 : 1 + horizon]

    def _lattice(self, hidden: torch.Tensor, roots: torch.Tensor) -> DraftLattice:
        """The DFlash2 lattice (module docstring) of hidden [B, h, H] after roots [B] int64: candidates and
        unary log-probs [B, h, K], transitions [B, h, K, K] float32. The LM head runs once."""
        draft_model = self._worker.draft_model
        logits = self._draft_head(hidden)  # [B, h, V] raw, the step's one head matmul
        candidate_ids, scores = sgl.lattice_of_head_logits(draft_model, logits, hidden, roots)
        # transformed in place (a float32 head's logits) only after the candidates were taken from them
        unary = torch.log_softmax(sgl.transform_unary_logits(draft_model, logits), dim=-1)
        return DraftLattice(
            unary=DraftTopK(unary.gather(-1, candidate_ids), candidate_ids),
            transitions=selector_logprobs(scores, 1.0),
        )
