"""build_lattice_tree against brute force and an explicit sort of every node, build_tree on independent
positions, DFlash2's greedy walk, and selector_logprobs against SGLang's sample_path softmax; the batched
searches of build_lattice_trees (the compiled heap, the numpy threshold search) against the heap; ties
broken by raw transitions; the in-candidate mass weighting against a brute force that counts the drafter's
mass outside the candidates."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion_sglang.controller import lattice_tree
from bastion_sglang.controller.batched import DraftTreeBatch
from bastion_sglang.controller.lattice_batched import LatticeNodes, best_first_batch
from bastion_sglang.controller.lattice_heap import best_first_by_compiled_heap
from bastion_sglang.controller.lattice_tree import (
    batch_search,
    build_lattice_tree,
    build_lattice_trees,
    build_lattice_trees_by_heap,
    cap_children,
    lattice_chain,
    selector_logprobs,
    weight_by_candidate_mass,
)
from bastion_sglang.controller.tree import ROOT, DraftTree, build_tree, expected_accept_length

KINDS = ["smooth", "ties", "inf"]
Search = Callable[[np.ndarray, np.ndarray | None, int], LatticeNodes]
SEARCHES = {"compiled heap": best_first_by_compiled_heap, "numpy search": best_first_batch}
"""The two ways build_lattice_trees finds a batch's nodes (`lattice_tree.batch_search`); each must return the
heap's trees."""


@contextmanager
def searching_by(search: Search) -> Iterator[None]:
    """build_lattice_trees finds nodes by `search` within the block."""
    with mock.patch.object(lattice_tree, "batch_search", lambda depth_count, width: search):
        yield


Path = tuple[int, ...]
"""A node: its candidate path (c_1, .., c_d), c_j a candidate of slot j - 1."""


def random_lattice(generator: torch.Generator, depth: int, width: int, kind: str) -> torch.Tensor:
    """[D, K, K] log-probs with row [0, p] the same for every p, as SGLang's. kind: "smooth"
    (selector_logprobs of random scores, float32); "ties" (float64 multiples of -0.5 with zeros: exact ties
    within rows and between the sums of different paths); "inf" (smooth with some entries at -inf, whole
    rows possible)."""
    if kind == "ties":
        lattice = -0.5 * torch.randint(0, 3, (depth, width, width), generator=generator).double()
    else:
        lattice = selector_logprobs(3.0 * torch.randn(depth, width, width, generator=generator))
    if kind == "inf":
        lattice = lattice.masked_fill(torch.rand(depth, width, width, generator=generator) < 0.3, -math.inf)
        lattice[-1, -1] = -math.inf
    lattice[0] = lattice[0, 0].clone()
    return lattice


def distinct_tokens(generator: torch.Generator, depth: int, width: int) -> torch.Tensor:
    """[D, K] int64 token ids, distinct within each slot (so a token names its candidate)."""
    return torch.argsort(torch.rand(depth, 4 * width + 3, generator=generator), -1)[:, :width]


def log_rho(lattice: list[list[list[float]]], path: Path) -> float:
    """The path score as the builder forms it: the first log-prob, then parent score + log-prob."""
    score = lattice[0][0][path[0]]
    for slot in range(1, len(path)):
        score = score + lattice[slot][path[slot - 1]][path[slot]]
    return score


def every_node(depth: int, width: int) -> list[Path]:
    return [path for d in range(1, depth + 1) for path in itertools.product(range(width), repeat=d)]


def key_order(lattice: torch.Tensor) -> list[Path]:
    """Every node sorted by (-log ρ, depth, rank tuple), ranks by a stable descending sort of each row (the
    lowest candidate first on a tie): the order the builder's docstring states, computed independently."""
    rows = lattice.double().tolist()
    depth, width = len(rows), len(rows[0])

    def ranks(path: Path) -> tuple[int, ...]:
        out = []
        for slot, candidate in enumerate(path):
            row = rows[slot][0 if slot == 0 else path[slot - 1]]
            out.append(sorted(range(width), key=lambda c, row=row: -row[c]).index(candidate))
        return tuple(out)

    return sorted(every_node(depth, width), key=lambda p: (-log_rho(rows, p), len(p), ranks(p)))


