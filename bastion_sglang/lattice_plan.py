"""The plan of a drafted step whose draft is a `DraftTopK` (DFlash) or a `DraftLattice` (DFlash2).

A DraftTopK goes to `StepController.plan` (best-first trees over independent positions). A lattice goes the
same way with trees over its transitions instead (`controller.lattice_tree.build_lattice_trees`): the
policies read the tree's best-first node order and its per-node scores whatever built it, so the batch plan,
the gate's record and the drafted step's evidence are `StepController.plan`'s, step for step; each node keeps
at most `branching` children (the policy's K: 1 for `chain`, whose tree is then DFlash2's own greedy walk,
`lattice_chain`). The plan's `top` is the lattice's unary top-K. Lattices are planned on their raw
transition log-probs: an acceptance calibration is fitted on DraftTopK records and is refused here.
"""

from __future__ import annotations

from bastion_sglang.controller.gate import DraftedStep, horizon_gain
from bastion_sglang.controller.lattice_tree import build_lattice_trees
from bastion_sglang.controller.policies import plan_batch
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step_controller import StepController, StepPlan, StepStart


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
    """`StepController.plan` on the best-first lattice trees of `lattice` (module docstring)."""
    if controller.acceptance is not None:
        raise ValueError(
            "an acceptance calibration maps top-K log-probs per depth and is fitted on DraftTopK records; "
            "plan a DFlash2 lattice without one"
        )
    trees = build_lattice_trees(lattice.transitions, lattice.unary.token_ids, controller.budget, branching)
    scales = controller.acceptance_tracker.corrections(step.greedy)
    plan = plan_batch(
        trees,
        step.contexts,
        controller.latency,
        step.costs(),
        controller.policy,
        accept_scale=scales,
        allow_plain=not controller.gate.verifies_probe,
    )
    controller.gate.record(plan.speculative_speedup)
    gain = horizon_gain(trees, int(lattice.transitions.shape[1]), controller.horizon.depth, scales)
    controller.evidence.record(DraftedStep(plan.accept_curve, gain, step.requests))
    return StepPlan(plan, trees, lattice.unary, scales)
