"""The step loop both trainers run: learning-rate schedule, progress log, timed checkpoints, stop on a signal.

`Trainer` (the DFlash drafter, `train.py`) and `SelectorTrainer` (the DFlash2 selector, `selector.py`) differ
in what one optimiser step does; `run_steps` is the rest of a run for both: it calls `train_step` from the
saved step to `config.steps`, averages the loss and the first-position accuracy over `log_every` steps into
a `LogPoint`, and checkpoints (`on_checkpoint`, then `save`) every `checkpoint_seconds`, at the last step,
and when SIGTERM or SIGINT asks the run to stop (`StopOnSignal`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from bastion_sglang.training.interrupt import StopOnSignal

logger = logging.getLogger(__name__)


class LogPoint(BaseModel):
    """Training progress at one step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    loss: float = Field(description="weighted cross-entropy, nats, mean over the steps since the last point")
    first_position_accuracy: float = Field(description="argmax == target at block position 1, same window")
    lr: float
    seconds: float = Field(description="training wall time so far")


class Schedule(Protocol):
    """What `learning_rate` reads of a run's config (`train.TrainConfig`, `selector.SelectorTrainConfig`)."""

    @property
    def lr(self) -> float: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def steps(self) -> int: ...


def learning_rate(config: Schedule, step: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to 0 at `steps` (step counts from 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class StepResult(Protocol):
    """What the loop reads of one optimiser step: the loss (scalar tensor) and the first-position counts."""

    @property
    def loss(self) -> torch.Tensor: ...

    @property
    def first_correct(self) -> int: ...

    @property
    def first_total(self) -> int: ...


class RunState(Protocol):
    """The part of a run's saved state the loop advances."""

    step: int
    seconds: float
    history: list[LogPoint]


class StepTrainer(Protocol):
    """A trainer `run_steps` can drive: its schedule, its state, one optimiser step, a checkpoint."""

    @property
    def config(self) -> Schedule: ...

    @property
    def state(self) -> RunState: ...

    def train_step(self, step: int) -> StepResult: ...

    def save(self) -> None: ...


TrainerT = TypeVar("TrainerT", bound=StepTrainer)


class _LogWindow:
    """Sums over the steps since the last `LogPoint`."""

    def __init__(self) -> None:
        self.loss, self.correct, self.total, self.steps = 0.0, 0, 0, 0

    def add(self, loss: float, result: StepResult) -> None:
        self.loss += loss
        self.correct += result.first_correct
        self.total += result.first_total
        self.steps += 1

    def point(self, config: Schedule, state: RunState) -> LogPoint:
        return LogPoint(
            step=state.step,
            loss=self.loss / self.steps,
            first_position_accuracy=self.correct / max(1, self.total),
            lr=learning_rate(config, state.step - 1),
            seconds=state.seconds,
        )


def run_steps(
    trainer: TrainerT,
    *,
    activity: str,
    checkpoint_seconds: float,
    log_every: int,
    on_checkpoint: Callable[[TrainerT], None] | None = None,
) -> None:
    """Train from `trainer.state.step` to `trainer.config.steps` (module docstring).

    activity: the run's name in the progress bar and the logs ("train-drafter").
    checkpoint_seconds: wall time between checkpoints; one is also written at the last step and on a stop.
    on_checkpoint: called with the trainer just before each checkpoint is written (to export it, measure
    acceptance and record that in its state, which the checkpoint then stores).
    """
    config, state = trainer.config, trainer.state
    last_save = time.perf_counter()
    window = _LogWindow()
    with (
        StopOnSignal(activity) as stop,
        tqdm(total=config.steps, initial=state.step, desc=activity, unit="step") as bar,
    ):
        while state.step < config.steps and not stop.requested:
            began = time.perf_counter()
            result = trainer.train_step(state.step)
            loss = float(result.loss.detach())  # host sync once per step, for the log
            state.step += 1
            state.seconds += time.perf_counter() - began
            window.add(loss, result)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            done = state.step == config.steps
            if state.step % log_every == 0 or done:
                point = window.point(config, state)
                state.history.append(point)
                logger.info(
                    "%s step %d/%d loss %.4f acc@1 %.3f lr %.2e (%.0f s)",
                    activity,
                    point.step,
                    config.steps,
                    point.loss,
                    point.first_position_accuracy,
                    point.lr,
                    point.seconds,
                )
                window = _LogWindow()
            if done or stop.requested or time.perf_counter() - last_save >= checkpoint_seconds:
                if on_checkpoint is not None:
                    on_checkpoint(trainer)
                trainer.save()
                last_save = time.perf_counter()
