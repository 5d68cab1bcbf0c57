"""From measurements to a profile: fit the calibrated roofline, score it, assemble the CalibrationProfile.

The fit is the controller's (`fit_latency`: T = max(α_c·T_comp + β_c, α_m·T_mem + β_m) by least squares on
the measured passes) against the roofline of the target on the MEASURED peaks, so α absorbs what the
roofline misses (kernel efficiency, launch overheads in β) on top of what the device really reaches.
`evaluate_fit` scores the bare roofline (same measured peaks, α = 1, β = 0) and the fit on the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from bastion_sglang.controller.latency import LatencySample, evaluate_fit, fit_latency
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
    """Fit `samples` (verify passes measured on `hardware`, whose peaks are the measured ones) and return
    the profile. Raises ValueError for fewer than two samples."""
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
        samples=list(samples),
        step_costs=step_costs,
        width_buckets=None,
        max_context=max_context,
    )


def now_utc() -> datetime:
    """The current time, timezone-aware (UTC): a profile's `created_at`."""
    return datetime.now(UTC)
