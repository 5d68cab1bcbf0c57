"""GPU tests: every test in this folder is skipped when CUDA is not available."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda")
