"""The synthetic acceptance profile file (`synthetic_acceptance`): per draft position and candidate rank, the
probability that the target's token is that candidate given the path so far.

Written by tools/offline_gpu/profiles/fit_acceptance.py, scaled to published acceptance lengths: flat rows of
an assumed geometric form, or rows shaped by a real drafter's rank histogram per position (`-shaped` files,
`calibration.rank_histogram`); read by the worker under `BastionConfig.synthetic_acceptance` and checked by
`bastion bench --synthetic-acceptance`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_DRAFTER_TEMPERATURE = 0.8
"""The stated probabilities' temperature when a profile names none: over-confident, so the start-up and online
acceptance calibrations have a difference to find (at 0.8 the GSM8K profile's stated chain Â over 15 positions
is about 1.4x its true τ; the demo drafter over-predicts by about a third)."""


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
    drafter_temperature: float = Field(
        default=DEFAULT_DRAFTER_TEMPERATURE,
        gt=0,
        le=4,
        description="the drafter's stated probabilities are q sharpened by this temperature, p ∝ q^(1/T) "
        "over the K_p candidates and the rest of the row (`stated_probs`): below 1 the drafter is "
        "over-confident, as block-diffusion drafters are; 1 is an oracle that states the truth",
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
        """[depth, K_p] float64 q of draft positions 1..depth: the truth the target's tokens come from."""
        return torch.tensor([self.row(d) for d in range(depth)], dtype=torch.float64)

    def stated_probs(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the drafter states at draft positions 1..depth: ([depth, K_p] candidate probabilities,
        [depth, 1] the rest of the row's mass), float64, each row summing to 1: the truth's candidates and
        rest (1 - Σ q) raised to 1 / drafter_temperature and renormalised. An oracle (temperature 1)
        states q."""
        q = self.probs(depth)
        rest = (1.0 - q.sum(-1, keepdim=True)).clamp_min(0.0)
        power = 1.0 / self.drafter_temperature
        sharpened, sharpened_rest = q.pow(power), rest.pow(power)
        total = sharpened.sum(-1, keepdim=True) + sharpened_rest
        return sharpened / total, sharpened_rest / total

    def stated_chain_accept(self, depth: int) -> float:
        """The chain's expected accepted length (bonus included) over `depth` positions as the drafter states
        it: 1 + Σ_d Π_{j<=d} p_j(rank 0), the raw Â a planner reads off the stated probabilities."""
        stated, _ = self.stated_probs(depth)
        return 1.0 + float(stated[:, 0].cumprod(0).sum())


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
