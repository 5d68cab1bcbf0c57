"""The plan stage of a decode step: the step's plan and the verify rows every tensor-parallel rank runs.

Rank 0 plans (`lattice_plan.plan_draft`: best-first trees over a DFlash top-K or a DFlash2 lattice, then one
width W for the batch); a follower takes plain decoding until rank 0's rows arrive (`rank_sync.RankSync`).
The rows are each request's root, then the first W - 1 nodes of its planned tree (`kernels.flatten_trees`),
or the roots alone when the plan declined. The step controller records the plan with the deepest node the
rows hold (the draft horizon's observation, read from rank 0's host trees).
"""

from __future__ import annotations

import torch

from bastion_sglang import kernels
from bastion_sglang.kernels.types import DraftLattice, DraftTopK, TreeBatch
from bastion_sglang.step.lattice_plan import plan_draft
from bastion_sglang.step.rank_sync import RankSync
from bastion_sglang.step.step_controller import StepController, StepPlan, StepStart


def plan_step(
    controller: StepController,
    rank_sync: RankSync,
    step: StepStart,
    draft: DraftTopK | DraftLattice,
    roots: torch.Tensor,
    branching: int,
) -> tuple[StepPlan, TreeBatch]:
    """The drafted step's plan (this rank's: a follower's is plain) and rank 0's verify rows [B, W].

    draft: [B, h, K] top-K (DFlash) or a [B, h, K, K] lattice (DFlash2, which runs on one rank:
    `registration.check_draft_logits_supported`); roots: [B] int64 the requests' bonus tokens; branching:
    the most children a lattice tree's node keeps. W = 1 (the roots alone): the plan declined.
    """
    leads = rank_sync.leads
    if leads:
        planned = plan_draft(controller, step, draft, branching)
    else:
        planned = controller.plain(step, draft if isinstance(draft, DraftTopK) else draft.unary)
    local_rows = (
        kernels.flatten_trees(planned.trees, roots, planned.plan.width)
        if planned.trees is not None
        else kernels.root_rows(roots)
    )
    rows = rank_sync.share_rows(local_rows, True)
    deepest = None  # the draft horizon's observation, from the host trees of rank 0 (it plans)
    if leads:
        deepest = 0 if planned.trees is None else planned.trees.deepest(rows.width - 1)
    controller.record(step, planned, deepest)
    return planned, rows
