"""Calibrated latency: the additive model, its NNLS fit on relative error, leave-out validation, plain decode,
width buckets, the online affine correction, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from bastion_sglang.controller.latency import (
    CORRECTION_FLOOR,
    SCALE_BOUNDS,
    DecodeFit,
    LatencyFit,
    LatencyModel,
    LatencySample,
    OnlineCorrection,
    evaluate_fit,
    fit_latency,
    validate_leave_out,
)
from bastion_sglang.controller.roofline import QWEN3_8B, HardwareSpec, ModelShape, RooflineModel

GPU = HardwareSpec(name="test-gpu", peak_flops=989.4e12, bandwidth=3.35e12)
TRUE_FIT = LatencyFit(
    beta_fixed=4e-3,
    alpha_gemm=1.35,
    alpha_tok=3e-6,
    alpha_attn=2.1,
    alpha_kv=6.0,
    decode=DecodeFit(beta=2.5e-3, alpha_attn=1.6),
)
WIDTHS = [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
CONTEXTS = [64, 256, 1024, 4096, 8192]
COEFFICIENTS = ("beta_fixed", "alpha_gemm", "alpha_tok", "alpha_attn", "alpha_kv")


@pytest.fixture
def roofline() -> RooflineModel:
    return RooflineModel(QWEN3_8B, GPU)


def synthetic(
    roofline: RooflineModel,
    fit: LatencyFit,
    noise: float = 0.0,
    batch: int = 1,
    seed: int = 0,
    widths: list[int] = WIDTHS,
    contexts: list[int] = CONTEXTS,
) -> list[LatencySample]:
    """Verify samples on the widths × contexts grid and decode samples at every context, from `fit`,
    times (1 + noise·N(0, 1))."""
    rng = np.random.default_rng(seed)
    model = LatencyModel(roofline, fit)
    samples = []
    for c in contexts:
        for s in widths:
            seconds = model.predict_batch([s] * batch, [c] * batch) * (1.0 + noise * rng.standard_normal())
            samples.append(LatencySample(s=s, c=c, seconds=seconds, batch=batch))
        seconds = model.predict_plain_batch([c] * batch) * (1.0 + noise * rng.standard_normal())
        samples.append(LatencySample(s=1, c=c, seconds=seconds, batch=batch, mode="decode"))
    return samples


def by_hand(roofline: RooflineModel, fit: LatencyFit, s: int, c: int) -> float:
    """The module docstring's formula for one request, written out."""
    hw = roofline.hw
    gemm = max(roofline.gemm_flops(s) / hw.peak_flops, roofline.weight_bytes() / hw.bandwidth)
    ridge = roofline.weight_bytes() / hw.bandwidth / (roofline.gemm_flops(1) / hw.peak_flops)
    attention = roofline.attention_flops(s, c) / hw.peak_flops
    kv = 2 * 36 * 2 * 1024 * (c + 2 * s) / hw.bandwidth  # bp·L·2h_kv·(c+2s) / bandwidth
    return (
        fit.beta_fixed
        + fit.alpha_gemm * gemm
        + fit.alpha_tok * min(s, ridge)
        + fit.alpha_attn * attention
        + fit.alpha_kv * kv
    )


def test_prediction_is_the_documented_formula(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT)
    for s, c in ((2, 0), (40, 512), (700, 8000)):
        assert model.predict(s, c) == pytest.approx(by_hand(roofline, TRUE_FIT, s, c), rel=1e-12)
    # the synthetic grid crosses the GEMM ridge, so the columns 1, G and min(T, T*) are independent
    assert WIDTHS[0] < roofline.gemm_ridge_tokens() < WIDTHS[-1]
    gemm_bound = {
        roofline.gemm_flops(s) / GPU.peak_flops > roofline.weight_bytes() / GPU.bandwidth for s in WIDTHS
    }
    attention_bound = {
        roofline.attention_flops(s, c) / GPU.peak_flops > roofline.request_bytes(s, c) / GPU.bandwidth
        for s in WIDTHS
        for c in CONTEXTS
    }
    assert gemm_bound == attention_bound == {True, False}


