"""`request_outputs`: the hidden states and sampling masks of the tokens a step commits, on hand-built passes.

Hidden states: a padded pass of 2 requests x 3 real positions (graph width 4), the rows gathered in each
request's compaction order; the prefill's rows where the server returns full or last hidden states.
Sampling masks: 3 requests x 3 positions over a vocabulary of 5, requests 0 and 2 asking, with their
accepted paths off the row order; SGLang's packing (`SpeculativeSamplingMaskCapture`) read back per
committed token. The Engine test (`test_request_outputs_engine.py`) checks both against SGLang without
speculation.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bastion_sglang.integration.sglang_adapter import CaptureHiddenMode
from bastion_sglang.step import request_outputs
from bastion_sglang.step.request_outputs import (
    attach_prefill_hidden_states,
    attach_sampling_masks,
    attach_step_hidden_states,
    capture_final_hidden_states,
)

HIDDEN = 2


def passes_output(rows: int) -> SimpleNamespace:
    """A LogitsProcessorOutput stand-in: aux states (the drafter's) and final-norm states, `rows` each."""
    final = torch.arange(rows * HIDDEN, dtype=torch.float32).view(rows, HIDDEN)
    return SimpleNamespace(hidden_states=-final, last_hidden_states=final, sampling_mask_output=None)


def hidden_batch(
    asks: bool, mode: CaptureHiddenMode = CaptureHiddenMode.NULL, **fields: Any
) -> SimpleNamespace:
    return SimpleNamespace(return_hidden_states=asks, return_hidden_states_mode=mode, **fields)


def test_a_tree_step_returns_the_states_of_its_accepted_path_in_order() -> None:
    """Row b * W + j is the final-norm state at the node whose child is committed token j; padding dropped."""
    out = passes_output(2 * 4)  # B = 2 requests, graph width 4, W = 3 real positions
    order = torch.tensor([[0, 2, 1], [0, 1, 2]])
    attach_step_hidden_states(hidden_batch(True), out, 2, 3, order)
    final = torch.arange(8 * HIDDEN, dtype=torch.float32).view(2, 4, HIDDEN)
    want = torch.stack([final[0, [0, 2, 1]], final[1, [0, 1, 2]]]).view(6, HIDDEN)
    assert torch.equal(out.hidden_states, want)
    assert out.last_hidden_states is None


def test_a_plain_step_returns_each_roots_state() -> None:
    out = passes_output(3)
    attach_step_hidden_states(hidden_batch(True), out, 3, 1, None)
    assert torch.equal(out.hidden_states, torch.arange(6, dtype=torch.float32).view(3, HIDDEN))


def test_a_batch_that_does_not_ask_returns_no_states() -> None:
    """The drafter's aux states never reach the scheduler."""
    out = passes_output(6)
    attach_step_hidden_states(hidden_batch(False), out, 2, 3, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert out.hidden_states is None and out.last_hidden_states is None


@pytest.mark.parametrize(
    ("server_mode", "rows"),
    [(CaptureHiddenMode.FULL, [0, 1, 2, 3, 4, 5]), (CaptureHiddenMode.LAST, [3, 5])],
)
def test_the_prefill_returns_every_prompt_position_or_each_last_one(
    monkeypatch: pytest.MonkeyPatch, server_mode: CaptureHiddenMode, rows: list[int]
) -> None:
    """Prompts of 4 and 2 tokens: SGLang's scheduler reads all 6 rows (full) or one per request (last)."""
    monkeypatch.setattr(request_outputs, "get_server_return_hidden_states_mode", lambda: server_mode)
    out = passes_output(6)
    batch = hidden_batch(True, CaptureHiddenMode.LAST, extend_lens=[4, 2])
    attach_prefill_hidden_states(batch, out)
    assert torch.equal(out.hidden_states, torch.arange(12, dtype=torch.float32).view(6, HIDDEN)[rows])
    assert out.last_hidden_states is None


def test_the_prefill_of_a_batch_that_does_not_ask_keeps_no_states() -> None:
    out = passes_output(6)
    out.hidden_states = None  # DFlash's prefill has dropped its aux states
    attach_prefill_hidden_states(hidden_batch(False, extend_lens=[4, 2]), out)
    assert out.hidden_states is None and out.last_hidden_states is None


@pytest.mark.parametrize(
    ("server_mode", "kept"), [(CaptureHiddenMode.NULL, False), (CaptureHiddenMode.FULL, True)]
)
def test_final_states_are_kept_only_where_the_server_returns_hidden_states(
    monkeypatch: pytest.MonkeyPatch, server_mode: CaptureHiddenMode, kept: bool
) -> None:
    monkeypatch.setattr(request_outputs, "get_server_return_hidden_states_mode", lambda: server_mode)
    worker = SimpleNamespace(_target_logits_processor=SimpleNamespace(keep_last_hidden_states=False))
    capture_final_hidden_states(worker)
    assert worker._target_logits_processor.keep_last_hidden_states is kept


def test_a_target_with_several_logits_processors_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        request_outputs, "get_server_return_hidden_states_mode", lambda: CaptureHiddenMode.LAST
    )
    with pytest.raises(ValueError, match="one logits processor"):
        capture_final_hidden_states(SimpleNamespace(_target_logits_processor=None))


# ---- sampling masks: B = 3, W = 3, V = 5; requests 0 and 2 ask (top_k 3), request 1 does not ----------

WEIGHTS = torch.tensor(
    [
        [[0, 3, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 2, 5]],  # request 0: path nodes 0, 2
        [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]],  # request 1: does not ask
        [[0, 0, 1, 0, 0], [1, 3, 4, 0, 0], [0, 0, 0, 0, 7]],  # request 2: path nodes 0, 1, 2
    ],
    dtype=torch.float32,
)
"""Processed distributions after each row, as unnormalised weights (zero: filtered out)."""
ORDER = torch.tensor([[0, 2, 1], [0, 1, 2], [0, 1, 2]])
OUT_TOKENS = torch.tensor([[2, 4, 0], [0, 0, 0], [2, 1, 4]])
COMMIT_LENS = torch.tensor([2, 1, 3], dtype=torch.int32)
MASKS = {0: [[1, 2], [4, 3, 0]], 2: [[2], [2, 1, 0], [4]]}
"""Each asking request's committed tokens' supports, most likely first."""
SELECTED = {0: [math.log(1 / 4), math.log(5 / 8)], 2: [0.0, math.log(3 / 8), 0.0]}


