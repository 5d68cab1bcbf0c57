"""Seeded random inputs of the measurement engines (`engines`, `sglang_runner`).

A forward's cost does not depend on the token or feature values, so the engines measure on random ones,
drawn from one fixed seed so that every run feeds the same inputs.
"""

from __future__ import annotations

import torch

CONTEXT_SEED = 0
"""Seed of the random context tokens and features (their values do not change the cost)."""


def random_context(length: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[length + 1] int64 committed tokens (context, then the bonus token), seeded."""
    generator = torch.Generator().manual_seed(CONTEXT_SEED)
    return torch.randint(0, vocab_size, (length + 1,), generator=generator).to(device)
