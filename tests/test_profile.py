"""Calibration profile: round trip, every kind of bad file, config_hash."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from bastion_sglang.controller.latency import (
    DecodeFit,
    LatencyFit,
    LatencyModel,
    LatencySample,
    evaluate_fit,
    validate_leave_out,
)
from bastion_sglang.controller.profile import (
    PROFILE_SCHEMA_VERSION,
    CalibrationProfile,
    ProfileError,
    ProfileMetadata,
    StepCosts,
    config_hash,
    load_profile,
    save_profile,
)
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "vocab_size": 151936,
}


def make_profile() -> CalibrationProfile:
    shape = ModelShape.from_hf_config(QWEN3_8B_CONFIG)
    hardware = HardwareSpec(name="NVIDIA H100 80GB HBM3 (measured)", peak_flops=7.1e14, bandwidth=2.9e12)
    roofline = RooflineModel(shape, hardware, bytes_per_element=2)
    fit = LatencyFit(
        beta_fixed=0.0015,
        alpha_gemm=1.3,
        alpha_tok=1e-6,
        alpha_attn=1.6,
        alpha_kv=2.0,
        decode=DecodeFit(beta=9e-4, alpha_attn=1.2),
    )
    model = LatencyModel(roofline, fit)
    samples = [
        LatencySample(s=s, c=c, seconds=model.predict(s, c)) for s in (2, 16, 64, 256) for c in (128, 2048)
    ]
    samples += [LatencySample(s=1, c=c, seconds=model.predict_plain(c), mode="decode") for c in (128, 2048)]
    metadata = ProfileMetadata(
        device_name="NVIDIA H100 80GB HBM3",
        driver_version="560.35.03",
        cuda_version="12.6",
        sglang_version="0.5.23",
        engine="sglang",
        model_path="Qwen/Qwen3-8B",
        model_config_hash=config_hash(QWEN3_8B_CONFIG),
        dtype="bfloat16",
        attention_backend="fa3",
        tp_size=1,
        created_at=datetime(2026, 5, 1, 12, 30, tzinfo=UTC),
    )
    return CalibrationProfile(
        schema_version=PROFILE_SCHEMA_VERSION,
        metadata=metadata,
        model_shape=shape,
        hardware=hardware,
        bytes_per_element=2.0,
        fit=fit,
        report=evaluate_fit(roofline, fit, samples),
        leave_out=validate_leave_out(roofline, samples),
        samples=samples,
        step_costs=StepCosts(t_draft=0.0021, t_aux=0.0004, l_ar=0.0072, t_aux_per_token=3e-6),
        width_buckets=[16, 32, 64, 128, 256],
        max_context=32768,
    )


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


@pytest.fixture
def profile_dict() -> dict[str, Any]:
    return json.loads(make_profile().model_dump_json())


def test_round_trip(tmp_path: Path) -> None:
    profile = make_profile()
    assert PROFILE_SCHEMA_VERSION == 2
    path = tmp_path / "profiles" / "h100" / "qwen3-8b.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    assert loaded.fit.decode == profile.fit.decode is not None
    assert loaded.leave_out is not None and loaded.leave_out == profile.leave_out
    assert [x.mode for x in loaded.samples].count("decode") == 2
    assert loaded.step_costs.t_aux_per_token == 3e-6
    assert loaded.metadata.created_at == datetime(2026, 5, 1, 12, 30, tzinfo=UTC)
    assert [p.name for p in path.parent.iterdir()] == ["qwen3-8b.json"]  # no temporary file left


def test_save_replaces_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text("old contents")
    save_profile(make_profile(), path)
    assert load_profile(path) == make_profile()


def test_save_failure_names_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(ProfileError, match="cannot write") as error:
        save_profile(make_profile(), target)
    assert str(target) in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_latency_model_from_profile() -> None:
    profile = make_profile()
    model = profile.latency_model(ema_alpha=0.2)
    assert model.calibrated and model.ema_alpha == 0.2 and model.width_buckets == (16, 32, 64, 128, 256)
    roofline = profile.roofline()
    expected = profile.fit.seconds(roofline.pass_terms(32, 900))
    assert model.predict(20, 900) == expected
    assert model.predict_plain(900) == pytest.approx(
        0.0009 + 1.2 * roofline.attention_seconds(1, 900), rel=1e-14
    )


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ProfileError, match="not found") as error:
        load_profile(path)
    assert str(path) in str(error.value) and error.value.path == path


def test_corrupt_json(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.json"
    path.write_text('{"schema_version": 1,\n  "metadata": {oops}\n}')
    with pytest.raises(ProfileError, match="corrupt JSON at line 2 column 16") as error:
        load_profile(path)
    assert str(path) in str(error.value)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "truncated.json"
    text = make_profile().model_dump_json(indent=2)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match=r"corrupt JSON at line \d+ column \d+") as error:
        load_profile(path)
    assert str(path) in str(error.value)
    line = int(str(error.value).split(" at line ")[1].split()[0])
    assert line > 1


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ProfileError, match="cannot read") as error:
        load_profile(path)
    assert str(path) in str(error.value)


def test_top_level_must_be_object(tmp_path: Path) -> None:
    path = write_json(tmp_path / "list.json", [1, 2])
    with pytest.raises(ProfileError, match="JSON object, got list"):
        load_profile(path)


@pytest.mark.parametrize("version", [3, 0, "2", True])
def test_wrong_schema_version(tmp_path: Path, profile_dict: dict[str, Any], version: Any) -> None:
    path = write_json(tmp_path / "future.json", {**profile_dict, "schema_version": version})
    with pytest.raises(ProfileError) as error:
        load_profile(path)
    message = str(error.value)
    assert str(path) in message
    assert f"found {version!r}" in message and f"supported {PROFILE_SCHEMA_VERSION}" in message


def test_version_1_profile_is_rejected_with_the_command_to_rerun(tmp_path: Path) -> None:
    """A profile of the max-of-two-affine fit (schema 1) cannot be read: it names the versions and the fix."""
    v1 = {
        "schema_version": 1,
        "fit": {"alpha_c": 1.3, "beta_c": 0.0015, "alpha_m": 1.1, "beta_m": 0.0007},
        "samples": [{"s": 1, "c": 128, "seconds": 0.01, "batch": 1}],
    }
    path = write_json(tmp_path / "v1.json", v1)
    with pytest.raises(ProfileError) as error:
        load_profile(path)
    message = str(error.value)
    assert str(path) in message
    assert "schema_version found 1, supported 2" in message
    assert "re-run `bastion calibrate`" in message


def test_missing_schema_version(tmp_path: Path, profile_dict: dict[str, Any]) -> None:
    del profile_dict["schema_version"]
    path = write_json(tmp_path / "unversioned.json", profile_dict)
    with pytest.raises(ProfileError, match="missing field schema_version"):
        load_profile(path)


def test_negative_latency_in_a_sample(tmp_path: Path, profile_dict: dict[str, Any]) -> None:
    profile_dict["samples"][3]["seconds"] = -0.004
    path = write_json(tmp_path / "negative.json", profile_dict)
    with pytest.raises(ProfileError, match=r"samples\.3\.seconds: Input should be greater than 0") as error:
        load_profile(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("remove", "field"),
    [
        (("metadata", "device_name"), "metadata.device_name"),
        (("fit",), "fit"),
        (("step_costs", "l_ar"), "step_costs.l_ar"),
    ],
)
def test_missing_field(
    tmp_path: Path, profile_dict: dict[str, Any], remove: tuple[str, ...], field: str
) -> None:
    holder = profile_dict
    for key in remove[:-1]:
        holder = holder[key]
    del holder[remove[-1]]
    path = write_json(tmp_path / "missing.json", profile_dict)
    with pytest.raises(ProfileError, match=f"{field}: Field required") as error:
        load_profile(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(width_buckets=[64, 32]), "width_buckets"),
        (lambda d: d["metadata"].update(model_config_hash="not-hex"), "metadata.model_config_hash"),
        (lambda d: d["metadata"].update(engine="vllm"), "metadata.engine"),
        (lambda d: d["metadata"].update(created_at="2026-05-01T12:30:00"), "metadata.created_at"),
        (lambda d: d["step_costs"].update(t_draft=-1.0), "step_costs.t_draft"),
        (lambda d: d.update(samples=[]), "samples"),
        (lambda d: d.update(unexpected=1), "unexpected"),
        (lambda d: d["model_shape"].update(num_layers="36"), "model_shape.num_layers"),
    ],
)
def test_invalid_field_is_named(tmp_path: Path, profile_dict: dict[str, Any], edit: Any, field: str) -> None:
    edit(profile_dict)
    path = write_json(tmp_path / "invalid.json", profile_dict)
    with pytest.raises(ProfileError) as error:
        load_profile(path)
    assert f"{field}: " in str(error.value) and str(path) in str(error.value)


def test_fit_with_non_positive_latency_is_rejected(tmp_path: Path, profile_dict: dict[str, Any]) -> None:
    zero = {"beta_fixed": 0.0, "alpha_gemm": 0.0, "alpha_tok": 0.0, "alpha_attn": 0.0, "alpha_kv": 0.0}
    profile_dict["fit"] = zero
    path = write_json(tmp_path / "zero-fit.json", profile_dict)
    with pytest.raises(ProfileError, match=r"fit: Value error, .*must be positive"):
        load_profile(path)
    profile_dict["fit"] = zero | {"beta_fixed": -1.0, "alpha_gemm": 1.0}
    path = write_json(tmp_path / "negative-fit.json", profile_dict)
    with pytest.raises(ProfileError, match=r"fit\.beta_fixed: Input should be greater than or equal to 0"):
        load_profile(path)


def test_step_costs_validation() -> None:
    with pytest.raises(ValidationError, match="l_ar"):
        StepCosts(t_draft=0.001, t_aux=0.0, l_ar=0.0)
    with pytest.raises(ValidationError, match="t_aux"):
        StepCosts(t_draft=0.001, t_aux=-0.001, l_ar=0.01)


def test_config_hash_stable_under_key_order() -> None:
    reordered = dict(reversed(list(QWEN3_8B_CONFIG.items())))
    assert config_hash(reordered) == config_hash(QWEN3_8B_CONFIG)
    nested = {"model_type": "wrapper", "text_config": QWEN3_8B_CONFIG}
    nested_reordered = {"text_config": reordered, "model_type": "wrapper"}
    assert config_hash(nested) == config_hash(nested_reordered)
    digest = config_hash(QWEN3_8B_CONFIG)
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_config_hash_ignores_bookkeeping_keys() -> None:
    noisy = {
        **QWEN3_8B_CONFIG,
        "_name_or_path": "/models/qwen3-8b",
        "transformers_version": "4.57.1",
        "torch_dtype": "float16",
        "dtype": "float16",
        "use_cache": False,
    }
    assert config_hash(noisy) == config_hash(QWEN3_8B_CONFIG)


@pytest.mark.parametrize(
    "change",
    [{"hidden_size": 5120}, {"num_key_value_heads": 4}, {"vocab_size": 151937}, {"architectures": ["Other"]}],
)
def test_config_hash_changes_with_the_model(change: dict[str, Any]) -> None:
    assert config_hash({**QWEN3_8B_CONFIG, **change}) != config_hash(QWEN3_8B_CONFIG)


def test_config_hash_from_file_and_folder(tmp_path: Path) -> None:
    write_json(tmp_path / "config.json", QWEN3_8B_CONFIG)
    assert config_hash(tmp_path) == config_hash(tmp_path / "config.json") == config_hash(QWEN3_8B_CONFIG)
    with pytest.raises(ValueError, match="cannot read"):
        config_hash(tmp_path / "absent")
