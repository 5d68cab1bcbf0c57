"""Pure planning for BASTION: best-first trees, budget policies, the latency model, calibration profiles.

Imports torch, numpy and pydantic only (never sglang): usable and testable with no GPU and no server.
"""

from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceTracker, fit_acceptance
from bastion_sglang.controller.adaptive_plan import plan_adaptive
from bastion_sglang.controller.batch_objective import BatchObjective
from bastion_sglang.controller.batched import DraftTreeBatch, build_trees, build_trees_auto, build_trees_host
from bastion_sglang.controller.fast_tree import build_tree_fast
from bastion_sglang.controller.gate import SpeculationGate
from bastion_sglang.controller.latency import (
    DecodeFit,
    FitReport,
    LatencyFit,
    LatencyModel,
    LatencySample,
    LeaveOutReport,
    evaluate_fit,
    fit_latency,
    validate_leave_out,
)
from bastion_sglang.controller.policies import (
    AdaptivePolicy,
    BatchPlan,
    BucketedAdaptivePolicy,
    BudgetPolicy,
    ChainPolicy,
    FixedPolicy,
    parse_policy,
    plain_plan,
    plan_batch,
)
from bastion_sglang.controller.profile import (
    PROFILE_SCHEMA_VERSION,
    CalibrationProfile,
    ProfileError,
    ProfileMetadata,
    StepCosts,
    config_hash,
    load_profile,
    save_profile,
)
from bastion_sglang.controller.roofline import KNOWN_GPUS, HardwareSpec, ModelShape, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.controller.tree import ROOT, DraftTree, build_tree, expected_accept_length

__all__ = [
    "KNOWN_GPUS",
    "PROFILE_SCHEMA_VERSION",
    "ROOT",
    "AcceptanceCalibration",
    "AcceptanceTracker",
    "AdaptivePolicy",
    "BatchObjective",
    "BatchPlan",
    "BucketedAdaptivePolicy",
    "BudgetPolicy",
    "CalibrationProfile",
    "ChainPolicy",
    "DecodeFit",
    "DraftTree",
    "DraftTreeBatch",
    "FitReport",
    "FixedPolicy",
    "HardwareSpec",
    "LatencyFit",
    "LatencyModel",
    "LatencySample",
    "LeaveOutReport",
    "ModelShape",
    "ProfileError",
    "ProfileMetadata",
    "RooflineModel",
    "SpeculationGate",
    "StepCostTracker",
    "StepCosts",
    "build_tree",
    "build_tree_fast",
    "build_trees",
    "build_trees_auto",
    "build_trees_host",
    "config_hash",
    "evaluate_fit",
    "expected_accept_length",
    "fit_acceptance",
    "fit_latency",
    "load_profile",
    "lookup_gpu",
    "parse_policy",
    "plain_plan",
    "plan_adaptive",
    "plan_batch",
    "save_profile",
    "validate_leave_out",
]
