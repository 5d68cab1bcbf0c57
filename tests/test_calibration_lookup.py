"""Profile store and lookup rules (what the server does at start-up), on synthetic profiles (CPU, fast)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from calibration_profiles import HASH, IDENTITY, OTHER_HASH, QWEN3_8B, make_profile

from bastion_sglang.calibration import cli as calibrate_cli
from bastion_sglang.calibration.identity import RuntimeIdentity
from bastion_sglang.calibration.lookup import (
    ProfileSource,
    build_latency_model,
    calibrate_command,
    resolve_latency_profile,
)
from bastion_sglang.calibration.profile_cli import list_lines
from bastion_sglang.calibration.store import (
    DEFAULT_STORE,
    STORE_ENV,
    ProfileStore,
    named_for,
    profile_file_name,
)
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import ProfileError, save_profile
from bastion_sglang.controller.roofline import KNOWN_GPUS, RooflineModel

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}


@pytest.fixture
def store(tmp_path: Path) -> ProfileStore:
    return ProfileStore(tmp_path / "profiles")


def saved(store: ProfileStore, **metadata: Any) -> Path:
    profile = make_profile(**metadata)
    path = store.path_for(profile)
    save_profile(profile, path)
    return path


def test_auto_finds_the_matching_profile(store: ProfileStore) -> None:
    path = saved(store)
    resolved = resolve_latency_profile("auto", IDENTITY, store)
    assert resolved.source is ProfileSource.STORE
    assert resolved.path == path
    assert resolved.profile is not None and resolved.profile.metadata.model_config_hash == HASH
    assert resolved.warnings == ()


def test_auto_takes_the_newest_match_and_ignores_other_deployments(store: ProfileStore) -> None:
    newest = saved(store, created_at=datetime(2026, 3, 1, tzinfo=UTC))
    saved(store, created_at=datetime(2026, 1, 1, tzinfo=UTC))
    saved(store, created_at=datetime(2026, 6, 1, tzinfo=UTC), device_name="NVIDIA H200")
    assert resolve_latency_profile("AUTO", IDENTITY, store).path == newest


MISMATCHES = {
    "device": {"device_name": "NVIDIA A100-SXM4-80GB"},
    "model": {"model_config_hash": OTHER_HASH},
    "dtype": {"dtype": "float16"},
    "backend": {"attention_backend": "flashinfer"},
    "tp": {"tp_size": 2},
}


def _calibrate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    calibrate_cli.add_arguments(parser)
    return parser


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_auto_with_no_match_returns_none_and_one_warning_naming_the_calibrate_command(
    store: ProfileStore, field: str
) -> None:
    saved(store, **MISMATCHES[field])
    resolved = resolve_latency_profile("auto", IDENTITY, store)
    assert resolved.profile is None and resolved.path is None
    assert resolved.source is ProfileSource.NONE
    assert len(resolved.warnings) == 1
    command = calibrate_command(IDENTITY, store)
    assert command in resolved.warnings[0]
    words = shlex.split(command)
    assert words[:2] == ["bastion", "calibrate"]
    args = _calibrate_parser().parse_args(words[2:])  # the command is one `bastion calibrate` accepts
    assert (args.model_path, args.draft_model_path) == ("/models/Qwen3-8B", "/models/Qwen3-8B-DFlash-b16")
    assert (args.dtype, args.attention_backend, args.tp, args.device) == ("bfloat16", "triton", 1, "cuda")
    assert (args.engine, args.store) == ("sglang", str(store.root))


def test_empty_or_missing_store_gives_the_calibrate_command(tmp_path: Path) -> None:
    resolved = resolve_latency_profile("auto", IDENTITY, ProfileStore(tmp_path / "nowhere"))
    assert resolved.profile is None
    assert "bastion calibrate --model-path /models/Qwen3-8B" in resolved.warnings[0]


def test_engine_restricts_matches_only_when_named(store: ProfileStore) -> None:
    saved(store, engine="reference")
    assert resolve_latency_profile("auto", IDENTITY, store).profile is not None
    sglang_only = IDENTITY.model_copy(update={"engine": "sglang"})
    resolved = resolve_latency_profile("auto", sglang_only, store)
    assert resolved.profile is None
    assert "--engine sglang" in resolved.warnings[0]


def test_explicit_path_for_another_device_is_used_with_a_warning_naming_both(store: ProfileStore) -> None:
    path = saved(store, device_name="NVIDIA A100-SXM4-80GB")
    resolved = resolve_latency_profile(str(path), IDENTITY, store)
    assert resolved.source is ProfileSource.EXPLICIT and resolved.path == path
    assert resolved.profile is not None
    assert len(resolved.warnings) == 1
    assert "'NVIDIA A100-SXM4-80GB'" in resolved.warnings[0]
    assert "'NVIDIA H100 80GB HBM3'" in resolved.warnings[0]
    assert str(path) in resolved.warnings[0]


def test_explicit_path_for_another_model_warns_with_both_hashes(store: ProfileStore) -> None:
    path = saved(store, model_config_hash=OTHER_HASH, tp_size=2)
    resolved = resolve_latency_profile(path, IDENTITY, store)
    text = "\n".join(resolved.warnings)
    assert len(resolved.warnings) == 2
    assert OTHER_HASH in text and HASH in text and "tp size '2'" in text


def test_explicit_matching_path_has_no_warning(store: ProfileStore) -> None:
    path = saved(store)
    assert resolve_latency_profile(path, IDENTITY, store).warnings == ()


def _corrupt(path: Path) -> None:
    path.write_text('{"schema_version": 2, "metadata": {', encoding="utf-8")


def _truncated(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: len(text) // 2], encoding="utf-8")


def _wrong_version(path: Path) -> None:
    """A profile of the previous layout (schema 1, the max-of-two-affine fit)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    data["schema_version"] = 1
    path.write_text(json.dumps(data), encoding="utf-8")


