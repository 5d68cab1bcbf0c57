"""Verify rows, layout, custom mask and the accept walk (torch reference path of bastion_sglang.kernels)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from bastion_sglang.controller.batched import DraftTreeBatch
from bastion_sglang.controller.tree import build_tree
from bastion_sglang.kernels import (
    NO_NODE,
    TreeBatch,
    accept_greedy,
    accept_walk,
    build_verify_layout,
    flat_custom_mask,
    flatten_trees,
    root_rows,
)


@dataclass(frozen=True)
class StackedTrees:
    """Rows of `build_tree` stacked to [B, N] (the fields flatten_trees reads)."""

    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64
    depths: torch.Tensor  # [B, N] int64


# The hand-built tree. Draft nodes, best-first:      verify positions (root = 0, bonus token 5):
#   node 0: token 10, parent root, depth 1             1: 10 <- 0
#   node 1: token 11, parent root, depth 1             2: 11 <- 0
#   node 2: token 20, parent node 0, depth 2           3: 20 <- 1
#   node 3: token 21, parent node 0, depth 2           4: 21 <- 1
#   node 4: token 30, parent node 2, depth 3           5: 30 <- 3
HAND_TOKENS = [10, 11, 20, 21, 30]
HAND_PARENTS = [-1, -1, 0, 0, 2]
HAND_DEPTHS = [1, 1, 2, 2, 3]
HAND_BONUS = 5


def hand_tree() -> TreeBatch:
    draft = StackedTrees(
        tokens=torch.tensor([HAND_TOKENS]),
        parents=torch.tensor([HAND_PARENTS]),
        depths=torch.tensor([HAND_DEPTHS]),
    )
    return flatten_trees(draft, torch.tensor([HAND_BONUS]), width=6)


def random_best_first_trees(
    gen: torch.Generator, batch: int, depth: int, top_k: int, budget: int, vocab: int
) -> StackedTrees:
    """B best-first trees from `build_tree` on random drafter outputs, `budget` nodes each.

    Token ids per depth are distinct, so sibling tokens are distinct. The lattice must hold `budget` nodes.
    """
    rows = []
    for _ in range(batch):
        logits = torch.randn(depth, vocab, generator=gen) * 3
        top = torch.log_softmax(logits.double(), dim=-1).topk(top_k, dim=-1)
        token_ids = torch.stack([torch.randperm(vocab, generator=gen)[:top_k] for _ in range(depth)])
        tree = build_tree(top.values, token_ids, budget)
        assert len(tree) == budget
        rows.append(tree)
    return StackedTrees(
        tokens=torch.stack([t.tokens for t in rows]),
        parents=torch.stack([t.parents for t in rows]),
        depths=torch.stack([t.depths for t in rows]),
    )


def children_of(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for j, p in enumerate(parents):
        if p >= 0:
            children[p].append(j)
    return children


def biased_targets(rng: random.Random, trees: TreeBatch, vocab: int, hit: float) -> torch.Tensor:
    """[B, W] target tokens: with probability `hit` the token of a random child of the position."""
    rows = []
    for tokens, parents in zip(trees.tokens.tolist(), trees.parents.tolist(), strict=True):
        row = []
        for kids in children_of(parents):
            if kids and rng.random() < hit:
                row.append(tokens[rng.choice(kids)])
            else:
                row.append(rng.randrange(vocab))
        rows.append(row)
    return torch.tensor(rows)


def oracle_walk(tokens: list[int], parents: list[int], targets: list[int]) -> tuple[list[int], int]:
    """Parent-index walk of one verify row: (accepted positions root first, bonus token)."""
    children = children_of(parents)
    path = [0]
    while True:
        current = path[-1]
        matches = [c for c in children[current] if tokens[c] == targets[current]]
        if not matches:
            return path, targets[current]
        path.append(matches[0])


def oracle_ancestors(parents: list[int]) -> list[set[int]]:
    sets = []
    for j in range(len(parents)):
        chain, node = {j}, j
        while parents[node] >= 0:
            node = parents[node]
            chain.add(node)
        sets.append(chain)
    return sets


# ---------------------------------------------------------------- flatten_trees


def test_flatten_hand_tree():
    trees = hand_tree()
    assert trees.tokens.tolist() == [[5, 10, 11, 20, 21, 30]]
    assert trees.parents.tolist() == [[NO_NODE, 0, 0, 1, 1, 3]]
    assert trees.depths.tolist() == [[0, 1, 1, 2, 2, 3]]


def test_flatten_truncates_to_width_and_accepts_draft_tree_batch():
    draft = DraftTreeBatch(
        tokens=torch.tensor([HAND_TOKENS, [1, 2, 3, 4, 6]]),
        parents=torch.tensor([HAND_PARENTS, [-1, 0, 1, 2, 3]]),
        depths=torch.tensor([HAND_DEPTHS, [1, 2, 3, 4, 5]]),
        log_scores=torch.zeros(2, 5, dtype=torch.float64),
    )
    trees = flatten_trees(draft, torch.tensor([5, 7]), width=4)
    assert trees.tokens.tolist() == [[5, 10, 11, 20], [7, 1, 2, 3]]
    assert trees.parents.tolist() == [[-1, 0, 0, 1], [-1, 0, 1, 2]]
    assert trees.depths.tolist() == [[0, 1, 1, 2], [0, 1, 2, 3]]
    root_only = flatten_trees(draft, torch.tensor([5, 7]), width=1)
    assert root_only.tokens.tolist() == [[5], [7]]
    assert root_only.parents.tolist() == [[-1], [-1]]


def test_root_rows_equal_flattening_trees_without_a_node_at_width_one():
    bonus = torch.tensor([5, 7, 9])
    roots = root_rows(bonus)
    flattened = flatten_trees(DraftTreeBatch.empty(3, "cpu"), bonus, width=1)
    for name in ("tokens", "parents", "depths"):
        got, want = getattr(roots, name), getattr(flattened, name)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
    assert roots.width == 1 and roots.batch_size == 3
    with pytest.raises(ValueError, match=r"bonus_tokens must be int64, got torch\.int32"):
        root_rows(bonus.int())
    with pytest.raises(ValueError, match=r"bonus_tokens must be \[B\]"):
        root_rows(bonus[:, None])


def test_flatten_rejects_bad_inputs():
    draft = StackedTrees(
        tokens=torch.tensor([HAND_TOKENS]),
        parents=torch.tensor([HAND_PARENTS]),
        depths=torch.tensor([HAND_DEPTHS]),
    )
    bonus = torch.tensor([HAND_BONUS])
    with pytest.raises(ValueError, match="width 7 needs 6 draft nodes per request, trees have N = 5"):
        flatten_trees(draft, bonus, width=7)
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        flatten_trees(draft, bonus, width=0)
    with pytest.raises(ValueError, match="width must be an int"):
        flatten_trees(draft, bonus, width=True)
    with pytest.raises(ValueError, match=r"bonus_tokens must be \[B\] = \(1,\), got shape \(2,\)"):
        flatten_trees(draft, torch.tensor([1, 2]), width=3)
    with pytest.raises(ValueError, match=r"bonus_tokens must be int64, got torch\.int32"):
        flatten_trees(draft, bonus.int(), width=3)
    flat = StackedTrees(tokens=draft.tokens[0], parents=draft.parents, depths=draft.depths)
    with pytest.raises(ValueError, match=r"trees.tokens must be \[B, N\], got shape \(5,\)"):
        flatten_trees(flat, bonus, width=3)
    short = StackedTrees(tokens=draft.tokens, parents=draft.parents[:, :4], depths=draft.depths)
    with pytest.raises(ValueError, match=r"trees.parents must be \[B, N\] like trees.tokens = \(1, 5\)"):
        flatten_trees(short, bonus, width=3)


# ---------------------------------------------------------------- build_verify_layout


def test_layout_hand_tree():
    layout = build_verify_layout(hand_tree(), torch.tensor([7]))
    assert layout.positions.tolist() == [[7, 8, 8, 9, 9, 10]]
    assert layout.ancestor_mask.dtype == torch.bool
    assert layout.ancestor_mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert layout.first_child.tolist() == [[1, 3, NO_NODE, 5, NO_NODE, NO_NODE]]
    assert layout.next_sibling.tolist() == [[NO_NODE, 2, NO_NODE, 4, NO_NODE, NO_NODE]]


@pytest.mark.parametrize(
    ("batch", "depth", "top_k", "budget", "width"), [(4, 6, 3, 40, 41), (3, 12, 5, 90, 57)]
)
def test_layout_random_trees_match_parent_chase(batch, depth, top_k, budget, width):
    gen = torch.Generator().manual_seed(batch * 1000 + width)
    draft = random_best_first_trees(gen, batch, depth, top_k, budget, vocab=50)
    trees = flatten_trees(draft, torch.randint(0, 50, (batch,), generator=gen), width)
    ctx_lens = torch.randint(0, 500, (batch,), generator=gen)
    layout = build_verify_layout(trees, ctx_lens)
    for b in range(batch):
        parents = trees.parents[b].tolist()
        depths = trees.depths[b].tolist()
        for j, ancestors in enumerate(oracle_ancestors(parents)):
            expected = [k in ancestors for k in range(width)]
            assert layout.ancestor_mask[b, j].tolist() == expected
            assert depths[j] == len(ancestors) - 1
            assert layout.positions[b, j].item() == ctx_lens[b].item() + depths[j]
        # Walking first_child then next_sibling lists exactly the children, in increasing position order.
        first_child = layout.first_child[b].tolist()
        next_sibling = layout.next_sibling[b].tolist()
        for j, kids in enumerate(children_of(parents)):
            walked, node = [], first_child[j]
            while node != NO_NODE:
                walked.append(node)
                node = next_sibling[node]
            assert walked == kids
        assert next_sibling[0] == NO_NODE


def test_layout_rejects_bad_inputs():
    trees = hand_tree()
    with pytest.raises(ValueError, match=r"ctx_lens must be \[B\] = \(1,\), got shape \(2,\)"):
        build_verify_layout(trees, torch.tensor([7, 8]))
    with pytest.raises(ValueError, match=r"ctx_lens must be int64, got torch\.float32"):
        build_verify_layout(trees, torch.tensor([7.0]))
    bad = TreeBatch(trees.tokens, trees.parents[:, :5], trees.depths)
    with pytest.raises(ValueError, match=r"trees.parents must be \[B, W\] like trees.tokens = \(1, 6\)"):
        build_verify_layout(bad, torch.tensor([7]))
    with pytest.raises(ValueError, match="trees must be a TreeBatch, got dict"):
        build_verify_layout({"tokens": trees.tokens}, torch.tensor([7]))


# ---------------------------------------------------------------- flat_custom_mask


def test_flat_custom_mask_hand_tree():
    layout = build_verify_layout(hand_tree(), torch.tensor([2]))
    mask = flat_custom_mask(layout.ancestor_mask, torch.tensor([2]))
    assert mask.dtype == torch.bool
    assert mask.view(6, 8).int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 1, 0, 1],
    ]


def test_flat_custom_mask_random_batch_matches_per_request_blocks():
    gen = torch.Generator().manual_seed(3)
    draft = random_best_first_trees(gen, 5, 8, 4, 30, vocab=40)
    trees = flatten_trees(draft, torch.zeros(5, dtype=torch.int64), width=19)
    seq_lens = torch.tensor([0, 3, 17, 1, 40])
    layout = build_verify_layout(trees, seq_lens)
    blocks = [
        torch.cat([torch.ones(19, int(seq_len), dtype=torch.bool), layout.ancestor_mask[b]], dim=1)
        for b, seq_len in enumerate(seq_lens.tolist())
    ]
    expected = torch.cat([block.reshape(-1) for block in blocks])
    assert torch.equal(flat_custom_mask(layout.ancestor_mask, seq_lens), expected)
    assert torch.equal(flat_custom_mask(layout.ancestor_mask, seq_lens, seq_lens_sum=61), expected)


def test_flat_custom_mask_rejects_bad_inputs():
    mask = torch.ones(2, 3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"ancestor_mask must be \[B, W, W\], got shape \(2, 3, 4\)"):
        flat_custom_mask(torch.ones(2, 3, 4, dtype=torch.bool), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"ancestor_mask must be bool, got torch\.int64"):
        flat_custom_mask(mask.long(), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"seq_lens must be \[B\] = \(2,\), got shape \(3,\)"):
        flat_custom_mask(mask, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="seq_lens_sum must be >= 0, got -1"):
        flat_custom_mask(mask, torch.tensor([1, 2]), seq_lens_sum=-1)


# ---------------------------------------------------------------- accept_walk


def targets_for(assignments: dict[int, int]) -> torch.Tensor:
    """[1, 6] target tokens for the hand tree; unassigned positions hold tokens that would match a
    child if the walk read the wrong position (so a wrong walk is caught)."""
    base = {0: 99, 1: 20, 2: 30, 3: 30, 4: 30, 5: 10}
    base.update(assignments)
    return torch.tensor([[base[j] for j in range(6)]])


@pytest.mark.parametrize(
    ("assignments", "path", "bonus"),
    [
        ({0: 99}, [0], 99),  # early mismatch: no root child carries 99
        ({0: 10, 1: 20, 3: 30, 5: 42}, [0, 1, 3, 5], 42),  # full path to the deepest leaf
        ({0: 10, 1: 21, 4: 77}, [0, 1, 4], 77),  # mid-branch: second child at depth 2, a leaf
        ({0: 10, 1: 25}, [0, 1], 25),  # mismatch at depth 2
        ({0: 11, 2: 13}, [0, 2], 13),  # second root child, a leaf
    ],
)
def test_accept_walk_hand_tree(assignments, path, bonus):
    result = accept_walk(hand_tree(), targets_for(assignments))
    assert result.accept_index.tolist() == [path + [NO_NODE] * (6 - len(path))]
    assert result.accept_length.tolist() == [len(path) - 1]
    assert result.bonus_tokens.tolist() == [bonus]


def test_accept_walk_batch_rows_are_independent():
    trees = hand_tree()
    batch = TreeBatch(*(torch.cat([getattr(trees, f)] * 3) for f in ("tokens", "parents", "depths")))
    targets = torch.cat(
        [targets_for({0: 99}), targets_for({0: 10, 1: 20, 3: 30, 5: 42}), targets_for({0: 11})]
    )
    result = accept_walk(batch, targets)
    assert result.accept_length.tolist() == [0, 3, 1]
    assert result.bonus_tokens.tolist() == [99, 42, 30]
    assert result.accept_index.tolist() == [
        [0, -1, -1, -1, -1, -1],
        [0, 1, 3, 5, -1, -1],
        [0, 2, -1, -1, -1, -1],
    ]


def test_accept_walk_matches_oracle_on_random_trees():
    gen = torch.Generator().manual_seed(2024)
    rng = random.Random(2024)
    checked = 0
    for round_index in range(25):
        depth, top_k = (3, 4) if round_index % 2 else (10, 3)
        budget = int(torch.randint(1, 40, (), generator=gen))
        width = int(torch.randint(1, budget + 2, (), generator=gen))
        draft = random_best_first_trees(gen, 8, depth, top_k, budget, vocab=12)
        trees = flatten_trees(draft, torch.randint(0, 12, (8,), generator=gen), width)
        targets = biased_targets(rng, trees, vocab=12, hit=0.75)
        result = accept_walk(trees, targets)
        for b in range(8):
            path, bonus = oracle_walk(
                trees.tokens[b].tolist(), trees.parents[b].tolist(), targets[b].tolist()
            )
            assert result.accept_index[b].tolist() == path + [NO_NODE] * (width - len(path))
            assert result.accept_length[b].item() == len(path) - 1
            assert result.bonus_tokens[b].item() == bonus
            checked += 1
    assert checked >= 200


def test_accept_greedy_follows_argmax_with_lowest_id_on_ties():
    logits = torch.zeros(1, 6, 100)
    logits[0, 0, 10] = 5.0  # root -> position 1
    logits[0, 1, [21, 40]] = 3.0  # tie between 21 (position 4) and 40: the smaller id wins
    logits[0, 4, 64] = 1.0
    result = accept_greedy(hand_tree(), logits)
    assert result.accept_index.tolist() == [[0, 1, 4, -1, -1, -1]]
    assert result.accept_length.tolist() == [2]
    assert result.bonus_tokens.tolist() == [64]


def test_accept_walk_rejects_bad_inputs():
    trees = hand_tree()
    with pytest.raises(ValueError, match=r"target_tokens must be \[B, W\] like trees.tokens = \(1, 6\)"):
        accept_walk(trees, torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"target_tokens must be \[B, W\], got shape \(6,\)"):
        accept_walk(trees, torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"target_tokens must be int64, got torch\.int32"):
        accept_walk(trees, torch.zeros(1, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"target_logits must be a floating tensor, got torch\.int64"):
        accept_greedy(trees, torch.zeros(1, 6, 10, dtype=torch.int64))
    with pytest.raises(
        ValueError, match=r"target_logits must be \[B, W, V\] = \(1, 6, 10\), got shape \(1, 5, 10\)"
    ):
        accept_greedy(trees, torch.zeros(1, 5, 10))
