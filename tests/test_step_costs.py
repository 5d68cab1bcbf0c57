"""StepCostTracker: the online fit of the step's work outside the forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import QWEN3_8B, HardwareSpec, RooflineModel, lookup_gpu
from bastion_sglang.controller.step_costs import PRIOR_TOKENS, StepCostTracker, draft_seconds_per_request


def test_recovers_a_line_in_the_verify_tokens() -> None:
    tracker = StepCostTracker(decay=0.99)
    rng = np.random.default_rng(0)
    for _ in range(400):
        tokens = int(rng.integers(2, 200))
        tracker.observe(0.02, 0.003 + 2e-5 * tokens + rng.normal(0, 1e-5), tokens)
    t_aux, per_token = tracker.aux_line()
    assert t_aux == pytest.approx(0.003, rel=0.02)
    assert per_token == pytest.approx(2e-5, rel=0.02)
    costs = tracker.costs(l_ar=0.05)
    assert costs.t_draft == pytest.approx(0.02) and costs.l_ar == 0.05


def test_constant_width_gives_the_mean_and_no_slope() -> None:
    tracker = StepCostTracker()
    for seconds in (0.004, 0.006):
        tracker.observe(0.01, seconds, 17)
    t_aux, per_token = tracker.aux_line()
    assert per_token == 0.0
    assert 0.004 < t_aux < 0.006


def test_falling_cost_never_gives_a_negative_slope() -> None:
    tracker = StepCostTracker()
    for tokens, seconds in ((2, 0.01), (64, 0.005), (128, 0.001)):
        tracker.observe(0.0, seconds, tokens)
    t_aux, per_token = tracker.aux_line()
    assert per_token == 0.0 and t_aux > 0


def test_prior_counts_as_pseudo_steps() -> None:
    prior = StepCosts(t_draft=0.5, t_aux=0.25, l_ar=1.0, t_aux_per_token=0.125)
    tracker = StepCostTracker(prior=prior, decay=0.9, prior_weight=10.0)
    assert tracker.costs(l_ar=0.2) == StepCosts(
        t_draft=0.5, t_aux=0.25, l_ar=0.2, t_aux_per_token=0.125, aux_token_span=PRIOR_TOKENS
    )
    for _ in range(200):
        tracker.observe(0.01, 0.01, 4)
    assert tracker.costs(l_ar=0.2).t_draft == pytest.approx(0.01, rel=1e-3)  # the measurements took over
    stubborn = StepCostTracker(prior=prior, decay=0.9, prior_weight=1e9)
    for _ in range(30):
        stubborn.observe(0.01, 0.01, 4)
    assert stubborn.costs(l_ar=0.2).t_draft == pytest.approx(0.5, rel=1e-3)  # a heavy prior stays


def test_the_prior_moves_with_the_machine_factor_and_measured_steps_do_not() -> None:
    """A profile measured while the machine ran slower: plain steps now run 0.8x it, so before any drafted
    step the prior's costs are taken 0.8x; a measured step's seconds are what they are."""
    prior = StepCosts(t_draft=0.5, t_aux=0.25, l_ar=1.0, t_aux_per_token=0.125)
    tracker = StepCostTracker(prior=prior, decay=0.9, prior_weight=1.0)
    costs = tracker.costs(l_ar=0.2, machine=0.8)
    assert (costs.t_draft, costs.t_aux, costs.t_aux_per_token) == pytest.approx((0.4, 0.2, 0.1))
    slower = StepCosts(t_draft=0.4, t_aux=0.2, l_ar=1.0, t_aux_per_token=0.1)  # the prior taken 0.8x
    twin = StepCostTracker(prior=slower, decay=0.9, prior_weight=1.0)
    for observed in (tracker, twin):
        observed.observe(0.3, 0.2, 4)  # one measured step against the prior's pseudo-steps
    moved, reference = tracker.costs(l_ar=0.2, machine=0.8), twin.costs(l_ar=0.2)
    assert (moved.t_draft, moved.t_aux, moved.t_aux_per_token) == pytest.approx(
        (reference.t_draft, reference.t_aux, reference.t_aux_per_token)
    )
    assert tracker.costs(l_ar=0.2).t_draft > moved.t_draft
    measured_only = StepCostTracker(decay=0.9)
    measured_only.observe(0.3, 0.2, 4)
    assert measured_only.costs(l_ar=0.2, machine=0.5).t_draft == pytest.approx(0.3)
    with pytest.raises(ValueError, match="machine"):
        tracker.costs(l_ar=0.2, machine=0.0)


def test_a_cost_the_profile_lacks_raises_the_priors_per_token_line() -> None:
    """A paged commit's KV copy (seconds per verify token) adds to the prior's slope, not to its intercept,
    and later measured steps, which include the copy, replace it as they would the prior's own line."""
    prior = StepCosts(t_draft=0.5, t_aux=0.25, l_ar=1.0, t_aux_per_token=0.125)
    tracker = StepCostTracker(prior=prior, decay=0.9, prior_weight=10.0)
    tracker.add_prior_per_token(0.03125)
    assert tracker.aux_line() == pytest.approx((0.25, 0.15625))
    assert tracker.aux_token_span() == PRIOR_TOKENS
    for _ in range(300):
        tracker.observe(0.01, 0.002 + 0.001 * 4, 4)
        tracker.observe(0.01, 0.002 + 0.001 * 8, 8)
    assert tracker.aux_line() == pytest.approx((0.002, 0.001), rel=1e-3)
    with pytest.raises(ValueError, match="before the first measured step"):
        tracker.add_prior_per_token(0.01)
    without_prior = StepCostTracker()
    without_prior.add_prior_per_token(0.01)
    assert without_prior.aux_line() == (0.0, 0.0)  # the first measured step prices the copy
    with pytest.raises(ValueError, match="seconds must be >= 0 per token, got -1"):
        StepCostTracker(prior=prior).add_prior_per_token(-1)


