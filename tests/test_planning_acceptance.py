"""The acceptance calibration a worker plans with (`planning_setup.planning_acceptance`): the profile's,
bound to the drafter by its config hash, for a DFlash drafter's top-K and a DFlash2 drafter's lattices
alike; a calibration fitted for the DFlash base is not a DFlash2 drafter's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from calibration_profiles import IDENTITY, make_profile
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.calibration.identity import model_config_hash
from bastion_sglang.calibration.lookup import ProfileSource, ResolvedProfile
from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.step.planning_setup import planning_acceptance


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny DFlash drafter, a tiny DFlash2 drafter) of one tiny target."""
    folder = tmp_path_factory.mktemp("drafters")
    target = make_tiny_target(folder / "target")
    return make_tiny_drafter(folder / "dflash", target), make_tiny_dflash2_drafter(folder / "dflash2", target)


def resolved_with(calibration: AcceptanceCalibration) -> ResolvedProfile:
    profile = make_profile().model_copy(update={"acceptance": calibration})
    return ResolvedProfile(profile, ProfileSource.EXPLICIT, Path("/store/profile.json"), IDENTITY, ())


def calibration_for(drafter: Path | None) -> AcceptanceCalibration:
    fitted_for = None if drafter is None else model_config_hash(drafter)
    return AcceptanceCalibration(
        slopes=[1.2, 1.5], offsets=[-0.1, -0.3], events=[40, 30], drafter_config_hash=fitted_for
    )


def test_a_dflash2_drafter_plans_with_its_profiles_calibration(
    drafters: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, dflash2 = drafters
    calibration = calibration_for(dflash2)
    with caplog.at_level(logging.INFO):
        chosen = planning_acceptance(resolved_with(calibration), str(dflash2), lattice_drafts=True)
    assert chosen == calibration
    assert "planning the DFlash2 drafter's lattices with the acceptance calibration" in caplog.text


def test_a_calibration_of_the_dflash_base_is_not_the_dflash2_drafters(
    drafters: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dflash, dflash2 = drafters
    assert model_config_hash(dflash) != model_config_hash(dflash2)
    with caplog.at_level(logging.INFO):
        chosen = planning_acceptance(
            resolved_with(calibration_for(dflash)), str(dflash2), lattice_drafts=True
        )
    assert chosen is None
    assert "was fitted for drafter config" in caplog.text
    assert "raw transition log-probs" in caplog.text
    # and the other way round: a DFlash2 drafter's calibration is not its DFlash base's
    other = planning_acceptance(resolved_with(calibration_for(dflash2)), str(dflash), lattice_drafts=False)
    assert other is None


def test_a_dflash_drafter_plans_with_its_profiles_calibration(drafters: tuple[Path, Path]) -> None:
    dflash, dflash2 = drafters
    calibration = calibration_for(dflash)
    assert planning_acceptance(resolved_with(calibration), str(dflash), lattice_drafts=False) == calibration
    # a calibration with no drafter hash is taken for any drafter, a DFlash2 one too
    unbound = calibration_for(None)
    assert planning_acceptance(resolved_with(unbound), str(dflash2), lattice_drafts=True) == unbound
