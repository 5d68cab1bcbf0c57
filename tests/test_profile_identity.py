"""The full identity of a profile: what the store's lookup matches, prefers and refuses (CPU, fast).

Every case stores the wrong profile beside the right one (or alone) and checks that the lookup takes the
right one, names it in its one reason line, and that a server with the wrong one alone loads nothing (or
calibrates, with the reason saying why): serving settings, SGLang version, the marks of dummy weights and
synthetic acceptance, thoroughness before age, the acceptance part bound to the drafter's weights, and
profiles written before these fields were recorded.
"""

from __future__ import annotations

import argparse
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from calibration_profiles import IDENTITY, PLAIN_SETTINGS, make_profile, startup_samples
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.calibration import profile_cli
from bastion_sglang.calibration.identity import (
    device_name,
    model_config_hash,
    serving_settings,
    weights_hash,
)
from bastion_sglang.calibration.lookup import ProfileSource, resolve_acceptance, resolve_latency_profile
from bastion_sglang.calibration.profile_cli import describe_profile, list_lines
from bastion_sglang.calibration.startup import needs_startup_calibration
from bastion_sglang.calibration.store import STORE_ENV, ProfileStore
from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.profile import CalibrationProfile, save_profile
from bastion_sglang.registration import make_config
from bastion_sglang.step.planning_setup import resolve_worker_profile

DRAFTER_A = "a" * 64
DRAFTER_B = "b" * 64
MAP = AcceptanceCalibration(slopes=[1.2], offsets=[-0.1], events=[40], drafter_config_hash=None)


@pytest.fixture
def store(tmp_path: Path) -> ProfileStore:
    return ProfileStore(tmp_path / "profiles")


def day(n: int) -> datetime:
    return datetime(2026, 1, n, tzinfo=UTC)


def saved(store: ProfileStore, profile: CalibrationProfile) -> Path:
    path = store.path_for(profile)
    save_profile(profile, path)
    return path


def settings(**changes: Any) -> Any:
    return PLAIN_SETTINGS.model_copy(update=changes)


def with_map(profile: CalibrationProfile) -> CalibrationProfile:
    return profile.model_copy(update={"acceptance": MAP})


SETTING_MISMATCHES: dict[str, tuple[dict[str, Any], str]] = {
    "quantization": ({"settings": settings(quantization="fp8")}, "quantization 'fp8' vs 'None'"),
    "kv-cache-dtype": ({"settings": settings(kv_cache_dtype="fp8_e4m3")}, "kv cache dtype 'fp8_e4m3'"),
    "page-size": ({"settings": settings(page_size=16)}, "page size '16' vs '1'"),
    "cuda-graphs": ({"settings": settings(cuda_graphs=True)}, "cuda graphs 'on' vs 'off'"),
    "sglang-version": ({"sglang_version": "0.5.22"}, "sglang version '0.5.22' vs '0.5.23'"),
    "dummy-weights": ({"settings": settings(load_format="dummy")}, "marks 'dummy-weights'"),
    "synthetic": ({"settings": settings(synthetic_acceptance=True)}, "marks 'synthetic-acceptance'"),
    "draft-vocab": ({"settings": settings(draft_vocab_size=8192)}, "draft vocabulary '8192 tokens'"),
}
SERVER = IDENTITY.model_copy(update={"engine": "sglang", "sglang_version": "0.5.23"})
"""A serving runtime: real weights, real drafts, the plain settings, SGLang 0.5.23."""


@pytest.mark.parametrize("field", sorted(SETTING_MISMATCHES))
def test_a_profile_for_other_settings_is_not_loaded_and_the_right_one_is(
    store: ProfileStore, field: str
) -> None:
    changes, named = SETTING_MISMATCHES[field]
    wrong = saved(store, make_profile(created_at=day(9), **changes))  # newer: preferred if it matched
    alone = resolve_latency_profile("auto", SERVER, store)
    assert alone.profile is None and alone.source is ProfileSource.NONE
    assert named in alone.warnings[-1] and wrong.name in alone.warnings[-1]
    assert "no stored latency profile matches this runtime" in alone.reason
    right = saved(store, make_profile(created_at=day(1)))
    resolved = resolve_latency_profile("auto", SERVER, store)
    assert resolved.path == right and resolved.warnings == ()
    assert resolved.reason.startswith(f"latency profile {right} (bastion calibrate, 2026-01-01")


