"""SpeculationGate: skip the drafter while speculation does not pay, re-probe with exponential backoff."""

from __future__ import annotations

import pytest

from bastion_sglang.controller.gate import SpeculationGate


def drafted_steps(gate: SpeculationGate, speedup: float, steps: int) -> list[bool]:
    """Run `steps` decode steps whose drafted plans all estimate `speedup`; which steps drafted."""
    drafted = []
    for _ in range(steps):
        draft = gate.should_draft()
        drafted.append(draft)
        if draft:
            gate.record(speedup)
    return drafted


def test_speculating_gate_drafts_every_step() -> None:
    gate = SpeculationGate()
    assert all(drafted_steps(gate, 1.5, 20)) and not gate.skipping and gate.skipped_share == 0.0


def test_backoff_doubles_up_to_the_cap() -> None:
    gate = SpeculationGate(min_backoff=1, max_backoff=4)
    drafted = drafted_steps(gate, 0.8, 20)
    # probe, skip 1, probe, skip 2, probe, skip 4, probe, skip 4, ...
    assert drafted[:13] == [
        True,
        False,
        True,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert gate.skipping
    assert gate.skipped_share == pytest.approx(drafted.count(False) / 20)


def test_a_paying_probe_resumes_speculation() -> None:
    gate = SpeculationGate(min_backoff=2, max_backoff=8)
    drafted_steps(gate, 0.5, 30)
    assert gate.skipping
    while not gate.should_draft():
        pass
    gate.record(1.2)
    assert not gate.skipping
    assert all(drafted_steps(gate, 1.2, 10))


def test_bad_backoff_is_refused() -> None:
    with pytest.raises(ValueError, match="min_backoff <= max_backoff"):
        SpeculationGate(min_backoff=4, max_backoff=2)
