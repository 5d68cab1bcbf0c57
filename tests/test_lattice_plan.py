"""Planning DFlash2 lattices: `cap_children` and `build_lattice_trees` (the stacked, branching-capped trees),
and `lattice_plan.plan_draft`, which plans a lattice exactly as `StepController.plan` plans a top-K draft."""

from __future__ import annotations

import math

import pytest
import torch

from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.batched import build_trees, lattice_size
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.lattice_tree import (
    build_lattice_tree,
    build_lattice_trees,
    cap_children,
    lattice_chain,
    selector_logprobs,
)
from bastion_sglang.controller.policies import AdaptivePolicy, BudgetPolicy, ChainPolicy, FixedPolicy
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.lattice_plan import plan_draft
from bastion_sglang.step.step_controller import StepController


def random_lattices(seed: int, batch: int = 2, depth: int = 5, width: int = 4) -> DraftLattice:
    """B random lattices (row [b, 0, p] one row per slot 0, as SGLang's) with distinct ids per slot."""
    generator = torch.Generator().manual_seed(seed)
    transitions = selector_logprobs(3.0 * torch.randn(batch, depth, width, width, generator=generator))
    transitions[:, 0] = transitions[:, 0, :1].clone()
    ids = torch.argsort(torch.rand(batch, depth, 40, generator=generator), -1)[..., :width]
    unary = torch.sort(torch.log_softmax(torch.randn(batch, depth, width, generator=generator), -1), -1, True)
    return DraftLattice(DraftTopK(unary.values, ids), transitions)


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
    """Where every row of a slot is the same sorted row, the lattice trees are `build_trees`' and the plan,
    the gate's record and the evidence are those `StepController.plan` makes of the top-K."""
    top = random_lattices(5).unary
    lattice = DraftLattice(top, top.logprobs[:, :, None, :].expand(-1, -1, 4, -1).contiguous())
    by_lattice, by_top = controller(policy, 20), controller(policy, 20)
    contexts, greedy, requests = [100, 300], [True, False], ["a", "b"]
    planned = plan_draft(by_lattice, by_lattice.begin(contexts, greedy, requests), lattice, branching=4)
    expected = by_top.plan(by_top.begin(contexts, greedy, requests), top)
    assert planned.plan == expected.plan and planned.scales == expected.scales and planned.top is top
    trees = build_trees(top.logprobs, top.token_ids, 20)
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
    every parent row alike), and the raw Â metric sums the raw transitions along each node's path."""
    calibration = AcceptanceCalibration(slopes=[1.6, 1.2], offsets=[-0.3, -0.8], events=[50, 20])
    lattice = random_lattices(7)
    slopes, offsets = calibration.depth_parameters(5)
    a = torch.tensor(slopes).view(1, 5, 1, 1)
    b = torch.tensor(offsets).view(1, 5, 1, 1)
    mapped = DraftLattice(lattice.unary, torch.clamp(lattice.transitions * a + b, max=0.0))
    calibrated, by_hand = controller(policy, 20, calibration), controller(policy, 20)
    contexts, greedy, requests = [100, 300], [True, False], ["a", "b"]
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
                log_q += float(lattice.transitions[row, depth, parent, candidate])
                parent = candidate
            total += math.exp(log_q)
        assert raw[row] == pytest.approx(1.0 + total, rel=1e-9)
    # not the trees' own (calibrated) scores
    assert by_hand._raw_expected_accept(expected, counts)[0] < raw[0]
