"""The acceptance map that learns online per depth (`controller.depth_acceptance`).

The map's arithmetic on literal events; its estimate against a known truth; and the controller that uses it:
fitted on hard text and then serving easy text its trees grow within a bounded number of steps, and the
reverse, with every step's accepted length drawn from the truth through the real tree it verified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from bastion_sglang.controller import AdaptivePolicy
from bastion_sglang.controller.acceptance import (
    AcceptanceCalibration,
    best_accept_curve,
    realised_accept_length,
)
from bastion_sglang.controller.depth_acceptance import (
    POOLED_PRIOR_WEIGHT,
    OnlineDepthMap,
    depth_reach,
    shift_logprobs,
)
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.step.step_controller import StepController

DEPTH, BRANCHING = 8, 4


def test_a_depth_without_events_takes_the_pooled_correction() -> None:
    online = OnlineDepthMap(6, prior_weight=1.0)
    assert online.shifts.tolist() == [0.0] * 6 and not online.active  # no events: the map it started with
    assert online.pooled_conditional() == pytest.approx(1.0)
    reach = np.zeros((2, 6))
    reach[:, 0] = [0.8, 0.8]  # each request verified one depth-1 node of probability 0.8 ...
    online.observe(reach, [0, 0])  # ... and neither was accepted
    pooled = online.pooled_conditional()  # 1.6 c̄ + k c̄ = 0 + k, k pseudo-events at c̄ = 1
    assert pooled == pytest.approx(POOLED_PRIOR_WEIGHT / (1.6 + POOLED_PRIOR_WEIGHT))
    ratios = online.reach_ratios()
    assert ratios[0] == pytest.approx((0 + 1.0 * pooled) / (1.6 + 1.0))  # one pseudo-event at r_0 · c̄
    assert np.allclose(online.shifts[1:], math.log(pooled))  # deeper depths: no events, c̄


def test_the_pooled_conditional_is_the_one_factor_of_every_depth() -> None:
    """Predicted reaches of a chain of conditionals 0.9 at five depths; realised: conditionals 0.6 at every
    depth. c̄ is 0.6/0.9 from all depths' events together, and each depth's shift is near it."""
    online = OnlineDepthMap(5, decay=0.999, prior_weight=1.0)
    predicted = np.array([[0.9**d for d in range(1, 6)]] * 1000)
    generator = np.random.default_rng(1)
    accepted = np.zeros(1000, dtype=int)
    alive = np.ones(1000, dtype=bool)
    for _ in range(5):
        alive &= generator.random(1000) < 0.6
        accepted += alive
    online.observe(predicted, accepted.tolist())
    assert online.pooled_conditional() == pytest.approx(0.6 / 0.9, abs=0.02)
    assert np.exp(online.shifts) == pytest.approx([0.6 / 0.9] * 5, abs=0.06)


def test_a_conditional_off_at_one_depth_shifts_that_depth_only() -> None:
    """Predicted reaches 0.9, 0.81, 0.729 (a chain of conditionals 0.9); realised: depth 1 half as often as
    predicted, deeper depths as predicted GIVEN depth 1 (so their reach is halved too): c_1 = 0.5, c_2 = c_3
    = 1."""
    online = OnlineDepthMap(3, decay=0.999, prior_weight=1e-6)
    predicted = np.array([[0.9, 0.81, 0.729]] * 1000)
    generator = np.random.default_rng(0)
    first = generator.random(1000) < 0.45
    second = first & (generator.random(1000) < 0.9)
    third = second & (generator.random(1000) < 0.9)
    accepted = first.astype(int) + second + third
    online.observe(predicted, accepted.tolist())
    c = np.exp(online.shifts)
    assert c[0] == pytest.approx(0.5, abs=0.04)
    assert c[1:] == pytest.approx([1.0, 1.0], abs=0.08)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"predicted_reach must be \[2, 3\]"):
        OnlineDepthMap(3).observe(np.zeros((2, 4)), [0, 0])
    with pytest.raises(ValueError, match="decay must be in"):
        OnlineDepthMap(3, decay=1.0)


def test_depth_reach_sums_the_verified_prefix_by_depth() -> None:
    depths = np.array([[1, 2, 1, 3], [1, 1, 2, 2]])
    scores = np.log(np.array([[0.5, 0.25, 0.2, 0.1], [0.6, 0.3, 0.2, 0.1]]))
    reach = depth_reach(depths, scores, [3, 0], 3)
    assert np.allclose(reach, [[0.7, 0.25, 0.0], [0.0, 0.0, 0.0]])


def test_a_shift_keeps_rows_sorted_and_caps_at_one() -> None:
    logprobs = torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.1]]], dtype=torch.float64))
    shifted = shift_logprobs(logprobs, np.log(np.array([2.0, 0.5, 7.0])))
    assert torch.allclose(shifted.exp(), torch.tensor([[[1.0, 0.6], [0.25, 0.05]]], dtype=torch.float64))


def test_a_shifted_calibration_moves_each_depths_offset() -> None:
    calibration = AcceptanceCalibration(slopes=[1.0, 2.0], offsets=[0.0, -1.0], events=[5, 0])
    moved = calibration.shifted(np.array([0.5, 0.0, -0.25]))
    assert (moved.slopes, moved.offsets, moved.events) == ([1.0, 2.0, 2.0], [0.5, -1.0, -1.25], [5, 0, 0])
    assert calibration.shifted(np.zeros(3)) is calibration
    bound = best_accept_curve(moved, 3, 2, 4)
    assert bound[1] == pytest.approx(2.0)  # depth 1's factor e^0.5 q is capped at 1


def _drafter(depth: int) -> DraftTopK:
    """One request's draft: at every depth the ranks 0..K-1 (token id = rank) with these probabilities."""
    row = torch.tensor([0.9, 0.05, 0.03, 0.02], dtype=torch.float32).log()
    return DraftTopK(row.expand(1, depth, BRANCHING).clone(), torch.arange(BRANCHING).expand(1, depth, -1))


