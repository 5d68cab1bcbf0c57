"""build_tree / build_trees: optimality against brute force, heap == beam, structure, bad input."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion_sglang.controller import (
    ROOT,
    build_tree,
    build_trees,
    build_trees_auto,
    build_trees_host,
    expected_accept_length,
)
from bastion_sglang.controller.batched import (
    build_trees_auto_unchecked,
    build_trees_host_unchecked,
    builds_on_host,
)


def random_draft(
    generator: torch.Generator, depth: int, width: int, ties: bool, batch: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted [.., D, K] log-probs (coarse values when `ties`, to force exact ties) and distinct token ids."""
    shape = (depth, width) if batch is None else (batch, depth, width)
    if ties:
        logprobs = -0.5 * torch.randint(0, 5, shape, generator=generator).double()
    else:
        logprobs = torch.log_softmax(2.0 * torch.randn(shape, generator=generator, dtype=torch.float64), -1)
    logprobs = logprobs.sort(-1, descending=True).values
    token_ids = torch.argsort(torch.rand((*shape[:-1], 50), generator=generator), -1)[..., :width]
    return logprobs, token_ids


def lattice(depth: int, width: int) -> list[tuple[int, ...]]:
    return [r for d in range(1, depth + 1) for r in itertools.product(range(width), repeat=d)]


def score(logprobs: torch.Tensor, ranks: tuple[int, ...]) -> float:
    return sum(float(logprobs[d, r]) for d, r in enumerate(ranks))


def best_by_enumeration(logprobs: torch.Tensor, size: int) -> float:
    """Max Σρ over every prefix-closed subset of the lattice with exactly `size` nodes (literal search)."""
    nodes = lattice(*logprobs.shape)
    rho = {r: math.exp(score(logprobs, r)) for r in nodes}
    best = -1.0
    for subset in itertools.combinations(nodes, size):
        chosen = set(subset)
        if all(len(r) == 1 or r[:-1] in chosen for r in chosen):
            best = max(best, sum(rho[r] for r in chosen))
    return best


def best_by_tree_knapsack(logprobs: torch.Tensor, size: int) -> float:
    """Max Σρ over prefix-closed trees of `size` nodes, by exhaustive dynamic programming over the lattice.

    f(prefix, m) = best sum of a prefix-closed subtree of m nodes hanging below `prefix` (prefix excluded):
    split m among the K children: a child gets m_c = 0 nodes, or itself plus m_c - 1 below it.
    """
    depth_count, width = logprobs.shape

    def below(prefix: tuple[int, ...], rho_prefix: float) -> list[float]:
        table = [0.0] + [-math.inf] * size
        if len(prefix) == depth_count:
            return table
        for r in range(width):
            rho = rho_prefix * math.exp(float(logprobs[len(prefix), r]))
            child = below((*prefix, r), rho)
            with_child = [0.0] + [rho + child[m - 1] for m in range(1, size + 1)]
            table = [
                max(table[a] + with_child[m - a] for a in range(m + 1) if table[a] > -math.inf)
                for m in range(size + 1)
            ]
        return table

    return below((), 1.0)[size]


def assert_valid_best_first(tree, logprobs: torch.Tensor, token_ids: torch.Tensor) -> None:
    n = len(tree)
    assert torch.all(tree.log_scores[1:] <= tree.log_scores[:-1])
    for i in range(n):
        parent = int(tree.parents[i])
        assert parent == ROOT or 0 <= parent < i
        expected_depth = 1 if parent == ROOT else int(tree.depths[parent]) + 1
        assert int(tree.depths[i]) == expected_depth
        base = 0.0 if parent == ROOT else float(tree.log_scores[parent])
        d = expected_depth - 1
        hits = (token_ids[d] == tree.tokens[i]).nonzero()
        assert hits.numel() == 1
        assert float(tree.log_scores[i]) == pytest.approx(base + float(logprobs[d, int(hits[0, 0])]))
    # no two siblings carry the same token
    pairs = set(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))
    assert len(pairs) == n


