"""Timing on a device, for the worker, the reference engine and calibration: CUDA events on a GPU,
`time.perf_counter` on the CPU. All durations are seconds.

- `StageTimer` times the named stages of a decode step (`STAGES`): `with timer.stage("verify"): ...`. A step
  ends in one of two ways. `finish()` returns this step's `StageTimes` at once (on CUDA it waits for the
  step's last event: one host sync per step). `finish_step(record)` never waits: on the CPU it returns this
  step's times with `record`, on CUDA the previous step's (None after the first), whose end events
  completed a step ago; `record` is the caller's typed description of the step (`TimedStep[R]`), so the
  late times arrive with the step they belong to.
- `time_op` times repeated calls of one operation (calibration): each timed call is
  bracketed by two marks and the host waits once, after the last call.

Nothing here imports SGLang: the controller's step-cost tracker, calibration and the reference engine use it
without a server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

STAGES = ("draft", "plan", "verify", "accept", "commit")
"""Stages of a decode step, in order: draft (drafter forward + top-k), plan (tree search + budget), verify
(the target's tree forward), accept (logits processing + accept walk), commit (KV compaction + drafter KV).
The reference engine times its commit inside accept, so its commit stage reads 0."""

Mark = float | torch.cuda.Event
"""A point in time: a host clock reading (seconds) or a recorded CUDA event."""

R = TypeVar("R")


def _mark(cuda: bool) -> Mark:
    """Now: a CUDA event recorded on the current stream, or the host clock."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(start: Mark, end: Mark) -> float:
    """Seconds from `start` to `end` (CUDA events: `end` must have completed)."""
    if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
        return start.elapsed_time(end) / 1000.0  # milliseconds -> seconds
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    raise ValueError("a span mixes CUDA events and host clock readings")


def synchronize(device: torch.device) -> None:
    """Block the host until `device` has finished its queued work (a no-op off CUDA): a timing boundary."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(mark: Mark) -> None:
    """Block the host until `mark` has completed (a no-op for a host clock reading)."""
    if isinstance(mark, torch.cuda.Event):
        mark.synchronize()


@dataclass(frozen=True)
class StageTimes:
    """Seconds of each stage of one step (0 for a stage not run) and of the whole step: from the step's start
    (the timer's creation or the previous finish) to its finish, gaps between stages included."""

    draft: float
    plan: float
    verify: float
    accept: float
    commit: float
    total: float

    @property
    def aux(self) -> float:
        """Work outside the two forwards (BASTION's T_aux): plan + accept + commit, seconds."""
        return self.plan + self.accept + self.commit


@dataclass(frozen=True)
class TimedStep(Generic[R]):
    """A finished step's record (what the caller said about it) and its measured times."""

    record: R
    times: StageTimes


@dataclass(frozen=True)
class _OpenStep:
    """A step whose marks are recorded but not read yet."""

    start: Mark
    stages: dict[str, tuple[Mark, Mark]]
    end: Mark


class StageTimer(Generic[R]):
    """Times the STAGES of each step on `device` (module docstring). R: the type of the steps' records."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._stages: dict[str, tuple[Mark, Mark]] = {}
        self._start = _mark(self._cuda)
        self._pending: tuple[R, _OpenStep] | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block as stage `name` (one of STAGES, at most once per step)."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages: {STAGES}")
        if name in self._stages:
            raise ValueError(f"stage {name!r} timed twice in one step")
        start = _mark(self._cuda)
        yield
        self._stages[name] = (start, _mark(self._cuda))

    def _close(self) -> _OpenStep:
        """End the current step: its marks, and a fresh start for the next one."""
        end = _mark(self._cuda)
        step = _OpenStep(self._start, self._stages, end)
        self._start, self._stages = end, {}
        return step

    @staticmethod
    def _read(step: _OpenStep) -> StageTimes:
        _wait(step.end)
        seconds = {name: _elapsed(*step.stages[name]) if name in step.stages else 0.0 for name in STAGES}
        return StageTimes(**seconds, total=_elapsed(step.start, step.end))

    def finish(self) -> StageTimes:
        """This step's times; on CUDA the host waits for the step's end once."""
        return self._read(self._close())

    def finish_step(self, record: R) -> TimedStep[R] | None:
        """Close the step described by `record`; return the last step whose times are known without waiting:
        this one on the CPU, the previous one on CUDA (None after the first)."""
        step = self._close()
        if not self._cuda:
            return TimedStep(record, self._read(step))
        previous, self._pending = self._pending, (record, step)
        if previous is None:
            return None
        done_record, done = previous
        return TimedStep(done_record, self._read(done))  # its end event completed a step ago: no stall


def _check_counts(warmup: int, repeats: int) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")


def time_op(
    op: Callable[[], object],
    device: torch.device,
    warmup: int,
    repeats: int,
    reset: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of `repeats` timed calls of `op` on `device`, after `warmup` untimed calls; `reset`
    (if given) runs untimed before every call, e.g. to drop the KV a verify pass appended."""
    _check_counts(warmup, repeats)
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        if reset is not None:
            reset()
        op()
    spans = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        start = _mark(cuda)
        op()
        spans.append((start, _mark(cuda)))
    _wait(spans[-1][1])  # host sync: read every mark once, after the last call
    return [_elapsed(start, end) for start, end in spans]
