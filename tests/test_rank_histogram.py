"""Rank histograms of a drafter: the counts by position and rank among passes whose target path stayed inside
the candidates, the monotone rows, the shrinkage of sparse positions, and the file's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bastion_sglang.calibration.rank_histogram import (
    PRIOR_PASSES,
    RankHistogram,
    count_ranks,
    load_rank_histogram,
    non_increasing,
)
from bastion_sglang.controller.acceptance import AcceptanceRecord


def _record(candidates: list[list[int]], continuation: tuple[int, ...]) -> AcceptanceRecord:
    """A pass with these candidate ids per position (best first) and the target's tokens after its root."""
    ids = torch.tensor(candidates)
    logprobs = -torch.arange(ids.shape[1], dtype=torch.float32).expand(ids.shape[0], -1).contiguous()
    return AcceptanceRecord(logprobs, ids, continuation)


def _histogram(counts: list[list[int]]) -> RankHistogram:
    return RankHistogram(
        drafter="d",
        drafter_sha256="0",
        target="t",
        target_sha256="1",
        dtype="float32",
        prompt_sets=("mtbench",),
        prompt_keys=("mtbench/81",),
        max_new_tokens=8,
        decode_budget=16,
        commit="abc",
        command="x",
        counts=counts,
    )


def test_counts_follow_the_path_while_it_stays_inside_the_candidates() -> None:
    candidates = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    passes = [
        _record(candidates, (1, 5, 9)),  # ranks 0, 1, 2
        _record(candidates, (3, 6, 7)),  # ranks 2, 2, 0
        _record(candidates, (2, 0, 7)),  # rank 1, then none: position 3 is not counted
        _record(candidates, (0, 4, 7)),  # none at position 1 only
        _record(candidates, (1,)),  # the output ended after one token
    ]
    assert count_ranks(passes, depth=3, ranks=3) == [[2, 1, 1, 1], [0, 1, 1, 1], [1, 0, 1, 0]]
    # two ranks counted: rank 2's hits become none, and those passes count no deeper
    assert count_ranks(passes, depth=3, ranks=2) == [[2, 1, 2], [0, 1, 1], [0, 0, 1]]
    assert count_ranks(passes, depth=2, ranks=3) == [[2, 1, 1, 1], [0, 1, 1, 1]]


def test_counting_needs_enough_candidates() -> None:
    with pytest.raises(ValueError, match="pass 0 has 3 candidates per position; 4 are needed"):
        count_ranks([_record([[1, 2, 3]], (1,))], depth=1, ranks=4)
    with pytest.raises(ValueError, match="depth and ranks must be >= 1"):
        count_ranks([], depth=0, ranks=2)


def test_non_increasing_pools_each_rise_and_keeps_the_sum() -> None:
    assert non_increasing(np.array([5.0, 1.0, 2.0, 3.0, 0.0, 1.0])).tolist() == [5.0, 2.0, 2.0, 2.0, 0.5, 0.5]
    assert non_increasing(np.array([1.0, 2.0, 6.0])).tolist() == [3.0, 3.0, 3.0]
    assert non_increasing(np.array([4.0, 2.0, 1.0])).tolist() == [4.0, 2.0, 1.0]


def test_conditional_rows_shrink_sparse_positions_toward_the_one_above() -> None:
    histogram = _histogram([[60, 20, 10, 10], [3, 0, 0, 1], [0, 0, 0, 0]])
    rows = histogram.conditional_rows()
    assert histogram.passes() == [100, 4, 0]
    pooled = np.array([63.0, 20.0, 10.0, 11.0]) / 104
    first = (np.array([60.0, 20.0, 10.0, 10.0]) + PRIOR_PASSES * pooled) / (100 + PRIOR_PASSES)
    assert rows[0] == pytest.approx(first, abs=1e-12)
    second = (np.array([3.0, 0.0, 0.0, 1.0]) + PRIOR_PASSES * first) / (4 + PRIOR_PASSES)
    assert rows[1] == pytest.approx(second, abs=1e-12)
    assert rows[2] == pytest.approx(rows[1], abs=1e-12)  # no passes: the position above
    assert rows.sum(-1) == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)


def test_conditional_rows_are_sorted_by_rank() -> None:
    rows = _histogram([[50, 5, 9, 1, 35]]).conditional_rows()
    assert bool((rows[:, 1:-1] <= rows[:, :-2]).all())
    assert rows[0, 1] == pytest.approx(rows[0, 2], abs=1e-12)
    assert rows[0].sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ([[1, 2], [3]], "counts row 1 has 1 entries; every row needs K_p + 1 >= 2 (2)"),
        ([[1, -2]], "counts row 0 [1, -2]: counts must be >= 0"),
        ([[0, 0], [1, 1]], "counts row 0 is empty: no drafter pass was counted"),
    ],
)
def test_malformed_histograms_name_the_file(counts: list[list[int]], message: str, tmp_path: Path) -> None:
    record = json.loads(_histogram([[1, 1]]).model_dump_json())
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps({**record, "counts": counts}))
    with pytest.raises(ValueError, match=r"rank histogram .*ranks\.json: ") as info:
        load_rank_histogram(path)
    assert message in str(info.value)
    with pytest.raises(ValueError, match="No such file"):
        load_rank_histogram(tmp_path / "nowhere.json")
