"""`BastionDraftInput` rows follow the batch: filter and merge keep every per-request field aligned, the
overlap scheduler's future-map indices included."""

from __future__ import annotations

import pytest
import torch

from bastion_sglang.spec_input import BastionDraftInput

RESERVE = 34


def draft_input(rows: list[int], future: bool) -> BastionDraftInput:
    """One row per value v of `rows`: bonus v, seq len 10 v, seed -v, future index v."""
    values = torch.tensor(rows, dtype=torch.int64)
    return BastionDraftInput(
        bonus_tokens=values.clone(),
        new_seq_lens=values * 10,
        seeds=-values,
        reserve=RESERVE,
        future_indices=values.clone() if future else None,
    )


def columns(info: BastionDraftInput) -> list[list[int]]:
    fields = [info.bonus_tokens, info.new_seq_lens // 10, -info.seeds]
    if info.future_indices is not None:
        fields.append(info.future_indices)
    return [field.tolist() for field in fields]


@pytest.mark.parametrize("future", [False, True])
def test_filter_then_merge_keeps_rows_aligned(future: bool) -> None:
    info = draft_input([3, 5, 7, 9], future)
    info.filter_batch(torch.tensor([3, 1]))
    info.merge_batch(draft_input([4], future))
    assert columns(info) == [[9, 5, 4]] * len(columns(info))


def test_merging_with_and_without_future_indices_is_refused() -> None:
    with pytest.raises(ValueError, match="future-map indices"):
        draft_input([1], True).merge_batch(draft_input([2], False))
