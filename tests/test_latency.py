"""Calibrated latency: max-of-two-affine fit, fit report, width buckets, EMA residual, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from bastion_sglang.controller.latency import (
    LatencyFit,
    LatencyModel,
    LatencySample,
    evaluate_fit,
    fit_latency,
)
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel

QWEN3_8B = ModelShape(
    num_layers=36,
    hidden_size=4096,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_size=12288,
    vocab_size=151936,
)
GPU = HardwareSpec(name="test-gpu", peak_flops=989.4e12, bandwidth=3.35e12)
TRUE_FIT = LatencyFit(alpha_c=1.6, beta_c=0.002, alpha_m=1.15, beta_m=0.0008)
WIDTHS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
CONTEXTS = [64, 256, 1024, 4096, 8192]


@pytest.fixture
def roofline() -> RooflineModel:
    return RooflineModel(QWEN3_8B, GPU)


def synthetic(
    roofline: RooflineModel, fit: LatencyFit, noise: float = 0.0, batch: int = 1, seed: int = 0
) -> list[LatencySample]:
    """Samples on the WIDTHS x CONTEXTS grid from `fit`, times (1 + noise·N(0, 1))."""
    rng = np.random.default_rng(seed)
    samples = []
    for s in WIDTHS:
        for c in CONTEXTS:
            compute = roofline.compute_seconds_batch([s] * batch, [c] * batch)
            memory = roofline.memory_seconds_batch([s] * batch, [c] * batch)
            seconds = fit.apply(compute, memory) * (1.0 + noise * rng.standard_normal())
            samples.append(LatencySample(s=s, c=c, seconds=seconds, batch=batch))
    return samples


def branch_counts(roofline: RooflineModel, fit: LatencyFit) -> tuple[int, int]:
    on_compute = sum(
        fit.alpha_c * roofline.compute_seconds(s, c) + fit.beta_c
        > fit.alpha_m * roofline.memory_seconds(s, c) + fit.beta_m
        for s in WIDTHS
        for c in CONTEXTS
    )
    return on_compute, len(WIDTHS) * len(CONTEXTS) - on_compute


def test_synthetic_grid_uses_both_branches(roofline: RooflineModel) -> None:
    on_compute, on_memory = branch_counts(roofline, TRUE_FIT)
    assert on_compute >= 10 and on_memory >= 10


def test_fit_recovers_exact_parameters(roofline: RooflineModel) -> None:
    fit = fit_latency(roofline, synthetic(roofline, TRUE_FIT))
    assert fit.alpha_c == pytest.approx(TRUE_FIT.alpha_c, rel=1e-6)
    assert fit.beta_c == pytest.approx(TRUE_FIT.beta_c, rel=1e-6)
    assert fit.alpha_m == pytest.approx(TRUE_FIT.alpha_m, rel=1e-6)
    assert fit.beta_m == pytest.approx(TRUE_FIT.beta_m, rel=1e-6)


@pytest.mark.parametrize(
    "truth",
    [
        LatencyFit(alpha_c=1.4, beta_c=-0.001, alpha_m=1.1, beta_m=0.002),
        LatencyFit(alpha_c=2.5, beta_c=0.004, alpha_m=1.02, beta_m=0.0001),
    ],
)
def test_fit_recovers_other_parameters(roofline: RooflineModel, truth: LatencyFit) -> None:
    on_compute, on_memory = branch_counts(roofline, truth)
    assert on_compute >= 5 and on_memory >= 5
    fit = fit_latency(roofline, synthetic(roofline, truth))
    for name in ("alpha_c", "beta_c", "alpha_m", "beta_m"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


KV_HEAVY = ModelShape(
    num_layers=4, hidden_size=64, num_q_heads=8, num_kv_heads=8, head_dim=128, ffn_size=128, vocab_size=128
)
"""Weights of 2.4 MB and 16 KB of KV per cached token: T_mem grows by 44 % between c = 0 and c = 64."""


def test_memory_intercept_stays_nonnegative_so_the_fit_is_positive_at_the_origin() -> None:
    """A memory branch whose least-squares intercept is negative (noisy CPU timings over c = 64, 128) would
    predict a negative latency at s = 1, c = 0, which LatencyModel rejects; the fit clamps β_m at 0."""
    roofline = RooflineModel(KV_HEAVY, GPU)
    at_origin = roofline.memory_seconds(1, 0)
    at_grid = roofline.memory_seconds(1, 64)
    assert at_grid > 1.3 * at_origin
    truth = LatencyFit(alpha_c=1.0, beta_c=-1.0, alpha_m=1.0, beta_m=-0.9 * at_grid)
    samples = [
        LatencySample(
            s=s, c=c, seconds=truth.apply(roofline.compute_seconds(s, c), roofline.memory_seconds(s, c))
        )
        for s in (1, 2, 4, 8, 16)
        for c in (64, 128)
    ]
    assert all(sample.seconds > 0 for sample in samples)
    with pytest.raises(ValueError, match="must be positive"):
        LatencyModel(roofline, truth)
    fit = fit_latency(roofline, samples)
    assert fit.beta_m == 0.0
    assert fit.alpha_m > 0
    assert LatencyModel(roofline, fit).predict(1, 0) > 0


def test_fit_with_two_percent_noise_is_close(roofline: RooflineModel) -> None:
    samples = synthetic(roofline, TRUE_FIT, noise=0.02, seed=7)
    fit = fit_latency(roofline, samples)
    assert fit.alpha_c == pytest.approx(TRUE_FIT.alpha_c, rel=0.05)
    assert fit.alpha_m == pytest.approx(TRUE_FIT.alpha_m, rel=0.05)
    assert fit.beta_c == pytest.approx(TRUE_FIT.beta_c, abs=5e-4)
    assert fit.beta_m == pytest.approx(TRUE_FIT.beta_m, abs=5e-4)
    clean = synthetic(roofline, TRUE_FIT)
    assert evaluate_fit(roofline, fit, clean).mape_fit < 0.01
    assert evaluate_fit(roofline, fit, samples).mape_fit < 0.025


def test_fit_uses_the_batch_roofline(roofline: RooflineModel) -> None:
    fit = fit_latency(roofline, synthetic(roofline, TRUE_FIT, batch=4))
    assert fit.alpha_c == pytest.approx(TRUE_FIT.alpha_c, rel=1e-6)
    assert fit.beta_m == pytest.approx(TRUE_FIT.beta_m, rel=1e-6)


def test_fit_with_one_active_branch_keeps_alphas_positive(roofline: RooflineModel) -> None:
    memory_only = [
        LatencySample(s=s, c=c, seconds=1.2 * roofline.memory_seconds(s, c) + 0.001)
        for s in (1, 2, 4)
        for c in (64, 1024)
    ]
    fit = fit_latency(roofline, memory_only)
    assert fit.alpha_c > 0 and fit.alpha_m == pytest.approx(1.2, rel=1e-6)
    assert evaluate_fit(roofline, fit, memory_only).rmse_fit < 1e-9


def test_fit_degenerate_branch_uses_ratio_median(roofline: RooflineModel) -> None:
    # One distinct width and context: the memory branch cannot fit a slope, so α = median ratio.
    base = roofline.memory_seconds(1, 64)
    samples = [LatencySample(s=1, c=64, seconds=base * ratio) for ratio in (1.1, 1.3, 1.2)]
    fit = fit_latency(roofline, samples)
    prediction = max(
        fit.alpha_c * roofline.compute_seconds(1, 64) + fit.beta_c, fit.alpha_m * base + fit.beta_m
    )
    assert prediction == pytest.approx(1.2 * base, rel=1e-9)
    assert fit.alpha_m == pytest.approx(1.2, rel=1e-9) and fit.alpha_c > 0


def test_fit_needs_two_samples(roofline: RooflineModel) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        fit_latency(roofline, [LatencySample(s=1, c=0, seconds=0.01)])
    with pytest.raises(ValueError, match="at least 1"):
        evaluate_fit(roofline, TRUE_FIT, [])


def test_fit_report_by_hand(roofline: RooflineModel) -> None:
    raw_1, raw_2 = roofline.verify_seconds(8, 100), roofline.verify_seconds(900, 4000)
    samples = [LatencySample(s=8, c=100, seconds=2 * raw_1), LatencySample(s=900, c=4000, seconds=raw_2 / 2)]
    doubled = LatencyFit(alpha_c=2.0, beta_c=0.0, alpha_m=2.0, beta_m=0.0)
    report = evaluate_fit(roofline, doubled, samples)
    assert report.num_samples == 2
    # raw errors: raw_1 - 2·raw_1 = -raw_1 (relative 1/2); raw_2 - raw_2/2 = raw_2/2 (relative 1)
    assert report.rmse_raw == pytest.approx(math.sqrt((raw_1**2 + (raw_2 / 2) ** 2) / 2), rel=1e-12)
    assert report.mape_raw == pytest.approx((0.5 + 1.0) / 2, rel=1e-12)
    # fitted = 2·raw: exact on sample 1; 2·raw_2 - raw_2/2 = 1.5·raw_2 (relative 3) on sample 2
    assert report.rmse_fit == pytest.approx(math.sqrt((1.5 * raw_2) ** 2 / 2), rel=1e-12)
    assert report.mape_fit == pytest.approx((0.0 + 3.0) / 2, rel=1e-12)


def test_fit_report_calibration_beats_raw(roofline: RooflineModel) -> None:
    samples = synthetic(roofline, TRUE_FIT)
    report = evaluate_fit(roofline, fit_latency(roofline, samples), samples)
    assert report.rmse_fit < 1e-12 < report.rmse_raw
    assert report.mape_fit < 1e-9 and report.mape_raw > 0.1


def test_predict_matches_calibrated_roofline(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT)
    assert model.calibrated
    expected = TRUE_FIT.apply(roofline.compute_seconds(40, 512), roofline.memory_seconds(40, 512))
    assert model.predict(40, 512) == expected
    bare = LatencyModel(roofline)
    assert not bare.calibrated and bare.predict(40, 512) == roofline.verify_seconds(40, 512)


def test_predict_many_equals_predict(roofline: RooflineModel) -> None:
    for buckets in (None, [16, 32, 64, 128]):
        model = LatencyModel(roofline, TRUE_FIT, width_buckets=buckets)
        widths = torch.arange(1, 129, dtype=torch.int64)
        values = model.predict_many(widths, 3000)
        assert values.dtype == torch.float64 and values.shape == (128,)
        expected = torch.tensor([model.predict(int(s), 3000) for s in widths], dtype=torch.float64)
        torch.testing.assert_close(values, expected, rtol=1e-13, atol=0.0)


def test_width_buckets_step_function(roofline: RooflineModel) -> None:
    plain = LatencyModel(roofline, TRUE_FIT)
    model = LatencyModel(roofline, TRUE_FIT, width_buckets=[16, 32, 64])
    assert model.width_buckets == (16, 32, 64)
    for s in range(1, 17):
        assert model.predict(s, 256) == plain.predict(16, 256)
    for s in range(17, 33):
        assert model.predict(s, 256) == plain.predict(32, 256)
    assert model.predict(33, 256) == plain.predict(64, 256) > plain.predict(33, 256)
    assert (model.padded_width(1), model.padded_width(16), model.padded_width(17)) == (16, 16, 32)
    with pytest.raises(ValueError, match=r"s = 65 .*\[16, 32, 64\]"):
        model.predict(65, 256)
    with pytest.raises(ValueError, match=r"s = 70 .*\[16, 32, 64\]"):
        model.predict_many(torch.tensor([3, 70, 5]), 256)


def test_predict_batch(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT)
    assert model.predict_batch([24], [900]) == model.predict(24, 900)
    pair = model.predict_batch([8, 8], [500, 500])
    # memory-bound: the second request adds traffic but shares the weight read
    assert model.predict(8, 500) < pair < 2 * model.predict(8, 500)
    compute = roofline.compute_seconds_batch([10, 20], [100, 200])
    memory = roofline.memory_seconds_batch([10, 20], [100, 200])
    assert model.predict_batch([10, 20], [100, 200]) == TRUE_FIT.apply(compute, memory)


def test_predict_batch_pads_every_request_to_the_widest_bucket(roofline: RooflineModel) -> None:
    plain = LatencyModel(roofline, TRUE_FIT)
    model = LatencyModel(roofline, TRUE_FIT, width_buckets=[16, 32, 64])
    assert model.predict_batch([3, 20], [100, 200]) == plain.predict_batch([32, 32], [100, 200])
    assert model.predict_batch(torch.tensor([16, 1]), torch.tensor([7, 9])) == plain.predict_batch(
        [16, 16], [7, 9]
    )
    with pytest.raises(ValueError, match="s = 65"):
        model.predict_batch([1, 65], [0, 0])


def test_ema_converges_to_constant_bias(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.1)
    points = [(s, c) for s in (1, 17, 200, 700) for c in (64, 4000)]
    truth = {point: 1.3 * model.predict(*point) for point in points}
    for step in range(200):
        point = points[step % len(points)]
        model.observe(*point, truth[point])
    assert model.ema_factor == pytest.approx(1.3, abs=1e-3)
    assert model.drift == pytest.approx(0.3, abs=1e-3)
    assert model.predict(17, 64) == pytest.approx(truth[(17, 64)], rel=1e-3)


def test_ema_single_update_arithmetic(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.25)
    base = model.predict(64, 1000)
    model.observe(64, 1000, 2.0 * base)
    assert model.ema_factor == pytest.approx(0.75 * 1.0 + 0.25 * 2.0, rel=1e-12)
    # the ratio is taken against the prediction without the factor
    model.observe(64, 1000, 2.0 * base)
    assert model.ema_factor == pytest.approx(0.75 * 1.25 + 0.25 * 2.0, rel=1e-12)
    assert model.predict(64, 1000) == pytest.approx(model.ema_factor * base, rel=1e-12)


def test_ema_batch_observation_uses_padded_batch(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=1.0, width_buckets=[16, 32])
    base = model.predict_batch([3, 20], [100, 200])
    model.observe_batch([3, 20], [100, 200], 0.5 * base)
    assert model.ema_factor == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("seconds", [0.0, -0.01, math.nan, math.inf])
def test_observe_rejects_bad_latency(roofline: RooflineModel, seconds: float) -> None:
    model = LatencyModel(roofline, TRUE_FIT)
    with pytest.raises(ValueError, match="seconds"):
        model.observe(16, 100, seconds)
    with pytest.raises(ValueError, match="seconds"):
        model.observe_batch([16], [100], seconds)
    assert model.ema_factor == 1.0


def test_fit_method_returns_new_calibrated_model(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, ema_alpha=0.3, width_buckets=[8, 1024])
    model.observe(8, 0, 2 * model.predict(8, 0))
    refit = model.fit(synthetic(roofline, TRUE_FIT))
    assert refit is not model and refit.calibrated and not model.calibrated
    assert (refit.ema_alpha, refit.width_buckets, refit.roofline) == (0.3, (8, 1024), roofline)
    assert refit.ema_factor == 1.0 and model.ema_factor != 1.0
    assert refit.latency_fit.alpha_c == pytest.approx(TRUE_FIT.alpha_c, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, math.nan, True])
def test_bad_ema_alpha(roofline: RooflineModel, alpha: float) -> None:
    with pytest.raises(ValueError, match="ema_alpha"):
        LatencyModel(roofline, ema_alpha=alpha)


@pytest.mark.parametrize("buckets", [[], [32, 16], [16, 16], [0, 16], [1.5, 4]])
def test_bad_width_buckets(roofline: RooflineModel, buckets: list[float]) -> None:
    with pytest.raises(ValueError, match="width_buckets"):
        LatencyModel(roofline, width_buckets=buckets)


def test_fit_predicting_non_positive_latency_is_rejected(roofline: RooflineModel) -> None:
    broken = LatencyFit(alpha_c=1.0, beta_c=-1.0, alpha_m=1.0, beta_m=-1.0)
    with pytest.raises(ValueError, match="must be positive"):
        LatencyModel(roofline, broken)


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"s": 4, "c": 0, "seconds": -0.001}, "seconds"),
        ({"s": 4, "c": 0, "seconds": 0.0}, "seconds"),
        ({"s": 0, "c": 0, "seconds": 0.01}, "s"),
        ({"s": 4, "c": -1, "seconds": 0.01}, "c"),
        ({"s": 4, "c": 0, "seconds": 0.01, "batch": 0}, "batch"),
    ],
)
def test_latency_sample_validation(fields: dict[str, float], bad: str) -> None:
    with pytest.raises(ValidationError) as error:
        LatencySample(**fields)
    assert error.value.errors()[0]["loc"] == (bad,)


def test_latency_fit_validation() -> None:
    with pytest.raises(ValidationError, match="alpha_c"):
        LatencyFit(alpha_c=0.0, beta_c=0.0, alpha_m=1.0, beta_m=0.0)
    with pytest.raises(ValidationError, match="beta_m"):
        LatencyFit(alpha_c=1.0, beta_c=0.0, alpha_m=1.0, beta_m=math.nan)
    assert LatencyFit.identity() == LatencyFit(alpha_c=1.0, beta_c=0.0, alpha_m=1.0, beta_m=0.0)
