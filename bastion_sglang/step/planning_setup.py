"""What a BASTION worker plans with: its latency profile, latency model, acceptance calibration and step
controller, resolved once at start-up from `--bastion-profile` and the runtime's identity.

`--bastion-profile PATH` loads that profile; `auto` looks in the profile store for the profile of this
runtime (`calibration.identity`: device, target config, dtype, attention backend, tp, SGLang version and
serving settings; the acceptance map by the drafter's weights) and logs one line saying which it took and
why. Without one (or with none measured with this drafter), a server whose policy plans on latency measures
its own at start-up (`calibration.startup`,
`--bastion-startup-calibration`); with that off, the worker plans on an uncalibrated roofline of the target
on this device (CPU_HARDWARE on a CPU, the GPU's datasheet otherwise) corrected online by the EMA.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang.calibration.identity import RuntimeIdentity, installed_version, serving_settings
from bastion_sglang.calibration.lookup import (
    ResolvedProfile,
    resolve_acceptance,
    resolve_latency_profile,
)
from bastion_sglang.calibration.lookup import build_latency_model as build_calibrated_latency_model
from bastion_sglang.calibration.microbench import datasheet_or_measured, measure_peaks
from bastion_sglang.calibration.startup import StartupCalibration, needs_startup_calibration
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import CPU_HARDWARE, HardwareSpec
from bastion_sglang.controller.step_costs import COLD_STEPS, StepCostTracker, draft_seconds_per_request
from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.step.step_controller import StepController
from bastion_sglang.step.synthetic_acceptance import synthetic_startup_calibration
from bastion_sglang.step.synthetic_profile import load_synthetic_profile

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

    from bastion_sglang.step.metrics import BastionMetrics

logger = logging.getLogger(__name__)


DRAFT_SHAPE_CONTEXT = 256
"""Cached tokens per request at which the target's latency model shapes the prior drafter cost over batch
sizes (`controller.step_costs.draft_seconds_per_request`)."""


def worker_latency_model(
    config: BastionConfig,
    server_args: ServerArgs,
    target_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    width_buckets: Sequence[int] | None = None,
    resolved: ResolvedProfile | None = None,
) -> tuple[LatencyModel, StepCosts | None]:
    """The verify-latency model and, from a profile, the fixed step costs (None: measured online).

    width_buckets: the widths verify passes run at (`graph_buckets.planning_widths`: a W between captured
    CUDA-graph widths costs the width it is padded to); None: every W runs as it is. resolved: the profile
    `resolve_worker_profile` found (None: resolve it here).

    `--bastion-profile PATH` loads that profile (a profile measured for another device or model: a warning
    naming both; a corrupt or wrong-version file: ProfileError naming it, so the server refuses to start).
    `auto` looks in the profile store for the profile of this device, target config, dtype, attention
    backend and tp; with none, an uncalibrated roofline of the target on this device (CPU_HARDWARE on a
    CPU, the GPU's datasheet otherwise) corrected online by the EMA, and one warning that names the
    `bastion calibrate` command to run.
    """
    if resolved is None:
        resolved = resolve_worker_profile(config, server_args, dtype, device)
    hardware = None if resolved.profile is not None else planning_hardware(device, dtype)
    latency = build_calibrated_latency_model(
        resolved, target_config, hardware, config.ema_alpha, width_buckets
    )
    return latency, None if resolved.profile is None else resolved.profile.step_costs


def planning_hardware(device: torch.device, dtype: torch.dtype) -> HardwareSpec:
    """Peaks of the uncalibrated roofline: CPU_HARDWARE on a CPU; a GPU's datasheet entry, or, for a GPU the
    table does not list, its peaks measured now (`measure_peaks`, a second or two), with a warning."""
    if device.type == "cpu":
        return CPU_HARDWARE
    name = torch.cuda.get_device_name(device)
    hardware, measured = datasheet_or_measured(name, lambda: measure_peaks(device, dtype, name))
    if measured:
        logger.warning(
            "BASTION: no datasheet entry for GPU %r; the uncalibrated roofline uses peaks measured at "
            "start-up: %.1f TFLOP/s, %.0f GB/s",
            name,
            hardware.peak_flops / 1e12,
            hardware.bandwidth / 1e9,
        )
    return hardware


def resolve_worker_profile(
    config: BastionConfig,
    server_args: ServerArgs,
    dtype: torch.dtype,
    device: torch.device,
    startup: StartupCalibration | None = None,
    draft_vocab_size: int | None = None,
) -> ResolvedProfile:
    """The calibration profile of this runtime (`--bastion-profile`: a path, or `auto` from the store, or
    measured now by `startup` where `needs_startup_calibration` says so); its warnings are logged here, once.
    draft_vocab_size: the tokens the draft step scores (None: the whole vocabulary), a serving setting.
    """
    identity = RuntimeIdentity.for_runtime(
        device=device,
        model_path=server_args.model_path,
        dtype=dtype,
        attention_backend=str(server_args.attention_backend),
        tp_size=int(server_args.tp_size),
        engine="sglang",
        draft_model_path=server_args.speculative_draft_model_path,
        settings=serving_settings(
            server_args, dtype, device, config.synthetic_acceptance is not None, draft_vocab_size
        ),
        sglang_version=installed_version("sglang"),
    )
    spec = "auto" if config.profile_path is None else config.profile_path
    store = ProfileStore.locate(None)
    resolved = resolve_latency_profile(spec, identity, store)
    why = None
    if startup is not None:
        why = needs_startup_calibration(
            config.startup_calibration, resolved, config.profile_path is not None, config.policy.may_decline
        )
    if why is not None and startup is not None:
        resolved = startup.run(identity, store, why)
    logger.info("BASTION: %s", resolved.reason)
    for warning in resolved.warnings:
        logger.warning("BASTION: %s", warning)
    return resolved


def planning_acceptance(resolved: ResolvedProfile, lattice_drafts: bool) -> AcceptanceCalibration | None:
    """The acceptance calibration the worker plans with: the map of the stored profile measured with this
    drafter (its weights hash, `lookup.resolve_acceptance`), else None (with a warning logged when the
    latency profile holds another drafter's map). A DFlash2 drafter (lattice_drafts) plans on its
    calibrated transitions (`lattice_plan`; the map a DFlash2 profile holds is fitted on lattice records)."""
    calibration, warnings = resolve_acceptance(resolved)
    for warning in warnings:
        logger.warning("BASTION: %s", warning)
    if calibration is not None:
        logger.info(
            "BASTION: planning %s with the acceptance calibration of %s",
            "the DFlash2 drafter's lattices" if lattice_drafts else "the drafter's top-K",
            resolved.acceptance_path,
        )
    elif lattice_drafts:
        logger.info(
            "BASTION: DFlash2 drafter: planning on its lattices' raw transition log-probs (no acceptance "
            "calibration for it), corrected online"
        )
    return calibration


def synthetic_planning_acceptance(config: BastionConfig, depth: int) -> AcceptanceCalibration | None:
    """The acceptance map of drafts under `BastionConfig.synthetic_acceptance` (D = `depth` positions): the
    one start-up calibration fits on the seam's passes (`synthetic_acceptance.synthetic_startup_calibration`),
    as it fits a real drafter's map on its passes; None (the drafter's stated probabilities) with
    `--bastion-startup-calibration off`. Either way the online depth map corrects it."""
    path = config.synthetic_acceptance
    if path is None or config.startup_calibration == "off":
        return None
    calibration = synthetic_startup_calibration(load_synthetic_profile(path), depth)
    logger.info(
        "BASTION: synthetic acceptance: start-up acceptance map fitted on the profile's synthetic passes "
        "(slopes %s)",
        [round(slope, 2) for slope in calibration.slopes],
    )
    return calibration


def worker_step_controller(
    config: BastionConfig,
    server_args: ServerArgs,
    target_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    width_buckets: Sequence[int] | None,
    metrics: BastionMetrics | None,
    startup: StartupCalibration | None = None,
    lattice_drafts: bool = False,
    draft_vocab_size: int | None = None,
) -> StepController:
    """The worker's step controller: the latency model and acceptance calibration of its profile, a step-cost
    tracker seeded with the profile's costs (T_draft rescaled per request, `draft_seconds_per_request`), the
    config's policy and budget, and a draft horizon (fixed-size policies keep every position: their trees stay
    DDTree's). block_size: the drafter's block γ; width_buckets: `graph_buckets.planning_widths`; startup: how
    this server calibrates itself when it has no profile (None: it does not); lattice_drafts: whether the
    drafter is a DFlash2 drafter, whose lattices are planned on the profile's acceptance calibration as
    top-K drafts are (`planning_acceptance`, `lattice_plan`); draft_vocab_size: the tokens the draft step
    scores (None: the whole vocabulary), part of the profile's identity. Under synthetic acceptance no
    stored map applies: maps are fitted on the real drafter's passes, and the synthetic drafter states other
    probabilities; it plans on the map fitted on the seam's own passes (`synthetic_planning_acceptance`),
    corrected online (`controller.depth_acceptance`)."""
    resolved = resolve_worker_profile(config, server_args, dtype, device, startup, draft_vocab_size)
    if config.synthetic_acceptance is not None:
        logger.info(
            "BASTION: synthetic acceptance: no stored acceptance map applies to the synthetic drafter's "
            "stated probabilities"
        )
    latency, profile_costs = worker_latency_model(
        config, server_args, target_config, dtype, device, width_buckets, resolved
    )
    costs = StepCostTracker(
        prior=profile_costs,
        prior_weight=1.0 / config.ema_alpha,
        warmup_steps=COLD_STEPS,
        prior_draft_per_request=0.0
        if profile_costs is None
        else draft_seconds_per_request(
            profile_costs.t_draft, latency, min(block_size, config.verify_width_cap), DRAFT_SHAPE_CONTEXT
        ),
    )
    depth = block_size - 1
    return StepController(
        latency=latency,
        costs=costs,
        policy=config.policy,
        budget=config.max_budget,
        horizon=DraftHorizon(depth) if config.policy.may_decline else DraftHorizon.full(depth),
        acceptance=synthetic_planning_acceptance(config, depth)
        if config.synthetic_acceptance is not None
        else planning_acceptance(resolved, lattice_drafts),
        branching=config.branching,
        device=device,
        metrics=metrics,
    )
