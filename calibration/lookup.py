"""Which calibration profile a server (or the reference engine) plans with, and the LatencyModel built from
it.

Rules of `resolve_latency_profile(spec, identity, store)`:
- spec is a path: that profile is used whatever it was measured for (an explicit choice overrides); every
  latency-part field it differs in (`RuntimeIdentity.mismatches`) gives a warning naming both values. Its
  acceptance map is used only where its acceptance part is this runtime's drafter's.
- spec is "auto": among the store's profiles that match the identity's latency part, the most thorough
  (`bastion calibrate`, then a full start-up calibration, then a quick one), then the newest
  (`store.preference`). The acceptance part is matched separately: the preferred matching profile measured
  with this drafter (its weights hash) gives the acceptance map, so a thorough profile measured with one
  drafter serves every drafter's latency, and each drafter keeps its own map. None matches: no profile, and
  one warning naming the `bastion calibrate` command that would make one.
- An unreadable, corrupt, truncated or wrong-version file raises `ProfileError` naming the file when it is
  the explicit one, or, for "auto", a store file whose name says it was measured for this runtime: the
  server refuses to start rather than plan without the profile meant for it. Other unusable files of the
  store are skipped with one warning each, so one broken file in a shared store stops no server.

`ResolvedProfile.reason` is the one line saying which profile was taken and why (or why none); warnings are
returned, not logged: the caller logs both once (the server at start-up, the CLI prints them).
"""

from __future__ import annotations

import enum
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bastion_sglang.calibration.identity import RuntimeIdentity
from bastion_sglang.calibration.store import ProfileSearch, ProfileStore
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

    profile: the profile to plan latency with, None when none applies. path: its file (None without a
    profile). identity: the runtime it was resolved for. warnings: messages for the caller to log, in order.
    acceptance_profile, acceptance_path: the profile whose acceptance part is this drafter's (its map, or
    None where none could be fitted), None when none is; acceptance_miss: why none is. reason: one line
    saying which profiles were taken and why.
    """

    profile: CalibrationProfile | None
    source: ProfileSource
    path: Path | None
    identity: RuntimeIdentity
    warnings: tuple[str, ...]
    acceptance_profile: CalibrationProfile | None = None
    acceptance_path: Path | None = None
    acceptance_miss: str | None = None
    reason: str = ""

    @property
    def acceptance(self) -> AcceptanceCalibration | None:
        """The acceptance map to plan with: the acceptance profile's (None: none applies)."""
        return None if self.acceptance_profile is None else self.acceptance_profile.acceptance


def describe_made(profile: CalibrationProfile) -> str:
    """'bastion calibrate, 2026-01-01T00:00:00+00:00': how and when a profile was measured."""
    meta = profile.metadata
    return f"{MADE_BY_NAMES[meta.made_by]}, {meta.created_at.isoformat(timespec='seconds')}"


MADE_BY_NAMES = {
    "calibrate": "bastion calibrate",
    "startup-full": "full start-up calibration",
    "startup-quick": "quick start-up calibration",
}


def _acceptance_words(resolved: ResolvedProfile) -> str:
    if resolved.acceptance_profile is None:
        return f"no stored acceptance for this drafter ({resolved.acceptance_miss})"
    fitted = "its map" if resolved.acceptance is not None else "no map could be fitted there"
    return f"acceptance from {resolved.acceptance_path} (this drafter's, {fitted})"


def describe_choice(resolved: ResolvedProfile, matches: int = 1) -> str:
    """The one line saying which profiles `resolved` plans with and why (`ResolvedProfile.reason`)."""
    if resolved.profile is None:
        return "no stored latency profile matches this runtime"
    made = describe_made(resolved.profile)
    if resolved.source is ProfileSource.STORE:
        why = (
            "the only stored profile matching this runtime"
            if matches == 1
            else (f"the most thorough, then newest, of {matches} stored profiles matching this runtime")
        )
        latency = f"latency profile {resolved.path} ({made}): {why}"
    elif resolved.source is ProfileSource.EXPLICIT:
        latency = f"latency profile {resolved.path} ({made}): given explicitly"
    else:
        latency = f"latency profile {resolved.path} ({made}): measured now"
    return f"{latency}; {_acceptance_words(resolved)}"


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


def _nearest(search: ProfileSearch) -> str:
    """' (N stored for other runtimes, e.g. FILE: field theirs vs ours; ...)', or '' without any."""
    if not search.rejected:
        return ""
    first = search.rejected[0]
    fields = "; ".join(f"{field} {theirs!r} vs {ours!r}" for field, theirs, ours in first.mismatches)
    return f" ({len(search.rejected)} stored for other runtimes, e.g. {first.path.name}: {fields})"


def _no_match_warning(identity: RuntimeIdentity, store: ProfileStore, search: ProfileSearch) -> str:
    nearest = _nearest(search)
    return (
        f"no latency profile in {store.root} matches device {identity.device_name!r}, model config "
        f"{identity.model_config_hash[:12]}, dtype {identity.dtype}, attention backend "
        f"{identity.attention_backend}, tp {identity.tp_size}"
        + (f", engine {identity.engine}" if identity.engine else "")
        + f" and its serving settings{nearest}; planning with the uncalibrated roofline corrected online. "
        "Measure one with: " + calibrate_command(identity, store)
    )


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
            warning = _no_match_warning(identity, store, search)
            reason = "no stored latency profile matches this runtime" + _nearest(search)
            return ResolvedProfile(
                None, ProfileSource.NONE, None, identity, (*skipped, warning), reason=reason
            )
        accepted = search.acceptance
        miss = None
        if accepted is None:
            miss = search.acceptance_misses[0][1] if search.acceptance_misses else None
        resolved = ResolvedProfile(
            match.profile,
            ProfileSource.STORE,
            match.path,
            identity,
            skipped,
            acceptance_profile=None if accepted is None else accepted.profile,
            acceptance_path=None if accepted is None else accepted.path,
            acceptance_miss=miss,
        )
        return replace(resolved, reason=describe_choice(resolved, len(search.matches)))
    if not str(spec).strip():
        raise ValueError("the latency profile spec is empty: pass 'auto' or a profile path")
    path = Path(spec)
    profile = load_profile(path)
    warnings = tuple(
        f"latency profile {path} was measured for {field} {theirs!r}, this runtime has {ours!r}; "
        "using it because it was given explicitly"
        for field, theirs, ours in identity.mismatches(profile)
    )
    miss = identity.acceptance_mismatch(profile)
    resolved = ResolvedProfile(
        profile,
        ProfileSource.EXPLICIT,
        path,
        identity,
        warnings,
        acceptance_profile=profile if miss is None else None,
        acceptance_path=path if miss is None else None,
        acceptance_miss=miss,
    )
    return replace(resolved, reason=describe_choice(resolved))


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


def resolve_acceptance(resolved: ResolvedProfile) -> tuple[AcceptanceCalibration | None, tuple[str, ...]]:
    """The acceptance calibration to plan with, and warnings for the caller to log: the map of the profile
    whose acceptance part is this drafter's (`ResolvedProfile.acceptance`). A map in the latency profile
    that is not this runtime's is ignored with a warning saying why (raw path probabilities, corrected
    online)."""
    calibration = resolved.acceptance
    profile = resolved.profile
    if calibration is None and profile is not None and profile.acceptance is not None:
        return None, (
            f"the acceptance calibration in {resolved.path} is not this runtime's "
            f"({resolved.acceptance_miss}); planning with the raw drafter probabilities (corrected online)",
        )
    return calibration, ()