def paths_of(tree: DraftTree, token_ids: torch.Tensor) -> list[Path]:
    """The candidate path of every node, read back through the tokens and parents (checks they agree)."""
    candidate_of = [{int(t): c for c, t in enumerate(row)} for row in token_ids.tolist()]
    paths: list[Path] = []
    for token, parent, depth in zip(
        tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), strict=True
    ):
        prefix = () if parent == ROOT else paths[parent]
        assert parent < len(paths) and len(prefix) == depth - 1
        paths.append((*prefix, candidate_of[depth - 1][token]))
    return paths


def prefix_closed_trees(depth: int, width: int, size: int) -> set[frozenset[Path]]:
    """Every prefix-closed set of `size` nodes (the root implicit), grown from smaller ones a node at a
    time."""
    trees: set[frozenset[Path]] = {frozenset()}
    for _ in range(size):
        grown = set()
        for tree in trees:
            for parent in [(), *tree]:
                if len(parent) < depth:
                    for candidate in range(width):
                        if (child := (*parent, candidate)) not in tree:
                            grown.add(tree | {child})
        trees = grown
    return trees


def best_values(lattice: torch.Tensor, sizes: range) -> list[float]:
    """Per size n, the largest Σ ρ over every prefix-closed n-node tree of the lattice (brute force)."""
    rows = lattice.double().tolist()
    depth, width = len(rows), len(rows[0])
    return [
        max(sum(math.exp(log_rho(rows, p)) for p in tree) for tree in prefix_closed_trees(depth, width, n))
        for n in sizes
    ]


SIZES = range(1, 7)


@pytest.mark.parametrize("seed", range(4))
def test_best_tree_of_every_size_by_brute_force(seed: int) -> None:
    """D = 3, K = 3: the builder's Â(n) - 1 is the largest Σ ρ of every prefix-closed n-node tree,
    n = 1..6."""
    generator = torch.Generator().manual_seed(seed)
    lattice = random_lattice(generator, 3, 3, "smooth")
    token_ids = distinct_tokens(generator, 3, 3)
    for size, best in zip(SIZES, best_values(lattice, SIZES), strict=True):
        tree = build_lattice_tree(lattice, token_ids, size)
        assert len(tree) == size
        assert expected_accept_length(tree) - 1.0 == pytest.approx(best, rel=1e-12)


def test_reading_the_lattice_as_independent_positions_misses_the_best_tree() -> None:
    """The brute-force check can fail: build_tree on row [e, 0] of each slot (each slot's candidates scored
    as if candidate 0 came before) builds a worse tree on the same lattice."""
    generator = torch.Generator().manual_seed(0)
    lattice = random_lattice(generator, 3, 3, "smooth")
    token_ids = distinct_tokens(generator, 3, 3)
    rows = lattice.double().tolist()
    marginals, order = lattice[:, 0].sort(-1, descending=True)
    misses = []
    for size, best in zip(SIZES, best_values(lattice, SIZES), strict=True):
        naive = build_tree(marginals, token_ids.gather(1, order), size)
        value = sum(math.exp(log_rho(rows, p)) for p in paths_of(naive, token_ids))
        misses.append(value < best * (1 - 1e-9))
    assert any(misses)


