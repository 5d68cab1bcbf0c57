"""Planning DFlash2 lattices: `cap_children` and `build_lattice_trees` (the stacked, branching-capped trees),
and `lattice_plan.plan_draft`, which plans a lattice exactly as `StepController.plan` plans a top-K draft, on
transitions weighted by each slot's in-candidate mass."""

from __future__ import annotations

import math

import pytest
import torch

from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.batched import build_trees, lattice_size
from bastion_sglang.controller.gate import OWN_TEXT_STEPS
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.lattice_tree import (
    build_lattice_tree,
    build_lattice_trees,
    build_lattice_trees_by_heap,
    cap_children,
    lattice_chain,
    selector_logprobs,
    weight_by_candidate_mass,
)
from bastion_sglang.controller.policies import AdaptivePolicy, BudgetPolicy, ChainPolicy, FixedPolicy
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.lattice_plan import plan_draft
from bastion_sglang.step.step_controller import StepController


def random_lattices(seed: int, batch: int = 2, depth: int = 5, width: int = 4) -> DraftLattice:
    """B random lattices (row [b, 0, p] one row per slot 0, as SGLang's) with distinct ids per slot, their
    unary log-probs over 40 tokens (the candidates hold part of the mass)."""
    generator = torch.Generator().manual_seed(seed)
    transitions = selector_logprobs(3.0 * torch.randn(batch, depth, width, width, generator=generator))
    transitions[:, 0] = transitions[:, 0, :1].clone()
    ids = torch.argsort(torch.rand(batch, depth, 40, generator=generator), -1)[..., :width]
    vocabulary = torch.log_softmax(2.0 * torch.randn(batch, depth, 40, generator=generator), -1)
    unary = torch.sort(vocabulary, -1, True).values[..., :width]
    return DraftLattice(DraftTopK(unary, ids), transitions)


def test_cap_children_keeps_each_rows_best_in_rank_order() -> None:
    row = torch.tensor([[-1.0, -0.5, -0.5, -2.0]])
    assert cap_children(row, 2).tolist() == [[-math.inf, -0.5, -0.5, -math.inf]]
    assert cap_children(row, 1).tolist() == [[-math.inf, -0.5, -math.inf, -math.inf]]  # the lower index
    assert cap_children(row, 4) is row and cap_children(row, 9) is row
    with pytest.raises(ValueError, match="branching must be a positive int"):
        cap_children(row, 0)


@pytest.mark.parametrize("seed", range(4))
def test_uncapped_rows_are_build_lattice_tree(seed: int) -> None:
    lattice = random_lattices(seed)
    trees = build_lattice_trees(lattice.transitions, lattice.unary.token_ids, 30)
    for b in range(2):
        tree = build_lattice_tree(lattice.transitions[b], lattice.unary.token_ids[b], 30)
        for field in ("tokens", "parents", "depths", "log_scores"):
            assert torch.equal(getattr(trees.row(b), field), getattr(tree, field)), field


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("branching", [1, 2, 3])
def test_capped_trees_keep_at_most_branching_children_and_the_best_of_them(seed: int, branching: int) -> None:
    lattice = random_lattices(seed)
    budget = 50
    trees = build_lattice_trees(lattice.transitions, lattice.unary.token_ids, budget, branching)
    assert trees.num_nodes == lattice_size(5, branching, budget)
    assert torch.isfinite(trees.log_scores).all()
    for b in range(2):
        parents = trees.parents[b].tolist()
        assert max(parents.count(p) for p in set(parents)) <= branching
        capped = cap_children(lattice.transitions[b], branching)
        tree = build_lattice_tree(capped, lattice.unary.token_ids[b], trees.num_nodes)
        assert torch.equal(trees.row(b).tokens, tree.tokens) and torch.equal(
            trees.row(b).parents, tree.parents
        )


@pytest.mark.parametrize("seed", range(4))
def test_branching_one_is_dflash2s_greedy_walk(seed: int) -> None:
    lattice = random_lattices(seed)
    trees = build_lattice_trees(lattice.transitions, lattice.unary.token_ids, 64, branching=1)
    for b in range(2):
        chain = lattice_chain(lattice.transitions[b], lattice.unary.token_ids[b])
        for field in ("tokens", "parents", "depths", "log_scores"):
            assert torch.equal(getattr(trees.row(b), field), getattr(chain, field)), field
    cut = build_lattice_trees(lattice.transitions, lattice.unary.token_ids, 3, branching=1)
    assert torch.equal(cut.tokens, trees.tokens[:, :3])


