"""The acceptance calibration a worker plans with (`planning_setup.planning_acceptance`): the map of the
profile measured with this drafter, bound by the drafter's weights hash, for a DFlash drafter's top-K and a
DFlash2 drafter's lattices alike; a calibration measured with the DFlash base is not a DFlash2 drafter's,
and one that records no drafter is no drafter's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from calibration_profiles import IDENTITY, make_profile
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.calibration.identity import weights_hash
from bastion_sglang.calibration.lookup import ResolvedProfile, resolve_latency_profile
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.profile import save_profile
from bastion_sglang.step.planning_setup import planning_acceptance

CALIBRATION = AcceptanceCalibration(slopes=[1.2, 1.5], offsets=[-0.1, -0.3], events=[40, 30])


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny DFlash drafter, a tiny DFlash2 drafter) of one tiny target."""
    folder = tmp_path_factory.mktemp("drafters")
    target = make_tiny_target(folder / "target")
    return make_tiny_drafter(folder / "dflash", target), make_tiny_dflash2_drafter(folder / "dflash2", target)


def resolved_with(tmp_path: Path, measured_with: Path | None, drafter: Path) -> ResolvedProfile:
    """The explicit profile (with CALIBRATION) measured with `measured_with` (None: not recorded), resolved
    for a runtime whose drafter is `drafter`."""
    profile = make_profile(
        drafter_weights_hash=None if measured_with is None else weights_hash(measured_with)
    )
    path = tmp_path / "profile.json"
    save_profile(profile.model_copy(update={"acceptance": CALIBRATION}), path)
    identity = IDENTITY.model_copy(update={"drafter_weights_hash": weights_hash(drafter)})
    return resolve_latency_profile(path, identity, ProfileStore(tmp_path / "store"))


def test_a_dflash2_drafter_plans_with_its_profiles_calibration(
    tmp_path: Path, drafters: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, dflash2 = drafters
    with caplog.at_level(logging.INFO):
        chosen = planning_acceptance(resolved_with(tmp_path, dflash2, dflash2), lattice_drafts=True)
    assert chosen == CALIBRATION
    assert "planning the DFlash2 drafter's lattices with the acceptance calibration" in caplog.text


def test_a_calibration_of_the_dflash_base_is_not_the_dflash2_drafters(
    tmp_path: Path, drafters: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dflash, dflash2 = drafters
    with caplog.at_level(logging.INFO):
        chosen = planning_acceptance(resolved_with(tmp_path, dflash, dflash2), lattice_drafts=True)
    assert chosen is None
    assert "is not this runtime's (measured for drafter weights" in caplog.text
    assert "raw transition log-probs" in caplog.text
    # and the other way round: a DFlash2 drafter's calibration is not its DFlash base's
    assert planning_acceptance(resolved_with(tmp_path, dflash2, dflash), lattice_drafts=False) is None


def test_a_dflash_drafter_plans_with_its_profiles_calibration(
    tmp_path: Path, drafters: tuple[Path, Path]
) -> None:
    dflash, dflash2 = drafters
    assert planning_acceptance(resolved_with(tmp_path, dflash, dflash), lattice_drafts=False) == CALIBRATION
    # a calibration that records no drafter is no drafter's
    assert planning_acceptance(resolved_with(tmp_path, None, dflash2), lattice_drafts=True) is None
