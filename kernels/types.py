"""Typed values passed between the device ops of one speculative step.

Terms. A request's *verify row* has W positions: position 0 is the root (the bonus token of the previous
step, already known to be correct), positions 1..W-1 are the first W-1 nodes of its best-first draft tree
(draft node i sits at position i + 1). Every position is a real node; there is no padding inside a row.
All index tensors are int64 and live on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

import torch

NO_NODE: Final = -1
"""Sentinel position: the root's parent, a missing first child / next sibling, accept_index padding."""

NO_MOVE: Final = -1
"""Sentinel cache row in `KvMoves.src` / `KvMoves.dst`: this slot moves nothing."""


class DraftTreeRows(Protocol):
    """What `flatten_trees` reads from the controller's `DraftTreeBatch` (B rows of N best-first nodes)."""

    @property
    def tokens(self) -> torch.Tensor: ...  # [B, N] int64: token id of each draft node

    @property
    def parents(self) -> torch.Tensor: ...  # [B, N] int64: parent node index (< own index), or -1 = root

    @property
    def depths(self) -> torch.Tensor: ...  # [B, N] int64: 1..D


@dataclass(frozen=True)
class TreeBatch:
    """The verify rows of a batch: B requests, W positions each, position 0 = root."""

    tokens: torch.Tensor  # [B, W] int64: column 0 = bonus token, column j >= 1 = draft node j - 1
    parents: torch.Tensor  # [B, W] int64: parents[:, 0] = NO_NODE, else a position in [0, j)
    depths: torch.Tensor  # [B, W] int64: 0 for the root, else 1..D

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


@dataclass(frozen=True)
class VerifyLayout:
    """Per-position inputs of the target's verify pass, derived from a `TreeBatch`."""

    positions: torch.Tensor  # [B, W] int64: rotary position = ctx_len + depth
    ancestor_mask: torch.Tensor  # [B, W, W] bool: [b, j, k] True iff k is j or an ancestor of j
    first_child: torch.Tensor  # [B, W] int64: smallest child position of j, or NO_NODE
    next_sibling: torch.Tensor  # [B, W] int64: next larger position with the same parent, or NO_NODE


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of the accept walk of one verify pass.

    The step emits the tokens of the accepted draft nodes (accept_index[b, 1..accept_length[b]]) followed
    by bonus_tokens[b]; accept_length[b] + 1 tokens in all.
    """

    accept_index: torch.Tensor  # [B, W] int64: accepted positions root first (slot k = depth k), NO_NODE pad
    accept_length: torch.Tensor  # [B] int64: number of accepted draft nodes, 0..W-1
    bonus_tokens: torch.Tensor  # [B] int64: the target's token after the last accepted node


@dataclass(frozen=True)
class KvMoves:
    """Cache rows to copy so that each request's accepted path sits at the front of its tree block.

    Slot k of request b moves row src[b, k] to row dst[b, k] (tree_base[b] + accept_index[b, k] ->
    tree_base[b] + k); slots with nothing to move hold NO_MOVE in both arrays.
    """

    src: torch.Tensor  # [B, W] int64: source cache row, or NO_MOVE
    dst: torch.Tensor  # [B, W] int64: destination cache row, or NO_MOVE
    keep: torch.Tensor  # [B] int64: rows of the tree block to keep (accept_length + 1, root included)


@dataclass(frozen=True)
class DraftTopK:
    """The drafter's top-k tokens per future position, as consumed by the controller's tree builder."""

    logprobs: torch.Tensor  # [B, D, k] float32: log-probabilities, each row sorted descending
    token_ids: torch.Tensor  # [B, D, k] int64: the matching token ids


@dataclass(frozen=True)
class DraftLattice:
    """A DFlash2 drafter's proposal: K candidates per position and the transition log-probabilities between
    the candidates of adjacent positions (SGLang's `CandidateSelector` lattice), which the controller's
    `lattice_tree` builds trees over.

    unary: the candidates of each of the D positions, largest drafter logit first, with their unary
    log-probabilities (the drafter's own per-position distribution over the vocabulary); what a tree over
    independent positions would read. transitions[b, e, p, c]: log q(candidate c of position e | candidate p
    of position e - 1), each [K] row a distribution over position e's candidates; position 0 follows the
    root, so its K rows are one row.
    """

    unary: DraftTopK  # [B, D, K]: candidates and their unary log-probs
    transitions: torch.Tensor  # [B, D, K, K] float32: row [b, e, p] over position e's candidates
