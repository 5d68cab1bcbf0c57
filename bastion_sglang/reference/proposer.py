"""The DFlash draft source of the reference engine (`draft_protocols.DraftSource`: what the engine asks of a
drafter each step; that module defines the terms). It returns, for the D = block_size - 1 positions after
the bonus, the top-k tokens and their log-probabilities (`DraftTopK`), from which the controller builds the
tree. `DraftBlockPass` is the drafter pass it shares with the DFlash2 source (`reference.lattice_proposer`).
"""

from __future__ import annotations

import torch
from torch import nn

from bastion_sglang.kernels import topk_logprobs
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.reference.drafter import DFlashDrafter, DraftContextCache
from bastion_sglang.step.draft_protocols import DraftInput
from bastion_sglang.step.rank_sync import DraftHead


class DraftBlockPass:
    """A drafter's context over one sequence and its pass over [bonus, MASK × (B - 1)] with the target's
    embedding: the final hidden states a DFlash or DFlash2 source reads its draft from."""

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Module) -> None:
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        self.cache: DraftContextCache | None = None

    def start(self, capacity: int) -> None:
        self.cache = self.drafter.new_cache(capacity)

    @torch.no_grad()
    def states(self, draft_input: DraftInput) -> torch.Tensor:
        """Ingest the newly committed positions' features, then run the block: [block_size, h] final states,
        row 0 the bonus token's, row e + 1 that of draft position e."""
        if self.cache is None:
            raise ValueError("the drafter pass was asked for a draft before start()")
        if draft_input.new_features is None:
            raise ValueError("a DFlash drafter needs the target features of the newly committed positions")
        new = int(draft_input.new_features.shape[0])
        if self.cache.length + new != draft_input.ctx_len:
            raise ValueError(
                f"draft context holds {self.cache.length} positions, {new} new ones do not reach "
                f"ctx_len {draft_input.ctx_len}"
            )
        self.drafter.append_context(self.cache, draft_input.new_features)
        config = self.drafter.config
        block = torch.full(
            (config.block_size,), config.mask_token_id, dtype=torch.int64, device=draft_input.committed.device
        )
        block[0] = draft_input.committed[-1]
        return self.drafter(self.embed_tokens(block).to(self.drafter.fc.weight.dtype), self.cache)


class DFlashProposer:
    """The DFlash DraftSource: one drafter pass over [bonus, MASK × (B - 1)] with the target's embedding and
    head. A DFlash2 drafter (with a selector) is refused: its draft is a lattice (`DFlash2Proposer`)."""

    def __init__(
        self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head: nn.Module | DraftHead
    ) -> None:
        if drafter.candidate_selector is not None:
            raise ValueError(
                "DFlashProposer drafts with a plain DFlash drafter; this one has a DFlash2 candidate "
                "selector, whose draft is a lattice: use reference.lattice_proposer.DFlash2Proposer"
            )
        self._pass = DraftBlockPass(drafter, embed_tokens)
        self.lm_head = lm_head

    @property
    def drafter(self) -> DFlashDrafter:
        return self._pass.drafter

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
    def propose(self, draft_input: DraftInput, k: int) -> DraftTopK:
        states = self._pass.states(draft_input)
        if isinstance(self.lm_head, DraftHead):  # the draft step's own head, a draft vocabulary's top-K
            return self.lm_head.top_k(states[None, 1:], k)
        logits = self.lm_head(states[1:].to(self.lm_head.weight.dtype))  # [D, V]
        return topk_logprobs(logits[None], k)