@pytest.mark.parametrize(
    "truth",
    [
        TRUE_FIT,
        LatencyFit(beta_fixed=1e-3, alpha_gemm=1.05, alpha_tok=0.0, alpha_attn=4.0, alpha_kv=1.0),
        LatencyFit(beta_fixed=0.0, alpha_gemm=2.5, alpha_tok=1e-5, alpha_attn=0.0, alpha_kv=12.0),
    ],
)
def test_fit_recovers_known_coefficients(roofline: RooflineModel, truth: LatencyFit) -> None:
    """Noise-free samples of the model's form: every coefficient back to 1e-6 relative (1e-12 s absolute
    for a true zero), and the fit's error ~0."""
    samples = synthetic(roofline, truth)
    fit = fit_latency(roofline, samples)
    for name in COEFFICIENTS:
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name
    if truth.decode is not None:
        assert fit.decode is not None
        assert fit.decode.beta == pytest.approx(truth.decode.beta, rel=1e-6)
        assert fit.decode.alpha_attn == pytest.approx(truth.decode.alpha_attn, rel=1e-6)
    report = evaluate_fit(roofline, fit, samples)
    assert report.mape_fit < 1e-9 and report.rmse_fit < 1e-12
    assert report.mape_raw > 0.1  # the bare roofline is far off
    assert report.num_samples == len(WIDTHS) * len(CONTEXTS) and report.num_decode_samples == len(CONTEXTS)
    assert report.mape_decode_fit is not None and report.mape_decode_fit < 1e-9


def test_fit_uses_the_batch_form(roofline: RooflineModel) -> None:
    """Batches of 4: GEMMs over 4·s tokens, attention summed over the 4 requests."""
    samples = synthetic(roofline, TRUE_FIT, batch=4)
    fit = fit_latency(roofline, samples)
    for name in COEFFICIENTS:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE_FIT, name), rel=1e-6), name
    assert fit.decode is not None and TRUE_FIT.decode is not None
    assert fit.decode.beta == pytest.approx(TRUE_FIT.decode.beta, rel=1e-6)
    assert fit.decode.alpha_attn == pytest.approx(TRUE_FIT.decode.alpha_attn, rel=1e-6)


def test_fit_with_two_percent_noise_is_close(roofline: RooflineModel) -> None:
    samples = synthetic(roofline, TRUE_FIT, noise=0.02, seed=7)
    fit = fit_latency(roofline, samples)
    assert fit.beta_fixed == pytest.approx(TRUE_FIT.beta_fixed, rel=0.1)
    assert fit.alpha_gemm == pytest.approx(TRUE_FIT.alpha_gemm, rel=0.1)
    assert fit.alpha_attn == pytest.approx(TRUE_FIT.alpha_attn, rel=0.1)
    clean = synthetic(roofline, TRUE_FIT)
    assert evaluate_fit(roofline, fit, clean).mape_fit < 0.01
    assert evaluate_fit(roofline, fit, samples).mape_fit < 0.025


def test_nnls_coefficients_are_never_negative(roofline: RooflineModel) -> None:
    """Latency that falls with the context: unconstrained least squares answers with negative context
    weights; the fit clamps them at 0 and still predicts a positive latency everywhere."""
    rng = np.random.default_rng(3)
    samples = [
        LatencySample(s=s, c=c, seconds=0.02 + 2e-5 * s - 1.5e-7 * c + 1e-4 * rng.standard_normal())
        for s in WIDTHS
        for c in CONTEXTS
    ]
    observed = np.array([x.seconds for x in samples])
    design = np.array(
        [
            (1.0, t.gemm_seconds, t.narrow_tokens, t.attention_compute_seconds, t.kv_seconds)
            for t in (roofline.pass_terms(x.s, x.c) for x in samples)
        ]
    )
    free, *_ = np.linalg.lstsq(design / observed[:, None], np.ones(len(samples)), rcond=None)
    assert free.min() < 0
    fit = fit_latency(roofline, samples)
    assert all(getattr(fit, name) >= 0 for name in COEFFICIENTS)
    assert fit.alpha_attn == fit.alpha_kv == 0.0
    model = LatencyModel(roofline, fit)
    assert model.predict(2, 0) > 0 and model.predict_plain(0) > 0