def test_bad_shapes_are_refused() -> None:
    lattice = random_lattices(0)
    with pytest.raises(ValueError, match=r"must be \[B, D, K, K\]"):
        build_lattice_trees(lattice.transitions[0], lattice.unary.token_ids, 4)
    with pytest.raises(ValueError, match=r"token_ids must be \[B, D, K\]"):
        build_lattice_trees(lattice.transitions, lattice.unary.token_ids[0], 4)
    with pytest.raises(ValueError, match="budget"):
        build_lattice_trees(lattice.transitions, lattice.unary.token_ids, -1)
    assert build_lattice_trees(lattice.transitions[:0], lattice.unary.token_ids[:0], 4).batch_size == 0


def controller(
    policy: BudgetPolicy, budget: int, acceptance: AcceptanceCalibration | None = None
) -> StepController:
    return StepController(
        latency=LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM"))),
        costs=StepCostTracker(),
        policy=policy,
        budget=budget,
        horizon=DraftHorizon.full(5),
        acceptance=acceptance,
        branching=4,
        device=torch.device("cpu"),
        fixed_costs=StepCosts(t_draft=2e-3, t_aux=4e-4, l_ar=1.8e-2),
    )


@pytest.mark.parametrize("policy", [AdaptivePolicy(), FixedPolicy(7)])
def test_a_lattice_of_independent_positions_plans_as_its_top_k(policy: BudgetPolicy) -> None:
    """Where every row of a slot is the same sorted row (the unary top-K renormalised over the candidates),
    the lattice trees are `build_trees`' on the mass-weighted rows (the unary log-probs again, up to
    rounding) and the plan, the gate's record and the evidence are those `StepController.plan` makes of that
    top-K."""
    top = random_lattices(5).unary
    rows = torch.log_softmax(top.logprobs, -1)[:, :, None, :].expand(-1, -1, 4, -1).contiguous()
    lattice = DraftLattice(top, rows)
    weighted = DraftTopK(weight_by_candidate_mass(rows, top.logprobs)[:, :, 0, :], top.token_ids)
    torch.testing.assert_close(weighted.logprobs, top.logprobs)
    by_lattice, by_top = controller(policy, 20), controller(policy, 20)
    contexts, greedy, requests = [100, 300], [True, False], ["a", "b"]
    for _ in range(OWN_TEXT_STEPS):  # the evidence prices a curve once it holds that many steps
        planned = plan_draft(by_lattice, by_lattice.begin(contexts, greedy, requests), lattice, branching=4)
        expected = by_top.plan(by_top.begin(contexts, greedy, requests), weighted)
        assert planned.plan == expected.plan and planned.scales == expected.scales and planned.top is top
    trees = build_trees(weighted.logprobs, top.token_ids, 20)
    assert torch.equal(planned.trees.tokens, trees.tokens) and torch.equal(
        planned.trees.parents, trees.parents
    )
    assert (by_lattice.evidence.curve_for(requests) == by_top.evidence.curve_for(requests)).all()
    assert by_lattice.gate.verifies_probe == by_top.gate.verifies_probe


def test_the_chain_policy_plans_the_greedy_walk() -> None:
    lattice = random_lattices(6)
    chain = controller(ChainPolicy(), 5)
    planned = plan_draft(chain, chain.begin([10, 10], [True, True], ["a", "b"]), lattice, branching=1)
    assert planned.plan.node_counts == (5, 5)
    for b in range(2):
        walk = lattice_chain(lattice.transitions[b], lattice.unary.token_ids[b])
        assert torch.equal(planned.trees.row(b).tokens, walk.tokens)


