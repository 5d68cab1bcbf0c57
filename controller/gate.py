"""Whether a decode step drafts: skip the drafter while speculation does not pay, re-probe with backoff.

A drafted step's plan reports `BatchPlan.speculative_speedup`, the estimated speedup over plain decoding of
the best speculative plan for that batch (drafter pass included, calibrated Â and latency). When it is at
most 1, plain decoding is at least as fast for such batches, so the next steps skip the drafter and decode
plainly (speedup exactly 1 by definition). After `backoff` skipped steps one step drafts again (a probe); if
speculation still does not pay, the backoff doubles, up to `max_backoff`; as soon as a probe's best plan
beats plain decoding, every step drafts again and the backoff returns to `min_backoff`. A batch that
shrinks, or text the drafter predicts well, is therefore picked up within `max_backoff` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationGate:
    """The module docstring's state machine. min_backoff / max_backoff: steps skipped after a failed probe."""

    min_backoff: int = 1
    max_backoff: int = 64
    _backoff: int = field(default=0, init=False)
    _skip_remaining: int = field(default=0, init=False)
    _skipped: int = field(default=0, init=False)
    _steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_backoff <= self.max_backoff:
            raise ValueError(
                f"need 1 <= min_backoff <= max_backoff, got {self.min_backoff} and {self.max_backoff}"
            )

    def should_draft(self) -> bool:
        """Called once at the start of every decode step: True to draft (speculate or probe), else skip."""
        self._steps += 1
        if self._skip_remaining > 0:
            self._skip_remaining -= 1
            self._skipped += 1
            return False
        return True

    def record(self, speculative_speedup: float) -> None:
        """After a drafted step's plan: the estimated speedup of its best speculative plan."""
        if speculative_speedup > 1.0:
            self._backoff = 0
            return
        self._backoff = self.min_backoff if self._backoff == 0 else min(2 * self._backoff, self.max_backoff)
        self._skip_remaining = self._backoff

    @property
    def skipping(self) -> bool:
        """Whether the last probe found speculation unprofitable (the gate is backing off)."""
        return self._backoff > 0

    @property
    def skipped_share(self) -> float:
        """Share of decode steps so far that skipped the drafter."""
        return self._skipped / self._steps if self._steps else 0.0
