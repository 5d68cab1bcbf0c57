"""The draft-source seam: what the engine asks of a drafter each step, and the DFlash implementation.

Terms. The *committed* sequence is the prompt plus every emitted token; its last token is the bonus token,
the only one not yet in the target's KV cache, so ctx_len = len(committed) - 1 and the bonus sits at
position ctx_len. A proposer returns, for the D = block_size - 1 positions after the bonus, the top-k
tokens and their log-probabilities (`DraftTopK`), from which the controller builds the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from bastion_sglang.kernels import topk_logprobs
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.reference.drafter import DFlashDrafter, DraftContextCache


@dataclass(frozen=True)
class DraftInput:
    """What a proposer sees at one step (batch 1)."""

    committed: torch.Tensor  # [ctx_len + 1] int64 on the device: prompt + emitted tokens, bonus last
    new_features: torch.Tensor | None  # [n, F·h] target features of positions ctx_len - n .. ctx_len - 1
    # (those committed since the previous step; the whole prompt at the first step); None if not requested

    @property
    def ctx_len(self) -> int:
        """Tokens in the target's KV cache; the bonus token's position."""
        return int(self.committed.shape[0]) - 1


class DraftProposer(Protocol):
    """A source of per-position top-k draft distributions for the next block."""

    @property
    def depth(self) -> int:
        """D: future positions proposed per step (block_size - 1 for DFlash)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the proposer reads (HF hidden_states[l + 1]); () for none."""

    def start(self, capacity: int) -> None:
        """Begin a new sequence of at most `capacity` committed positions (drops all state)."""

    def propose(self, draft_input: DraftInput, k: int) -> DraftTopK:
        """Top-k draft tokens for positions ctx_len + 1 .. ctx_len + D: DraftTopK [1, D, k]."""


class DFlashProposer:
    """DFlash drafting: one drafter pass over [bonus, MASK × (B - 1)] with the target's embedding and head."""

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self._cache: DraftContextCache | None = None

    @property
    def depth(self) -> int:
        return self.drafter.config.block_size - 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    @property
    def cache(self) -> DraftContextCache | None:
        """The drafter's context K/V of the current sequence (None before `start`)."""
        return self._cache

    def start(self, capacity: int) -> None:
        self._cache = self.drafter.new_cache(capacity)

    @torch.no_grad()
    def propose(self, draft_input: DraftInput, k: int) -> DraftTopK:
        if self._cache is None:
            raise ValueError("DFlashProposer.propose called before start()")
        if draft_input.new_features is None:
            raise ValueError("DFlashProposer needs the target features of the newly committed positions")
        new = int(draft_input.new_features.shape[0])
        if self._cache.length + new != draft_input.ctx_len:
            raise ValueError(
                f"draft context holds {self._cache.length} positions, {new} new ones do not reach "
                f"ctx_len {draft_input.ctx_len}"
            )
        self.drafter.append_context(self._cache, draft_input.new_features)
        config = self.drafter.config
        block = torch.full(
            (config.block_size,), config.mask_token_id, dtype=torch.int64, device=draft_input.committed.device
        )
        block[0] = draft_input.committed[-1]
        states = self.drafter(self.embed_tokens(block).to(self.drafter.fc.weight.dtype), self._cache)
        logits = self.lm_head(states[1:].to(self.lm_head.weight.dtype))  # [D, V]
        return topk_logprobs(logits[None], k)
