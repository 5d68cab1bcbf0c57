"""Verify rows for kernel tests: best-first trees from the planner, random, chain and star trees, and target
tokens that follow a chosen child, all seeded and on the CPU.

A tree kind names its shape: "best_first" (`build_tree` on random drafter top-k, 16 depths, top-8),
"random" (each node's parent uniform among earlier positions), "chain" (depth W - 1, the deepest tree of
width W) and "star" (every node a child of the root). Tokens are distinct within a row.
"""

from __future__ import annotations

import torch

from bastion_sglang.controller.batched import DraftTreeBatch
from bastion_sglang.controller.tree import build_tree
from bastion_sglang.kernels import NO_NODE, TreeBatch, reference

VOCAB = 4096
"""Token ids of the generated rows lie in [0, VOCAB)."""

KINDS = ("best_first", "random", "chain", "star")


def best_first_trees(gen: torch.Generator, batch: int, width: int) -> TreeBatch:
    """[B, W] verify rows of `build_tree` on random drafter outputs (16 depths, top-8), random bonus roots."""
    rows = []
    for _ in range(batch):
        top = torch.log_softmax(torch.randn(16, VOCAB, generator=gen).double() * 3, dim=-1).topk(8, dim=-1)
        token_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:8] for _ in range(16)])
        rows.append(build_tree(top.values, token_ids, width - 1))
    fields = ("tokens", "parents", "depths", "log_scores")
    draft = DraftTreeBatch(*(torch.stack([getattr(tree, f) for tree in rows]) for f in fields))
    bonus = torch.randint(0, VOCAB, (batch,), generator=gen)
    return reference.flatten_trees(draft, bonus, width)


def shaped_trees(gen: torch.Generator, batch: int, width: int, kind: str) -> TreeBatch:
    """[B, W] verify rows with "random", "chain" or "star" parents."""
    position = torch.arange(width)
    if kind == "random":
        parents = (torch.rand(batch, width, generator=gen) * position).long()
    elif kind == "chain":
        parents = (position - 1).expand(batch, width).clone()
    elif kind == "star":
        parents = torch.zeros(batch, width, dtype=torch.int64)
    else:
        raise ValueError(f"tree kind must be one of {KINDS}, got {kind!r}")
    parents[:, 0] = NO_NODE
    depths = torch.zeros(batch, width, dtype=torch.int64)
    for j in range(1, width):
        depths[:, j] = depths.gather(1, parents[:, j : j + 1])[:, 0] + 1
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[:width] for _ in range(batch)])
    return TreeBatch(tokens=tokens, parents=parents, depths=depths)


def make_trees(gen: torch.Generator, batch: int, width: int, kind: str) -> TreeBatch:
    """[B, W] verify rows of tree kind `kind` (module doc)."""
    if kind == "best_first":
        return best_first_trees(gen, batch, width)
    return shaped_trees(gen, batch, width, kind)


def biased_targets(gen: torch.Generator, trees: TreeBatch, hit: float) -> torch.Tensor:
    """[B, W] int64 target tokens: after each position, with probability `hit` the token of one of its
    children (chosen at random), else a random token."""
    tokens, parents = trees.tokens, trees.parents
    batch, width = tokens.shape
    priority = torch.rand(batch, width, generator=gen)
    slot = torch.where(parents >= 0, parents, width)
    best = torch.full((batch, width + 1), -1.0).scatter_reduce(1, slot, priority, reduce="amax")
    chosen = (parents >= 0) & (priority == best.gather(1, slot))
    child_token = torch.full((batch, width + 1), -1, dtype=torch.int64)
    child_token.scatter_(1, torch.where(chosen, slot, width), torch.where(chosen, tokens, -1))
    child_token = child_token[:, :width]
    targets = torch.randint(0, VOCAB, (batch, width), generator=gen)
    take = (child_token >= 0) & (torch.rand(batch, width, generator=gen) < hit)
    return torch.where(take, child_token, targets)


def hand_tree() -> TreeBatch:
    """The 5-node tree of tests/test_kernels_tree.py as one verify row (bonus 5):
    positions 0..5 carry tokens 5, 10, 11, 20, 21, 30 with parents -, 0, 0, 1, 1, 3."""
    return TreeBatch(
        tokens=torch.tensor([[5, 10, 11, 20, 21, 30]]),
        parents=torch.tensor([[NO_NODE, 0, 0, 1, 1, 3]]),
        depths=torch.tensor([[0, 1, 1, 2, 2, 3]]),
    )
