"""Which latency profile a server (or the reference engine) plans with, and the LatencyModel built from it.

Rules of `resolve_latency_profile(spec, identity, store)`:
- spec is a path: that profile is used whatever it was measured for (an explicit choice overrides); every
  identity field it differs in (device, model config hash, dtype, attention backend, TP size, and the
  engine when the identity names one) gives a warning naming both values.
- spec is "auto": the newest profile of the store whose metadata matches the identity in every field.
  None matches: no profile, and one warning naming the `bastion calibrate` command that would make one.
- An unreadable, corrupt, truncated or wrong-version file raises `ProfileError` naming the file when it is
  the explicit one, or, for "auto", a store file whose name says it was measured for this runtime: the
  server refuses to start rather than plan without the profile meant for it. Other unusable files of the
  store are skipped with one warning each, so one broken file in a shared store stops no server.

Warnings are returned, not logged: the caller logs them once (the server at start-up, the CLI prints them).
"""

from __future__ import annotations

import enum
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion_sglang.calibration.identity import RuntimeIdentity
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import CalibrationProfile, load_profile
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel

AUTO = "auto"
"""The profile spec that asks for a store lookup."""


class ProfileSource(enum.Enum):
    """Where a resolved profile came from."""

    EXPLICIT = "explicit path"
    STORE = "profile store"
    STARTUP = "start-up calibration"
    NONE = "none (uncalibrated roofline)"


@dataclass(frozen=True)
class ResolvedProfile:
    """The outcome of `resolve_latency_profile`.

    profile: the profile to plan with, None when none applies. path: its file (None without a profile).
    identity: the runtime it was resolved for. warnings: messages for the caller to log, in order.
    """

    profile: CalibrationProfile | None
    source: ProfileSource
    path: Path | None
    identity: RuntimeIdentity
    warnings: tuple[str, ...]


def calibrate_command(identity: RuntimeIdentity, store: ProfileStore) -> str:
    """The `bastion calibrate` command line that measures a profile `auto` would find for `identity`."""
    engine = identity.engine or ("reference" if identity.attention_backend in ("sdpa", "eager") else "sglang")
    device = "cpu" if identity.device_name.startswith("CPU ") else "cuda"
    words = [
        "bastion",
        "calibrate",
        "--model-path",
        identity.model_path or "<target model path>",
        "--draft-model-path",
        identity.draft_model_path or "<DFlash drafter path>",
        "--engine",
        engine,
        "--device",
        device,
        "--dtype",
        identity.dtype,
        "--attention-backend",
        identity.attention_backend,
        "--tp",
        str(identity.tp_size),
        "--store",
        str(store.root),
    ]
    return shlex.join(words)


def resolve_latency_profile(
    spec: str | Path, identity: RuntimeIdentity, store: ProfileStore
) -> ResolvedProfile:
    """Pick the profile for `identity` following the module's rules. spec: "auto" or a profile path.

    Raises ProfileError (naming the file) for an unusable explicit file, or with "auto" for an unusable
    store file named for this runtime (`store.named_for`); other unusable store files are skipped with a
    warning naming each. ValueError for an empty spec.
    """
    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        search = store.find_profile(identity)
        skipped = tuple(
            f"skipped an unreadable file of the profile store: {entry.error}" for entry in search.skipped
        )
        match = search.match
        if match is None:
            warning = (
                f"no latency profile in {store.root} matches device {identity.device_name!r}, model config "
                f"{identity.model_config_hash[:12]}, dtype {identity.dtype}, attention backend "
                f"{identity.attention_backend}, tp {identity.tp_size}"
                + (f", engine {identity.engine}" if identity.engine else "")
                + "; planning with the uncalibrated roofline corrected online. Measure one with: "
                + calibrate_command(identity, store)
            )
            return ResolvedProfile(None, ProfileSource.NONE, None, identity, (*skipped, warning))
        return ResolvedProfile(match.profile, ProfileSource.STORE, match.path, identity, skipped)
    if not str(spec).strip():
        raise ValueError("the latency profile spec is empty: pass 'auto' or a profile path")
    path = Path(spec)
    profile = load_profile(path)
    warnings = tuple(
        f"latency profile {path} was measured for {field} {theirs!r}, this runtime has {ours!r}; "
        "using it because it was given explicitly"
        for field, theirs, ours in identity.mismatches(profile.metadata)
    )
    return ResolvedProfile(profile, ProfileSource.EXPLICIT, path, identity, warnings)


def build_latency_model(
    resolved: ResolvedProfile,
    target_config: dict[str, Any] | str | Path,
    hardware: HardwareSpec | None,
    ema_alpha: float,
    width_buckets: Sequence[int] | None,
) -> LatencyModel:
    """The verify-latency model the planner uses, with the runtime's EMA weight and width buckets.

    With a profile: the roofline of the runtime's target (`target_config`: HF config dict, config.json or
    model folder) on the profile's measured peaks and bytes per element, and the profile's fit.
    Without one: the uncalibrated roofline on `hardware` (required then: there is no default device)
    at the identity's dtype width, corrected online by the EMA alone.
    """
    shape = ModelShape.from_hf_config(target_config)
    profile = resolved.profile
    if profile is not None:
        roofline = RooflineModel(shape, profile.hardware, profile.bytes_per_element)
        return LatencyModel(roofline, profile.fit, ema_alpha, width_buckets)
    if hardware is None:
        raise ValueError(
            "no latency profile and no hardware spec: pass the device's HardwareSpec (e.g. "
            "controller.roofline.lookup_gpu(name)) for the uncalibrated roofline"
        )
    element_bytes = resolved.identity.torch_dtype.itemsize
    return LatencyModel(RooflineModel(shape, hardware, element_bytes), None, ema_alpha, width_buckets)


def resolve_acceptance(
    resolved: ResolvedProfile, drafter_config_hash: str | None
) -> tuple[AcceptanceCalibration | None, tuple[str, ...]]:
    """The acceptance calibration to plan with, and warnings for the caller to log.

    The profile's calibration is used when it was fitted for this drafter (same config hash, or either hash
    unknown); a calibration of another drafter is ignored with a warning (raw path probabilities, corrected
    online). None without a profile or when the profile has no calibration.
    """
    profile = resolved.profile
    if profile is None or profile.acceptance is None:
        return None, ()
    fitted_for = profile.acceptance.drafter_config_hash
    if fitted_for is not None and drafter_config_hash is not None and fitted_for != drafter_config_hash:
        return None, (
            f"the acceptance calibration in {resolved.path} was fitted for drafter config {fitted_for[:12]}, "
            f"this drafter is {drafter_config_hash[:12]}; planning with the raw drafter probabilities "
            "(corrected online). Re-run bastion calibrate with this drafter.",
        )
    return profile.acceptance, ()
