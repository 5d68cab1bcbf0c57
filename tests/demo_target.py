"""pytest plugin: the SmolLM2-135M-Instruct demo target, converted once per test session.

Test modules that need the converted target (`bastion demo setup`, ~538 MB written, tens of seconds on two
cores) load this plugin with `pytest_plugins = ["demo_target"]` and take the session-scoped `demo_target`
fixture, so a session converts it once whatever the modules. The fixture also keeps what that first call
returned, for the tests of `setup_demo_target` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from bastion_sglang.demo import SetupResult, setup_demo_target


@dataclass(frozen=True)
class DemoTarget:
    """The session's converted target: its cache directory and the first `setup_demo_target` result."""

    cache_dir: Path
    first: SetupResult

    @property
    def path(self) -> Path:
        """The converted target's folder."""
        return self.first.path


@pytest.fixture(scope="session")
def demo_target(tmp_path_factory: pytest.TempPathFactory) -> DemoTarget:
    """Convert the demo target into a fresh cache directory (the session's first and only conversion)."""
    cache = tmp_path_factory.mktemp("demo-cache")
    return DemoTarget(cache_dir=cache, first=setup_demo_target(cache))