def test_rejects_bad_decay() -> None:
    with pytest.raises(ValueError, match="decay"):
        StepCostTracker(decay=1.0)


def test_draft_cost_is_a_line_in_the_batch_size() -> None:
    tracker = StepCostTracker(decay=0.99)
    rng = np.random.default_rng(1)
    for _ in range(300):
        batch = int(rng.integers(1, 33))
        tracker.observe(0.01 + 0.009 * batch + rng.normal(0, 1e-4), 0.001, 2 * batch, batch)
    assert tracker.draft_seconds(1) == pytest.approx(0.019, rel=0.02)
    assert tracker.costs(l_ar=0.05, batch=32).t_draft == pytest.approx(0.01 + 0.009 * 32, rel=0.01)


def test_one_drafted_step_at_a_larger_batch_prices_that_batch() -> None:
    """A profile measures the drafter at B = 1; the first probe at B = 8 fixes the line's slope, so the
    next plan at B = 8 pays what that probe paid, while B = 1 keeps the profile's cost."""
    prior = StepCosts(t_draft=0.018, t_aux=0.001, l_ar=0.045)
    tracker = StepCostTracker(prior=prior, prior_weight=10.0)
    assert tracker.draft_seconds(8) == pytest.approx(0.018)
    tracker.observe(0.080, 0.001, 16, 8)
    assert tracker.draft_seconds(8) == pytest.approx(0.080, rel=0.06)
    assert tracker.draft_seconds(1) == pytest.approx(0.018, rel=0.25)


def test_the_prior_draft_line_grows_as_the_target_does_on_this_hardware() -> None:
    """The profile times the drafter at B = 1 only: its slope over B comes from the target's latency model,
    near flat where a pass of B blocks is bound by weight reads (an H100 at B = 8), steep where it is
    compute-bound (a slow CPU); the tracker's prior line goes through T_draft at B = 1 with that slope."""
    gpu = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")))
    cpu = LatencyModel(RooflineModel(QWEN3_8B, HardwareSpec(name="cpu", peak_flops=1e11, bandwidth=2e10)))
    flat = draft_seconds_per_request(0.002, gpu, block=16, context=256)
    steep = draft_seconds_per_request(0.002, cpu, block=16, context=256)
    assert 0 <= flat < 0.1 * 0.002  # under a tenth of the B = 1 pass per extra request
    assert steep > 0.5 * 0.002
    one = cpu.predict_batch([16], [256])
    eight = cpu.predict_batch([16] * 8, [256] * 8)
    assert 0.002 + 7 * steep == pytest.approx(0.002 * eight / one)
    prior = StepCosts(t_draft=0.002, t_aux=0.001, l_ar=0.017)
    tracker = StepCostTracker(prior=prior, prior_weight=10.0, prior_draft_per_request=steep)
    assert tracker.draft_seconds(1) == pytest.approx(0.002)
    assert tracker.draft_seconds(8) == pytest.approx(0.002 + 7 * steep)
    with pytest.raises(ValueError, match="prior_draft_per_request"):
        StepCostTracker(prior=prior, prior_draft_per_request=-1e-3)
    with pytest.raises(ValueError, match="batch >= 2"):
        draft_seconds_per_request(0.002, cpu, block=16, context=256, batch=1)
    with pytest.raises(ValueError, match="t_draft"):
        draft_seconds_per_request(-0.002, cpu, block=16, context=256)