def test_relative_error_fit_beats_absolute_error_fit_on_mape() -> None:
    """A grid spanning 1 ms .. 1 s whose latency has a term the model lacks (s^1.5): least squares on
    absolute error spends its freedom on the slow passes and misses the fast ones by far more."""
    shape = ModelShape(
        num_layers=16,
        hidden_size=2048,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        ffn_size=8192,
        vocab_size=32000,
    )
    roofline = RooflineModel(shape, HardwareSpec(name="slow", peak_flops=2e13, bandwidth=2e12))
    truth = LatencyFit(beta_fixed=2e-4, alpha_gemm=1.2, alpha_tok=0.0, alpha_attn=1.5, alpha_kv=2.0)
    model = LatencyModel(roofline, truth)
    widths, contexts = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048], [64, 1024, 8192, 32768]
    samples = [
        LatencySample(s=s, c=c, seconds=model.predict(s, c) + 2e-6 * s**1.5) for s in widths for c in contexts
    ]
    seconds = [x.seconds for x in samples]
    assert min(seconds) < 2e-3 and max(seconds) > 0.5
    relative = evaluate_fit(roofline, fit_latency(roofline, samples), samples)
    absolute = evaluate_fit(roofline, fit_latency(roofline, samples, relative=False), samples)
    assert relative.mape_fit < 0.5 * absolute.mape_fit
    assert absolute.rmse_fit < relative.rmse_fit  # what each one minimises


def test_leave_out_validation_passes_on_the_models_form(roofline: RooflineModel) -> None:
    exact = validate_leave_out(roofline, synthetic(roofline, TRUE_FIT))
    assert [fold.held_out for fold in exact.widths] == WIDTHS
    assert [fold.held_out for fold in exact.contexts] == CONTEXTS
    assert [fold.held_out for fold in exact.decode_contexts] == CONTEXTS
    assert all(fold.num_samples == len(CONTEXTS) for fold in exact.widths)
    assert exact.mape_widths is not None and exact.mape_widths < 1e-9
    assert exact.mape_contexts is not None and exact.mape_contexts < 1e-9
    assert exact.mape_decode_contexts is not None and exact.mape_decode_contexts < 1e-9
    noisy = validate_leave_out(roofline, synthetic(roofline, TRUE_FIT, noise=0.01, seed=1))
    assert noisy.mape_widths is not None and noisy.mape_widths < 0.02
    assert noisy.mape_contexts is not None and noisy.mape_contexts < 0.02


def test_leave_out_validation_fails_on_a_form_the_model_cannot_represent(roofline: RooflineModel) -> None:
    """Latency with an s² term and no context dependence: the fit bends its attention and token terms to
    follow it in sample, but left-out widths and contexts expose it (MAPE > 10 %)."""
    samples = [LatencySample(s=s, c=c, seconds=5e-3 + 5e-8 * s * s) for s in WIDTHS for c in CONTEXTS]
    report = validate_leave_out(roofline, samples)
    assert report.mape_widths is not None and report.mape_contexts is not None
    assert max(report.mape_widths, report.mape_contexts) > 0.10
    assert max(fold.mape for fold in report.widths) > 0.10
    assert report.decode_contexts == [] and report.mape_decode_contexts is None


def test_leave_out_needs_two_values_to_split(roofline: RooflineModel) -> None:
    samples = synthetic(roofline, TRUE_FIT, contexts=[512])
    report = validate_leave_out(roofline, samples)
    assert report.contexts == [] and report.mape_contexts is None
    assert report.mape_widths is not None and report.mape_widths < 1e-9


def test_fit_needs_two_verify_samples(roofline: RooflineModel) -> None:
    decode_only = [LatencySample(s=1, c=c, seconds=0.01, mode="decode") for c in (0, 64, 128)]
    with pytest.raises(ValueError, match="at least 2 verify"):
        fit_latency(roofline, [LatencySample(s=2, c=0, seconds=0.01), *decode_only])
    with pytest.raises(ValueError, match="at least 1 verify"):
        evaluate_fit(roofline, TRUE_FIT, decode_only)
    with pytest.raises(ValueError, match="samples\\[0\\] must be a LatencySample"):
        fit_latency(roofline, [(2, 0, 0.01), (4, 0, 0.02)])  # type: ignore[list-item]


