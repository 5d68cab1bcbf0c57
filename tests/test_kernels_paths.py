"""`kernels.accept_paths` against the op chain it replaces (`accept_walk`, `compaction_order`,
`committed_tokens`), on a hand-built tree and on random best-first rows; its ops and host reads per bucket."""

from __future__ import annotations

import random

import pytest
import torch
from op_counting import counted

from bastion_sglang import kernels
from bastion_sglang.kernels import NO_NODE, AcceptedPaths, TreeBatch

# root 0; 1 and 2 children of the root; 3 and 4 children of 2; 5 a child of 4 (tokens distinct)
HAND = TreeBatch(
    tokens=torch.tensor([[7, 10, 11, 20, 21, 30]]),
    parents=torch.tensor([[NO_NODE, 0, 0, 2, 2, 4]]),
    depths=torch.tensor([[0, 1, 1, 2, 2, 3]]),
)


def ancestors_of(trees: TreeBatch) -> torch.Tensor:
    prefix = torch.zeros(trees.batch_size, dtype=torch.int64, device=trees.tokens.device)
    return kernels.build_verify_layout(trees, prefix).ancestor_mask


def chained(trees: TreeBatch, target_tokens: torch.Tensor) -> AcceptedPaths:
    """What the walk, the compaction order and the committed tokens give, as `accept_paths` returns it."""
    accept = kernels.accept_walk(trees, target_tokens)
    order = kernels.compaction_order(accept.accept_index, accept.accept_length)
    return AcceptedPaths(
        order=order,
        out_tokens=kernels.committed_tokens(trees.tokens, order, accept),
        commit_lens=(accept.accept_length + 1).to(torch.int32),
        commit_counts=accept.accept_length.to(torch.int64) + 1,
        bonus_tokens=accept.bonus_tokens,
    )


def assert_same(got: AcceptedPaths, expected: AcceptedPaths) -> None:
    for name in ("order", "out_tokens", "commit_lens", "commit_counts", "bonus_tokens"):
        value, want = getattr(got, name), getattr(expected, name)
        assert value.dtype == want.dtype, name
        assert torch.equal(value, want), (name, value.tolist(), want.tolist())


@pytest.mark.parametrize(
    ("targets", "order", "out_tokens", "bonus"),
    [
        # root -> 2 -> 4 -> 5 accepted, then the target's 99
        ([11, 0, 21, 0, 30, 99], [0, 2, 4, 5, 1, 3], [11, 21, 30, 99, 0, 0], 99),
        # root -> 2 accepted; 2's target token 5 matches neither child
        ([11, 0, 5, 0, 30, 99], [0, 2, 1, 3, 4, 5], [11, 5, 0, 0, 0, 0], 5),
        # nothing accepted: the root's target token 8 is the bonus
        ([8, 10, 20, 20, 30, 99], [0, 1, 2, 3, 4, 5], [8, 0, 0, 0, 0, 0], 8),
        # root -> 1 accepted (1 has no child)
        ([10, 4, 21, 0, 30, 99], [0, 1, 2, 3, 4, 5], [10, 4, 0, 0, 0, 0], 4),
    ],
)
def test_hand_tree(targets: list[int], order: list[int], out_tokens: list[int], bonus: int) -> None:
    target_tokens = torch.tensor([targets])
    paths = kernels.accept_paths(HAND, ancestors_of(HAND), target_tokens)
    assert paths.order.tolist() == [order]
    assert paths.out_tokens.tolist() == [out_tokens]
    assert paths.bonus_tokens.tolist() == [bonus]
    assert paths.commit_lens.tolist() == [sum(1 for token in out_tokens if token)]
    assert_same(paths, chained(HAND, target_tokens))


def random_rows(rng: random.Random, batch: int, width: int, vocab: int) -> tuple[TreeBatch, torch.Tensor]:
    """B random verify rows of width W (each node's parent an earlier position, sibling tokens distinct) and
    target tokens that follow a random child with probability 3/4."""
    tokens, parents, depths, targets = [], [], [], []
    for _ in range(batch):
        row_parents = [NO_NODE] + [rng.randrange(j) for j in range(1, width)]
        row_depths = [0] * width
        for j in range(1, width):
            row_depths[j] = row_depths[row_parents[j]] + 1
        row_tokens = rng.sample(range(vocab), width)  # all distinct, so siblings' are
        row_targets = []
        for j in range(width):
            children = [k for k in range(width) if row_parents[k] == j]
            if children and rng.random() < 0.75:
                row_targets.append(row_tokens[rng.choice(children)])
            else:
                row_targets.append(rng.randrange(vocab))
        tokens.append(row_tokens)
        parents.append(row_parents)
        depths.append(row_depths)
        targets.append(row_targets)
    trees = TreeBatch(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))
    return trees, torch.tensor(targets)


def test_random_rows_equal_the_walk_then_the_compaction() -> None:
    rng = random.Random(7)
    lengths = set()
    for width in (1, 2, 3, 5, 8, 17, 33, 64):
        for _ in range(6):
            trees, targets = random_rows(rng, 8, width, vocab=200)
            paths = kernels.accept_paths(trees, ancestors_of(trees), targets)
            assert_same(paths, chained(trees, targets))
            lengths.update(paths.commit_lens.tolist())
    assert len(lengths) >= 6  # paths of many lengths were compared


def test_bad_inputs_are_refused() -> None:
    ancestors = ancestors_of(HAND)
    targets = torch.zeros((1, 6), dtype=torch.int64)
    with pytest.raises(ValueError, match="ancestors"):
        kernels.accept_paths(HAND, ancestors[:, :5, :5], targets)
    with pytest.raises(ValueError, match="ancestors must be bool"):
        kernels.accept_paths(HAND, ancestors.long(), targets)
    with pytest.raises(ValueError, match="target_tokens"):
        kernels.accept_paths(HAND, ancestors, targets[:, :5])


@pytest.mark.parametrize(("batch", "width"), [(1, 17), (8, 17), (4, 64)])
def test_ops_depend_on_the_bucket_alone(batch: int, width: int) -> None:
    """Rows that accept everything, nothing, or anything between issue the same thirteen ops and no host
    read."""
    rng = random.Random(batch * width)
    chain = TreeBatch(
        tokens=torch.arange(batch * width).view(batch, width),
        parents=(torch.arange(width) - 1).expand(batch, width).clone(),
        depths=torch.arange(width).expand(batch, width).clone(),
    )
    cases = [
        (chain, torch.roll(chain.tokens, -1, dims=1)),  # every node accepted
        (chain, torch.full((batch, width), -5)),  # none
        random_rows(rng, batch, width, vocab=500),
    ]
    counts = []
    for trees, targets in cases:
        ancestors = ancestors_of(trees)
        counts.append(counted(lambda t=trees, a=ancestors, g=targets: kernels.accept_paths(t, a, g)))
    assert [c.ops for c in counts] == [13, 13, 13]
    assert [c.syncs for c in counts] == [{}, {}, {}]
    lengths = [int(kernels.accept_paths(t, ancestors_of(t), g).commit_lens[0]) for t, g in cases]
    assert lengths[0] == width and lengths[1] == 1  # the contents did differ
