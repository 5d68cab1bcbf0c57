"""Per-step statistics of the reference engine.

Its stages are timed by `timing.StageTimer`: draft (drafter pass and top-k), plan (tree build and budget
choice), verify (the target's tree forward), accept (accept walk, KV compaction, commit; the commit stage
reads 0). A plain decoding step has the verify and accept stages only. All durations are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.step.timing import StageTimes


@dataclass(frozen=True)
class StepStats:
    """One decoding step of one request."""

    ctx_len: int  # tokens in the target's KV cache before the step (the bonus token's position)
    nodes: int  # n: draft nodes verified (0 for a plain decoding step)
    width: int  # W = n + 1: tokens in the verify pass
    expected_accept: float  # Â(n) = 1 + Σ ρ of the verified nodes (1 for a plain step)
    accepted: int  # draft nodes accepted, 0..n
    emitted: int  # tokens this step added to the output (accepted + 1, fewer when a stop cut it)
    predicted_verify_seconds: float  # the latency model's prediction for (W, ctx_len) before observing
    seconds: StageTimes
    draft: DraftTopK | None = None  # the drafter's top-K of the step, [1, D, K] (None for a plain step)
    lattice: DraftLattice | None = None  # a DFlash2 drafter's lattice, [1, D, K, K] (its draft is None)


@dataclass(frozen=True)
class GenerationResult:
    """Output tokens (prompt excluded; EOS kept when it ended the output) and the per-step statistics."""

    tokens: list[int]
    steps: list[StepStats]
    prefill_seconds: float

    @property
    def mean_accept_length(self) -> float:
        """τ: mean tokens committed per verify pass, bonus included (accepted + 1); 0 with no step."""
        if not self.steps:
            return 0.0
        return sum(step.accepted + 1 for step in self.steps) / len(self.steps)

    @property
    def decode_seconds(self) -> float:
        """Total seconds of the decoding steps (prefill excluded)."""
        return sum(step.seconds.total for step in self.steps)
