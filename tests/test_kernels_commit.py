"""`kernels.compaction_order` and `kernels.committed_tokens` on hand-built verify rows.

Row 0 is a tree whose accepted path is root -> slot 2 -> slot 4 (two draft nodes, slots 1 and 3 rejected);
row 1 accepts nothing (only the bonus); row 2 accepts its whole chain.
"""

from __future__ import annotations

import pytest
import torch

from bastion_sglang import kernels
from bastion_sglang.kernels import NO_NODE, AcceptResult

N = NO_NODE
ACCEPT = AcceptResult(
    accept_index=torch.tensor([[0, 2, 4, N, N], [0, N, N, N, N], [0, 1, 2, 3, 4]]),
    accept_length=torch.tensor([2, 0, 4]),
    bonus_tokens=torch.tensor([99, 98, 97]),
)
TOKENS = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34]])


def test_the_accepted_path_comes_first_then_the_rest_ascending() -> None:
    order = kernels.compaction_order(ACCEPT.accept_index, ACCEPT.accept_length)
    assert order.tolist() == [[0, 2, 4, 1, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_committed_tokens_are_the_path_then_the_bonus_then_zeros() -> None:
    order = kernels.compaction_order(ACCEPT.accept_index, ACCEPT.accept_length)
    out = kernels.committed_tokens(TOKENS, order, ACCEPT)
    assert out.tolist() == [[12, 14, 99, 0, 0], [98, 0, 0, 0, 0], [31, 32, 33, 34, 97]]


def test_a_path_through_later_slots_keeps_every_rejected_slot() -> None:
    """The permutation holds every slot once: rejected slots stay in the row (their KV slots are reused)."""
    index = torch.tensor([[0, 3, N, N]])
    order = kernels.compaction_order(index, torch.tensor([1]))
    assert order.tolist() == [[0, 3, 1, 2]]
    assert sorted(order[0].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("index", "length", "message"),
    [
        (torch.zeros((2, 3)), torch.zeros(2, dtype=torch.int64), "accept_index"),
        (torch.zeros((2, 0), dtype=torch.int64), torch.zeros(2, dtype=torch.int64), "width W >= 1"),
        (torch.zeros((2, 3), dtype=torch.int64), torch.zeros(3, dtype=torch.int64), "accept_length"),
        (torch.zeros((2, 3), dtype=torch.int64), torch.zeros(2, dtype=torch.int32), "accept_length"),
    ],
)
def test_bad_compaction_input_is_refused(index: torch.Tensor, length: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kernels.compaction_order(index, length)


def test_committed_tokens_refuse_mismatched_rows() -> None:
    order = kernels.compaction_order(ACCEPT.accept_index, ACCEPT.accept_length)
    with pytest.raises(ValueError, match="order"):
        kernels.committed_tokens(TOKENS, order[:, :4], ACCEPT)
    with pytest.raises(ValueError, match="tokens"):
        kernels.committed_tokens(TOKENS.float(), order, ACCEPT)