def test_fit_report_by_hand(roofline: RooflineModel) -> None:
    raw_1, raw_2 = roofline.verify_seconds(8, 100), roofline.verify_seconds(900, 4000)
    fit = LatencyFit(beta_fixed=0.0, alpha_gemm=2.0, alpha_tok=0.0, alpha_attn=2.0, alpha_kv=2.0)
    model = LatencyModel(roofline, fit)
    fit_1, fit_2 = model.predict(8, 100), model.predict(900, 4000)
    samples = [LatencySample(s=8, c=100, seconds=2 * raw_1), LatencySample(s=900, c=4000, seconds=raw_2 / 2)]
    report = evaluate_fit(roofline, fit, samples)
    assert report.num_samples == 2 and report.num_decode_samples == 0 and report.mape_decode_fit is None
    assert report.rmse_raw == pytest.approx(math.sqrt((raw_1**2 + (raw_2 / 2) ** 2) / 2), rel=1e-12)
    assert report.mape_raw == pytest.approx((0.5 + 1.0) / 2, rel=1e-12)
    errors = [fit_1 - 2 * raw_1, fit_2 - raw_2 / 2]
    assert report.rmse_fit == pytest.approx(math.sqrt((errors[0] ** 2 + errors[1] ** 2) / 2), rel=1e-12)
    assert report.mape_fit == pytest.approx((abs(errors[0]) / (2 * raw_1) + abs(errors[1]) / (raw_2 / 2)) / 2)


def test_uncalibrated_model_is_the_sum_of_the_roofline_parts(roofline: RooflineModel) -> None:
    bare = LatencyModel(roofline)
    assert not bare.calibrated and bare.latency_fit == LatencyFit.identity()
    terms = roofline.pass_terms(40, 512)
    parts = terms.gemm_seconds + terms.attention_compute_seconds + terms.kv_seconds
    assert bare.predict(40, 512) == pytest.approx(parts, rel=1e-14)
    # plain decoding without a fit: the roofline of one token
    one = roofline.pass_terms(1, 900)
    parts = one.gemm_seconds + one.attention_compute_seconds + one.kv_seconds
    assert bare.predict_plain(900) == pytest.approx(parts, rel=1e-14)


def test_plain_decode_prediction(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT)
    decode = TRUE_FIT.decode
    assert decode is not None
    assert model.predict_plain(3000) == pytest.approx(
        decode.beta + decode.alpha_attn * roofline.attention_seconds(1, 3000), rel=1e-14
    )
    # a batch: attention per request, and the extra tokens at the verify fit's GEMM and token costs
    extra = (
        TRUE_FIT.alpha_gemm * (roofline.gemm_seconds(3) - roofline.gemm_seconds(1)) + 2 * TRUE_FIT.alpha_tok
    )
    attention = sum(roofline.attention_seconds(1, c) for c in (100, 2000, 5000))
    assert model.predict_plain_batch(torch.tensor([100, 2000, 5000])) == pytest.approx(
        decode.beta + decode.alpha_attn * attention + extra, rel=1e-12
    )
    # a calibrated fit without decode samples prices plain decoding as the verify form at s = 1
    verify_only = LatencyModel(roofline, TRUE_FIT.model_copy(update={"decode": None}))
    assert verify_only.predict_plain(3000) == pytest.approx(by_hand(roofline, TRUE_FIT, 1, 3000), rel=1e-12)
    with pytest.raises(ValueError, match="at least one request"):
        model.predict_plain_batch([])
    with pytest.raises(ValueError, match="c \\(cached"):
        model.predict_plain(-1)


def test_predict_many_equals_predict(roofline: RooflineModel) -> None:
    for buckets in (None, [16, 32, 64, 128]):
        model = LatencyModel(roofline, TRUE_FIT, width_buckets=buckets)
        model.observe(24, 3000, 1.2 * model.predict(24, 3000))  # the correction applies to both alike
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
    # the second request shares the fixed cost and the weight read
    assert model.predict(8, 500) < pair < 2 * model.predict(8, 500)
    terms = roofline.pass_terms_batch([10, 20], [100, 200])
    assert terms.tokens == 30
    assert model.predict_batch([10, 20], [100, 200]) == pytest.approx(TRUE_FIT.seconds(terms), rel=1e-14)


