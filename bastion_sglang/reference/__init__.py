"""A lean Transformers engine running BASTION with the same planner and kernels as the SGLang worker.

It is the test oracle of the worker and the way to measure the algorithm on a GPU without SGLang:
`ReferenceEngine(target, drafter, device=..., dtype=..., hardware=...)`, then `generate(...)`.
"""

from bastion_sglang.reference.drafter import DFlashDrafter, DraftContextCache
from bastion_sglang.reference.engine import ReferenceEngine
from bastion_sglang.reference.proposer import DFlashProposer
from bastion_sglang.reference.sampling import SamplingParams
from bastion_sglang.reference.stats import GenerationResult, StepStats
from bastion_sglang.reference.target import SlotCache, TargetModel, TargetOutput, load_causal_lm
from bastion_sglang.step.draft_protocols import DraftInput, DraftSource

__all__ = [
    "DFlashDrafter",
    "DFlashProposer",
    "DraftContextCache",
    "DraftInput",
    "DraftSource",
    "GenerationResult",
    "ReferenceEngine",
    "SamplingParams",
    "SlotCache",
    "StepStats",
    "TargetModel",
    "TargetOutput",
    "load_causal_lm",
]
