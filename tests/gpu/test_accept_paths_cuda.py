"""`kernels.accept_paths` on CUDA equals the same op on the CPU and the Triton walk followed by the
compaction, exactly."""

from __future__ import annotations

import random

import pytest
import torch
from test_kernels_paths import ancestors_of, assert_same, random_rows

from bastion_sglang import kernels
from bastion_sglang.kernels import AcceptedPaths, TreeBatch


def on(device: torch.device, trees: TreeBatch) -> TreeBatch:
    return TreeBatch(trees.tokens.to(device), trees.parents.to(device), trees.depths.to(device))


def to_cpu(paths: AcceptedPaths) -> AcceptedPaths:
    return AcceptedPaths(*(value.cpu() for value in vars(paths).values()))


@pytest.mark.parametrize(("batch", "width"), [(1, 2), (1, 17), (8, 17), (64, 65), (16, 257)])
def test_cuda_equals_cpu_and_the_triton_walk(device: torch.device, batch: int, width: int) -> None:
    rng = random.Random(batch * 1000 + width)
    trees, targets = random_rows(rng, batch, width, vocab=4 * width)
    expected = kernels.accept_paths(trees, ancestors_of(trees), targets)
    cuda_trees, cuda_targets = on(device, trees), targets.to(device)
    ancestors = ancestors_of(cuda_trees)
    assert_same(to_cpu(kernels.accept_paths(cuda_trees, ancestors, cuda_targets)), expected)
    walk = kernels.accept_walk(cuda_trees, cuda_targets)  # the Triton walk on CUDA
    order = kernels.compaction_order(walk.accept_index, walk.accept_length)
    chained = AcceptedPaths(
        order=order,
        out_tokens=kernels.committed_tokens(cuda_trees.tokens, order, walk),
        commit_lens=(walk.accept_length + 1).to(torch.int32),
        commit_counts=walk.accept_length.to(torch.int64) + 1,
        bonus_tokens=walk.bonus_tokens,
    )
    assert_same(to_cpu(chained), expected)