@pytest.mark.parametrize("policy", [AdaptivePolicy(), FixedPolicy(7)])
def test_a_calibrated_controller_plans_the_calibrated_transitions(policy: BudgetPolicy) -> None:
    """With a calibration the plan is the uncalibrated plan of the transitions mapped by hand (per depth,
    every parent row alike), and the raw Â metric sums the raw transitions, weighted by each slot's
    in-candidate mass, along each node's path."""
    calibration = AcceptanceCalibration(slopes=[1.6, 1.2], offsets=[-0.3, -0.8], events=[50, 20])
    lattice = random_lattices(7)
    slopes, offsets = calibration.depth_parameters(5)
    a = torch.tensor(slopes).view(1, 5, 1, 1)
    b = torch.tensor(offsets).view(1, 5, 1, 1)
    # unary mass 1 exactly on one candidate per slot: the uncalibrated controller weights by log 1 = 0
    certain = torch.full_like(lattice.unary.logprobs, -math.inf)
    certain[..., 0] = 0.0
    mapped_rows = torch.clamp(lattice.transitions * a + b, max=0.0)
    mapped = DraftLattice(DraftTopK(certain, lattice.unary.token_ids), mapped_rows)
    calibrated, by_hand = controller(policy, 20, calibration), controller(policy, 20)
    contexts, greedy, requests = [100, 300], [True, False], ["a", "b"]
    for _ in range(OWN_TEXT_STEPS):  # the evidence prices a curve once it holds that many steps
        planned = plan_draft(calibrated, calibrated.begin(contexts, greedy, requests), lattice, branching=3)
        expected = plan_draft(by_hand, by_hand.begin(contexts, greedy, requests), mapped, branching=3)
        assert planned.plan == expected.plan and planned.scales == expected.scales
    for field in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(planned.trees, field), getattr(expected.trees, field)), field
    assert torch.allclose(planned.trees.log_scores, expected.trees.log_scores, atol=1e-6, rtol=0.0)
    assert planned.top is lattice.unary and planned.lattice is lattice
    assert (calibrated.evidence.curve_for(requests) == by_hand.evidence.curve_for(requests)).all()
    counts = planned.plan.node_counts
    assert min(counts) > 1
    raw = calibrated._raw_expected_accept(planned, counts)
    trees = planned.trees
    log_mass = torch.logsumexp(lattice.unary.logprobs.double(), -1)  # [B, D]
    for row in range(2):
        slots = lattice.unary.token_ids[row].tolist()
        total = 0.0
        for node in range(counts[row]):  # the raw path probability of each verified node, walked by hand
            path, at = [], node
            while at >= 0:
                path.append(at)
                at = int(trees.parents[row, at])
            log_q, parent = 0.0, 0
            for depth, at in enumerate(reversed(path)):
                candidate = slots[depth].index(int(trees.tokens[row, at]))
                log_q += float(lattice.transitions[row, depth, parent, candidate]) + float(
                    log_mass[row, depth]
                )
                parent = candidate
            total += math.exp(log_q)
        assert raw[row] == pytest.approx(1.0 + total, rel=1e-6)
    # not the trees' own (calibrated) scores
    assert by_hand._raw_expected_accept(expected, counts)[0] < raw[0]


def test_an_uncalibrated_plan_builds_on_mass_weighted_transitions() -> None:
    """No calibration: the trees are the heap's on the transitions weighted by in-candidate mass, ties going
    to the raw transitions, so every node scores less than it would on the raw softmax over K."""
    lattice = random_lattices(8)
    planner = controller(FixedPolicy(7), 20)
    planned = plan_draft(planner, planner.begin([50, 60], [True, True], ["a", "b"]), lattice, branching=3)
    weighted = weight_by_candidate_mass(lattice.transitions, lattice.unary.logprobs)
    heap = build_lattice_trees_by_heap(weighted, lattice.unary.token_ids, 20, 3, ties=lattice.transitions)
    for field in ("tokens", "parents", "depths", "log_scores"):
        assert torch.equal(getattr(planned.trees, field), getattr(heap, field)), field
    unweighted = build_lattice_trees(lattice.transitions, lattice.unary.token_ids, 20, 3)
    assert bool((planned.trees.log_scores.exp().sum(1) < unweighted.log_scores.exp().sum(1)).all())


def test_the_chain_policy_under_a_clamping_calibration_plans_the_raw_greedy_walk() -> None:
    """A calibration whose offsets clamp most transitions to 0 makes every row's best entries tie: the chain
    still follows the raw transitions' argmax (ties broken by raw score)."""
    calibration = AcceptanceCalibration(slopes=[1.0], offsets=[3.0], events=[50])
    lattice = random_lattices(9)
    chain = controller(ChainPolicy(), 5, calibration)
    planned = plan_draft(chain, chain.begin([10, 10], [True, True], ["a", "b"]), lattice, branching=1)
    assert bool((calibration.apply(lattice.transitions) == 0.0).any(-1).all())
    for b in range(2):
        walk = lattice_chain(lattice.transitions[b], lattice.unary.token_ids[b])
        assert torch.equal(planned.trees.row(b).tokens, walk.tokens)
