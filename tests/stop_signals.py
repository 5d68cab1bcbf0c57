"""Helpers for the tests of training runs stopped by a signal (`bastion_sglang.training.interrupt`)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


@contextmanager
def sigterm_recorded() -> Iterator[list[int]]:
    """SIGTERM handled by appending it to the yielded list, so that a run that does not take the signal over
    fails its test instead of ending the test process; asserts on exit that the run restored this handler."""
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, record)
    try:
        yield received
        assert signal.getsignal(signal.SIGTERM) is record
    finally:
        signal.signal(signal.SIGTERM, previous)


def sigterm_after_step(run: Any, step: int) -> None:
    """Make `run.train_step(step)` send this process SIGTERM once the step is done."""
    original = run.train_step

    def train_step(current: int) -> Any:
        result = original(current)
        if current == step:
            signal.raise_signal(signal.SIGTERM)
        return result

    run.train_step = train_step
