"""`bastion_sglang.step.timing`: the stage timer of the worker and the reference engine, and calibration's op
timer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bastion_sglang.step.timing import STAGES, StageTimer, TimedStep, time_op

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Record:
    index: int


def test_finish_gives_each_stage_and_the_total() -> None:
    timer: StageTimer[Record] = StageTimer(CPU)
    with timer.stage("draft"):
        torch.ones(256, 256) @ torch.ones(256, 256)
    with timer.stage("verify"):
        pass
    times = timer.finish()
    assert times.draft > 0 and times.plan == 0 and times.commit == 0
    assert times.total >= times.draft + times.verify
    assert times.aux == times.plan + times.accept + times.commit
    with pytest.raises(ValueError, match="unknown stage"), timer.stage("sample"):
        pass


def test_a_stage_is_timed_once_per_step() -> None:
    timer: StageTimer[Record] = StageTimer(CPU)
    with timer.stage("plan"):
        pass
    with pytest.raises(ValueError, match="timed twice"), timer.stage("plan"):
        pass
    timer.finish()
    with timer.stage("plan"):  # a new step
        pass


def test_finish_step_returns_this_step_with_its_record_on_the_cpu() -> None:
    timer: StageTimer[Record] = StageTimer(CPU)
    for index in range(3):
        with timer.stage("accept"):
            torch.ones(128, 128) @ torch.ones(128, 128)
        done = timer.finish_step(Record(index))
        assert isinstance(done, TimedStep) and done.record == Record(index)
        assert done.times.accept > 0 and done.times.draft == 0
        assert set(STAGES) <= set(vars(done.times))


def test_time_op_resets_before_every_call_and_checks_counts() -> None:
    log: list[str] = []
    seconds = time_op(lambda: log.append("op"), CPU, warmup=2, repeats=3, reset=lambda: log.append("reset"))
    assert log == ["reset", "op"] * 5 and len(seconds) == 3 and all(s >= 0 for s in seconds)
    with pytest.raises(ValueError, match="repeats"):
        time_op(lambda: None, CPU, warmup=0, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        time_op(lambda: None, CPU, warmup=True, repeats=1)