def _controller(acceptance: AcceptanceCalibration | None, depth: int = DEPTH) -> StepController:
    latency = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    l_ar = latency.predict_plain_batch([512])
    return StepController(
        latency=latency,
        costs=StepCostTracker(),
        policy=AdaptivePolicy(),
        budget=48,
        horizon=DraftHorizon.full(depth),
        acceptance=acceptance,
        branching=BRANCHING,
        device=torch.device("cpu"),
        # each verified token costs 2 % of a plain step: the best tree is about as deep as the text allows
        fixed_costs=StepCosts(t_draft=0.05 * l_ar, t_aux=1e-4, l_ar=l_ar, t_aux_per_token=0.02 * l_ar),
    )


@dataclass
class Served:
    """Per decode step of `_serve`: the nodes verified, the plan's Â and the tree's true expected accepted
    length (1 + Σ over its all-rank-0 path of top1^d; 1 for a skipped step)."""

    nodes: list[int] = field(default_factory=list)
    planned: list[float] = field(default_factory=list)
    true: list[float] = field(default_factory=list)


def _serve(controller: StepController, top1: float, steps: int, seed: int, depth: int = DEPTH) -> Served:
    """`steps` decode steps of one request on text where the drafter's rank 0 is the target's token with
    probability `top1` at every depth (else a token the drafter did not propose)."""
    generator = np.random.default_rng(seed)
    served = Served()
    for _ in range(steps):
        step = controller.begin([512], [True], ["request"])
        if controller.draft_horizon(step, decides=True) == 0:  # the gate skipped the drafter
            controller.record(step, None)
            controller.verified([0])
            served.nodes.append(0)
            served.planned.append(1.0)
            served.true.append(1.0)
            continue
        planned = controller.plan(step, _drafter(depth))
        nodes = planned.plan.node_counts[0]
        host = planned.trees.on_host()
        depths = host.depths[0, :nodes]
        controller.record(step, planned, int(depths.max()) if nodes else 0)
        continuation = np.where(generator.random(depth) < top1, 0, -1).tolist()
        tokens, parents = host.tokens[0, :nodes].tolist(), host.parents[0, :nodes].tolist()
        controller.verified([realised_accept_length(tokens, parents, depths.tolist(), continuation) - 1])
        on_path = [True] * nodes  # whether every token on the node's path is rank 0
        for i in range(nodes):
            on_path[i] = tokens[i] == 0 and (parents[i] < 0 or on_path[parents[i]])
        served.nodes.append(nodes)
        served.planned.append(planned.plan.expected_accept[0])
        served.true.append(1.0 + sum(top1 ** int(d) for d, hit in zip(depths, on_path, strict=True) if hit))
    return served


HARD = AcceptanceCalibration(slopes=[1.0], offsets=[math.log(0.3)], events=[100])
"""A map fitted where the drafter's rank 0 was right a third as often as it says (0.27 of its 0.9)."""


def test_fitted_on_hard_text_then_serving_easy_text_the_trees_grow() -> None:
    """The drafter is right (rank 0 accepted 90 % of the time, as it states), the start-up map says 27 %:
    within 30 steps the online map undoes it and the trees are as large as those the raw drafter plans."""
    oracle = np.mean(_serve(_controller(None), 0.9, 60, seed=1).nodes[-30:])
    learning = _serve(_controller(HARD), 0.9, 60, seed=2).nodes
    assert learning[0] <= 0.5 * oracle
    assert np.mean(learning[-30:]) >= 0.85 * oracle