def test_predict_batch_pads_every_request_to_the_widest_bucket(roofline: RooflineModel) -> None:
    plain = LatencyModel(roofline, TRUE_FIT)
    model = LatencyModel(roofline, TRUE_FIT, width_buckets=[16, 32, 64])
    assert model.predict_batch([3, 20], [100, 200]) == plain.predict_batch([32, 32], [100, 200])
    assert model.predict_batch(torch.tensor([16, 1]), torch.tensor([7, 9])) == plain.predict_batch(
        [16, 16], [7, 9]
    )
    with pytest.raises(ValueError, match="s = 65"):
        model.predict_batch([1, 65], [0, 0])


ONLINE_POINTS = [(s, c) for s in (2, 8, 32, 128, 512) for c in (256, 4096)]
ONLINE_CHECK = [(3, 256), (48, 4096), (700, 1024), (16, 8000)]
"""Observed points cycle through ONLINE_POINTS; the check points were never observed."""
ONLINE_STEPS = 60
"""N: observations after which the correction must have converged (ema_alpha = 0.1)."""


def test_online_correction_recovers_a_scale_change(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.1)
    offline = LatencyModel(roofline, TRUE_FIT)
    assert model.ema_factor == 1.0 and model.drift == 0.0
    for step in range(ONLINE_STEPS):
        s, c = ONLINE_POINTS[step % len(ONLINE_POINTS)]
        model.observe(s, c, 1.3 * offline.predict(s, c))
    for s, c in ONLINE_POINTS + ONLINE_CHECK:
        assert model.predict(s, c) == pytest.approx(1.3 * offline.predict(s, c), rel=0.01), (s, c)
    assert model.ema_factor == pytest.approx(1.3, rel=0.01)
    assert model.drift == pytest.approx(0.3, abs=0.01)
    # no plain step observed yet: plain decoding borrows the verify passes' correction
    assert model.predict_plain(1000) == pytest.approx(1.3 * offline.predict_plain(1000), rel=0.01)
    model.observe_plain(1000, offline.predict_plain(1000))  # then it is corrected apart
    assert model.predict_plain(1000) == pytest.approx(offline.predict_plain(1000), rel=0.01)


def test_online_correction_recovers_a_slope_change(roofline: RooflineModel) -> None:
    """The observed latency gains 15 µs per verified token at c = 1024, where the offline prediction is
    nearly flat (below the GEMM ridge): the correction's per-token term finds it, also at widths it never
    saw. A single factor cannot: it is right at one width only."""
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.1)
    offline = LatencyModel(roofline, TRUE_FIT)

    def truth(s: int) -> float:
        return offline.predict(s, 1024) + 1.5e-5 * s

    observed_widths = (2, 8, 16, 32, 64)
    for step in range(ONLINE_STEPS):
        s = observed_widths[step % len(observed_widths)]
        model.observe(s, 1024, truth(s))
    for s in (2, 3, 5, 12, 24, 40, 64):
        assert model.predict(s, 1024) == pytest.approx(truth(s), rel=0.01), s
    ratios = [truth(s) / offline.predict(s, 1024) for s in (2, 64)]
    assert ratios[1] > 1.07 * ratios[0]  # a slope change indeed, not a scale change
    assert model.verify_correction.per_token == pytest.approx(1.5e-5, rel=0.05)
    assert model.verify_correction.scale == pytest.approx(1.0, abs=0.01)


def test_online_plain_correction(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.2)
    offline = LatencyModel(roofline, TRUE_FIT)
    for step in range(ONLINE_STEPS):
        c = (64, 512, 2048, 8192)[step % 4]
        model.observe_plain(c, 0.8 * offline.predict_plain(c))
    assert model.predict_plain(1000) == pytest.approx(0.8 * offline.predict_plain(1000), rel=0.01)
    # single-request steps cannot tell a scale from a per-request cost: a batch of two lands near, not on
    assert model.predict_plain_batch([100, 100]) == pytest.approx(
        0.8 * offline.predict_plain_batch([100, 100]), rel=0.05
    )
    # a profile relates the two passes: verify predictions carry the plain steps' machine factor
    assert model.verify_correction.observations == 0
    assert model.ema_factor == pytest.approx(0.8, rel=0.01)
    assert model.predict(8, 1000) == pytest.approx(0.8 * offline.predict(8, 1000), rel=0.01)


