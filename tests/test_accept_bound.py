"""Where speculation can pay at all: the bound on any tree's calibrated Â, and the gate that reads it.

`best_accept_curve` must hold above the calibrated Â(n) of the best tree of every size for every drafter
(checked against `build_tree` on random drafters and calibrations) and be reached by the drafter it assumes
(a certain drafter with no calibration); a batch whose bound does not beat plain decoding never drafts but
for refresh probes, from its first step on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bastion_sglang.controller import AdaptivePolicy
from bastion_sglang.controller.acceptance import AcceptanceCalibration, best_accept_curve
from bastion_sglang.controller.gate import SpeculationCeiling, SpeculationGate
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.controller.tree import build_tree
from bastion_sglang.step.step_controller import StepController


def best_tree_accept(logprobs: torch.Tensor, token_ids: torch.Tensor, nodes: int) -> np.ndarray:
    """[nodes + 1] Â(n) = 1 + Σ ρ of the best tree of n nodes, n = 0..nodes (fewer nodes: flat after)."""
    tree = build_tree(logprobs, token_ids, nodes)
    gains = torch.exp(tree.log_scores).cumsum(0).numpy()
    curve = np.ones(nodes + 1)
    curve[1 : 1 + gains.shape[0]] += gains
    curve[1 + gains.shape[0] :] = curve[gains.shape[0]]
    return curve


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_holds_above_every_best_tree(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    depth, branching, vocab, nodes = 4, 3, 9, 30
    slopes = (0.3 + 2.7 * torch.rand(depth, generator=generator)).tolist()
    offsets = (-3.0 + 3.5 * torch.rand(depth, generator=generator)).tolist()
    calibration = AcceptanceCalibration(slopes=slopes, offsets=offsets, events=[0] * depth)
    bound = best_accept_curve(calibration, depth, branching, nodes)
    sharpness = float(torch.rand((), generator=generator)) * 8.0
    for _ in range(5):
        logits = sharpness * torch.randn(depth, vocab, generator=generator, dtype=torch.float64)
        top = torch.log_softmax(logits, dim=-1).topk(branching, dim=-1)
        calibrated = calibration.apply(top.values)
        accept = best_tree_accept(calibrated, top.indices, nodes)
        assert np.all(accept <= bound + 1e-9), (accept - bound).max()


def test_a_certain_drafter_without_calibration_reaches_the_bound() -> None:
    """Identity calibration: one node per depth, each accepted for sure: Â(n) = 1 + min(n, D)."""
    depth, branching, nodes = 5, 4, 12
    bound = best_accept_curve(AcceptanceCalibration.identity(depth), depth, branching, nodes)
    logprobs = torch.tensor([[0.0] + [-60.0] * (branching - 1)] * depth, dtype=torch.float64)
    token_ids = torch.arange(branching).repeat(depth, 1)
    assert np.allclose(best_tree_accept(logprobs, token_ids, nodes), bound, atol=1e-9)
    assert bound.tolist() == [1.0 + min(n, depth) for n in range(nodes + 1)]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="depth >= 1"):
        best_accept_curve(AcceptanceCalibration.identity(), 0, 4, 8)


def test_a_bound_at_most_one_skips_from_the_first_step_but_for_refreshes() -> None:
    gate = SpeculationGate()
    never = SpeculationCeiling(speedup=0.8, refresh_steps=0.5)
    interval = gate.refresh_interval(never)
    drafted = []
    for _ in range(3 * interval + 3):
        drafted.append(gate.should_draft(None, never))
        if drafted[-1]:
            gate.record(0.9)  # the refresh's plan does not pay either: the next refresh waits twice as long
    assert not drafted[0]
    assert [i for i, d in enumerate(drafted) if d] == [interval, 3 * interval + 1]
    pays = SpeculationCeiling(speedup=1.5, refresh_steps=0.5)
    assert SpeculationGate().should_draft(None, pays)  # a bound above 1 leaves the decision to the backoff


def controller(acceptance: AcceptanceCalibration | None, t_draft: float) -> StepController:
    latency = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    l_ar = latency.predict_plain_batch([512] * 8)
    return StepController(
        latency=latency,
        costs=StepCostTracker(),
        policy=AdaptivePolicy(),
        budget=64,
        horizon=DraftHorizon(15),
        acceptance=acceptance,
        branching=8,
        device=torch.device("cpu"),
        fixed_costs=StepCosts(t_draft=t_draft, t_aux=1e-4, l_ar=l_ar),
    )


def first_horizons(step_controller: StepController, steps: int) -> list[int]:
    horizons = []
    for _ in range(steps):
        step = step_controller.begin([512] * 8, [True] * 8, [str(i) for i in range(8)])
        horizons.append(step_controller.draft_horizon(step, decides=True))
    return horizons


def test_a_drafter_whose_best_tree_cannot_pay_is_never_probed() -> None:
    """A calibration that caps each depth's acceptance at e^-2.5 (about 8 %): no tree can repay a drafter
    pass of 5 ms at batch 8, so the controller skips the drafter from the first step; a drafter with no
    calibration (no bound) is probed, and so is the same calibration with a cheap drafter."""
    weak = AcceptanceCalibration(slopes=[1.0] * 15, offsets=[-2.5] * 15, events=[0] * 15)
    assert first_horizons(controller(weak, 5e-3), 20) == [0] * 20
    assert first_horizons(controller(None, 5e-3), 1)[0] > 0
    assert first_horizons(controller(weak, 1e-6), 1)[0] > 0
