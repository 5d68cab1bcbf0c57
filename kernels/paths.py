"""The accept walk and the compaction of its path as one op of fixed shape: `accept_paths`.

What a tree step commits, from its verify rows [B, W], their ancestor mask and the target's token after each
row: the permutation that puts each request's accepted path first, the step's output rows, the tokens
emitted and the bonus. `accept_walk` -> `compaction_order` -> `committed_tokens` compute the same values in
about forty torch ops (at W = 17) and from the walk's result; this computes them from the acceptance of each
node in thirteen, every one of shape [B, W] or [B, W, W] and none reading a value back to the host, so the
ops of a step depend only on its bucket (B, W) and could be recorded in a CUDA graph. Plain torch on every
device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bastion_sglang.kernels.types import TreeBatch


@dataclass(frozen=True)
class AcceptedPaths:
    """What a tree step commits (the path of request b: its root and accepted nodes, one per depth).

    order: each row's permutation with the path first, root to deepest, then the other positions
    ascending (`compaction_order`); out_tokens: the step's output row, the path's draft tokens, the bonus,
    then zeros (`committed_tokens`); commit_lens: tokens emitted, accepted nodes + 1, as SGLang's accept
    lengths (int32); commit_counts: the same counts as int64, the dtype of the committed lengths they are
    added to; bonus_tokens: the target's token after the deepest path node (the next root).
    """

    order: torch.Tensor  # [B, W] int64
    out_tokens: torch.Tensor  # [B, W] int64
    commit_lens: torch.Tensor  # [B] int32
    commit_counts: torch.Tensor  # [B] int64, equal to commit_lens
    bonus_tokens: torch.Tensor  # [B] int64


def accept_paths(trees: TreeBatch, ancestors: torch.Tensor, target_tokens: torch.Tensor) -> AcceptedPaths:
    """The accepted paths of verify rows and what they commit; no host sync, 13 ops at every (B, W).

    trees: TreeBatch [B, W] (sibling tokens distinct); ancestors: [B, W, W] bool, [b, j, k] True iff k is j
    or an ancestor of j (`VerifyLayout.ancestor_mask` of these rows); target_tokens: [B, W] int64, the
    target's token after each position.

    Node j >= 1 matches when its token is the target's token after its parent; a node is accepted when
    every node of its chain but the root matches (the accept walk's path: siblings' tokens are distinct, so
    at most one node per depth is). Sorting the positions by their depth, with every rejected position at
    depth W, stably, lists the path root to deepest and then the rest ascending. The output's column k < a
    is the target's token after the path's node at depth k, which is the token of its node at depth k + 1
    (that node matches); column a is the target's token after the deepest node, the bonus.
    """
    width = trees.tokens.shape[1]
    mismatch = trees.tokens[:, 1:] != target_tokens.gather(1, trees.parents[:, 1:])  # [B, W - 1]
    rejected = (ancestors[:, :, 1:] & mismatch[:, None, :]).any(dim=-1)  # [B, W]
    keys, order = torch.sort(trees.depths.masked_fill(rejected, width), dim=1, stable=True)
    on_path = keys < width  # [B, W]: the path's columns, a prefix of each row
    out_tokens = target_tokens.gather(1, order) * on_path
    kept = on_path.sum(dim=1, keepdim=True)  # [B, 1] int64: accepted nodes + 1
    return AcceptedPaths(
        order=order,
        out_tokens=out_tokens,
        commit_lens=kept[:, 0].to(torch.int32),
        commit_counts=kept[:, 0],
        bonus_tokens=out_tokens.gather(1, kept - 1)[:, 0],
    )
