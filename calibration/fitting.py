"""From measurements to a profile: fit the latency model, score it, assemble the CalibrationProfile.

The fit is the controller's (`fit_latency`: T = β_fixed + α_gemm·G + α_attn·ΣA + α_tok·tokens for verify
passes and L_AR = β + α·A(1, c) for plain decode steps, non-negative least squares on relative error) against
the roofline parts of the target on the MEASURED peaks, so the α absorb what the roofline misses (kernel
efficiency) on top of what the device really reaches, and β the fixed cost of a step. `evaluate_fit` scores
the bare roofline (eqs. 8 and 9 on the same measured peaks) and the fit on the same samples;
`validate_leave_out` refits with each whole width and each whole context left out and scores what was left
out.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from bastion_sglang.controller.latency import LatencySample, evaluate_fit, fit_latency, validate_leave_out
from bastion_sglang.controller.profile import (
    PROFILE_SCHEMA_VERSION,
    CalibrationProfile,
    ProfileMetadata,
    StepCosts,
)
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel


def build_profile(
    *,
    metadata: ProfileMetadata,
    shape: ModelShape,
    hardware: HardwareSpec,
    bytes_per_element: float,
    samples: Sequence[LatencySample],
    step_costs: StepCosts,
    max_context: int,
) -> CalibrationProfile:
    """Fit `samples` (verify passes and plain decode steps measured on `hardware`, whose peaks are the
    measured ones), validate the fit with whole widths and contexts left out, and return the profile.
    Raises ValueError for fewer than two verify samples."""
    roofline = RooflineModel(shape, hardware, bytes_per_element)
    fit = fit_latency(roofline, samples)
    return CalibrationProfile(
        schema_version=PROFILE_SCHEMA_VERSION,
        metadata=metadata,
        model_shape=shape,
        hardware=hardware,
        bytes_per_element=bytes_per_element,
        fit=fit,
        report=evaluate_fit(roofline, fit, samples),
        leave_out=validate_leave_out(roofline, samples),
        samples=list(samples),
        step_costs=step_costs,
        width_buckets=None,
        max_context=max_context,
    )


def now_utc() -> datetime:
    """The current time, timezone-aware (UTC): a profile's `created_at`."""
    return datetime.now(UTC)
