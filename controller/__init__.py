"""Pure planning for BASTION: best-first trees, budget policies, the latency model, calibration profiles.

Imports torch, numpy and pydantic only (never sglang): usable and testable with no GPU and no server.
"""

from bastion_sglang.controller.batched import DraftTreeBatch, build_trees
from bastion_sglang.controller.policies import (
    AdaptivePolicy,
    BatchPlan,
    BucketedAdaptivePolicy,
    BudgetPolicy,
    ChainPolicy,
    FixedPolicy,
    parse_policy,
    plan_batch,
)
from bastion_sglang.controller.tree import ROOT, DraftTree, build_tree, expected_accept_length

__all__ = [
    "ROOT",
    "AdaptivePolicy",
    "BatchPlan",
    "BucketedAdaptivePolicy",
    "BudgetPolicy",
    "ChainPolicy",
    "DraftTree",
    "DraftTreeBatch",
    "FixedPolicy",
    "build_tree",
    "build_trees",
    "expected_accept_length",
    "parse_policy",
    "plan_batch",
]
