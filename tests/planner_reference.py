"""The batch objective computed the plain way, independent of the planner code, for controller tests."""

from __future__ import annotations

import torch

from bastion_sglang.controller.batched import DraftTreeBatch
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import StepCosts


def brute_speedup(
    trees: DraftTreeBatch,
    counts: list[int],
    contexts: list[int],
    model: LatencyModel,
    costs: StepCosts,
    scale: list[float] | None = None,
) -> float:
    """Σ_i Â_i · L_AR / (B · Ĉ) for request i verifying counts[i] nodes, Â_i = 1 + c_i Σ_{j<n_i} ρ_ij, with
    one `predict_batch` call and `StepCosts.cycle_seconds` over the pass's tokens."""
    gains = torch.exp(trees.log_scores)
    factors = scale if scale is not None else [1.0] * len(counts)
    accept = sum(1.0 + factors[i] * float(gains[i, :n].sum()) for i, n in enumerate(counts))
    verify = model.predict_batch([n + 1 for n in counts], contexts)
    return accept * costs.l_ar / (len(counts) * costs.cycle_seconds(verify, sum(n + 1 for n in counts)))
