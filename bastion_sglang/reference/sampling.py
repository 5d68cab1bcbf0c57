"""The target's processed next-token distribution: temperature, then top-k / top-p / min-p filters.

Filters follow SGLang's sampler on its pytorch backend (`kernels.processed_probs`, `FilterRule.JOINT`): with
p the softmax of logits / temperature sorted descending, a token is dropped if its rank is >= top_k, if the
mass strictly before it exceeds top_p, or if p < min_p · p_max; the survivors are renormalised.
temperature = 0 means greedy (argmax) decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bastion_sglang.kernels.sampling import FilterRule, processed_probs


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request."""

    temperature: float = 0.0  # 0: greedy; > 0: divide logits by it
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1: no limit, else >= 1
    min_p: float = 0.0  # in [0, 1)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or (self.top_k < 1 and self.top_k != -1)
        ):
            raise ValueError(f"top_k must be -1 (no limit) or an int >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [M, V] -> processed probabilities [M, V] float32, each row summing to 1 (sampling only).

        `kernels.processed_probs` with SGLang's pytorch-backend rule (the filters joint on the softmax).
        """
        if self.greedy:
            raise ValueError("greedy decoding has no sampling distribution; use the argmax")
        rows = logits.shape[0]

        def column(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((rows,), value, dtype=dtype, device=logits.device)

        filtered = self.top_k != -1 or self.top_p != 1 or self.min_p != 0
        kept = processed_probs(
            logits,
            column(self.temperature, torch.float32),
            column(self.top_k if self.top_k != -1 else logits.shape[-1], torch.int64),
            column(self.top_p, torch.float32),
            column(self.min_p, torch.float32),
            FilterRule.JOINT if filtered else FilterRule.NONE,
        )
        return kept / kept.sum(dim=-1, keepdim=True)
