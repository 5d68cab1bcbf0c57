"""Per-GPU latency profiles: the `bastion calibrate` CLI, the profile store and the lookup the server uses.

Server side (imported at start-up, no measurement code loaded):

    from bastion_sglang.calibration import (
        ProfileStore, RuntimeIdentity, build_latency_model, resolve_latency_profile,
    )
    store = ProfileStore.locate(None)                       # $BASTION_PROFILE_STORE or ~/.cache/...
    identity = RuntimeIdentity.for_runtime(device=..., model_path=..., dtype=..., attention_backend=...,
                                           tp_size=1, engine="sglang")
    resolved = resolve_latency_profile("auto" or path, identity, store)   # ProfileError: refuse to start
    for warning in resolved.warnings: logger.warning(warning)
    latency = build_latency_model(resolved, target_config, hardware, ema_alpha, width_buckets)
    step_costs = resolved.profile.step_costs if resolved.profile else None

Modules: `identity` (what a profile is for), `store`, `lookup`, `cli` / `profile_cli` (the commands),
`microbench` (peaks), `sweep` (grid and measurements), `engines` (reference / SGLang back ends, with
`sglang_runner` and `random_inputs`), `fitting`, `plot`; operations are timed by `bastion_sglang.step.timing`.
"""

from bastion_sglang.calibration.identity import RuntimeIdentity, device_name, dtype_name, model_config_hash
from bastion_sglang.calibration.lookup import (
    AUTO,
    ProfileSource,
    ResolvedProfile,
    build_latency_model,
    calibrate_command,
    resolve_latency_profile,
)
from bastion_sglang.calibration.store import STORE_ENV, ProfileMatch, ProfileStore, StoreEntry

__all__ = [
    "AUTO",
    "STORE_ENV",
    "ProfileMatch",
    "ProfileSource",
    "ProfileStore",
    "ResolvedProfile",
    "RuntimeIdentity",
    "StoreEntry",
    "build_latency_model",
    "calibrate_command",
    "device_name",
    "dtype_name",
    "model_config_hash",
    "resolve_latency_profile",
]