def test_verify_prices_carry_the_plain_steps_machine_factor(roofline: RooflineModel) -> None:
    """With a profile, plain steps that run 0.8x it while nothing verifies (a start-up profile measured on a
    slower machine) take verify prices along, so Ŝ's ratio L_AR / Ĉ stays the profile's and the planner
    takes the current L_AR; verify passes observed at another ratio (1.6x where plain steps run 1.8x) keep
    that ratio when the plain steps move again. Without the machine factor a verify price stuck at the
    profile's kept the gate closed where speculation paid 1.14x."""
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.1)
    offline = LatencyModel(roofline, TRUE_FIT)
    batch, widths = [512] * 8, [4] * 8
    for _ in range(ONLINE_STEPS):
        model.observe_plain_batch(batch, 0.8 * offline.predict_plain_batch(batch))
    assert model.predict_plain_batch_as_of_verify(batch) == model.predict_plain_batch(batch)
    ratio = model.predict_batch(widths, batch) / model.predict_plain_batch(batch)
    assert ratio == pytest.approx(
        offline.predict_batch(widths, batch) / offline.predict_plain_batch(batch), rel=0.01
    )
    for _ in range(ONLINE_STEPS):
        model.observe_plain_batch(batch, 1.8 * offline.predict_plain_batch(batch))
        model.observe_batch(widths, batch, 1.6 * offline.predict_batch(widths, batch))
    assert model.predict_batch(widths, batch) == pytest.approx(
        1.6 * offline.predict_batch(widths, batch), rel=0.02
    )
    for _ in range(ONLINE_STEPS):
        model.observe_plain_batch(batch, 2.5 * offline.predict_plain_batch(batch))
    assert model.predict_plain_batch(batch) == pytest.approx(
        2.5 * offline.predict_plain_batch(batch), rel=0.01
    )
    expected = 1.6 * 2.5 / 1.8 * offline.predict_batch(widths, batch)
    assert model.predict_batch(widths, batch) == pytest.approx(expected, rel=0.02)


def test_plain_step_prices_follow_the_batch_they_are_asked_for(roofline: RooflineModel) -> None:
    """A step prices one batch several times (plan, record, observation); each batch still gets its own price:
    one asked after another equals a fresh model's, whether its contexts, their order or its size changed."""
    model = LatencyModel(roofline, TRUE_FIT)
    for batch in ([512] * 8, [512] * 7, [513] * 8, [100, 2000], [2000, 100], [100, 2000], [0]):
        assert model.predict_plain_batch(batch) == LatencyModel(roofline, TRUE_FIT).predict_plain_batch(batch)
    observed = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.5)
    reference = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.5)
    observed.predict_plain_batch([64] * 4)  # the last price was of another batch than the observed one
    observed.observe_plain_batch([4096] * 4, 0.5)
    reference.observe_plain_batch([4096] * 4, 0.5)
    assert observed.predict_plain_batch([64] * 4) == reference.predict_plain_batch([64] * 4)


def test_without_a_profile_planning_takes_the_current_plain_step_until_one_precedes_a_verify_pass(
    roofline: RooflineModel,
) -> None:
    """The bare roofline does not relate plain steps to verify passes: a verify pass observed before any plain
    step leaves the planner the current L_AR; once a plain step preceded a verify pass, its state is kept."""
    model = LatencyModel(roofline, ema_alpha=0.1)
    offline = LatencyModel(roofline)
    batch = [512] * 8
    model.observe_batch([4] * 8, batch, 1e3 * offline.predict_batch([4] * 8, batch))
    for _ in range(10):
        model.observe_plain_batch(batch, 5e3 * offline.predict_plain_batch(batch))
    assert model.predict_plain_batch_as_of_verify(batch) == model.predict_plain_batch(batch)
    model.observe_batch([4] * 8, batch, 1e3 * offline.predict_batch([4] * 8, batch))
    held = model.predict_plain_batch(batch)
    for _ in range(10):
        model.observe_plain_batch(batch, 9e3 * offline.predict_plain_batch(batch))
    assert model.predict_plain_batch_as_of_verify(batch) == held < model.predict_plain_batch(batch)


def test_online_correction_copy_is_independent() -> None:
    correction = OnlineCorrection(0.5)
    correction.update(1.0, 4.0, 2.0)
    twin = correction.copy()
    assert (twin.scale, twin.per_token, twin.base, twin.observations) == (
        correction.scale,
        correction.per_token,
        correction.base,
        1,
    )
    correction.update(1.0, 4.0, 3.0)
    assert twin.observations == 1 and twin.correct(1.0, 4.0) == pytest.approx(2.0)
    assert correction.correct(1.0, 4.0) != twin.correct(1.0, 4.0)


