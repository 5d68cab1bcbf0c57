"""Puts tests/ on sys.path so test modules can import the shared helpers (`from tiny_models import ...`),
holds the fixtures several modules share (the tiny model pair, the run's pool of live Engines in
`engine_pool`), and turns servers' start-up calibration off unless a test asks for it (every server a test
starts would otherwise measure itself first; `$BASTION_STARTUP_CALIBRATION` reaches the servers' processes
too)."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("BASTION_STARTUP_CALIBRATION", "off")

pytest_plugins = ["engine_pool"]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, drafter) of `engine_support.make_model_pair`, written once for the run: the weights are a
    function of the seed, so modules that share it can share Engines too (`engine_pool`)."""
    from engine_support import make_model_pair

    return make_model_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine they thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