@pytest.mark.parametrize("seed", range(12))
def test_optimal_against_literal_enumeration(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    depth, width = [(3, 2), (2, 3), (1, 4), (2, 2)][seed % 4]
    logprobs, token_ids = random_draft(gen, depth, width, ties=seed % 3 == 0)
    total = len(lattice(depth, width))
    for budget in range(1, min(total, 9) + 1):
        tree = build_tree(logprobs, token_ids, budget)
        assert len(tree) == budget
        assert expected_accept_length(tree) - 1.0 == pytest.approx(best_by_enumeration(logprobs, budget))


@settings(max_examples=60, deadline=None)
@given(
    depth=st.integers(1, 4),
    width=st.integers(1, 4),
    budget=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
)
def test_optimal_against_tree_knapsack(depth: int, width: int, budget: int, seed: int, ties: bool) -> None:
    logprobs, token_ids = random_draft(torch.Generator().manual_seed(seed), depth, width, ties)
    size = min(budget, len(lattice(depth, width)))
    tree = build_tree(logprobs, token_ids, budget)
    assert len(tree) == size
    assert_valid_best_first(tree, logprobs, token_ids)
    assert expected_accept_length(tree) - 1.0 == pytest.approx(
        best_by_tree_knapsack(logprobs, size), rel=1e-12
    )
    for n in range(size + 1):
        assert expected_accept_length(tree, n) - 1.0 == pytest.approx(
            best_by_tree_knapsack(logprobs, n), rel=1e-12
        )


def test_matches_heap_order_on_literal_case() -> None:
    # Exact three-way tie at log ρ = -2: depth-1 rank 1, and depth-2 ranks (0,0), (0,1). Shallower first,
    # then the lexicographically smaller rank tuple.
    logprobs = torch.tensor([[-1.0, -2.0, -4.0], [-1.0, -1.0, -9.0]], dtype=torch.float64)
    token_ids = torch.tensor([[10, 11, 12], [20, 21, 22]])
    tree = build_tree(logprobs, token_ids, 6)
    assert tree.tokens.tolist() == [10, 11, 20, 21, 20, 21]
    assert tree.parents.tolist() == [ROOT, ROOT, 0, 0, 1, 1]
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("seed", range(40))
def test_batched_equals_heap_row_by_row(seed: int) -> None:
    gen = torch.Generator().manual_seed(1000 + seed)
    batch = 1 + seed % 5
    depth = 1 + seed % 6
    width = 1 + (seed * 7) % 6
    logprobs, token_ids = random_draft(gen, depth, width, ties=seed % 2 == 0, batch=batch)
    for budget in (0, 1, 3, 17, 64, 5000):  # 5000 exceeds every lattice here
        trees = build_trees(logprobs, token_ids, budget)
        for b in range(batch):
            heap = build_tree(logprobs[b], token_ids[b], budget)
            row = trees.row(b)
            for field in ("tokens", "parents", "depths", "log_scores"):
                assert torch.equal(getattr(heap, field), getattr(row, field)), (field, b, budget)
        auto = build_trees_auto(logprobs, token_ids, budget)
        for field in ("tokens", "parents", "depths", "log_scores"):
            assert torch.equal(getattr(auto, field), getattr(trees, field)), (field, budget)


def test_batched_large_budget_realistic_shape() -> None:
    gen = torch.Generator().manual_seed(7)
    logprobs, token_ids = random_draft(gen, 15, 32, ties=False, batch=3)
    trees = build_trees(logprobs.float(), token_ids, 512)
    assert trees.num_nodes == 512
    for b in range(3):
        heap = build_tree(logprobs[b].float(), token_ids[b], 512)
        assert torch.equal(heap.parents, trees.parents[b])
        assert torch.equal(heap.log_scores, trees.log_scores[b])
    for host in (
        build_trees_host(logprobs.float(), token_ids, 512),
        build_trees_auto_unchecked(logprobs.float(), token_ids, 512),
    ):
        for field in ("tokens", "parents", "depths", "log_scores"):
            assert torch.equal(getattr(host, field), getattr(trees, field)), field


@pytest.mark.parametrize(
    ("logprobs", "token_ids", "budget", "message"),
    [
        (
            torch.tensor([[-0.1, -0.5], [-2.0, -0.2]]),
            torch.zeros(2, 2, dtype=torch.int64),
            4,
            "sorted descending",
        ),
        (torch.tensor([[0.5, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), 4, "<= 0"),
        (torch.tensor([[float("nan"), -0.5]]), torch.zeros(1, 2, dtype=torch.int64), 4, "NaN"),
        (torch.tensor([-0.1, -0.5]), torch.zeros(2, dtype=torch.int64), 4, "[D, K]"),
        (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 3, dtype=torch.int64), 4, "differs from logprobs"),
        (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2), 4, "integer tensor"),
        (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), -1, "non-negative int"),
        (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), 2.5, "non-negative int"),
    ],
)
def test_bad_input_is_named(logprobs, token_ids, budget, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_tree(logprobs, token_ids, budget)
    with pytest.raises(ValueError):
        build_trees(logprobs.unsqueeze(0), token_ids.unsqueeze(0), budget)


def test_controller_imports_no_serving_stack() -> None:
    code = (
        "import sys, bastion_sglang.controller\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'transformers', 'triton'))\n"
        "print(bad)\n"
        "raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_auto_builder_takes_the_host_for_small_cuda_batches_and_the_beam_for_large() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for batch, budget in ((1, 64), (1, 1024), (8, 64), (8, 1024), (32, 64)):  # host faster on the H200 host
        assert builds_on_host(batch, budget, cuda), (batch, budget)
    for batch, budget in ((32, 128), (32, 256), (32, 1024), (64, 64)):  # the beam faster there
        assert not builds_on_host(batch, budget, cuda), (batch, budget)
    assert builds_on_host(64, 1024, cpu)


def test_host_built_trees_keep_their_host_copy_for_planning_reads() -> None:
    logprobs, token_ids = random_draft(torch.Generator().manual_seed(5), 4, 3, ties=False, batch=3)
    on_host = build_trees_host_unchecked(logprobs, token_ids, 6)
    assert on_host.host_copy is None and on_host.on_host() is on_host
    assert on_host.to_device(torch.device("cpu")) is on_host
    # trees on another device (meta: no data) answer host reads from the copy their builder kept
    elsewhere = on_host.to_device(torch.device("meta"))
    assert elsewhere.tokens.device.type == "meta" and elsewhere.on_host() is on_host
    assert elsewhere.deepest(4) == int(on_host.depths[:, :4].max()) and elsewhere.deepest(0) == 0
    assert elsewhere.deepest(6) == int(on_host.depths.max()) >= elsewhere.deepest(1) == 1
