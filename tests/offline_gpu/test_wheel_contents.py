"""The wheel of bastion-sglang ships none of the offline-GPU tooling and no `tools/` or `scripts/` file.

Builds the wheel offline (`pip wheel --no-deps --no-build-isolation`, setuptools from this environment) from a
copy of the files git would carry (tracked, plus untracked ones it does not ignore), so the build leaves no
`build/` or egg-info behind in the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from offline_gpu.gpu_carry import repository_files

ROOT = Path(__file__).resolve().parents[2]
TOOLING_MODULES = (
    "gpu_bundle",
    "gpu_carry",
    "sgl_kernel_ops",
    "sgl_kernel_finder",
    "torchvision_cpu",
    "plans",
    "results",
    "write_meta",
)
"""Module names of the offline-GPU tooling and the CPU environment glue (none may be in the wheel)."""


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The file names inside the freshly built wheel."""
    source = tmp_path_factory.mktemp("source")
    for name in repository_files(ROOT):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*command, "-q", "-w", str(out), str(source)], check=True, timeout=600)
    (wheel,) = out.glob("bastion_sglang-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_holds_the_package(wheel_names: list[str]) -> None:
    """The check below could not pass vacuously: the package itself is there."""
    assert "bastion_sglang/worker.py" in wheel_names
    assert "bastion_sglang/controller/tree.py" in wheel_names


def test_wheel_has_no_tooling(wheel_names: list[str]) -> None:
    tooling = [
        name
        for name in wheel_names
        if name.startswith(("tools/", "offline_gpu/", "scripts/")) or Path(name).stem in TOOLING_MODULES
    ]
    assert not tooling, tooling