def test_a_marked_profile_is_loaded_only_by_a_runtime_with_the_same_mark(store: ProfileStore) -> None:
    dummy = saved(store, make_profile(settings=settings(load_format="dummy")))
    bench = SERVER.model_copy(update={"settings": settings(load_format="dummy")})
    assert resolve_latency_profile("auto", bench, store).path == dummy
    assert resolve_latency_profile("auto", SERVER, store).profile is None
    rows = "\n".join(list_lines(store, store.list_profiles()))
    assert "dummy-weights" in rows
    assert not any("MARKED" in line for line in describe_profile(make_profile(), None))
    marked = describe_profile(with_map(make_profile(settings=settings(load_format="dummy"))), dummy)
    assert any("MARKED dummy-weights: never loaded by a serving runtime" in line for line in marked)


def test_the_most_thorough_profile_wins_then_the_newest(store: ProfileStore) -> None:
    calibrated = saved(store, make_profile(created_at=day(1)))
    saved(store, make_profile(created_at=day(5), made_by="startup-quick"))
    saved(store, make_profile(created_at=day(4), made_by="startup-full"))
    resolved = resolve_latency_profile("auto", SERVER, store)
    assert resolved.path == calibrated
    assert "the most thorough, then newest, of 3 stored profiles" in resolved.reason
    calibrated.unlink()
    assert resolve_latency_profile("auto", SERVER, store).profile.metadata.made_by == "startup-full"  # type: ignore[union-attr]
    newer_quick = saved(store, make_profile(created_at=day(7), made_by="startup-quick"))
    full = next(
        e.path for e in store.list_profiles() if e.profile and e.profile.metadata.made_by == "startup-full"
    )
    full.unlink()
    assert resolve_latency_profile("auto", SERVER, store).path == newer_quick


def test_latency_serves_every_drafter_and_each_drafter_keeps_its_own_map(store: ProfileStore) -> None:
    thorough = saved(store, with_map(make_profile(created_at=day(1), drafter_weights_hash=DRAFTER_A)))
    quick_b = saved(
        store,
        with_map(make_profile(created_at=day(2), made_by="startup-quick", drafter_weights_hash=DRAFTER_B)),
    )
    for drafter, acceptance in ((DRAFTER_A, thorough), (DRAFTER_B, quick_b)):
        resolved = resolve_latency_profile(
            "auto", SERVER.model_copy(update={"drafter_weights_hash": drafter}), store
        )
        assert resolved.path == thorough and resolved.acceptance_path == acceptance
        assert resolved.acceptance == MAP and resolve_acceptance(resolved) == (MAP, ())
        assert f"acceptance from {acceptance} (this drafter's, its map)" in resolved.reason
        assert needs_startup_calibration("quick", resolved, False, True) is None
    other = resolve_latency_profile(
        "auto", SERVER.model_copy(update={"drafter_weights_hash": "c" * 64}), store
    )
    assert other.path == thorough and other.acceptance is None and other.acceptance_path is None
    calibration, warnings = resolve_acceptance(other)
    assert calibration is None and "measured for drafter weights aaaaaaaaaaaa" in warnings[0]
    why = needs_startup_calibration("quick", other, False, True)
    assert why is not None and "no stored profile measured this drafter's acceptance" in why
    rows = list_lines(store, store.list_profiles(), other)
    assert rows[-1] == f"this server: {other.reason}"
    assert [row.split()[-2] for row in rows[2:-1]] == ["loads", "-"]


