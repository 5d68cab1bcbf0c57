"""DraftHorizon: the LM head scores as many drafted positions as recent trees used, doubling when bound."""

from __future__ import annotations

import pytest

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