def _bad_field(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data["samples"][0]["seconds"] = -1.0
    path.write_text(json.dumps(data), encoding="utf-8")


BREAKERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "corrupt": (_corrupt, "corrupt JSON"),
    "truncated": (_truncated, "corrupt JSON"),
    "wrong-version": (_wrong_version, "schema_version found 1, supported 2; re-run `bastion calibrate`"),
    "bad-field": (_bad_field, "samples.0.seconds"),
}


@pytest.mark.parametrize("breaker", sorted(BREAKERS))
def test_unusable_explicit_profile_raises_naming_the_file(store: ProfileStore, breaker: str) -> None:
    path = saved(store)
    damage, detail = BREAKERS[breaker]
    damage(path)
    with pytest.raises(ProfileError, match=detail) as raised:
        resolve_latency_profile(str(path), IDENTITY, store)
    assert raised.value.path == path and str(path) in str(raised.value)


@pytest.mark.parametrize("breaker", sorted(BREAKERS))
def test_unusable_file_of_another_runtime_is_skipped_with_a_warning(
    store: ProfileStore, breaker: str
) -> None:
    match = saved(store)
    broken = saved(store, device_name="NVIDIA H200")
    damage, detail = BREAKERS[breaker]
    damage(broken)
    resolved = resolve_latency_profile("auto", IDENTITY, store)
    assert resolved.path == match and resolved.profile is not None
    assert len(resolved.warnings) == 1
    assert str(broken) in resolved.warnings[0] and re.search(detail, resolved.warnings[0])
    # with no match the skipped file is named beside the calibrate command
    match.unlink()
    alone = resolve_latency_profile("auto", IDENTITY, store)
    assert alone.profile is None and len(alone.warnings) == 2 and str(broken) in alone.warnings[0]
    rows = "\n".join(list_lines(store, store.list_profiles()))
    assert "INVALID" in rows and broken.name in rows


