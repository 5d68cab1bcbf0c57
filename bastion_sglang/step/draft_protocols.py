"""The two seams around a drafter, side by side: where draft distributions come from, and how a deployment
may rewrite them. They have different contracts, so they have different names.

- `DraftSource` (the reference engine, batch 1): produces the drafter's top-k per position, or a DFlash2
  drafter's candidate lattice. It owns the drafter's state across steps (`start`, then one `propose` per
  step, fed the target features of the positions committed since). `reference.DFlashProposer` is the
  DFlash one, `reference.lattice_proposer.DFlash2Proposer` the DFlash2 one; tests plug in oracles.
- `DraftLogitsRewriter` (the SGLang worker, a batch of B requests): the drafter has already run through
  SGLang's DFlash draft path; a rewriter maps its logits [B, h, V] (the first h of the D drafted positions,
  h the draft horizon, `controller.horizon`) to logits of the same shape before the top-k, e.g. to steer the
  tree towards a known continuation in tests. It is configured by name on the
  server (`BastionConfig.draft_proposer` = "module:factory", called once with `draft_proposer_arg` in the
  scheduler process; `load_draft_logits_rewriter`).
- `DraftTopKReader` (the SGLang worker): reads the top-k the tree search plans on from those logits,
  `kernels.topk_logprobs` unless synthetic acceptance states its profile's probabilities at the drafter's own
  top ids (`synthetic_acceptance.SyntheticDraft.top`), at the cost of the same log-softmax and top-k.

Terms. The *committed* sequence is the prompt plus every emitted token; its last token is the bonus token,
the only one not yet in the target's KV cache, so ctx_len = len(committed) - 1 and the bonus sits at
position ctx_len. D = drafter block size - 1: the positions drafted after the bonus.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.kernels.types import DraftLattice, DraftTopK

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


@dataclass(frozen=True)
class DraftInput:
    """What a DraftSource sees at one step (batch 1)."""

    committed: torch.Tensor  # [ctx_len + 1] int64 on the device: prompt + emitted tokens, bonus last
    new_features: torch.Tensor | None  # [n, F·h] target features of positions ctx_len - n .. ctx_len - 1
    # (those committed since the previous step; the whole prompt at the first step); None if not requested

    @property
    def ctx_len(self) -> int:
        """Tokens in the target's KV cache; the bonus token's position."""
        return int(self.committed.shape[0]) - 1


class DraftSource(Protocol):
    """A source of draft distributions for the next block (the reference engine's): per-position top-k, or
    a lattice of transitions between adjacent positions' candidates."""

    @property
    def depth(self) -> int:
        """D: future positions proposed per step (block_size - 1 for DFlash)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the source reads (HF hidden_states[l + 1]); () for none."""

    def start(self, capacity: int) -> None:
        """Begin a new sequence of at most `capacity` committed positions (drops all state)."""

    def propose(self, draft_input: DraftInput, k: int) -> DraftTopK | DraftLattice:
        """Draft of positions ctx_len + 1 .. ctx_len + D: the top-k tokens, DraftTopK [1, D, k]; or a
        DraftLattice [1, D, K, K] with the source's own K, whose tree nodes then keep at most k children."""


class DraftLogitsRewriter(Protocol):
    """Rewrites the SGLang drafter's logits before the tree search (the worker's)."""

    def __call__(
        self, reqs: Sequence[Req], draft_logits: torch.Tensor, prefix_lens: Sequence[int]
    ) -> torch.Tensor:
        """reqs: the batch's B requests; draft_logits: [B, h, V], h <= D the draft horizon; prefix_lens: [B]
        committed tokens with KV (the root sits at that position, so the request has emitted
        prefix - prompt + 1 tokens; under overlap scheduling a request's own `output_ids` may lag a step).
        Returns [B, h, V] logits."""


class DraftTopKReader(Protocol):
    """Reads the draft's top-k from its logits (the worker's draft stage)."""

    def __call__(self, logits: torch.Tensor, k: int) -> DraftTopK:
        """logits: [B, h, V] draft logits. Returns DraftTopK [B, h, k]: log-probs (sorted descending), ids."""


def load_draft_logits_rewriter(config: BastionConfig) -> DraftLogitsRewriter | None:
    """The configured rewriter (the `draft_proposer` factory called with `draft_proposer_arg`), or None."""
    if config.draft_proposer is None:
        return None
    module_name, _, attr = config.draft_proposer.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config.draft_proposer_arg)
