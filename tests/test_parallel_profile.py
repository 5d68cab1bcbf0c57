"""A tensor-parallel server looks up the latency profile measured at its own TP size.

Profiles are keyed by `RuntimeIdentity.tp_size`; the worker builds that identity from the scheduler's
`--tp-size` (under `--dp-size`, each replica's TP size), so a store holding tp1 and tp2 profiles of the same
target on the same device gives each run its own.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from calibration_profiles import make_profile
from tiny_models import make_tiny_target

from bastion_sglang.calibration.identity import device_name, model_config_hash
from bastion_sglang.calibration.store import STORE_ENV, ProfileStore
from bastion_sglang.controller.profile import save_profile
from bastion_sglang.registration import make_config
from bastion_sglang.step.planning_setup import resolve_worker_profile


def test_each_tp_size_resolves_its_own_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = make_tiny_target(tmp_path / "target", vocab_size=260)
    store = ProfileStore(tmp_path / "profiles")
    paths = {}
    for tp_size in (1, 2):
        profile = make_profile(
            device_name=device_name(torch.device("cpu")),
            model_path=str(target),
            model_config_hash=model_config_hash(target),
            dtype="float32",
            attention_backend="torch_native",
            tp_size=tp_size,
        )
        paths[tp_size] = store.path_for(profile)
        save_profile(profile, paths[tp_size])
    monkeypatch.setenv(STORE_ENV, str(store.root))
    for tp_size in (1, 2, 4):
        server_args = types.SimpleNamespace(
            model_path=str(target),
            attention_backend="torch_native",
            tp_size=tp_size,
            speculative_draft_model_path=None,
        )
        resolved = resolve_worker_profile(make_config(), server_args, torch.float32, torch.device("cpu"))
        if tp_size in paths:
            assert resolved.path == paths[tp_size]
            assert resolved.profile is not None and resolved.profile.metadata.tp_size == tp_size
        else:
            assert resolved.profile is None
            assert any("tp 4" in warning for warning in resolved.warnings), resolved.warnings
