"""Per-step statistics of the reference engine and the timer that measures its stages.

Stages of one speculative step, in order (`STAGES`): draft (drafter pass and top-k), plan (tree build and
budget choice), verify (the target's tree forward), accept (accept walk, KV compaction, commit). A plain
decoding step has the verify stage only. All durations are seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from bastion_sglang.kernels.types import DraftTopK

STAGES = ("draft", "plan", "verify", "accept")

Mark = float | torch.cuda.Event
"""A point in time: a host clock reading (seconds) or a recorded CUDA event."""


@dataclass(frozen=True)
class StageSeconds:
    """Wall time of each stage of one step, and of the whole step (gaps between stages included)."""

    draft: float
    plan: float
    verify: float
    accept: float
    total: float


class StageTimer:
    """Times the named stages of one step.

    On CUDA each stage is bracketed by CUDA events on the current stream (no sync while timing); `finish`
    waits for the last event once. On CPU, `time.perf_counter` around each stage.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: dict[str, tuple[Mark, Mark]] = {}
        self._start = self._now()

    def _now(self) -> Mark:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def _seconds(start: Mark, end: Mark) -> float:
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return start.elapsed_time(end) / 1000.0  # milliseconds -> seconds
        if isinstance(start, float) and isinstance(end, float):
            return end - start
        raise ValueError("a stage mixes CUDA events and host clock readings")

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block as stage `name` (one of STAGES, each at most once per step)."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {STAGES}")
        if name in self._marks:
            raise ValueError(f"stage {name!r} timed twice in one step")
        start = self._now()
        yield
        self._marks[name] = (start, self._now())

    def finish(self) -> StageSeconds:
        """Seconds per stage (0 for a stage not run) and in total since the timer was created."""
        end = self._now()
        if isinstance(end, torch.cuda.Event):
            end.synchronize()  # host sync: read the step's event times once
        per_stage = {
            name: self._seconds(*self._marks[name]) if name in self._marks else 0.0 for name in STAGES
        }
        return StageSeconds(**per_stage, total=self._seconds(self._start, end))


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
    seconds: StageSeconds
    draft: DraftTopK | None = None  # the drafter's top-K of the step, [1, D, K] (None for a plain step)


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
