"""The commit stage of a decode step: the accepted path's KV slots, the drafter's context, the logprobs.

A tree step moves each request's accepted slots to the front of its verify window by permuting its slot ids
(no KV is copied; the rejected slots stay in the request's reserve) and appends the accepted positions'
target hidden states to the drafter KV (DFlash's commit, `sglang_adapter.append_target_hidden_to_draft_kv`). A
step of width 1 has its one token already in place: its drafter row is held
(`draft_context.DeferredDraftContext`) and written in one append before the next drafter pass, a prefill, a
change of batch or 64 held steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import sglang_adapter as sgl
from bastion_sglang.draft_context import ContextRows, DeferredDraftContext
from bastion_sglang.sglang_adapter import DFlashWorkerV2, compute_spec_logprobs

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch


class DraftContextWriter:
    """The drafter context rows of `worker`'s width-1 steps, held until the drafter needs them."""

    def __init__(self, worker: DFlashWorkerV2) -> None:
        self._worker = worker
        self._held = DeferredDraftContext()

    def write_held(self) -> None:
        """Write every held row into the drafter KV (before a drafter pass or a prefill)."""
        self._write(self._held.take())

    def defer(self, batch: ScheduleBatch, rows: ContextRows) -> None:
        """Hold a step's rows (one per request of `batch`), writing the rows held so far first when they are
        due (`DeferredDraftContext.due`)."""
        if self._held.due(batch.reqs):
            self._write(self._held.take())
        self._held.defer(batch.reqs, rows)

    def _write(self, rows: ContextRows | None) -> None:
        """Write rows into the drafter KV, one token per row; None: nothing."""
        if rows is not None:
            sgl.append_target_hidden_to_draft_kv(
                self._worker,
                target_hidden=rows.hidden,
                cache_loc_2d=rows.slots[:, None],
                positions=rows.positions,
                commit_lens=torch.ones_like(rows.slots, dtype=torch.int32),
            )


def commit_tree(
    worker: DFlashWorkerV2,
    req_to_token: torch.Tensor,
    rows_index: torch.Tensor,
    slots: torch.Tensor,
    window: torch.Tensor,
    order: torch.Tensor,
    hidden: torch.Tensor,
    commit_lens: torch.Tensor,
) -> None:
    """Commit a tree step's accepted paths.

    req_to_token: SGLang's [pool rows, max context] slot table; rows_index: [B, 1] int64 the requests' rows;
    slots: [B, W] int64 the verify rows' KV slots; window: [B, W] int64 req_to_token columns L_b..L_b+W-1;
    order: [B, W] `kernels.compaction_order`; hidden: [B, W, H] the rows' target hidden states; commit_lens:
    [B] int32 tokens emitted. The accepted slots take columns L_b.. in path order; the accepted positions'
    hidden states become drafter KV at those slots.
    """
    compacted = slots.gather(1, order)
    req_to_token[rows_index, window] = compacted.to(req_to_token.dtype)
    path_hidden = hidden.gather(1, order[:, :, None].expand(-1, -1, hidden.shape[-1]))
    sgl.append_target_hidden_to_draft_kv(
        worker,
        target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
        cache_loc_2d=compacted,
        positions=window.reshape(-1),
        commit_lens=commit_lens,
    )


def attach_logprobs(
    batch: ScheduleBatch,
    logits_output: Any,
    logits: torch.Tensor,
    out_tokens: torch.Tensor,
    order: torch.Tensor | None,
) -> None:
    """SGLang's logprobs of the committed tokens, for a batch that asks for them.

    logits: [B * W, V] the rows' processed logits; out_tokens: [B, W] the step's output rows; order: [B, W]
    the rows' compaction order (None: W = 1). The committed chain's logits replace `next_token_logits`.
    """
    bs, width = out_tokens.shape
    if order is not None:
        logits = logits.view(bs, width, -1).gather(1, order[:, :, None].expand(-1, -1, logits.shape[-1]))
    logits_output.next_token_logits = logits.reshape(bs * width, -1)
    compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=width)
