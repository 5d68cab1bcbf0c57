"""`BastionDraftInput` rows follow the batch: filter and merge keep every per-request field aligned, the
overlap scheduler's future-map indices included; `decode_allocation` keeps every request's reserve and
tops the batch up together."""

from __future__ import annotations

import pytest
import torch

from bastion_sglang.step.spec_input import (
    TOP_UP_SLOTS,
    BastionDraftInput,
    DecodeAllocation,
    decode_allocation,
)

RESERVE = 34


def draft_input(rows: list[int], future: bool) -> BastionDraftInput:
    """One row per value v of `rows`: bonus v, seq len 10 v, seed key -v, future index v."""
    values = torch.tensor(rows, dtype=torch.int64)
    return BastionDraftInput(
        bonus_tokens=values.clone(),
        new_seq_lens=values * 10,
        seed_keys=-values,
        reserve=RESERVE,
        future_indices=values.clone() if future else None,
    )


def columns(info: BastionDraftInput) -> list[list[int]]:
    fields = [info.bonus_tokens, info.new_seq_lens // 10, -info.seed_keys]
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


def allocation(committed, allocated, free=10**6, page_size=1, row_len=10**6):
    asked = []

    def free_slots() -> int:
        asked.append(free)
        return free

    result = decode_allocation(
        committed, allocated, reserve=RESERVE, page_size=page_size, row_len=row_len, free_slots=free_slots
    )
    return result, len(asked)


def test_no_allocation_while_every_request_keeps_its_reserve() -> None:
    result, asked = allocation([100, 7], [100 + RESERVE, 7 + RESERVE + 5])
    assert result is None
    assert asked == 0  # the pool is not even asked


def test_one_short_request_tops_up_the_whole_batch() -> None:
    result, asked = allocation([100, 7], [100 + RESERVE - 1, 7 + RESERVE + 5])
    assert result == DecodeAllocation(
        current=[100 + RESERVE - 1, 7 + RESERVE + 5],
        target=[100 + RESERVE + TOP_UP_SLOTS, 7 + RESERVE + TOP_UP_SLOTS],
        needed=TOP_UP_SLOTS + 1 + TOP_UP_SLOTS - 5,
    )
    assert asked == 1


def test_top_ups_are_whole_pages_and_stop_at_the_row() -> None:
    result, _ = allocation([100], [100], page_size=16)
    assert result is not None and result.target == [160 + 16]  # 100 + 34 + 32 = 166 -> 176
    result, _ = allocation([100], [100], page_size=16, row_len=150)
    assert result is not None and result.target == [144]  # the row's whole pages cap the top-up ...
    result, _ = allocation([120], [120], page_size=16, row_len=150)
    assert result is not None and result.target == [160]  # ... never the reserve itself (SGLang's rule)


def test_a_full_pool_gets_the_reserve_alone() -> None:
    result, _ = allocation([100, 7], [100, 7 + RESERVE], free=RESERVE + TOP_UP_SLOTS + TOP_UP_SLOTS - 1)
    assert result == DecodeAllocation(
        current=[100, 7 + RESERVE], target=[100 + RESERVE, 7 + RESERVE], needed=RESERVE
    )


def test_one_token_steps_allocate_once_per_top_up() -> None:
    committed, allocated, allocations = [50, 80], [50, 80], 0
    for _ in range(99):
        result, _ = allocation(committed, allocated)
        if result is not None:
            allocations += 1
            allocated = result.target
        assert all(a >= c + RESERVE for c, a in zip(committed, allocated, strict=True))
        committed = [c + 1 for c in committed]
    assert allocations == 3  # steps 0, 33 and 66; the reserve alone would allocate at every step
