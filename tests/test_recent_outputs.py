"""`request_penalties.RecentOutputs`: a request's output so far when its `output_ids` lag the forwards that
committed tokens for it (SGLang's overlap scheduler appends them one iteration late)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bastion_sglang.step.request_penalties import RecentOutputs

PROMPT = [7, 8, 9]


def request(rid: str, output: list[int]) -> SimpleNamespace:
    """The fields of SGLang's `Req` the record reads."""
    return SimpleNamespace(rid=rid, origin_input_ids=list(PROMPT), output_ids=list(output))


def committed(output_len: int) -> int:
    """Tokens with KV once `output_len` tokens are output (the last one, the root, has none yet)."""
    return len(PROMPT) + output_len - 1


def test_up_to_date_outputs_are_the_requests_own() -> None:
    a, b = request("a", [1, 2]), request("b", [5])
    assert RecentOutputs().outputs([a, b], [committed(2), committed(1)]) == [[1, 2], [5]]


def test_a_lagging_request_gets_the_committed_tokens_its_output_lacks() -> None:
    a, b = request("a", [1, 2]), request("b", [5])
    recent = RecentOutputs()
    # a decode step committed 3 tokens for a (its rows: 3, 4, 6, then padding) and 1 for b
    recent.record([a, b], torch.tensor([[3, 4, 6, 0], [2, 0, 0, 0]]), torch.tensor([3, 1], dtype=torch.int32))
    # a's output_ids lag that step; b's were already processed
    b.output_ids.append(2)
    assert recent.outputs([b, a], [committed(2), committed(5)]) == [[5, 2], [1, 2, 3, 4, 6]]


def test_a_new_request_gets_its_prefill_token() -> None:
    old, new = request("old", [1]), request("new", [])
    recent = RecentOutputs()
    recent.record([old], torch.tensor([[4, 5]]), torch.tensor([2]))
    recent.record([new], torch.tensor([[11]]), torch.tensor([1]))
    old.output_ids += [4, 5]
    assert recent.outputs([old, new], [committed(3), committed(1)]) == [[1, 4, 5], [11]]


def test_the_most_recent_forward_of_a_request_counts() -> None:
    a = request("a", [1])
    recent = RecentOutputs()
    recent.record([a], torch.tensor([[2, 3]]), torch.tensor([2]))
    a.output_ids += [2, 3]
    recent.record([a], torch.tensor([[4, 5]]), torch.tensor([1]))
    assert recent.outputs([a], [committed(4)]) == [[1, 2, 3, 4]]


@pytest.mark.parametrize(
    ("output_len", "why"),
    [(6, "more than its last forward committed"), (1, "output ahead of the committed length")],
)
def test_an_unexplained_lag_names_the_request(output_len: int, why: str) -> None:
    a = request("req-17", [1, 2])
    recent = RecentOutputs()
    recent.record([a], torch.tensor([[3, 4, 5]]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="request req-17"):
        recent.outputs([a], [committed(output_len)])


def test_forwards_older_than_kept_are_forgotten() -> None:
    a, b, c = request("a", [1]), request("b", [1]), request("c", [1])
    recent = RecentOutputs(keep=2)
    for req in (a, b, c):
        recent.record([req], torch.tensor([[2]]), torch.tensor([1]))
    assert recent.outputs([b, c], [committed(2), committed(2)]) == [[1, 2], [1, 2]]
    with pytest.raises(RuntimeError, match="request a"):
        recent.outputs([a], [committed(2)])