def test_a_heavy_prior_keeps_the_profile_draft_cost_at_every_batch_size() -> None:
    """ema_alpha -> 0 weighs the profile as ~1e6 steps: CPU timings at B = 8 do not reshape it."""
    prior = StepCosts(t_draft=0.002, t_aux=0.001, l_ar=0.017)
    tracker = StepCostTracker(prior=prior, prior_weight=1e6)
    for _ in range(50):
        tracker.observe(0.080, 0.001, 16, 8)
    assert tracker.draft_seconds(8) < 0.008  # near the profile's 2 ms, far from the measured 80 ms


def test_first_step_rule_without_a_prior() -> None:
    """The first step sets the estimate outright; step n weighs 1 / (1 + decay + … + decay^(n-1))."""
    tracker = StepCostTracker(decay=0.9)
    tracker.observe(0.02, 0.004, 8)
    assert tracker.costs(l_ar=0.05).t_draft == pytest.approx(0.02)
    assert tracker.aux_line() == pytest.approx((0.004, 0.0))
    tracker.observe(0.03, 0.006, 8)
    newest = 1 / (1 + 0.9)
    assert tracker.draft_seconds(1) == pytest.approx(0.02 + newest * (0.03 - 0.02))
    assert tracker.aux_line()[0] == pytest.approx(0.004 + newest * (0.006 - 0.004))


def test_warmup_steps_are_left_out() -> None:
    """A cold first step (one-time costs) does not set the lines; the steps after it do, by the first-step
    rule. Until then the costs are the prior's, or zeros without one."""
    tracker = StepCostTracker(decay=0.9, warmup_steps=1)
    tracker.observe(0.25, 0.06, 8, 6)
    assert tracker.steps == 0
    assert tracker.costs(l_ar=0.05, batch=6).t_draft == 0.0
    assert tracker.aux_line() == (0.0, 0.0)
    tracker.observe(0.04, 0.008, 8, 6)
    assert tracker.steps == 1
    assert tracker.draft_seconds(6) == pytest.approx(0.04)
    assert tracker.aux_line() == pytest.approx((0.008, 0.0))
    prior = StepCosts(t_draft=0.01, t_aux=0.002, l_ar=0.05)
    with_prior = StepCostTracker(prior=prior, warmup_steps=2)
    for _ in range(2):
        with_prior.observe(0.25, 0.06, 8, 6)
    assert with_prior.costs(l_ar=0.05, batch=6).t_draft == pytest.approx(0.01)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        StepCostTracker(warmup_steps=-1)


def test_aux_work_is_priced_no_further_than_the_measured_tokens() -> None:
    """A slope fitted at 5..16 tokens (one request) by noisy steps prices a batch of 8 such trees (128 tokens)
    at the most tokens measured; a step measured at 128 tokens extends the span, after which 128 tokens cost
    what the line says there."""
    tracker = StepCostTracker(decay=0.95)
    for tokens, seconds in ((5, 0.001), (16, 0.0065), (9, 0.003), (16, 0.006)):
        tracker.observe(0.02, seconds, tokens)
    t_aux, per_token = tracker.aux_line()
    assert per_token > 3e-4  # the noise's steep slope
    costs = tracker.costs(l_ar=0.01)
    assert costs.aux_token_span == 16
    wide = float(costs.cycle_seconds(0.03, 128))
    assert wide == pytest.approx(0.02 + t_aux + per_token * 16 + 0.03)
    many = costs.cycle_seconds(np.array([0.03, 0.03]), np.array([8, 128]))
    assert many == pytest.approx([0.02 + t_aux + per_token * 8 + 0.03, wide])
    tensor = costs.cycle_seconds(torch.tensor([0.03, 0.03], dtype=torch.float64), torch.tensor([8, 128]))
    assert tensor.tolist() == pytest.approx(many.tolist())
    tracker.observe(0.02, 0.008, 128, 8)
    assert tracker.costs(l_ar=0.01).aux_token_span == 128
    t_aux, per_token = tracker.aux_line()
    assert tracker.costs(l_ar=0.01).cycle_seconds(0.0, 128) == pytest.approx(0.02 + t_aux + per_token * 128)


def test_aux_token_span_is_none_before_any_point_and_rejects_zero() -> None:
    assert StepCostTracker().costs(l_ar=0.01).aux_token_span is None
    assert StepCostTracker().costs(l_ar=0.01).cycle_seconds(0.01, 10**6) == pytest.approx(0.01)
    with pytest.raises(ValidationError, match="aux_token_span"):
        StepCosts(t_draft=0.0, t_aux=0.0, l_ar=0.01, aux_token_span=0)