@pytest.mark.parametrize("breaker", sorted(BREAKERS))
def test_unusable_file_named_for_this_runtime_refuses_auto_even_beside_a_match(
    store: ProfileStore, breaker: str
) -> None:
    saved(store)
    broken = saved(store, created_at=datetime(2026, 2, 1, tzinfo=UTC))
    assert named_for(broken, IDENTITY) and not named_for(broken, IDENTITY.model_copy(update={"tp_size": 2}))
    damage, detail = BREAKERS[breaker]
    damage(broken)
    with pytest.raises(ProfileError, match=detail) as raised:
        resolve_latency_profile("auto", IDENTITY, store)
    assert raised.value.path == broken


def test_temporary_and_hidden_files_are_not_profiles(store: ProfileStore) -> None:
    path = saved(store)
    (store.root / ".half-written.json").write_text("{", encoding="utf-8")
    (store.root / f".{path.name}.abc.tmp").write_text("{", encoding="utf-8")
    assert [entry.path for entry in store.list_profiles()] == [path]


def test_empty_spec_is_rejected(store: ProfileStore) -> None:
    with pytest.raises(ValueError, match="spec is empty"):
        resolve_latency_profile("  ", IDENTITY, store)


def test_store_location_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    environ = {STORE_ENV: str(tmp_path / "from-env")}
    assert ProfileStore.locate(tmp_path / "given", environ).root == tmp_path / "given"
    assert ProfileStore.locate(None, environ).root == tmp_path / "from-env"
    assert ProfileStore.locate(None, {}).root == tmp_path / "home" / DEFAULT_STORE
    assert ProfileStore.locate(None, {STORE_ENV: ""}).root == tmp_path / "home" / DEFAULT_STORE


def test_file_names_spell_the_identity_and_time() -> None:
    name = profile_file_name(make_profile(created_at=datetime(2026, 2, 3, 4, 5, 6, tzinfo=UTC)))
    assert name == (
        "nvidia-h100-80gb-hbm3--qwen3-8b--bfloat16--triton--tp1--sglang--aaaaaaaaaaaa--20260203T040506Z.json"
    )


def test_build_latency_model_from_a_profile_uses_its_fit_and_the_runtime_buckets(store: ProfileStore) -> None:
    saved(store)
    resolved = resolve_latency_profile("auto", IDENTITY, store)
    buckets = (2, 4, 8, 16, 32, 64, 65)
    model = build_latency_model(
        resolved, QWEN3_8B_CONFIG, hardware=None, ema_alpha=0.25, width_buckets=buckets
    )
    assert resolved.profile is not None
    expected = resolved.profile.latency_model(0.25)
    assert model.calibrated and model.ema_alpha == 0.25 and model.width_buckets == buckets
    for s, c in ((1, 64), (3, 1000), (40, 4096)):
        padded = next(b for b in buckets if b >= s)
        assert model.predict(s, c) == pytest.approx(expected.predict(padded, c), rel=1e-12)


def test_build_latency_model_without_a_profile_is_the_uncalibrated_roofline(store: ProfileStore) -> None:
    identity = IDENTITY.model_copy(update={"dtype": "float32"})
    resolved = resolve_latency_profile("auto", identity, store)
    hardware = KNOWN_GPUS["H200"]
    model = build_latency_model(resolved, QWEN3_8B_CONFIG, hardware, ema_alpha=0.1, width_buckets=None)
    bare = LatencyModel(RooflineModel(QWEN3_8B, hardware, 4))
    assert not model.calibrated
    assert model.predict(17, 3000) == pytest.approx(bare.predict(17, 3000), rel=1e-12)
    with pytest.raises(ValueError, match="no latency profile and no hardware spec"):
        build_latency_model(resolved, QWEN3_8B_CONFIG, None, ema_alpha=0.1, width_buckets=None)


def test_runtime_identity_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="not a torch floating-point dtype"):
        RuntimeIdentity(**(IDENTITY.model_dump() | {"dtype": "int8"}))
    with pytest.raises(ValueError):
        RuntimeIdentity(**(IDENTITY.model_dump() | {"model_config_hash": "xyz"}))
    assert RuntimeIdentity(**(IDENTITY.model_dump() | {"dtype": "torch.bfloat16"})).dtype == "bfloat16"