def test_fitted_on_easy_text_then_serving_hard_text_the_trees_shrink() -> None:
    """The reverse: no map (the drafter says 90 %), the text accepts rank 0 27 % of the time: the first tree
    is at least twice what the true map plans, and over the last 30 of 60 steps the trees are within one node
    of the true map's on average (steps where the gate skipped the drafter plan no tree and are left out)."""
    truth = [nodes for nodes in _serve(_controller(HARD), 0.27, 60, seed=3).nodes[-30:] if nodes]
    learning = _serve(_controller(None), 0.27, 60, seed=4).nodes
    assert learning[0] >= 2.0 * np.mean(truth)
    assert np.mean([nodes for nodes in learning[-30:] if nodes]) <= np.mean(truth) + 1.0


def test_the_scalar_correction_does_not_repeat_the_depth_maps() -> None:
    """The drafter states 0.9 where the text accepts 0.6 (over-confident, as real drafters are), and
    speculation pays about twice over. The depth map and the scalar correction learn from the same accepted
    lengths; the scalar must correct only what the map leaves. Summed against each step's own (shifted)
    prediction it went on correcting what the map had since learnt: averaged over 16 requests the plan's Â
    fell to 0.78 of its tree's true expected accepted length by the fourth step, and with the gate's ceiling
    priced at a decline's correction the gate closed on 108 of their 640 steps. From the fourth step on, the
    plan's Â averaged over the requests is within 10 % of the truth at every step, and the gate skips the
    drafter on at most a tenth of the steps (two unlucky first steps still put the correction at its floor:
    the gate then probes again once it is forgotten)."""
    ratios, skipped = [], 0
    for seed in range(16):
        served = _serve(_controller(None), 0.6, 40, seed=100 + seed)
        ratios.append(np.array(served.planned) / np.array(served.true))
        skipped += served.nodes.count(0)
    mean = np.mean(ratios, axis=0)[3:]
    assert skipped <= 64
    assert mean.min() >= 0.9 and mean.max() <= 1.1, mean.round(2).tolist()


def test_a_deep_depth_with_a_few_misses_does_not_stop_the_trees() -> None:
    """The drafter states 0.9 at each of 15 depths, the text accepts 0.86, and the trees that pay best (as
    priced on the true map) reach the last depth: 13 to 15 nodes are within 0.6 % of each other. A deep depth
    sees a few predicted reaches per step at most, so a few misses there are noise; with each depth's prior at
    the depth above's own conditional they marked it below its truth, the trees stopped above it and did not
    see the events to undo it: over 16 requests of 40 steps, the last 20 steps planned 12.5 nodes on average
    and reached depth 15 on 41 of 320. Leaning on the conditional pooled over every depth they plan at least
    13.5 nodes on average, reach depth 15 on at least a third of those steps, and Â stays within 4 % of the
    trees' true expected accepted length."""
    depth = 15
    planned, true, nodes = [], [], []
    for seed in range(16):
        served = _serve(_controller(None, depth), 0.86, 40, seed=200 + seed, depth=depth)
        planned += served.planned[-20:]
        true += served.true[-20:]
        nodes += served.nodes[-20:]
    assert np.mean(nodes) >= 13.5, np.mean(nodes)
    assert sum(n >= depth for n in nodes) >= len(nodes) / 3, nodes
    assert abs(sum(planned) / sum(true) - 1.0) <= 0.04, sum(planned) / sum(true)


def test_a_fitted_map_is_not_overruled_by_the_first_short_accepts() -> None:
    """The start-up map is right (the drafter states 0.9, the text accepts 0.86 and the map says so), and
    each request's first steps accept what they happen to. With the online corrections starting from
    nothing (the bare ratio of the first steps, 8 pseudo-events for the pooled conditional), a few short
    accepts halved Â: over 16 requests of 12 steps, each request's lowest Â over its tree's true expected
    length averaged 0.70. With the map weighed as evidence (`CALIBRATED_PRIOR_WEIGHT`,
    `CALIBRATED_POOLED_PRIOR_WEIGHT`) it averages at least 0.75."""
    depth = 15
    true_map = AcceptanceCalibration(slopes=[1.0], offsets=[math.log(0.86 / 0.9)], events=[1000])
    lowest = []
    for seed in range(16):
        served = _serve(_controller(true_map, depth), 0.86, 12, seed=300 + seed, depth=depth)
        lowest.append(min(p / t for p, t in zip(served.planned, served.true, strict=True)))
    assert np.mean(lowest) >= 0.75, np.round(lowest, 2).tolist()
