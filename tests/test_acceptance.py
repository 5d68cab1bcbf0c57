"""Acceptance calibration: recovering a known miscalibration, keeping the tree exact, the online tracker."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bastion_sglang.controller.acceptance import (
    AcceptanceCalibration,
    AcceptanceRecord,
    AcceptanceTracker,
    conditional_events,
    evaluate_acceptance,
    fit_acceptance,
    node_log_scores,
    realised_accept_length,
)
from bastion_sglang.controller.batched import build_trees
from bastion_sglang.controller.tree import build_tree

DEPTHS, TOPK, VOCAB = 4, 6, 50
OUTSIDE = -1
"""A target token outside every top-K row (never matches a candidate)."""


def synthetic_records(
    count: int, slopes: list[float], offsets: list[float], seed: int
) -> list[AcceptanceRecord]:
    """Drafter passes whose target token at depth d is the rank-r candidate with probability
    exp(min(0, a_d·log q + b_d)) (a known miscalibration), else a token outside the top-K."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        probs = rng.dirichlet(np.full(VOCAB, 0.15), size=DEPTHS)
        order = np.argsort(-probs, axis=1)[:, :TOPK]
        top = np.take_along_axis(probs, order, axis=1)
        logprobs = np.log(top)
        continuation = []
        for d in range(DEPTHS):
            true = np.exp(np.minimum(slopes[d] * logprobs[d] + offsets[d], 0.0))
            assert true.sum() <= 1.0 + 1e-9
            pick = rng.choice(TOPK + 1, p=[*true, 1.0 - true.sum()])
            continuation.append(int(order[d, pick]) if pick < TOPK else OUTSIDE)
        records.append(
            AcceptanceRecord(
                logprobs=torch.tensor(logprobs, dtype=torch.float32),
                token_ids=torch.tensor(order, dtype=torch.int64),
                continuation=tuple(continuation),
            )
        )
    return records


TRUE_SLOPES = [1.6, 1.4, 1.8, 1.8]
TRUE_OFFSETS = [-0.3, -0.6, -0.2, -0.2]


@pytest.fixture(scope="module")
def records() -> list[AcceptanceRecord]:
    return synthetic_records(6000, TRUE_SLOPES, TRUE_OFFSETS, seed=0)


def test_fit_recovers_a_known_miscalibration(records: list[AcceptanceRecord]) -> None:
    calibration = fit_acceptance(records, DEPTHS)
    # depths 1 and 2 have thousands of events: within 0.15 of the truth in slope, 0.15 in offset
    for d in range(2):
        assert calibration.slopes[d] == pytest.approx(TRUE_SLOPES[d], abs=0.15)
        assert calibration.offsets[d] == pytest.approx(TRUE_OFFSETS[d], abs=0.15)
    assert all(count > 0 for count in calibration.events[:2])


def test_identity_drafter_fits_near_identity() -> None:
    calibrated = synthetic_records(4000, [1.0] * DEPTHS, [0.0] * DEPTHS, seed=1)
    calibration = fit_acceptance(calibrated, DEPTHS)
    assert calibration.slopes[0] == pytest.approx(1.0, abs=0.12)
    assert calibration.offsets[0] == pytest.approx(0.0, abs=0.12)


def test_calibrated_expected_accept_length_matches_held_out(records: list[AcceptanceRecord]) -> None:
    calibration = fit_acceptance(records, DEPTHS)
    held_out = synthetic_records(3000, TRUE_SLOPES, TRUE_OFFSETS, seed=7)
    report = evaluate_acceptance(calibration, held_out, budgets=[1, 4, 16])
    # the raw drafter over-predicts by far more than the calibrated one
    assert all(error > 0.08 for error in report.error_raw)
    assert all(abs(error) < 0.03 for error in report.error)


def test_conditional_events_stop_where_the_target_leaves_the_lattice() -> None:
    logprobs = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.9, 0.05]]))
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    record = AcceptanceRecord(logprobs, ids, continuation=(2, 7, 5))
    events = conditional_events([record], 3)
    assert events[0][1].tolist() == [0.0, 1.0]
    assert events[1][1].tolist() == [0.0, 0.0]  # target token 7 is outside the row
    assert events[2][0].size == 0  # not conditional: the target's path left the lattice at depth 2


def test_apply_keeps_rows_sorted_and_the_tree_exact() -> None:
    generator = torch.Generator().manual_seed(3)
    logprobs = (
        torch.log_softmax(torch.randn(2, 5, 8, generator=generator), -1).sort(-1, descending=True).values
    )
    token_ids = torch.randint(0, 1000, (2, 5, 8), generator=generator)
    calibration = AcceptanceCalibration(
        slopes=[1.7, 0.6, 2.0], offsets=[-0.2, 0.3, -1.0], events=[10, 10, 10]
    )
    calibrated = calibration.apply(logprobs)
    assert calibrated.shape == logprobs.shape and calibrated.dtype == logprobs.dtype
    assert (calibrated <= 0).all()
    assert (calibrated[..., 1:] <= calibrated[..., :-1]).all()
    # depth 4 and 5 use the last fitted depth's map
    assert torch.allclose(calibrated[:, 4], torch.clamp(2.0 * logprobs[:, 4] - 1.0, max=0.0))
    # the beam on calibrated values equals the heap on them (the tree search is exact for them)
    batch = build_trees(calibrated, token_ids, 40)
    for b in range(2):
        heap = build_tree(calibrated[b], token_ids[b], 40)
        assert torch.equal(batch.row(b).tokens, heap.tokens)
        assert torch.equal(batch.row(b).parents, heap.parents)
    # and its top-n maximise the calibrated Â over prefix-closed trees of that size: no node outside
    # the tree scores above the tree's last node
    scores = heap.log_scores
    assert bool((scores[1:] <= scores[:-1]).all())


