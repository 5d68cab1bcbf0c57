"""DeferredDraftContext: which rows are held, when they fall due, and what `take` returns."""

from __future__ import annotations

import pytest
import torch

from bastion_sglang.step.draft_context import ContextRows, DeferredDraftContext

HIDDEN = 6


class Req:
    """A request: told apart by identity, as the scheduler's `Req` objects are."""


def step_rows(step: int, batch: int) -> ContextRows:
    """One skipped step's rows for `batch` requests: values that name the step and the row."""
    hidden = torch.arange(batch * HIDDEN, dtype=torch.float32).view(batch, HIDDEN) + 1000 * step
    slots = torch.arange(batch, dtype=torch.int64) + 100 * step
    positions = torch.full((batch,), 10 + step, dtype=torch.int64)
    return ContextRows(hidden, slots, positions)


def test_take_returns_every_held_row_oldest_step_first_then_nothing() -> None:
    reqs = [Req(), Req(), Req()]
    held = DeferredDraftContext()
    steps = [step_rows(step, len(reqs)) for step in range(4)]
    for rows in steps:
        assert not held.due(reqs)
        held.defer(reqs, rows)
    assert len(held) == 4
    rows = held.take()
    assert rows is not None
    assert torch.equal(rows.hidden, torch.cat([s.hidden for s in steps]))
    assert torch.equal(rows.slots, torch.cat([s.slots for s in steps]))
    assert torch.equal(rows.positions, torch.cat([s.positions for s in steps]))
    assert held.take() is None
    assert len(held) == 0


def test_a_single_held_step_comes_back_as_it_was() -> None:
    reqs = [Req(), Req()]
    held = DeferredDraftContext()
    rows = step_rows(0, 2)
    held.defer(reqs, rows)
    assert held.take() is rows


def test_nothing_held_is_never_due() -> None:
    assert not DeferredDraftContext().due([Req()])
    assert DeferredDraftContext().take() is None


@pytest.mark.parametrize("change", ["leave", "join", "reorder"])
def test_a_changed_batch_makes_the_held_rows_due(change: str) -> None:
    a, b, c = Req(), Req(), Req()
    held = DeferredDraftContext()
    held.defer([a, b], step_rows(0, 2))
    assert not held.due([a, b])
    changed = {"leave": [a], "join": [a, b, c], "reorder": [b, a]}[change]
    assert held.due(changed)
    with pytest.raises(ValueError, match="one batch"):
        held.defer(changed, step_rows(1, len(changed)))
    held.take()
    held.defer(changed, step_rows(1, len(changed)))  # after a write, any batch may start holding
    assert len(held) == 1


def test_the_step_bound_makes_the_held_rows_due() -> None:
    reqs = [Req()]
    held = DeferredDraftContext(max_steps=3)
    for step in range(3):
        assert not held.due(reqs)
        held.defer(reqs, step_rows(step, 1))
    assert held.due(reqs)


def test_bad_rows_and_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        DeferredDraftContext(max_steps=0)
    with pytest.raises(ValueError, match=r"hidden \[M, H\]"):
        ContextRows(
            torch.zeros(3, HIDDEN), torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="one row per request: 2 rows for 3 requests"):
        DeferredDraftContext().defer([Req(), Req(), Req()], step_rows(0, 2))