def mask_batch(support_rows: list[int] | None = None) -> SimpleNamespace:
    info = SimpleNamespace(
        sampling_mask_batch_indices=torch.tensor([0, 2]),
        sampling_mask_top_ks=[3, 1, 3],
        sampling_support_logprobs_capture_indices=None
        if support_rows is None
        else torch.tensor(support_rows),
    )
    return SimpleNamespace(sampling_info=info)


def committed(output: Any, row: int, request: int) -> list[list[int]]:
    """The supports of one capture row's committed tokens."""
    lengths = output.lengths[row].tolist()[: COMMIT_LENS[request]]
    return [output.token_ids[row, j, :length].tolist() for j, length in enumerate(lengths)]


def test_each_committed_token_gets_the_support_of_its_path_node() -> None:
    out = passes_output(9)
    attach_sampling_masks(mask_batch(), out, WEIGHTS, OUT_TOKENS, ORDER, COMMIT_LENS)
    masks = out.sampling_mask_output
    assert masks.num_accept_tokens.tolist() == [2, 3]
    for row, request in enumerate((0, 2)):
        assert committed(masks, row, request) == MASKS[request]
        n = int(COMMIT_LENS[request])
        assert masks.selected_logprobs[row, :n].tolist() == pytest.approx(SELECTED[request], abs=1e-6)
        assert masks.statuses[row, :n].tolist() == [0] * n  # SamplingMaskStatus.OK


def test_support_logprobs_follow_the_supports() -> None:
    """In SGLang's "support" mode the support rows (here request 2's, capture row 1) carry every support
    token's log-probability, renormalised over the support."""
    out = passes_output(9)
    attach_sampling_masks(mask_batch(support_rows=[1]), out, WEIGHTS, OUT_TOKENS, ORDER, COMMIT_LENS)
    support = out.sampling_mask_output.support_logprobs
    assert support.shape == (1, 3, 3)
    assert support[0, 1].tolist() == pytest.approx([math.log(p) for p in (4 / 8, 3 / 8, 1 / 8)], abs=1e-6)


def test_a_greedy_batch_returns_each_token_alone() -> None:
    out = passes_output(9)
    attach_sampling_masks(mask_batch(), out, None, OUT_TOKENS, ORDER, COMMIT_LENS)
    masks = out.sampling_mask_output
    assert committed(masks, 0, 0) == [[2], [4]] and committed(masks, 1, 2) == [[2], [1], [4]]
    assert masks.selected_logprobs.abs().max() == 0


def test_a_plain_step_reads_the_roots_distributions() -> None:
    out = passes_output(3)
    attach_sampling_masks(
        mask_batch(), out, WEIGHTS[:, 2:], OUT_TOKENS[:, 1:2], None, torch.ones(3, dtype=torch.int32)
    )
    masks = out.sampling_mask_output
    assert [masks.token_ids[row, 0, : masks.lengths[row, 0]].tolist() for row in (0, 1)] == [[4, 3, 0], [4]]


def test_no_request_asking_builds_nothing() -> None:
    out = passes_output(9)
    batch = mask_batch()
    batch.sampling_info.sampling_mask_batch_indices = None
    attach_sampling_masks(batch, out, WEIGHTS, OUT_TOKENS, ORDER, COMMIT_LENS)
    assert out.sampling_mask_output is None
