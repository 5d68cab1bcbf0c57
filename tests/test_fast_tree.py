"""build_tree_fast against the heap (`build_tree`): the same tree bit for bit, ties and -inf included."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion_sglang.controller import fast_tree
from bastion_sglang.controller.batched import lattice_size
from bastion_sglang.controller.fast_tree import build_tree_fast
from bastion_sglang.controller.tree import DraftTree, build_tree

FIELDS = ("tokens", "parents", "depths", "log_scores")
KINDS = ["smooth", "ties", "inf", "absorb"]


def assert_identical(fast: DraftTree, heap: DraftTree, context: object = None) -> None:
    """Same dtypes, devices and values; log_scores compared as bit patterns (so -0.0 != 0.0)."""
    for field in FIELDS:
        got, want = getattr(fast, field), getattr(heap, field)
        assert got.dtype == want.dtype and got.device == want.device, (field, context)
        assert torch.equal(got, want), (field, context)
    assert torch.equal(fast.log_scores.view(torch.int64), heap.log_scores.view(torch.int64)), context


def lattice_draft(
    generator: torch.Generator, depth: int, width: int, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted [D, K] float64 log-probs and distinct token ids per row.

    kind: "smooth" (log-softmax of random logits); "ties" (coarse values: exact ties within and across rows,
    zeros included); "inf" (smooth with the tail of some rows at -inf, whole rows possible); "absorb"
    (multiples of 0.1, inexact in binary, with some rows shifted by -0.75·2^53, so that sums along different
    paths that differ by an ulp round to the same float: ties of sums whose parents do not tie).
    """
    if kind == "ties":
        logprobs = -0.5 * torch.randint(0, 4, (depth, width), generator=generator).double()
    elif kind == "absorb":
        logprobs = -0.1 * torch.randint(0, 6, (depth, width), generator=generator).double()
        shifted = torch.rand(depth, 1, generator=generator) < 0.4
        logprobs = torch.where(shifted, logprobs - 0.75 * 2.0**53, logprobs)
    else:
        logprobs = torch.log_softmax(3.0 * torch.randn(depth, 4 * width, generator=generator).double(), -1)
        logprobs = logprobs[:, :width]
    logprobs = logprobs.sort(-1, descending=True).values
    if kind == "inf":
        cut = torch.randint(0, width + 1, (depth, 1), generator=generator)
        logprobs = torch.where(torch.arange(width) >= cut, float("-inf"), logprobs)
    token_ids = torch.argsort(torch.rand(depth, 4 * width + 3, generator=generator), -1)[:, :width]
    return logprobs, token_ids


def check_every_budget(logprobs: torch.Tensor, token_ids: torch.Tensor, budgets: list[int]) -> None:
    """Fast == heap at each budget: the heap with budget b pops the first b nodes of its full order. Each
    budget twice: as configured, and with seeds (module docstring, point 6) at every budget."""
    full = build_tree(logprobs, token_ids, max(budgets))
    for seed_min in (fast_tree.SEED_MIN_BUDGET, 1):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast_tree, "SEED_MIN_BUDGET", seed_min)
            for budget in budgets:
                got = build_tree_fast(logprobs, token_ids, budget)
                assert_identical(got, full.truncate(budget), (budget, seed_min))


