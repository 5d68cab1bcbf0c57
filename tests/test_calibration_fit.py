"""The calibrate CLI's fitting path, its grids, its timer and its peak micro-benchmarks (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch
from calibration_profiles import CONTEXTS, H100, QWEN3_8B, TRUE_FIT, WIDTHS, make_profile, synthetic_samples

from bastion_sglang.calibration.microbench import (
    MeasuredPeaks,
    datasheet_comparison,
    datasheet_or_measured,
    measure_peaks,
)
from bastion_sglang.calibration.sweep import SweepSettings, aux_line, check_widths, context_grid, width_grid
from bastion_sglang.controller.latency import LatencyFit, LatencyModel
from bastion_sglang.controller.roofline import RooflineModel

CPU = torch.device("cpu")


COEFFICIENTS = ("beta_fixed", "alpha_gemm", "alpha_tok", "alpha_attn", "alpha_kv")


def test_fit_recovers_known_coefficients_exactly() -> None:
    profile = make_profile()
    fit = profile.fit
    for name in COEFFICIENTS:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE_FIT, name), rel=1e-6), name
    assert fit.decode is not None and TRUE_FIT.decode is not None
    assert fit.decode.beta == pytest.approx(TRUE_FIT.decode.beta, rel=1e-6)
    assert fit.decode.alpha_attn == pytest.approx(TRUE_FIT.decode.alpha_attn, rel=1e-6)
    assert profile.report.rmse_fit < 1e-9
    assert profile.report.rmse_raw > 1e-3  # the bare roofline misses the fixed cost by milliseconds
    assert profile.report.num_samples == len(WIDTHS) * len(CONTEXTS)
    assert profile.report.num_decode_samples == len(CONTEXTS)


def test_profile_holds_the_leave_out_validation() -> None:
    held = make_profile().leave_out
    assert held is not None
    assert [fold.held_out for fold in held.widths] == list(WIDTHS)
    assert [fold.held_out for fold in held.contexts] == list(CONTEXTS)
    assert held.mape_widths is not None and held.mape_widths < 1e-9
    assert held.mape_contexts is not None and held.mape_contexts < 1e-9
    assert held.mape_decode_contexts is not None and held.mape_decode_contexts < 1e-9


def test_fit_recovers_coefficients_under_measurement_noise() -> None:
    generator = torch.Generator().manual_seed(0)
    noisy = [
        x.model_copy(update={"seconds": x.seconds * (1 + 0.01 * float(torch.randn((), generator=generator)))})
        for x in synthetic_samples(TRUE_FIT)
    ]
    profile = make_profile(noisy)
    assert profile.fit.alpha_gemm == pytest.approx(TRUE_FIT.alpha_gemm, rel=0.05)
    assert profile.fit.beta_fixed == pytest.approx(TRUE_FIT.beta_fixed, rel=0.05)
    assert profile.report.mape_fit < 0.02 < profile.report.mape_raw
    assert profile.leave_out is not None and profile.leave_out.mape_widths is not None
    assert profile.leave_out.mape_widths < 0.03


def test_fitted_profile_predicts_the_true_latency_off_grid() -> None:
    model = make_profile().latency_model()
    truth = LatencyModel(RooflineModel(QWEN3_8B, H100, 2), TRUE_FIT)
    for s, c in ((3, 100), (300, 2000), (777, 7000)):
        assert model.predict(s, c) == pytest.approx(truth.predict(s, c), rel=1e-6)
    for c in (0, 100, 3000):
        assert model.predict_plain(c) == pytest.approx(truth.predict_plain(c), rel=1e-6)


def test_width_grid_holds_powers_of_two_midpoints_and_the_cap() -> None:
    assert width_grid(2) == (2,)
    assert width_grid(16) == (2, 3, 4, 6, 8, 12, 16)
    assert width_grid(65) == (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 65)
    grid = width_grid(1025)
    assert grid[0] == 2 and grid[-1] == 1025  # width 1 is plain decoding, measured on its own
    assert {2**i for i in range(1, 11)} <= set(grid) and {3 * 2**i for i in range(9)} <= set(grid)
    assert list(grid) == sorted(set(grid))


@pytest.mark.parametrize("bad", [1, 0, True, 2.5])
def test_width_grid_rejects_widths_without_a_node(bad: object) -> None:
    with pytest.raises(ValueError, match="largest verify width"):
        width_grid(bad)  # type: ignore[arg-type]


def test_context_grid_is_powers_of_two_from_64_and_the_max() -> None:
    assert context_grid(64) == (64,)
    assert context_grid(8192) == (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert context_grid(1000) == (64, 128, 256, 512, 1000)
    with pytest.raises(ValueError, match="--max-context must be an int >= 64, got 63"):
        context_grid(63)


@pytest.mark.parametrize("widths", [[4], [4, 2], [2, 2, 4], [0, 4], [1, 2, 4]])
def test_explicit_widths_must_be_sorted_unique_and_at_least_two(widths: list[int]) -> None:
    with pytest.raises(ValueError, match="--widths"):
        check_widths(widths)
    assert check_widths([2, 3, 64]) == (2, 3, 64)


def test_aux_line_is_a_non_negative_line() -> None:
    assert aux_line([2, 64], [1e-3, 1e-3 + 62 * 5e-6]) == pytest.approx((1e-3 - 2 * 5e-6, 5e-6), rel=1e-9)
    # noise making the wide step faster: slope 0 at the mean, never a negative per-token cost
    intercept, slope = aux_line([2, 16, 64], [1.2e-3, 1.0e-3, 1.1e-3])
    assert slope == 0.0 and intercept == pytest.approx(1.1e-3, rel=1e-9)
    # a line through zero at s = 0 would need a negative intercept: intercept 0 instead
    intercept, slope = aux_line([10, 20], [1e-3, 3e-3])
    assert intercept == 0.0 and slope > 0
    with pytest.raises(ValueError, match="one time per width"):
        aux_line([2, 4], [1e-3])


def test_sweep_settings_name_their_budget_and_middle_context() -> None:
    settings = SweepSettings(widths=(2, 4, 9), contexts=(64, 128, 256, 512))
    assert settings.budget == 8
    assert settings.mid_context == 256
    assert settings.cells() == ((64, 1), (128, 1), (256, 1), (512, 1))  # batch 1 only by default


def test_batched_cells_measure_three_widths_within_the_token_cap_at_the_smallest_context() -> None:
    settings = SweepSettings(
        widths=(2, 4, 8, 16, 32, 64, 65), contexts=(64, 256), batches=(1, 4, 16, 64, 2048), batch_tokens=2048
    )
    assert settings.batch_widths(1) == (2, 4, 8, 16, 32, 64, 65)  # every width at batch 1
    assert settings.batch_widths(4) == (2, 16, 65)  # narrowest, middle, widest
    assert settings.batch_widths(64) == (2, 8, 32)  # 64 · 64 > 2048
    assert settings.batch_widths(2048) == ()  # even 2 tokens a request is too many
    assert settings.cells() == ((64, 1), (256, 1), (64, 4), (64, 16), (64, 64))


@pytest.mark.parametrize("batches", [(), (2, 4), (1, 4, 2), (1, 1), (1, 0)])
def test_batches_must_start_at_one_sorted_and_unique(batches: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="batch sizes must be sorted, unique ints >= 1 starting at 1"):
        SweepSettings(widths=(2, 4), contexts=(64,), batches=batches)


def test_cpu_peaks_are_measured_and_have_no_datasheet_entry() -> None:
    peaks = measure_peaks(CPU, torch.float32, "CPU test")
    assert math.isfinite(peaks.matmul_flops) and peaks.matmul_flops > 1e8
    assert math.isfinite(peaks.copy_bandwidth) and peaks.copy_bandwidth > 1e8
    assert peaks.dtype == "float32"
    lines = datasheet_comparison(peaks)
    assert "no KNOWN_GPUS entry for 'CPU test'" in lines[-1]
    spec = peaks.hardware_spec()
    assert (spec.name, spec.peak_flops, spec.bandwidth) == (
        "CPU test",
        peaks.matmul_flops,
        peaks.copy_bandwidth,
    )


def test_gpu_peaks_are_compared_with_the_datasheet() -> None:
    peaks = MeasuredPeaks(
        device_name="NVIDIA H100 80GB HBM3",
        dtype="bfloat16",
        matmul_flops=791.5e12,
        matmul_size=8192,
        copy_bandwidth=3.015e12,
        copy_bytes=1 << 30,
    )
    text = "\n".join(datasheet_comparison(peaks))
    assert "datasheet (H100-SXM): matmul 989.40 TFLOP/s" in text
    assert "matmul 80%, bandwidth 90%" in text


def test_a_gpu_missing_from_the_table_plans_with_measured_peaks() -> None:
    """An H100 NVL (no datasheet entry) gets the peaks its measurement returns (measured here on the CPU:
    the only device at hand); a listed GPU gets its datasheet entry and is not measured."""
    measured: list[str] = []

    def measure(name: str):
        def run() -> MeasuredPeaks:
            measured.append(name)
            return measure_peaks(CPU, torch.float32, name)

        return run

    spec, was_measured = datasheet_or_measured("NVIDIA H100 NVL", measure("NVIDIA H100 NVL"))
    assert was_measured and measured == ["NVIDIA H100 NVL"]
    assert spec.name == "NVIDIA H100 NVL" and spec.peak_flops > 1e8 and spec.bandwidth > 1e8
    known, was_measured = datasheet_or_measured("NVIDIA H100 80GB HBM3", measure("NVIDIA H100 80GB HBM3"))
    assert known == H100 and not was_measured and measured == ["NVIDIA H100 NVL"]


def test_identity_fit_is_recovered_from_the_bare_roofline_parts() -> None:
    """Samples of the identity fit (the roofline's parts added, no score matrix, no fixed cost): recovered
    exactly; eqs. (8) and (9), a max over whole-pass totals with the score matrix, miss them."""
    profile = make_profile(synthetic_samples(LatencyFit.identity()))
    for name, value in zip(COEFFICIENTS, (0.0, 1.0, 0.0, 1.0, 1.0), strict=True):
        assert getattr(profile.fit, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name
    assert profile.report.rmse_fit < 1e-12 < profile.report.rmse_raw
