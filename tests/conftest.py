"""Puts tests/ on sys.path so test modules can import the shared helpers (`from tiny_models import ...`),
holds the fixtures several modules share, and turns servers' start-up calibration off unless a test asks for
it (every server a test starts would otherwise measure itself first; `$BASTION_STARTUP_CALIBRATION` reaches
the servers' processes too)."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("BASTION_STARTUP_CALIBRATION", "off")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine they thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
