"""The DFlash2 draft source of the reference engine (`draft_protocols.DraftSource`): the DFlash drafter pass,
then SGLang's candidate selector over the target LM head's top-K of each position (`reference.selector`),
giving a `DraftLattice` that the controller builds trees over (`controller.lattice_tree`).

Per step, with D = block_size - 1 and h_e the drafter's final state of position e: the candidates are the
top-K of the LM head on h_e (raw logits, as SGLang's `candidate_topk`), their unary logits the transformed
raw logits (`transform_unary_logits`), the lattice scores `CandidateSelector.build_lattice` with the bonus
token as the anchor, and the transitions `selector_logprobs(scores, 1.0)`: the temperature-1 log-probs,
on which the DFlash source plans too (`kernels.topk_logprobs`). The unary log-probs are the log-softmax over
the vocabulary of the transformed logits, read at the candidates.
"""

from __future__ import annotations

import torch
from torch import nn

from bastion_sglang.controller.lattice_tree import selector_logprobs
from bastion_sglang.integration.drafter_config import SelectorConfig
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.reference.drafter import DFlashDrafter, DraftContextCache
from bastion_sglang.reference.proposer import DraftBlockPass
from bastion_sglang.reference.selector import CandidateSelector, candidate_topk, transform_unary_logits
from bastion_sglang.step.draft_protocols import DraftInput


class DFlash2Proposer:
    """The DFlash2 DraftSource (module docstring). drafter: a DFlash2 drafter (with its selector);
    embed_tokens, lm_head: the target's (a bias-free head)."""

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        if drafter.config.selector is None or drafter.candidate_selector is None:
            raise ValueError(
                "DFlash2Proposer needs a DFlash2 drafter (dflash_config.selector_rank and selector_top_k "
                "with a DFlash2 architecture); this one is plain DFlash: use DFlashProposer"
            )
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("DFlash2 candidates come from a bias-free LM head, as SGLang's candidate_topk")
        self._pass = DraftBlockPass(drafter, embed_tokens)
        self.lm_head = lm_head

    @property
    def drafter(self) -> DFlashDrafter:
        return self._pass.drafter

    @property
    def selector(self) -> SelectorConfig:
        selector = self.drafter.config.selector
        if selector is None:
            raise ValueError("the drafter has no selector")
        return selector

    @property
    def depth(self) -> int:
        return self.drafter.config.block_size - 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    @property
    def cache(self) -> DraftContextCache | None:
        """The drafter's context K/V of the current sequence (None before `start`)."""
        return self._pass.cache

    def start(self, capacity: int) -> None:
        self._pass.start(capacity)

    @torch.no_grad()
    def propose(self, draft_input: DraftInput, k: int) -> DraftLattice:
        """The lattice of the next D positions: DraftLattice [1, D, K] candidates and [1, D, K, K]
        transitions, K the selector's top_k whatever k is (the planner caps a node's children at k)."""
        module = self.drafter.candidate_selector
        if not isinstance(module, CandidateSelector):
            raise ValueError("the drafter has no candidate selector")
        selector = self.selector
        hidden = self._pass.states(draft_input)[1:]  # [D, h]
        candidates = candidate_topk(hidden, self.lm_head.weight, selector.top_k)
        scores = module.build_lattice(
            candidate_ids=candidates.ids[None],
            unary_logits=transform_unary_logits(candidates.raw, selector)[None],
            hidden_states=hidden[None],
            anchor_token_ids=draft_input.committed[-1:],
        )  # [1, D, K, K]
        unary = torch.log_softmax(transform_unary_logits(candidates.logits, selector), dim=-1)  # [D, V]
        return DraftLattice(
            unary=DraftTopK(unary.gather(-1, candidates.ids)[None], candidates.ids[None]),
            transitions=selector_logprobs(scores, 1.0),
        )