@pytest.mark.parametrize("kind", KINDS)
def test_order_is_the_stated_key_order(kind: str) -> None:
    """Every budget takes the first n nodes of the key order, ties included, with the scores formed as the
    builder's docstring says: prefix-closed (each parent earlier), best-first."""
    generator = torch.Generator().manual_seed(KINDS.index(kind))
    for depth, width in ((4, 3), (3, 4), (1, 5), (5, 1), (2, 40)):  # K = 40: rows past insertion sort
        lattice = random_lattice(generator, depth, width, kind)
        token_ids = distinct_tokens(generator, depth, width)
        order = key_order(lattice)
        rows = lattice.double().tolist()
        for budget in sorted({0, 1, 2, 5, 17, len(order) - 1, len(order), len(order) + 3}):
            tree = build_lattice_tree(lattice, token_ids, budget)
            paths = paths_of(tree, token_ids)
            assert paths == order[:budget], (kind, depth, width, budget)
            assert tree.log_scores.tolist() == [log_rho(rows, p) for p in paths]
            assert tree.depths.tolist() == [len(p) for p in paths]
            assert all(parent < index for index, parent in enumerate(tree.parents.tolist()))
            assert bool((tree.log_scores[1:] <= tree.log_scores[:-1]).all())


def test_ties_break_by_depth_then_rank_tuple() -> None:
    """A lattice of equal log-probs: every depth-d node scores -d, so the order is breadth-first with each
    depth in lexicographic candidate order (stable ranks); the same on every call."""
    lattice = torch.full((3, 2, 2), -1.0)
    token_ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    tree = build_lattice_tree(lattice, token_ids, 14)
    assert tree.tokens.tolist() == [10, 11, 20, 21, 20, 21, 30, 31, 30, 31, 30, 31, 30, 31]
    assert tree.parents.tolist() == [ROOT, ROOT, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert tree.log_scores.tolist() == [-1.0, -1.0, -2.0, -2.0, -2.0, -2.0, *[-3.0] * 8]
    again = build_lattice_tree(lattice, token_ids, 14)
    assert all(torch.equal(getattr(tree, f), getattr(again, f)) for f in ("tokens", "parents", "log_scores"))


def test_a_tie_across_parents_goes_to_the_smaller_rank_tuple() -> None:
    """Slot 0 ranks candidate 1 first; (1, 0) and (0, 0) tie at -1.0 and come in rank-tuple order, (0, 0) <
    (1, 0), which is not their candidate-path order."""
    lattice = torch.tensor(
        [
            [[-0.75, -0.25], [-0.75, -0.25]],
            [[-0.25, -2.0], [-0.75, -1.0]],  # row [1, p]: slot 1's candidates after candidate p of slot 0
        ]
    )
    token_ids = torch.tensor([[1, 2], [3, 4]])
    tree = build_lattice_tree(lattice, token_ids, 6)
    assert paths_of(tree, token_ids) == [(1,), (0,), (1, 0), (0, 0), (1, 1), (0, 1)]
    assert tree.log_scores.tolist() == [-0.25, -0.75, -1.0, -1.0, -1.25, -2.75]


@pytest.mark.parametrize("kind", ["smooth", "ties", "inf", "zeros"])
def test_independent_positions_give_build_tree_bit_for_bit(kind: str) -> None:
    """Every row [e, p] the same sorted row: the tree is build_tree's on those rows (values, ties, signed
    zeros and -inf alike)."""
    generator = torch.Generator().manual_seed(7)
    depth, width = 6, 4
    if kind == "zeros":
        logprobs = torch.tensor([[0.0, -0.0, -0.0, -1.0]] * depth, dtype=torch.float64)
    else:
        logprobs = random_lattice(generator, depth, width, kind)[:, 0].sort(-1, descending=True).values
    lattice = logprobs[:, None, :].expand(depth, width, width).contiguous()
    token_ids = distinct_tokens(generator, depth, width)
    for budget in (0, 1, 3, 10, 40, 200, 5000):
        got, want = build_lattice_tree(lattice, token_ids, budget), build_tree(logprobs, token_ids, budget)
        for field in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (kind, budget, field)
        assert got.log_scores.dtype == want.log_scores.dtype == torch.float64
        assert torch.equal(got.log_scores.view(torch.int64), want.log_scores.view(torch.int64)), (
            kind,
            budget,
        )


def test_only_row_zero_of_slot_zero_is_read() -> None:
    """Slot 0 follows the verified token: rows [0, p > 0] do not change the tree."""
    generator = torch.Generator().manual_seed(3)
    lattice = random_lattice(generator, 4, 5, "smooth")
    token_ids = distinct_tokens(generator, 4, 5)
    changed = lattice.clone()
    changed[0, 1:] = torch.log_softmax(torch.randn(4, 5, generator=generator), dim=-1)
    tree, other = build_lattice_tree(lattice, token_ids, 60), build_lattice_tree(changed, token_ids, 60)
    assert torch.equal(tree.tokens, other.tokens) and torch.equal(tree.log_scores, other.log_scores)


def test_large_lattice_is_a_best_first_tree() -> None:
    """D = 16, K = 8, 256 nodes: each node's score is its parent's plus its row's log-prob, non-increasing."""
    generator = torch.Generator().manual_seed(11)
    lattice = random_lattice(generator, 16, 8, "smooth")
    token_ids = distinct_tokens(generator, 16, 8)
    tree = build_lattice_tree(lattice, token_ids, 256)
    rows = lattice.double().tolist()
    paths = paths_of(tree, token_ids)
    assert len(tree) == 256 and len(set(paths)) == 256
    assert tree.log_scores.tolist() == [log_rho(rows, p) for p in paths]
    assert bool((tree.log_scores[1:] <= tree.log_scores[:-1]).all())
    assert tree.depths.max() > 1


def sglang_greedy_walk(scores: torch.Tensor) -> list[int]:
    """SGLang's sample_path for a greedy row, on one request's raw scores [D, K, K]: the argmax of
    scores[0, 0], then each slot's argmax on the row of the previous candidate (its local maps, followed)."""
    index = int(scores[0, 0].argmax())
    local_maps = scores[1:].argmax(dim=-1)
    path = [index]
    for edge in range(scores.shape[0] - 1):
        index = int(local_maps[edge, index])
        path.append(index)
    return path


@pytest.mark.parametrize("seed", range(5))
def test_chain_is_sglangs_greedy_walk(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    depth, width = 12, 8
    scores = 4.0 * torch.randn(depth, width, width, generator=generator)
    scores[0] = scores[0, 0].clone()
    token_ids = distinct_tokens(generator, depth, width)
    chain = lattice_chain(selector_logprobs(scores, 0.0), token_ids)
    walk = sglang_greedy_walk(scores)
    assert chain.tokens.tolist() == token_ids.gather(1, torch.tensor(walk)[:, None])[:, 0].tolist()
    assert chain.parents.tolist() == [ROOT, *range(depth - 1)]
    assert chain.depths.tolist() == list(range(1, depth + 1))
    rows = selector_logprobs(scores).double().tolist()
    assert chain.log_scores.tolist() == [log_rho(rows, tuple(walk[: d + 1])) for d in range(depth)]


@pytest.mark.parametrize("seed", range(3))
def test_chain_follows_the_first_children_of_the_best_first_order(seed: int) -> None:
    """On a lattice full of ties: the chain's first node is the first depth-1 node of the full best-first
    order and each next one its parent's first child there (the rank-0 child, which the argmax picks)."""
    generator = torch.Generator().manual_seed(seed)
    lattice = random_lattice(generator, 4, 3, "ties")
    token_ids = distinct_tokens(generator, 4, 3)
    order = paths_of(build_lattice_tree(lattice, token_ids, 3 + 9 + 27 + 81), token_ids)
    chain = paths_of(lattice_chain(lattice, token_ids), token_ids)
    first_children = [next(p for p in order if p[:-1] == parent) for parent in [(), *chain[:-1]]]
    assert chain == first_children


def test_chain_ties_take_the_lowest_candidate() -> None:
    lattice = torch.tensor([[[-1.0, -1.0], [-1.0, -1.0]], [[-2.0, -2.0], [-3.0, -0.5]]])
    chain = lattice_chain(lattice, torch.tensor([[5, 6], [7, 8]]))
    assert chain.tokens.tolist() == [5, 7] and chain.log_scores.tolist() == [-1.0, -3.0]


def test_selector_logprobs_is_the_log_of_sample_paths_softmax() -> None:
    """Per request: softmax(scores.float() / T) over a slot's candidates (SGLang's initial and transition
    probabilities); temperature 0 (greedy) plans at temperature 1."""
    generator = torch.Generator().manual_seed(5)
    scores = 2.0 * torch.randn(3, 4, 6, 6, generator=generator, dtype=torch.bfloat16)
    temperatures = torch.tensor([0.7, 0.0, 1.5])
    got = selector_logprobs(scores, temperatures)
    assert got.dtype == torch.float32 and got.shape == scores.shape
    for request, temperature in enumerate([0.7, 1.0, 1.5]):
        want = torch.softmax(scores[request].float() / temperature, dim=-1)
        torch.testing.assert_close(got[request].exp(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(selector_logprobs(scores[0], 0.7), got[0], rtol=0, atol=0)
    torch.testing.assert_close(
        selector_logprobs(scores[1], 0.0), selector_logprobs(scores[1]), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("scores", "temperature", "message"),
    [
        (torch.zeros(4, 3), 1.0, r"scores must be \[\.\.\., D, K, K\], got shape \(4, 3\)"),
        (torch.zeros(2, 3, 4), 1.0, r"scores must be \[\.\.\., D, K, K\], got shape \(2, 3, 4\)"),
        (torch.zeros(2, 3, 3, dtype=torch.int64), 1.0, "scores must be a floating tensor"),
        (torch.zeros(2, 3, 3), -0.5, "temperature must be >= 0"),
        (torch.zeros(2, 3, 3), math.nan, "temperature must be >= 0"),
        (torch.zeros(2, 4, 3, 3), torch.ones(3), r"temperature shape \(3,\) differs"),
    ],
)
def test_selector_logprobs_errors(scores: torch.Tensor, temperature: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        selector_logprobs(scores, temperature)  # type: ignore[arg-type]


def _with(index: tuple[int, ...], value: float) -> torch.Tensor:
    lattice = torch.full((2, 3, 3), -1.0)
    lattice[index] = value
    return lattice


@pytest.mark.parametrize(
    ("lattice", "token_ids", "budget", "message"),
    [
        (
            torch.zeros(2, 3),
            torch.zeros(2, 3, dtype=torch.int64),
            4,
            r"must be \[D, K, K\], got shape \(2, 3\)",
        ),
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.int64), 4, r"got shape \(2, 3, 4\)"),
        (torch.zeros(0, 3, 3), torch.zeros(0, 3, dtype=torch.int64), 4, "at least one slot"),
        (
            torch.zeros(2, 3, 3),
            torch.zeros(2, 4, dtype=torch.int64),
            4,
            r"token_ids must be \[D, K\] = \[2, 3\]",
        ),
        (torch.zeros(2, 3, 3), torch.zeros(2, 3), 4, "token_ids must be an integer tensor"),
        (torch.zeros(2, 3, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64), 4, "floating"),
        (
            _with((1, 2, 0), math.nan),
            torch.zeros(2, 3, dtype=torch.int64),
            4,
            r"NaN, first at index \[1, 2, 0\]",
        ),
        (
            _with((0, 1, 2), 0.25),
            torch.zeros(2, 3, dtype=torch.int64),
            4,
            r"found 0\.25 at index \[0, 1, 2\]",
        ),
        (torch.zeros(2, 3, 3), torch.zeros(2, 3, dtype=torch.int64), -1, "budget must be a non-negative int"),
        (
            torch.zeros(2, 3, 3),
            torch.zeros(2, 3, dtype=torch.int64),
            True,
            "budget must be a non-negative int",
        ),
        (
            torch.zeros(2, 3, 3),
            torch.zeros(2, 3, dtype=torch.int64),
            2.0,
            "budget must be a non-negative int",
        ),
    ],
)
def test_bad_input_is_refused_by_name(
    lattice: torch.Tensor, token_ids: torch.Tensor, budget: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_lattice_tree(lattice, token_ids, budget)  # type: ignore[arg-type]
    if not message.startswith("budget"):
        with pytest.raises(ValueError, match=message):
            lattice_chain(lattice, token_ids)


def assert_same_trees(got: DraftTreeBatch, want: DraftTreeBatch, label: object) -> None:
    """Equal node sets, order, tokens and float64 scores bit for bit (signed zeros and -inf included)."""
    for field in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(got, field), getattr(want, field)), (label, field)
    assert got.log_scores.dtype == want.log_scores.dtype == torch.float64
    assert torch.equal(got.log_scores.view(torch.int64), want.log_scores.view(torch.int64)), label


def random_batch(
    generator: torch.Generator, batch: int, depth: int, width: int, kinds: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, D, K, K] lattices, row b of kind kinds[b % len(kinds)] (`random_lattice`, or "zeros": log-probs
    of 0 beside -1, so children tie with their parents), and [B, D, K] distinct ids."""
    rows = []
    for b in range(batch):
        kind = kinds[b % len(kinds)]
        if kind == "zeros":
            pick = torch.randint(0, 2, (depth, width, width), generator=generator).double()
            rows.append(-pick)
        else:
            rows.append(random_lattice(generator, depth, width, kind).double())
    return torch.stack(rows), torch.stack([distinct_tokens(generator, depth, width) for _ in range(batch)])


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    depth=st.integers(1, 5),
    width=st.sampled_from([1, 2, 3, 4, 8]),  # 8: the compiled heap's sorting network
    budget=st.integers(0, 400),
    branching=st.one_of(st.none(), st.integers(1, 4)),
    kinds=st.lists(st.sampled_from(["smooth", "ties", "inf", "zeros"]), min_size=1, max_size=4),
    with_ties=st.booleans(),
)
@pytest.mark.parametrize("search", SEARCHES.values(), ids=SEARCHES.keys())
def test_batched_trees_are_the_heaps(
    search: Search,
    seed: int,
    batch: int,
    depth: int,
    width: int,
    budget: int,
    branching: int | None,
    kinds: list[str],
    with_ties: bool,
) -> None:
    """Any batch, depth, width, budget (beyond the lattice's size too), branching and tie values: the batched
    search returns the heap's trees."""
    generator = torch.Generator().manual_seed(seed)
    lattices, ids = random_batch(generator, batch, depth, width, kinds)
    ties = random_batch(generator, batch, depth, width, ["ties"])[0] if with_ties else None
    with searching_by(search):
        got = build_lattice_trees(lattices, ids, budget, branching, ties=ties)
    want = build_lattice_trees_by_heap(lattices, ids, budget, branching, ties=ties)
    assert_same_trees(got, want, (seed, batch, depth, width, budget, branching, kinds))


@pytest.mark.parametrize("search", SEARCHES.values(), ids=SEARCHES.keys())
@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0, 6.0, 12.0])
@pytest.mark.parametrize("budget", [1, 32, 64, 256, 1024])
def test_batched_trees_are_the_heaps_at_serving_sizes(search: Search, scale: float, budget: int) -> None:
    """B = 8, D = 16, K = 8: flat and peaked lattices (selector log-probs of scores scaled by `scale`), where
    the search needs one, two or three passes."""
    generator = torch.Generator().manual_seed(int(scale * 10) + budget)
    lattices = selector_logprobs(scale * torch.randn(8, 16, 8, 8, generator=generator))
    lattices[:, 0] = lattices[:, 0, :1].clone()
    ids = torch.stack([distinct_tokens(generator, 16, 8) for _ in range(8)])
    with searching_by(search):
        got = build_lattice_trees(lattices, ids, budget)
    assert_same_trees(got, build_lattice_trees_by_heap(lattices, ids, budget), scale)


@pytest.mark.parametrize("search", SEARCHES.values(), ids=SEARCHES.keys())
def test_batched_trees_of_hand_built_lattices(search: Search) -> None:
    """Equal log-probs everywhere (every node of a depth ties), K = 1 (one path), depth 1, a budget larger
    than the lattice, and a signed zero at rank 0."""
    cases = [
        (torch.full((2, 3, 2, 2), -1.0), 14),
        (torch.full((2, 3, 2, 2), -1.0), 5),
        (torch.full((3, 6, 1, 1), -0.5), 4),
        (torch.full((3, 6, 1, 1), -0.5), 50),
        (torch.log_softmax(torch.tensor([[[[1.0, 2.0, 2.0]] * 3]]), -1).double(), 2),
        (torch.tensor([[[[-0.0, 0.0], [-0.0, 0.0]], [[-0.0, -1.0], [0.0, -0.0]]]]).double(), 6),
    ]
    for lattice, budget in cases:
        ids = torch.arange(lattice.shape[1] * lattice.shape[2]).view(1, *lattice.shape[1:3])
        ids = ids.expand(lattice.shape[0], -1, -1).contiguous()
        with searching_by(search):
            got = build_lattice_trees(lattice, ids, budget)
        assert_same_trees(got, build_lattice_trees_by_heap(lattice, ids, budget), (lattice.shape, budget))
        for b in range(lattice.shape[0]):
            tree = build_lattice_tree(lattice[b], ids[b], budget)
            assert torch.equal(got.row(b).tokens, tree.tokens) and torch.equal(
                got.row(b).parents, tree.parents
            )


def test_the_compiled_heap_serves_where_numba_imports_and_its_keys_fit() -> None:
    """The compiled heap for DFlash's lattices; the numpy search where the rank keys K^D would overflow int64
    and where Numba is missing (the module's import fails, as in a bundle without it)."""
    assert batch_search(16, 8) is best_first_by_compiled_heap
    assert batch_search(20, 8) is best_first_by_compiled_heap  # keys below 8^20 = 2^60
    assert batch_search(16, 16) is best_first_batch  # 16^16 = 2^64
    assert batch_search(31, 4) is best_first_batch  # 4^31 = 2^62: KEY_BITS
    lattice_tree.compiled_heap.cache_clear()
    try:
        with mock.patch.dict(sys.modules, {"bastion_sglang.controller.lattice_heap": None}):
            assert batch_search(16, 8) is best_first_batch
    finally:
        lattice_tree.compiled_heap.cache_clear()
    assert batch_search(16, 8) is best_first_by_compiled_heap


def test_equal_rows_take_the_raw_argmax_first() -> None:
    """Ties: a row whose values tie (a calibration clamped them to 0) ranks its candidates by the tie values
    (the raw transitions), not by candidate index; without ties, the lower index."""
    values = torch.tensor([[[0.0, 0.0, -1.0]] * 3]).double()  # [D = 1, K = 3, K]
    raw = torch.tensor([[[-0.9, -0.6, -2.0]] * 3]).double()
    ids = torch.tensor([[7, 8, 9]])
    assert build_lattice_tree(values, ids, 3).tokens.tolist() == [7, 8, 9]
    assert build_lattice_tree(values, ids, 3, ties=raw).tokens.tolist() == [8, 7, 9]
    assert cap_children(values, 1, raw).tolist() == [[[-math.inf, 0.0, -math.inf]] * 3]
    with pytest.raises(ValueError, match="ties must have the lattice's shape"):
        build_lattice_tree(values, ids, 3, ties=raw[:, :2])


@pytest.mark.parametrize("seed", range(4))
def test_branching_one_on_clamped_or_weighted_values_is_the_raw_chain(seed: int) -> None:
    """A calibration that clamps many transitions to 0 (ties), or a weight per slot (rounding ties): with the
    raw transitions as tie values, branching 1 is still `lattice_chain` of the raw transitions; without them,
    the clamped ties go to the lowest candidate, another path."""
    generator = torch.Generator().manual_seed(seed)
    raw = selector_logprobs(2.0 * torch.randn(3, 6, 5, 5, generator=generator))
    raw[:, 0] = raw[:, 0, :1].clone()
    ids = torch.stack([distinct_tokens(generator, 6, 5) for _ in range(3)])
    clamped = torch.clamp(raw * 1.2 + 2.5, max=0.0)  # a non-decreasing map: every row's best few tie at 0
    unary = torch.log_softmax(torch.randn(3, 6, 40, generator=generator), -1)[..., :5]
    weighted = weight_by_candidate_mass(raw, unary)
    for values in (clamped, weighted):
        trees = build_lattice_trees(values, ids, 64, branching=1, ties=raw)
        for b in range(3):
            assert trees.row(b).tokens.tolist() == lattice_chain(raw[b], ids[b]).tokens.tolist()
    plain = build_lattice_trees(clamped, ids, 64, branching=1)
    chains = [lattice_chain(raw[b], ids[b]).tokens.tolist() for b in range(3)]
    assert any(plain.row(b).tokens.tolist() != chains[b] for b in range(3))


def mass_aware_best(transitions: torch.Tensor, unary: torch.Tensor, sizes: range) -> list[float]:
    """Per size n, the largest Σ over a prefix-closed n-node tree of each node's probability that the
    drafter's sample follows its path: Π_j m_j · q(c_j | c_{j-1}), m_j the drafter's mass on slot j's
    candidates (brute force)."""
    rows = transitions.double().tolist()
    masses = unary.double().exp().sum(-1).tolist()
    depth, width = len(rows), len(rows[0])

    def probability(path: Path) -> float:
        return math.prod(
            masses[j] * math.exp(rows[j][0 if j == 0 else path[j - 1]][c]) for j, c in enumerate(path)
        )

    return [
        max(sum(probability(p) for p in tree) for tree in prefix_closed_trees(depth, width, n)) for n in sizes
    ]


@pytest.mark.parametrize("seed", range(3))
def test_weighted_expected_length_is_the_mass_aware_best(seed: int) -> None:
    """D = 3, K = 3, candidates holding 40-90 % of the drafter's mass per slot: Â of the trees on the weighted
    transitions equals the best Â of every tree when the mass outside the candidates counts as a miss; Â of
    the raw transitions exceeds it (it counts every slot's candidates as certain to hold the sample)."""
    generator = torch.Generator().manual_seed(seed)
    transitions = random_lattice(generator, 3, 3, "smooth")
    shares = 0.4 + 0.5 * torch.rand(3, generator=generator)  # in-candidate mass per slot
    unary = torch.log(torch.softmax(torch.randn(3, 3, generator=generator), -1) * shares[:, None])
    token_ids = distinct_tokens(generator, 3, 3)
    weighted = weight_by_candidate_mass(transitions, unary)
    for size, best in zip(SIZES, mass_aware_best(transitions, unary, SIZES), strict=True):
        tree = build_lattice_tree(weighted, token_ids, size)
        assert expected_accept_length(tree) - 1.0 == pytest.approx(best, rel=1e-5)
        assert expected_accept_length(build_lattice_tree(transitions, token_ids, size)) - 1.0 > best * 1.05


def test_weighting_checks_shapes() -> None:
    with pytest.raises(ValueError, match="disagree"):
        weight_by_candidate_mass(torch.zeros(2, 3, 3), torch.zeros(2, 4))