@pytest.mark.parametrize(("depth", "width"), list(itertools.product(range(1, 4), range(1, 4))))
@pytest.mark.parametrize("kind", KINDS)
def test_small_lattices_every_budget(depth: int, width: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(depth * 10 + width)
    for _ in range(4):
        logprobs, token_ids = lattice_draft(generator, depth, width, kind)
        total = lattice_size(depth, width, 10**9)
        for budget in range(total + 2):
            assert_identical(
                build_tree_fast(logprobs, token_ids, budget), build_tree(logprobs, token_ids, budget), budget
            )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", KINDS)
def test_mid_lattices_every_budget(seed: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    depth, width = [(4, 5), (6, 3), (3, 9), (8, 2), (2, 16), (5, 4)][seed]
    logprobs, token_ids = lattice_draft(generator, depth, width, kind)
    total = lattice_size(depth, width, 10**9)
    check_every_budget(logprobs, token_ids, list(range(total + 2)))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", KINDS)
def test_realistic_lattices(seed: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(200 + seed)
    depth = [15, 15, 12, 15, 7, 15, 10, 15][seed]
    width = [64, 32, 64, 8, 64, 1, 17, 64][seed]
    logprobs, token_ids = lattice_draft(generator, depth, width, kind)
    total = lattice_size(depth, width, 5000)
    budgets = sorted({1, 2, 3, 15, 16, 17, 63, 64, 65, 100, 256, 511, 1024, 2047, 3000, total, total + 1})
    check_every_budget(logprobs, token_ids, [b for b in budgets if b <= total + 1])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", KINDS)
def test_seed_threshold_lies_below_the_tree(monkeypatch: pytest.MonkeyPatch, seed: int, kind: str) -> None:
    # σ (module docstring, point 6) is strictly below the score of every node the heap pops, and it is finite
    # for smooth drafts with enough seeds (about D²·min(K, SEED_RANKS) / 2 of them): the search prunes by it.
    generator = torch.Generator().manual_seed(300 + seed)
    width = [64, 32, 8, 64][seed]
    logprobs, token_ids = lattice_draft(generator, 15, width, kind)
    lattice = logprobs.numpy()
    monkeypatch.setattr(fast_tree, "SEED_MIN_BUDGET", 1)  # seeds at every budget
    for budget in (1, 16, 200, 1024, 3000):
        sigma = fast_tree._seed_threshold(lattice, budget)
        tree = build_tree(logprobs, token_ids, budget)
        assert sigma < float(tree.log_scores.min()) or sigma == -np.inf, budget
        if kind == "smooth" and (budget <= 200 or width >= 32):
            assert sigma > -np.inf, budget


@settings(max_examples=80, deadline=None)
@given(
    depth=st.integers(1, 6),
    width=st.integers(1, 7),
    budget=st.integers(0, 400),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(KINDS),
)
def test_property_matches_heap(depth: int, width: int, budget: int, seed: int, kind: str) -> None:
    logprobs, token_ids = lattice_draft(torch.Generator().manual_seed(seed), depth, width, kind)
    want = build_tree(logprobs, token_ids, budget)
    assert_identical(build_tree_fast(logprobs, token_ids, budget), want)
    with pytest.MonkeyPatch.context() as patch:  # seeds at every budget, few deviation ranks
        patch.setattr(fast_tree, "SEED_MIN_BUDGET", 1)
        patch.setattr(fast_tree, "SEED_RANKS", 2)
        assert_identical(build_tree_fast(logprobs, token_ids, budget), want)


@pytest.mark.parametrize(
    "rows",
    [
        [[-1.0, -2.0, -4.0], [-1.0, -1.0, -9.0]],  # three-way tie at -2 across depths and ranks
        [[-0.5] * 6] * 4,  # every log-prob equal: ties everywhere
        [[0.0, 0.0, -1.0], [0.0, -0.0, -0.0], [-0.0, -3.0, -3.0]],  # certain tokens and signed zeros
        [[-0.0, -1.0], [-0.0, -0.0]],  # the rank-0 node keeps -0.0; its siblings are 0.0 + lp
        [[-1.0, float("-inf")], [float("-inf"), float("-inf")], [-0.5, -0.5]],  # a dead row cuts the tree
        [[float("-inf")] * 3, [-1.0, -2.0, -3.0]],  # every node scores -inf
        [[-2.0, -2.0, -2.0], [-1.0, -1.0, float("-inf")], [-1.0, -1.0, -1.0]],
    ],
)
def test_literal_tie_cases(rows: list[list[float]]) -> None:
    logprobs = torch.tensor(rows, dtype=torch.float64)
    depth, width = logprobs.shape
    token_ids = torch.arange(depth * width).reshape(depth, width) + 100
    check_every_budget(logprobs, token_ids, list(range(lattice_size(depth, width, 10**9) + 2)))


def test_dense_ties_at_large_budget() -> None:
    # 4^6 nodes whose scores take few distinct values: the N-th score is shared by hundreds of nodes.
    logprobs = torch.tensor([[-1.0, -1.0, -2.0, -2.0]] * 6, dtype=torch.float64)
    token_ids = torch.arange(24).reshape(6, 4)
    check_every_budget(logprobs, token_ids, [1, 5, 37, 100, 301, 1000, 2500, 5460, 5461])


def degenerate_rows(kind: str) -> torch.Tensor:
    """[15, 64] lattices where the N-th best score is shared by many nodes or is -inf."""
    if kind == "zeros":
        return torch.zeros(15, 64, dtype=torch.float64)
    if kind == "equal":
        return torch.full((15, 64), -0.5, dtype=torch.float64)
    finite = {"two finite": 2, "chain only": 1}[kind]
    logprobs = torch.full((15, 64), float("-inf"), dtype=torch.float64)
    logprobs[:, :finite] = torch.tensor([-0.1, -0.7][:finite], dtype=torch.float64)
    return logprobs


@pytest.mark.parametrize("kind", ["zeros", "equal", "two finite", "chain only"])
def test_degenerate_lattices_at_large_budgets(kind: str) -> None:
    logprobs = degenerate_rows(kind)
    token_ids = torch.arange(15 * 64).reshape(15, 64)
    check_every_budget(logprobs, token_ids, [1, 63, 64, 65, 1000, 1024, 4095, 4096, 4097])


def test_input_dtypes_match_heap() -> None:
    generator = torch.Generator().manual_seed(5)
    logprobs, token_ids = lattice_draft(generator, 15, 64, "smooth")
    for lp, ids in ((logprobs.float(), token_ids.int()), (logprobs.half(), token_ids.short())):
        assert_identical(build_tree_fast(lp, ids, 700), build_tree(lp, ids, 700))


def test_returns_the_budget_or_the_lattice() -> None:
    generator = torch.Generator().manual_seed(6)
    logprobs, token_ids = lattice_draft(generator, 15, 64, "smooth")
    assert len(build_tree_fast(logprobs, token_ids, 1024)) == 1024
    assert len(build_tree_fast(logprobs[:2, :3], token_ids[:2, :3], 1024)) == 12
    assert len(build_tree_fast(logprobs, token_ids, 0)) == 0


BAD_DRAFTS = [
    (torch.tensor([[-0.1, -0.5], [-2.0, -0.2]]), torch.zeros(2, 2, dtype=torch.int64), 4),
    (torch.tensor([[0.5, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), 4),
    (torch.tensor([[float("nan"), -0.5]]), torch.zeros(1, 2, dtype=torch.int64), 4),
    (torch.tensor([-0.1, -0.5]), torch.zeros(2, dtype=torch.int64), 4),
    (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 3, dtype=torch.int64), 4),
    (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2), 4),
    (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2, dtype=torch.bool), 4),
    (torch.tensor([[-1, -2]]), torch.zeros(1, 2, dtype=torch.int64), 4),
    (torch.empty(0, 3), torch.empty(0, 3, dtype=torch.int64), 4),
    (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), -1),
    (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), 2.5),
    (torch.tensor([[-0.1, -0.5]]), torch.zeros(1, 2, dtype=torch.int64), True),
]
"""Drafts and budgets every tree builder rejects, each with the heap's ValueError."""


@pytest.mark.parametrize(("logprobs", "token_ids", "budget"), BAD_DRAFTS)
def test_bad_input_raises_as_the_heap(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> None:
    with pytest.raises(ValueError) as heap_error:
        build_tree(logprobs, token_ids, budget)
    with pytest.raises(ValueError) as fast_error:
        build_tree_fast(logprobs, token_ids, budget)
    assert str(fast_error.value) == str(heap_error.value)