def test_a_drafter_whose_start_up_found_no_map_does_not_calibrate_again(store: ProfileStore) -> None:
    startup = make_profile(startup_samples(), made_by="startup-quick", drafter_weights_hash=DRAFTER_A)
    path = saved(store, startup)  # no map
    resolved = resolve_latency_profile(
        "auto", SERVER.model_copy(update={"drafter_weights_hash": DRAFTER_A}), store
    )
    assert resolved.acceptance_path == path and resolved.acceptance is None
    assert "no map could be fitted there" in resolved.reason
    assert needs_startup_calibration("quick", resolved, False, True) is None


def test_a_retrained_drafter_is_another_drafter(tmp_path: Path, store: ProfileStore) -> None:
    target = make_tiny_target(tmp_path / "target")
    first = make_tiny_drafter(tmp_path / "first", target, seed=0)
    retrained = make_tiny_drafter(tmp_path / "retrained", target, seed=1)
    assert model_config_hash(first) == model_config_hash(retrained)
    assert weights_hash(first) != weights_hash(retrained)
    assert weights_hash(first) == weights_hash(first / "config.json")
    saved(store, with_map(make_profile(drafter_weights_hash=weights_hash(first))))
    same = resolve_latency_profile(
        "auto", SERVER.model_copy(update={"drafter_weights_hash": weights_hash(first)}), store
    )
    assert same.acceptance == MAP
    new = resolve_latency_profile(
        "auto", SERVER.model_copy(update={"drafter_weights_hash": weights_hash(retrained)}), store
    )
    assert new.profile is not None and new.acceptance is None


def test_a_synthetic_acceptance_run_plans_latency_but_no_stored_map(store: ProfileStore) -> None:
    path = saved(store, with_map(make_profile(drafter_weights_hash=DRAFTER_A)))
    bench = SERVER.model_copy(
        update={"drafter_weights_hash": DRAFTER_A, "settings": settings(synthetic_acceptance=True)}
    )
    resolved = resolve_latency_profile("auto", bench, store)
    assert resolved.path == path and resolved.acceptance is None
    assert "synthetic-acceptance" in resolved.reason
    calibration, warnings = resolve_acceptance(resolved)
    assert calibration is None and "synthetic-acceptance" in warnings[0]
    assert needs_startup_calibration("quick", resolved, False, True) is None


def write_old(store: ProfileStore, profile: CalibrationProfile) -> Path:
    """`profile` as a file written before settings, draft_model_path and drafter_weights_hash existed."""
    path = saved(store, profile)
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in ("settings", "draft_model_path", "drafter_weights_hash"):
        del data["metadata"][key]
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_old_profiles_load_list_and_match_only_where_their_settings_are_known(store: ProfileStore) -> None:
    reference = write_old(store, make_profile(engine="reference", sglang_version=None, settings=None))
    entries = store.list_profiles()
    assert entries[0].profile is not None and entries[0].profile.metadata.settings is None
    assert resolve_latency_profile("auto", IDENTITY, store).path == reference  # nothing there could differ
    reference.unlink()
    with_acceptance = write_old(store, with_map(make_profile(settings=None)))
    resolved = resolve_latency_profile("auto", SERVER, store)
    assert resolved.path == with_acceptance  # calibrate: page 1, eager, unquantized; a map: real weights
    assert resolved.acceptance is None and "records no drafter weights hash" in resolved.reason
    paged = SERVER.model_copy(update={"settings": settings(page_size=16)})
    assert resolve_latency_profile("auto", paged, store).profile is None
    with_acceptance.unlink()
    no_map = write_old(store, make_profile(settings=None))
    missing = resolve_latency_profile("auto", SERVER, store)
    assert missing.profile is None and "its weights may have been dummy" in missing.warnings[-1]
    startup = write_old(store, make_profile(settings=None, made_by="startup-quick", created_at=day(3)))
    assert resolve_latency_profile("auto", SERVER, store).profile is None
    rejected = {r.path: r.mismatches for r in store.find_profile(SERVER).rejected}
    assert "a start-up profile from before they were" in rejected[startup][0][1]
    rows = "\n".join(list_lines(store, store.list_profiles()))
    assert no_map.name in rows and startup.name in rows and "unknown" in rows
    assert any("not recorded" in line for line in describe_profile(store.list_profiles()[0].profile, None))  # type: ignore[arg-type]


