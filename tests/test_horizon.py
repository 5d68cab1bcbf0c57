"""DraftHorizon: the LM head scores as many drafted positions as recent trees used, doubling when bound; a
probe of the speculation gate scores every position."""

from __future__ import annotations

import pytest
from test_accept_bound import controller as step_controller

from bastion_sglang.controller.horizon import DraftHorizon


def horizons(rule: DraftHorizon, deepest: list[int]) -> list[int]:
    """The horizon before each step and after the last one, the steps' deepest nodes observed in turn."""
    seen = [rule.horizon]
    for depth in deepest:
        rule.observe(depth)
        seen.append(rule.horizon)
    return seen


def test_binding_trees_double_the_horizon_up_to_the_drafted_depth() -> None:
    assert horizons(DraftHorizon(15), [4, 8, 15, 15]) == [4, 8, 15, 15, 15]


def test_shallow_trees_shrink_it_to_twice_their_depth_and_plain_plans_to_the_floor() -> None:
    assert horizons(DraftHorizon(15), [4, 8, 3, 1, 0, 2]) == [4, 8, 15, 6, 2, 2, 4]


def test_a_short_drafter_caps_every_horizon() -> None:
    assert horizons(DraftHorizon(3), [3, 0, 1]) == [3, 3, 2, 2]
    assert horizons(DraftHorizon(1), [1, 0]) == [1, 1, 1]


def test_the_full_horizon_never_moves() -> None:
    assert horizons(DraftHorizon.full(15), [15, 0, 3, 15]) == [15] * 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(depth=0), "at least one position"),
        (dict(depth=15, start=2, min_horizon=3), "min_horizon <= start"),
        (dict(depth=15, min_horizon=0), "min_horizon <= start"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DraftHorizon(**kwargs)


def test_a_plan_deeper_than_the_horizon_is_refused() -> None:
    rule = DraftHorizon(15)
    with pytest.raises(ValueError, match="within horizon 4 cannot reach depth 5"):
        rule.observe(5)


def test_a_probe_opens_the_horizon_to_every_position() -> None:
    rule = DraftHorizon(15)
    rule.observe(0)
    assert rule.horizon == 2
    rule.open()
    assert horizons(rule, [12, 0, 1]) == [15, 15, 2, 2]
    rule.open()
    assert horizons(rule, [15]) == [15, 15]


def test_the_gates_probes_draft_every_position_and_steady_speculation_its_horizon() -> None:
    """After a declined plan the horizon falls to two positions; the backoff's probe still drafts all 15, and
    once a plan pays the steps draft at the horizon the plans leave."""
    controller = step_controller(None, t_draft=1e-3)  # no calibration: no bound, the backoff decides

    def next_drafted_horizon() -> int:
        while True:
            step = controller.begin([512], [True], ["r"])
            horizon = controller.draft_horizon(step, decides=True)
            if horizon:
                return horizon

    assert next_drafted_horizon() == 4  # the first step: the starting horizon
    controller.gate.record(0.5)
    controller.horizon.observe(0)
    assert controller.horizon.horizon == 2
    assert next_drafted_horizon() == 15  # the backoff's probe
    controller.gate.record(1.2)  # it paid, with a tree three deep
    controller.horizon.observe(3)
    assert next_drafted_horizon() == 6
