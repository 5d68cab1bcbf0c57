"""The synthetic acceptance profile file (`synthetic_acceptance`): per draft position and candidate rank, the
probability that the target's token is that candidate given the path so far.

Written by tools/offline_gpu/profiles/fit_acceptance.py from published acceptance lengths; read by the worker
under `BastionConfig.synthetic_acceptance` and checked by `bastion bench --synthetic-acceptance`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class SyntheticAcceptanceProfile(BaseModel):
    """A synthetic acceptance profile file: q[d][k], the probability that the target's token at draft position
    d + 1 is the drafter's rank-k candidate, given that it took the drafter's path up to d."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        description="what the profile reproduces, e.g. 'z-lab Qwen3-8B-DFlash-b16 on GSM8K, T=0'"
    )
    source: str = Field(description="where the published figures come from")
    published_chain_tau: float = Field(gt=1, description="mean accepted length of the chain, bonus included")
    published_tree_tau: float | None = Field(
        default=None, gt=1, description="mean accepted length of the published tree at tree_budget"
    )
    tree_budget: int | None = Field(default=None, gt=0, description="draft nodes of the published tree")
    rank_probs: tuple[tuple[float, ...], ...] = Field(
        min_length=1, description="[D][K_p] q per draft position and candidate rank, each row summing to <= 1"
    )

    @field_validator("rank_probs")
    @classmethod
    def _rows_are_distributions(cls, rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        width = len(rows[0])
        for d, row in enumerate(rows):
            if len(row) != width or width == 0:
                raise ValueError(f"row {d} has {len(row)} ranks; every row needs the same K_p >= 1 ({width})")
            if any(not math.isfinite(q) or q < 0 for q in row):
                raise ValueError(f"row {d} {list(row)}: probabilities must be finite and >= 0")
            if sum(row) > 1 + 1e-9:
                raise ValueError(f"row {d} sums to {sum(row):.6f} > 1")
        return rows

    def chain_tau(self, depth: int) -> float:
        """The chain's mean accepted length (bonus included) over `depth` draft positions."""
        tau, run = 1.0, 1.0
        for d in range(depth):
            run *= self.row(d)[0]
            tau += run
        return tau

    def row(self, d: int) -> tuple[float, ...]:
        """q of draft position d + 1 (0-based d); positions past the profile take its last row."""
        return self.rank_probs[min(d, len(self.rank_probs) - 1)]

    def probs(self, depth: int) -> torch.Tensor:
        """[depth, K_p] float64 q of draft positions 1..depth."""
        return torch.tensor([self.row(d) for d in range(depth)], dtype=torch.float64)


def load_synthetic_profile(path: Path) -> SyntheticAcceptanceProfile:
    """The profile in `path`; ValueError naming the file and the field when it is missing or malformed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"synthetic acceptance profile {path}: {error.strerror or error}") from None
    try:
        return SyntheticAcceptanceProfile.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(file)"
        raise ValueError(f"synthetic acceptance profile {path}: {where}: {first['msg']}") from None