def test_online_correction_is_bounded(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=0.5)
    offline = LatencyModel(roofline, TRUE_FIT)
    for step in range(40):
        s = (2, 64, 512)[step % 3]
        model.observe(s, 100, 1e-6 * offline.predict(s, 100))
    assert model.verify_correction.base == 1.0  # a calibrated model is never rescaled by a pass
    for s in (2, 64, 512, 1024):
        assert model.predict(s, 100) >= CORRECTION_FLOOR * offline.predict(s, 100) > 0
    assert model.verify_correction.scale == SCALE_BOUNDS[0]
    for _ in range(40):
        model.observe(64, 100, 1e3 * offline.predict(64, 100))
    assert model.verify_correction.scale <= SCALE_BOUNDS[1]
    assert model.predict(2, 100) > 0


def test_uncalibrated_correction_takes_its_scale_from_the_first_pass(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, ema_alpha=0.5)
    offline = LatencyModel(roofline)
    for step in range(40):
        s = (2, 64, 512)[step % 3]
        model.observe(s, 100, 1e-6 * offline.predict(s, 100))
    base = model.verify_correction.base  # the first pass's ratio fixes the scale, however far off
    assert base == pytest.approx(1e-6)
    for s in (2, 64, 512):
        assert model.predict(s, 100) == pytest.approx(1e-6 * offline.predict(s, 100), rel=0.01)
        assert model.predict(s, 100) >= CORRECTION_FLOOR * base * offline.predict(s, 100) > 0


@pytest.mark.parametrize(("ema_alpha", "kept"), [(1e-6, True), (0.1, False)])
def test_calibrated_correction_weighs_the_profile_as_one_over_ema_alpha_passes(
    roofline: RooflineModel, ema_alpha: float, kept: bool
) -> None:
    """A profile counts as 1 / ema_alpha passes that decay like measured ones: a tiny ema_alpha keeps it
    against 60 passes twice as slow, the default hands over to them."""
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=ema_alpha)
    offline = LatencyModel(roofline, TRUE_FIT)
    for step in range(ONLINE_STEPS):
        s, c = ONLINE_POINTS[step % len(ONLINE_POINTS)]
        model.observe(s, c, 2.0 * offline.predict(s, c))
    expected = 1.0 if kept else 2.0
    for s, c in ONLINE_CHECK:
        assert model.predict(s, c) == pytest.approx(expected * offline.predict(s, c), rel=0.02), (s, c)


def test_online_correction_single_update_fits_the_observation() -> None:
    """ema_alpha = 1: only the newest observation (and the prior) count, so the correction meets it."""
    correction = OnlineCorrection(ema_alpha=1.0)
    assert correction.factor == 1.0 and correction.reference is None
    correction.update(0.010, 16, 0.015)
    assert correction.base == pytest.approx(1.5)
    assert correction.correct(0.010, 16) == pytest.approx(0.015, rel=0.01)
    assert correction.reference == pytest.approx((0.015, 16))  # base-scaled predictions
    assert correction.factor == pytest.approx(1.5, rel=0.01)
    assert correction.observations == 1
    correction.update(0.020, 64, 0.020)  # the previous observation is forgotten
    assert correction.correct(0.020, 64) == pytest.approx(0.020, rel=0.01)


def test_batch_observation_uses_the_padded_batch(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, TRUE_FIT, ema_alpha=1.0, width_buckets=[16, 32])
    base = model.predict_batch([3, 20], [100, 200])
    model.observe_batch([3, 20], [100, 200], 0.5 * base)
    assert model.verify_correction.reference == pytest.approx((base, 64), rel=1e-12)
    assert model.predict_batch([3, 20], [100, 200]) == pytest.approx(0.5 * base, rel=0.01)


@pytest.mark.parametrize("seconds", [0.0, -0.01, math.nan, math.inf])
def test_observe_rejects_bad_latency(roofline: RooflineModel, seconds: float) -> None:
    model = LatencyModel(roofline, TRUE_FIT)
    for observe in (
        lambda: model.observe(16, 100, seconds),
        lambda: model.observe_batch([16], [100], seconds),
        lambda: model.observe_plain(100, seconds),
        lambda: model.observe_plain_batch([100], seconds),
    ):
        with pytest.raises(ValueError, match="seconds"):
            observe()
    assert model.verify_correction.observations == model.plain_correction.observations == 0


