"""The calibrate CLI's fitting path, its grids, its timer and its peak micro-benchmarks (CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch
from calibration_profiles import CONTEXTS, H100, QWEN3_8B, TRUE_FIT, WIDTHS, make_profile, synthetic_samples

from bastion_sglang.calibration.microbench import MeasuredPeaks, datasheet_comparison, measure_peaks
from bastion_sglang.calibration.sweep import SweepSettings, check_widths, context_grid, width_grid
from bastion_sglang.calibration.timing import time_op
from bastion_sglang.controller.latency import LatencyFit, LatencySample
from bastion_sglang.controller.roofline import RooflineModel

CPU = torch.device("cpu")


def test_fit_recovers_known_alpha_beta_exactly() -> None:
    profile = make_profile()
    fit = profile.fit
    for name in ("alpha_c", "beta_c", "alpha_m", "beta_m"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE_FIT, name), rel=1e-6), name
    assert profile.report.rmse_fit < 1e-9
    assert profile.report.rmse_raw > 1e-3  # the bare roofline misses α and β by milliseconds
    assert profile.report.num_samples == len(WIDTHS) * len(CONTEXTS)


def test_both_roofline_branches_are_exercised_by_the_synthetic_grid() -> None:
    roofline = RooflineModel(QWEN3_8B, H100, 2)
    compute_bound = {
        TRUE_FIT.alpha_c * roofline.compute_seconds(s, c) + TRUE_FIT.beta_c
        > TRUE_FIT.alpha_m * roofline.memory_seconds(s, c) + TRUE_FIT.beta_m
        for s in WIDTHS
        for c in CONTEXTS
    }
    assert compute_bound == {True, False}


def test_fit_recovers_alpha_beta_under_measurement_noise() -> None:
    generator = torch.Generator().manual_seed(0)
    noisy = [
        LatencySample(
            s=x.s, c=x.c, seconds=x.seconds * (1 + 0.01 * float(torch.randn((), generator=generator)))
        )
        for x in synthetic_samples(TRUE_FIT)
    ]
    profile = make_profile(noisy)
    assert profile.fit.alpha_c == pytest.approx(TRUE_FIT.alpha_c, rel=0.05)
    assert profile.fit.alpha_m == pytest.approx(TRUE_FIT.alpha_m, rel=0.05)
    assert profile.report.mape_fit < 0.02 < profile.report.mape_raw


def test_fitted_profile_predicts_the_true_latency_off_grid() -> None:
    model = make_profile().latency_model()
    roofline = RooflineModel(QWEN3_8B, H100, 2)
    for s, c in ((3, 100), (300, 2000), (777, 7000)):
        truth = TRUE_FIT.apply(roofline.compute_seconds(s, c), roofline.memory_seconds(s, c))
        assert model.predict(s, c) == pytest.approx(truth, rel=1e-6)


def test_width_grid_holds_powers_of_two_midpoints_and_the_cap() -> None:
    assert width_grid(16) == (1, 2, 3, 4, 6, 8, 12, 16)
    assert width_grid(65) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 65)
    grid = width_grid(1025)
    assert grid[0] == 1 and grid[-1] == 1025
    assert {2**i for i in range(11)} <= set(grid) and {3 * 2**i for i in range(9)} <= set(grid)
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


@pytest.mark.parametrize("widths", [[4], [4, 2], [2, 2, 4], [0, 4]])
def test_explicit_widths_must_be_sorted_unique_and_positive(widths: list[int]) -> None:
    with pytest.raises(ValueError, match="--widths"):
        check_widths(widths)


def test_sweep_settings_name_their_budget_and_middle_context() -> None:
    settings = SweepSettings(widths=(1, 2, 4, 9), contexts=(64, 128, 256, 512))
    assert settings.budget == 8
    assert settings.mid_context == 256


def test_time_op_resets_before_every_call_and_times_only_the_op() -> None:
    log: list[str] = []
    seconds = time_op(lambda: log.append("op"), CPU, warmup=2, repeats=3, reset=lambda: log.append("reset"))
    assert log == ["reset", "op"] * 5
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        time_op(lambda: None, CPU, warmup=0, repeats=0)


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


def test_identity_fit_is_what_the_bare_roofline_scores() -> None:
    samples = synthetic_samples(LatencyFit.identity())
    profile = make_profile(samples)
    assert profile.report.rmse_raw < 1e-12
    assert profile.report.rmse_fit < 1e-9