def test_serving_settings_read_the_server_arguments() -> None:
    args = SimpleNamespace(
        quantization="fp8", kv_cache_dtype="auto", page_size=16, disable_cuda_graph=False, load_format="dummy"
    )
    cpu = serving_settings(args, torch.bfloat16, torch.device("cpu"), synthetic_acceptance=False)
    assert (cpu.quantization, cpu.kv_cache_dtype, cpu.page_size, cpu.cuda_graphs) == (
        "fp8",
        "bfloat16",
        16,
        False,
    )
    assert cpu.marks == ("dummy-weights",)
    args.kv_cache_dtype, args.load_format, args.quantization = "bf16", "auto", None
    plain = serving_settings(args, torch.float32, torch.device("cpu"), synthetic_acceptance=True)
    assert (plain.quantization, plain.kv_cache_dtype, plain.marks) == (
        None,
        "bfloat16",
        ("synthetic-acceptance",),
    )


def test_a_server_logs_one_line_naming_the_profile_it_loads_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = make_tiny_target(tmp_path / "target")
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    store = ProfileStore(tmp_path / "store")
    monkeypatch.setenv(STORE_ENV, str(store.root))
    cpu = device_name(torch.device("cpu"))
    identity = {"device_name": cpu, "model_config_hash": model_config_hash(target), "dtype": "float32"}
    plain = settings(kv_cache_dtype="float32")
    paged = saved(
        store,
        make_profile(created_at=day(9), settings=plain.model_copy(update={"page_size": 16}), **identity),
    )
    right = saved(
        store,
        make_profile(
            created_at=day(1), settings=plain, drafter_weights_hash=weights_hash(drafter), **identity
        ),
    )
    server_args = SimpleNamespace(
        model_path=str(target),
        attention_backend="triton",
        tp_size=1,
        speculative_draft_model_path=str(drafter),
        quantization=None,
        kv_cache_dtype="auto",
        page_size=1,
        disable_cuda_graph=True,
        load_format="auto",
    )
    config = make_config(startup_calibration="off")
    with caplog.at_level(logging.INFO):
        resolved = resolve_worker_profile(config, server_args, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    assert resolved.path == right and resolved.acceptance_path == right
    lines = [record.getMessage() for record in caplog.records if "latency profile" in record.getMessage()]
    assert lines == [f"BASTION: {resolved.reason}"]
    assert str(right) in lines[0] and str(paged) not in lines[0]


def test_profile_list_says_which_profile_a_server_loads_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = make_tiny_target(tmp_path / "target")
    store = ProfileStore(tmp_path / "store")
    cpu = device_name(torch.device("cpu"))
    identity = {"device_name": cpu, "model_config_hash": model_config_hash(target), "dtype": "float32"}
    plain = settings(kv_cache_dtype="float32")
    real = saved(store, make_profile(created_at=day(1), settings=plain, **identity))
    dummy = saved(
        store,
        make_profile(
            created_at=day(2), settings=plain.model_copy(update={"load_format": "dummy"}), **identity
        ),
    )
    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    server = [
        "--model-path",
        str(target),
        "--attention-backend",
        "triton",
        "--device",
        "cpu",
        "--store",
        str(store.root),
    ]
    assert profile_cli.run(parser.parse_args(["list", *server])) == 0
    rows = capsys.readouterr().out.splitlines()
    by_file = {row.split()[-1]: row for row in rows if row.endswith(".json")}
    assert "dummy-weights" in by_file[dummy.name] and " loads " in by_file[real.name]
    assert rows[-1].startswith(f"this server: latency profile {real} (bastion calibrate, 2026-01-01")
    assert profile_cli.run(parser.parse_args(["list", *server, "--load-format", "dummy"])) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"this server: latency profile {dummy} ")
