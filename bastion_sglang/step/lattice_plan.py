"""The plan of a drafted step whose draft is a `DraftTopK` (DFlash) or a `DraftLattice` (DFlash2).

A DraftTopK goes to `StepController.plan` (best-first trees over independent positions). A lattice goes the
same way with trees over its transitions instead (`controller.lattice_tree.build_lattice_trees`): the
policies read the tree's best-first node order and its per-node scores whatever built it, so the batch plan,
the gate's record and the drafted step's evidence are `StepController.plan`'s, step for step; each node keeps
at most `branching` children (the policy's K: 1 for `chain`, whose tree is then DFlash2's own greedy walk,
`lattice_chain`: ties among the values a tree is built on go to the raw transitions' order). The plan's `top`
is the lattice's unary top-K and its `lattice` the lattice itself. The trees of the whole batch are built at
once (`controller.lattice_batched`, the heap's trees bit for bit).

Without an acceptance calibration the trees are built on the transitions weighted by each slot's in-candidate
mass (`weight_by_candidate_mass`: the drafter's unary mass on the slot's K candidates), so Â counts the
drafter's mass outside the candidates as a miss instead of treating each slot's softmax over K as certain.

With an acceptance calibration the trees are built on the calibrated transitions
(`AcceptanceCalibration.apply` on [B, D, K, K]: every parent row of a depth by that depth's map, rows kept
sorted, so the trees stay exact for the calibrated path scores), as `StepController.plan` builds top-K trees
on calibrated log-probs; the plan's raw Â metric sums the mass-weighted raw transitions along each node's
path (`lattice_node_log_scores` on the host copy of the draft that the trees were built from, kept as the
trees' `raw_log_scores`; `StepController._raw_expected_accept`). The map is the one fitted on lattice records
(`controller.lattice_acceptance`), on raw transitions: their events count a target token outside the
candidates as a miss already.
"""

from __future__ import annotations

from bastion_sglang.controller.lattice_tree import build_lattice_trees, weight_by_candidate_mass
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.step_controller import StepController, StepPlan, StepStart


def plan_draft(
    controller: StepController, step: StepStart, draft: DraftTopK | DraftLattice, branching: int
) -> StepPlan:
    """The step's plan (module docstring). draft: [B, h, K] top-K or a [B, D, K, K] lattice; branching: the
    most children a lattice tree's node keeps (a top-K draft's K is its own width)."""
    if isinstance(draft, DraftTopK):
        return controller.plan(step, draft)
    return plan_lattice(controller, step, draft, branching)


def plan_lattice(
    controller: StepController, step: StepStart, lattice: DraftLattice, branching: int
) -> StepPlan:
    """`StepController.plan` on the best-first lattice trees of `lattice`: on its calibrated transitions
    where the controller has a calibration, else on its transitions weighted by in-candidate mass (module
    docstring); ties between equal values broken by the raw transitions."""
    acceptance, ids, budget = controller.acceptance, lattice.unary.token_ids, controller.budget
    raw = lattice.transitions
    weighted = weight_by_candidate_mass(raw, lattice.unary.logprobs)
    if acceptance is None:
        trees = build_lattice_trees(weighted, ids, budget, branching, ties=raw)
    else:  # the weighted raw transitions scored beside the calibrated trees, for the raw Â metric
        trees = build_lattice_trees(acceptance.apply(raw), ids, budget, branching, raw=weighted, ties=raw)
    scales = controller.acceptance_scales(step.greedy)
    plan = controller.plan_trees(step, trees, int(lattice.transitions.shape[1]), scales)
    return StepPlan(plan, trees, lattice.unary, scales, lattice)