def test_calibration_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="slopes must be > 0"):
        AcceptanceCalibration(slopes=[1.0, 0.0], offsets=[0.0, 0.0], events=[1, 1])
    with pytest.raises(ValueError, match="one entry per depth"):
        AcceptanceCalibration(slopes=[1.0], offsets=[0.0, 0.0], events=[1])


def test_fit_refuses_too_little_data() -> None:
    few = synthetic_records(3, TRUE_SLOPES, TRUE_OFFSETS, seed=2)
    with pytest.raises(ValueError, match="matching events at depth 1"):
        fit_acceptance(few, DEPTHS)


def test_realised_accept_length_follows_the_matching_path() -> None:
    # root -> a(1) -> c(3); root -> b(2) -> d(4)
    tokens, parents, depths = [1, 2, 3, 4], [-1, -1, 0, 1], [1, 1, 2, 2]
    assert realised_accept_length(tokens, parents, depths, (2, 4, 9)) == 3
    assert realised_accept_length(tokens, parents, depths, (2, 3, 9)) == 2  # 3 hangs off the wrong parent
    assert realised_accept_length(tokens, parents, depths, (7, 4)) == 1


def test_tracker_learns_the_ratio_per_mode() -> None:
    tracker = AcceptanceTracker(decay=0.9, min_predicted=4.0)
    assert tracker.correction(True) == 1.0
    for _ in range(100):
        tracker.observe([2.0, 2.0], [1, 2], greedy=[True, False], corrections=[1.0, 1.0])
    assert tracker.correction(True) == pytest.approx(0.5)
    assert tracker.correction(False) == pytest.approx(1.0)
    assert tracker.calibration_error == pytest.approx(0.2)  # expected 6, realised 5 per step
    # requests that verified no node add nothing; forgotten below min_predicted, c is 1 again
    before = tracker.correction(True)
    tracker.observe([0.0], [0], greedy=[True], corrections=[1.0])
    assert tracker.correction(True) == pytest.approx(before)
    for _ in range(40):
        tracker.observe([0.0], [0], greedy=[True], corrections=[1.0])
    assert tracker.correction(True) == 1.0


def test_tracker_corrects_what_the_depth_map_leaves() -> None:
    """Per-depth predictions are weighed by the depth map's reach factors as they are when asked: a map
    that has learnt the whole error leaves c at 1, whatever the steps were planned with."""
    tracker = AcceptanceTracker(decay=0.5, min_predicted=1.0, depth=2)
    reach = np.array([[0.8, 0.4]] * 2)  # the base map's predicted reaches of depths 1 and 2 (1.2 drafted)
    tracker.observe([1.2, 1.2], [0, 1], greedy=[True, True], corrections=[1.0, 1.0], reach=reach)
    assert tracker.correction(True) == pytest.approx(1.0 / 2.4)
    assert tracker.correction(True, np.array([0.5, 0.25])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"reach must be \[1, 2\]"):
        tracker.observe([1.2], [0], greedy=[True], corrections=[1.0], reach=np.zeros((1, 3)))


def test_tracker_clips_the_correction() -> None:
    tracker = AcceptanceTracker(decay=0.5, min_predicted=0.1, lower=0.25, upper=4.0)
    for _ in range(50):
        tracker.observe([0.1], [5], greedy=[True], corrections=[1.0])
    assert tracker.correction(True) == 4.0
    assert math.isfinite(tracker.calibration_error)


def test_node_log_scores_recover_the_raw_path_scores() -> None:
    generator = torch.Generator().manual_seed(5)
    logprobs = (
        torch.log_softmax(torch.randn(3, 5, 6, generator=generator), -1).sort(-1, descending=True).values
    )
    token_ids = torch.stack([torch.randperm(100, generator=generator)[:30].view(5, 6) for _ in range(3)])
    calibration = AcceptanceCalibration(slopes=[1.5, 2.5], offsets=[-0.1, -0.4], events=[1, 1])
    raw_trees = build_trees(logprobs, token_ids, 25)
    # on the raw tree, the recomputed scores are the builder's own scores
    assert torch.allclose(
        node_log_scores(raw_trees.tokens, raw_trees.parents, raw_trees.depths, logprobs, token_ids),
        raw_trees.log_scores,
    )
    # on a tree built from calibrated values, they are the raw scores of that tree's paths
    trees = build_trees(calibration.apply(logprobs), token_ids, 25)
    scores = node_log_scores(trees.tokens, trees.parents, trees.depths, logprobs, token_ids)
    for b in range(3):
        for i in range(trees.num_nodes):
            expected, node = 0.0, i
            while node >= 0:
                depth = int(trees.depths[b, node])
                rank = (token_ids[b, depth - 1] == trees.tokens[b, node]).nonzero().item()
                expected += float(logprobs[b, depth - 1, rank])
                node = int(trees.parents[b, node])
            assert float(scores[b, i]) == pytest.approx(expected, abs=1e-6)