def test_fit_method_returns_new_calibrated_model(roofline: RooflineModel) -> None:
    model = LatencyModel(roofline, ema_alpha=0.3, width_buckets=[8, 1024])
    model.observe(8, 0, 2 * model.predict(8, 0))
    refit = model.fit(synthetic(roofline, TRUE_FIT))
    assert refit is not model and refit.calibrated and not model.calibrated
    assert (refit.ema_alpha, refit.width_buckets, refit.roofline) == (0.3, (8, 1024), roofline)
    assert refit.ema_factor == 1.0 and model.ema_factor != 1.0
    assert refit.latency_fit.alpha_gemm == pytest.approx(TRUE_FIT.alpha_gemm, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5, math.nan, True])
def test_bad_ema_alpha(roofline: RooflineModel, alpha: float) -> None:
    with pytest.raises(ValueError, match="ema_alpha"):
        LatencyModel(roofline, ema_alpha=alpha)


@pytest.mark.parametrize("buckets", [[], [32, 16], [16, 16], [0, 16], [1.5, 4]])
def test_bad_width_buckets(roofline: RooflineModel, buckets: list[float]) -> None:
    with pytest.raises(ValueError, match="width_buckets"):
        LatencyModel(roofline, width_buckets=buckets)


def test_a_fit_predicting_zero_is_rejected(roofline: RooflineModel) -> None:
    zero = LatencyFit(beta_fixed=0.0, alpha_gemm=0.0, alpha_tok=0.0, alpha_attn=0.0, alpha_kv=0.0)
    with pytest.raises(ValueError, match=r"verify pass .* must be positive"):
        LatencyModel(roofline, zero)
    no_decode = TRUE_FIT.model_copy(update={"decode": DecodeFit(beta=0.0, alpha_attn=0.0)})
    with pytest.raises(ValueError, match=r"plain decode pass .* must be positive"):
        LatencyModel(roofline, no_decode)


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"s": 4, "c": 0, "seconds": -0.001}, "seconds"),
        ({"s": 4, "c": 0, "seconds": 0.0}, "seconds"),
        ({"s": 0, "c": 0, "seconds": 0.01}, "s"),
        ({"s": 4, "c": -1, "seconds": 0.01}, "c"),
        ({"s": 4, "c": 0, "seconds": 0.01, "batch": 0}, "batch"),
        ({"s": 4, "c": 0, "seconds": 0.01, "mode": "prefill"}, "mode"),
    ],
)
def test_latency_sample_validation(fields: dict[str, float], bad: str) -> None:
    with pytest.raises(ValidationError) as error:
        LatencySample(**fields)
    assert error.value.errors()[0]["loc"] == (bad,)


def test_decode_sample_is_one_token() -> None:
    assert LatencySample(s=1, c=10, seconds=0.01, mode="decode").mode == "decode"
    assert LatencySample(s=4, c=10, seconds=0.01).mode == "verify"
    with pytest.raises(ValidationError, match="s = 1"):
        LatencySample(s=2, c=10, seconds=0.01, mode="decode")


def test_latency_fit_validation() -> None:
    fields = dict(beta_fixed=0.0, alpha_gemm=1.0, alpha_tok=0.0, alpha_attn=1.0, alpha_kv=1.0)
    with pytest.raises(ValidationError, match="alpha_gemm"):
        LatencyFit(**(fields | {"alpha_gemm": -0.1}))
    with pytest.raises(ValidationError, match="alpha_kv"):
        LatencyFit(**(fields | {"alpha_kv": -1e-9}))
    with pytest.raises(ValidationError, match="beta_fixed"):
        LatencyFit(**(fields | {"beta_fixed": math.nan}))
    with pytest.raises(ValidationError, match="alpha_c"):
        LatencyFit(**fields, alpha_c=1.0)
    with pytest.raises(ValidationError, match="beta"):
        DecodeFit(beta=-1e-3, alpha_attn=1.0)
    assert LatencyFit.identity() == LatencyFit(**fields)
    assert LatencyFit.identity().coefficients() == (0.0, 1.0, 0.0, 1.0, 1.0)
