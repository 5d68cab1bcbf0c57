"""When a server calibrates itself at start-up, on what grid, where the result goes, and the flag that asks
for it (CPU, fast; the server that does it: test_startup_calibration_engine.py)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from calibration_profiles import IDENTITY, PLAIN_SETTINGS, make_profile

from bastion_sglang.calibration.lookup import ProfileSource, ResolvedProfile
from bastion_sglang.calibration.profile_cli import describe_profile
from bastion_sglang.calibration.startup import StartupSettings, needs_startup_calibration, store_profile
from bastion_sglang.controller.profile import load_profile
from bastion_sglang.integration.config import (
    STARTUP_CALIBRATION_ENV,
    BastionConfig,
    default_startup_calibration,
)
from bastion_sglang.registration import FLAGS, config_from_namespace, make_config

DRAFTER = "a" * 64
OTHER_DRAFTER = "b" * 64


def resolved(found: str) -> ResolvedProfile:
    """A lookup result for a runtime with drafter DRAFTER: "none", no profile; "this", a profile measured
    with this drafter; "other", one measured with OTHER_DRAFTER only; "synthetic", "other" for a runtime
    under synthetic acceptance; "unhashed", "other" for a drafter whose weights could not be hashed."""
    identity = IDENTITY.model_copy(update={"drafter_weights_hash": DRAFTER})
    if found == "synthetic":
        identity = identity.model_copy(
            update={"settings": PLAIN_SETTINGS.model_copy(update={"synthetic_acceptance": True})}
        )
    if found == "unhashed":
        identity = identity.model_copy(update={"drafter_weights_hash": None})
    if found == "none":
        return ResolvedProfile(
            None, ProfileSource.NONE, None, identity, (), reason="no stored profile matches"
        )
    measured_with = DRAFTER if found == "this" else OTHER_DRAFTER
    profile = make_profile(drafter_weights_hash=measured_with)
    miss = identity.acceptance_mismatch(profile)
    return ResolvedProfile(
        profile,
        ProfileSource.STORE,
        Path("stored.json"),
        identity,
        (),
        acceptance_profile=profile if miss is None else None,
        acceptance_path=Path("stored.json") if miss is None else None,
        acceptance_miss=miss,
    )


@pytest.mark.parametrize(
    ("mode", "found", "explicit", "plans", "calibrates"),
    [
        ("quick", "none", False, True, True),  # nothing stored
        ("full", "none", False, True, True),
        ("off", "none", False, True, False),  # the operator said no
        ("quick", "none", True, True, False),  # an explicit --bastion-profile is the operator's choice
        ("quick", "none", False, False, False),  # fixed / chain never read the latency model
        ("quick", "this", False, True, False),  # stored, measured with this drafter: reused
        ("quick", "other", False, True, True),  # latency stored, but no acceptance of this drafter
        ("quick", "synthetic", False, True, False),  # rewritten drafts plan with no map: latency suffices
        ("quick", "unhashed", False, True, False),  # never found: it would calibrate at every start
    ],
)
def test_when_a_server_calibrates_at_start_up(
    mode: str, found: str, explicit: bool, plans: bool, calibrates: bool
) -> None:
    why = needs_startup_calibration(mode, resolved(found), explicit, plans)  # type: ignore[arg-type]
    assert (why is not None) == calibrates
    if found == "other":
        assert why is not None and OTHER_DRAFTER[:12] in why and DRAFTER[:12] in why


def test_a_stored_start_up_profile_of_batch_one_only_is_measured_again() -> None:
    """A start-up profile stored before start-up calibration measured batches priced every batch by the
    roofline's extrapolation: the server measures again. One with a batched sample, or one `bastion
    calibrate` made (the operator's thorough choice), is reused."""
    stored = resolved("this")
    assert stored.profile is not None
    single = stored.profile.model_copy(
        update={"metadata": stored.profile.metadata.model_copy(update={"made_by": "startup-quick"})}
    )
    why = needs_startup_calibration("quick", replace(stored, profile=single), False, True)
    assert why == "the stored start-up profile stored.json measured verify passes of one request only"
    batched_sample = single.samples[0].model_copy(update={"batch": 4})
    batched = single.model_copy(update={"samples": [*single.samples, batched_sample]})
    assert needs_startup_calibration("quick", replace(stored, profile=batched), False, True) is None
    assert needs_startup_calibration("quick", stored, False, True) is None  # made by calibrate


def test_quick_grid_is_the_servers_widths_at_three_contexts() -> None:
    settings = StartupSettings.for_server(
        "quick", (4, 2, 8, 16, 32, 64, 65), max_context=8000, topk=8, max_batch=256
    )
    assert settings.sweep.widths == (2, 4, 8, 16, 32, 64, 65)
    assert settings.sweep.contexts == (64, 256, 1024)
    assert settings.sweep.batches == (1, 4, 16)
    assert (settings.sweep.warmup, settings.sweep.repeats) == (1, 3)
    assert settings.acceptance.num_prompts == 24 and settings.acceptance.topk == 8


def test_quick_grid_keeps_within_what_the_server_holds() -> None:
    settings = StartupSettings.for_server("quick", (9,), max_context=300, topk=4, max_batch=8)
    assert settings.sweep.widths == (2, 9)  # one node, and the cap
    assert settings.sweep.contexts == (64, 256, 300)
    assert settings.sweep.batches == (1, 4)  # 16 requests do not fit
    assert StartupSettings.for_server("quick", (9,), 300, 4, max_batch=1).sweep.batches == (1,)


def test_full_grid_is_calibrates_grid_up_to_the_cap() -> None:
    settings = StartupSettings.for_server("full", (2, 4, 8, 16, 17), max_context=5000, topk=8, max_batch=40)
    assert settings.sweep.widths == (2, 3, 4, 6, 8, 12, 16, 17)
    assert settings.sweep.contexts == (64, 128, 256, 512, 1024, 2048, 4096, 5000)
    assert settings.sweep.batches == (1, 2, 4, 8, 16, 32)
    assert settings.acceptance.num_prompts == 36


def test_a_server_too_small_for_any_grid_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"holds 40 cached tokens.*--max-total-tokens"):
        StartupSettings.for_server("quick", (2, 4), max_context=40, topk=4)


def test_a_store_that_cannot_be_written_is_an_error_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    profile = make_profile(made_by="startup-quick")
    with caplog.at_level(logging.ERROR):
        assert store_profile(profile, blocker / "profile.json") is None
    assert str(blocker) in caplog.text and "calibrate again at its next start" in caplog.text


def test_a_stored_start_up_profile_says_how_it_was_made(tmp_path: Path) -> None:
    path = store_profile(make_profile(made_by="startup-quick"), tmp_path / "store" / "p.json")
    assert path is not None
    profile = load_profile(path)
    assert profile.metadata.made_by == "startup-quick"
    lines = describe_profile(profile, path)
    assert any("quick start-up calibration" in line for line in lines)
    assert not any(line.startswith("plot") for line in lines)  # only bastion calibrate draws one
    assert make_profile().metadata.made_by == "calibrate"  # profiles written before the field say so too


def test_the_flag_sets_the_mode_and_refuses_others() -> None:
    parser = argparse.ArgumentParser()
    flag = next(flag for flag in FLAGS if flag.flag == "--bastion-startup-calibration")
    parser.add_argument(flag.flag, dest=flag.dest, type=flag.type, default=None)
    config = config_from_namespace(parser.parse_args(["--bastion-startup-calibration", "FULL"]))
    assert config is not None and config.startup_calibration == "full"
    with pytest.raises(SystemExit):
        parser.parse_args(["--bastion-startup-calibration", "sometimes"])
    with pytest.raises(ValueError, match="startup_calibration must be one of off, quick, full"):
        BastionConfig(startup_calibration="sometimes")  # type: ignore[arg-type]


def test_the_default_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STARTUP_CALIBRATION_ENV, raising=False)
    assert default_startup_calibration() == "quick"
    assert BastionConfig().startup_calibration == "quick" and make_config().startup_calibration == "quick"
    monkeypatch.setenv(STARTUP_CALIBRATION_ENV, "off")
    assert BastionConfig().startup_calibration == "off" and make_config().startup_calibration == "off"
    assert make_config(startup_calibration="full").startup_calibration == "full"
    monkeypatch.setenv(STARTUP_CALIBRATION_ENV, "later")
    with pytest.raises(ValueError, match=r"\$BASTION_STARTUP_CALIBRATION='later'"):
        BastionConfig()
