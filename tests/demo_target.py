"""pytest plugin: the SmolLM2-135M-Instruct demo target, converted at most once per machine and cache.

Test modules that need the converted target (`bastion demo setup`: ~538 MB written, ~30 s on two cores)
load this plugin with `pytest_plugins = ["demo_target"]` and take the session-scoped `demo_target`
fixture. It sets the target up in the user cache (`$XDG_CACHE_HOME` or `~/.cache`, then
`bastion-sglang/smollm2-135m-instruct`, the folder `bastion demo setup` makes), where the manifest keys
the conversion by the GGUF's SHA-256: a session converts only when no complete folder from that GGUF is
there, and otherwise checks every file's SHA-256 against the manifest (~0.3 s) and reuses it. Deleting
the folder forces the next session to convert again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from bastion_sglang.assets import default_cache_dir
from bastion_sglang.demo.target import setup_demo_target


@dataclass(frozen=True)
class DemoTarget:
    """The session's demo target: the cache directory it lies under, and its folder."""

    cache_dir: Path
    path: Path


@pytest.fixture(scope="session")
def demo_target() -> DemoTarget:
    """The demo target under the user cache, converted there first when no verified conversion exists."""
    cache = default_cache_dir()
    return DemoTarget(cache_dir=cache, path=setup_demo_target(cache, verify_hashes=True).path)
