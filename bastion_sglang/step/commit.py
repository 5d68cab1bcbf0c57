"""The commit stage of a decode step: the accepted path's KV slots, the drafter's context, the logprobs.

A tree step puts each request's accepted path (root first, then its accepted nodes in path order) at columns
L_b.. of its verify window and appends the accepted positions' target hidden states to the drafter KV at those
columns' slots (DFlash's commit, `sglang_adapter.append_target_hidden_to_draft_kv`). How the path gets there
is chosen once by the KV page size (`TreeCommit`):
- pages of one token: the window's slot ids are permuted in `req_to_token` (no KV is copied; the rejected
  slots stay in the request's reserve);
- pages of N > 1 tokens: SGLang's page invariant (the positions of one page sit at consecutive slots of one
  page, which paged attention kernels and the allocator rely on) forbids permuting slot ids, so the accepted
  nodes' target KV (every layer) is copied from their slots to the slots of columns 1..a in path order
  (`kernels.window_kv_moves`, SGLang's `move_kv_cache`), `req_to_token` is left as it is, and the drafter KV
  is written at the destination slots. The copy moves at most W - 1 slots per request; the planner prices it
  per verify token (`kv_copy_seconds_per_token`, `StepCostTracker.add_prior_per_token`).
A step of width 1 has its one token already in place: its drafter row is held
(`draft_context.DeferredDraftContext`) and written in one append before the next drafter pass, a prefill, a
change of batch or 64 held steps.
"""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING, Any

import torch

from bastion_sglang import kernels
from bastion_sglang.integration import sglang_adapter as sgl
from bastion_sglang.integration.sglang_adapter import DFlashWorkerV2, compute_spec_logprobs
from bastion_sglang.step.draft_context import ContextRows, DeferredDraftContext
from bastion_sglang.step.timing import time_op

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from bastion_sglang.controller.step_costs import StepCostTracker

logger = logging.getLogger(__name__)


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


PADDING_SLOT = 0
"""SGLang's padding KV slot (never allocated to a request): moves that move nothing copy it onto itself, so
a paged commit's copy has a fixed size and needs no host sync (SGLang's own
`move_accept_tokens_to_target_kvcache` pads its moves the same way)."""


class TreeCommit:
    """Commits a tree step's accepted paths into `worker`'s KV (module docstring): by permuting slot ids with
    pages of one token (`page_size` 1), by copying KV with larger pages."""

    def __init__(self, worker: DFlashWorkerV2, page_size: int) -> None:
        self._worker = worker
        self._page_size = page_size
        self._copies_kv = page_size > 1

    def price_copies(self, costs: StepCostTracker, tokens: int) -> None:
        """With pages of several tokens, add the KV copy's seconds per verify token, timed here at `tokens`
        slots (`kv_copy_seconds_per_token`), to the step costs' prior; with pages of one token nothing is
        copied and nothing is added. Call at start-up, before any request holds KV."""
        if not self._copies_kv:
            return
        copy_seconds = kv_copy_seconds_per_token(self._worker, tokens)
        costs.add_prior_per_token(copy_seconds)
        logger.info(
            "BASTION: page size %d, tree commits copy KV: %.3g µs per verify token priced",
            self._page_size,
            copy_seconds * 1e6,
        )

    def commit(
        self,
        rows_index: torch.Tensor,
        slots: torch.Tensor,
        window: torch.Tensor,
        order: torch.Tensor,
        hidden: torch.Tensor,
        commit_lens: torch.Tensor,
    ) -> None:
        """Commit a tree step's accepted paths.

        rows_index: [B, 1] int64 the requests' req_to_token rows; slots: [B, W] int64 the verify rows' KV
        slots; window: [B, W] int64 req_to_token columns L_b..L_b+W-1; order: [B, W]
        `kernels.compaction_order`; hidden: [B, W, H] the rows' target hidden states; commit_lens: [B] int32
        tokens emitted (the path's columns: root + accepted nodes). Afterwards columns L_b.. hold the path's
        KV in path order, and the path's hidden states are drafter KV at those columns' slots.
        """
        if not self._copies_kv:
            req_to_token = self._worker.model_runner.req_to_token_pool.req_to_token
            path_slots = slots.gather(1, order)
            req_to_token[rows_index, window] = path_slots.to(req_to_token.dtype)
        else:
            moves = kernels.window_kv_moves(order, commit_lens.to(torch.int64), slots)
            sgl.move_kv(
                sgl.target_kv_pool(self._worker),
                tgt_loc=moves.dst.reshape(-1).clamp(min=PADDING_SLOT),  # NO_MOVE -> the padding slot
                src_loc=moves.src.reshape(-1).clamp(min=PADDING_SLOT),
            )
            path_slots = slots
        path_hidden = hidden.gather(1, order[:, :, None].expand(-1, -1, hidden.shape[-1]))
        sgl.append_target_hidden_to_draft_kv(
            self._worker,
            target_hidden=path_hidden.reshape(-1, hidden.shape[-1]),
            cache_loc_2d=path_slots,
            positions=window.reshape(-1),
            commit_lens=commit_lens,
        )


def kv_copy_seconds_per_token(worker: DFlashWorkerV2, tokens: int, repeats: int = 5) -> float:
    """Seconds per token of copying `tokens` slots' target KV (every layer) within the pool, as a paged
    `TreeCommit` copies an accepted path: the median of `repeats` timed copies (after one untimed) of
    `tokens` distinct slots onto `tokens` others, divided by `tokens`. Both ranges are free slots past the
    padding page; call at start-up, before any request holds KV. ValueError unless tokens >= 1 and the pool
    holds 2 · tokens slots past its padding page."""
    kv_pool = sgl.target_kv_pool(worker)
    first = int(kv_pool.page_size)  # slots [0, page_size) are SGLang's padding page
    if tokens < 1 or first + 2 * tokens > int(kv_pool.size):
        raise ValueError(f"cannot time a copy of {tokens} slots in a KV pool of {kv_pool.size} slots")
    device = torch.device(worker.device)
    src = torch.arange(first, first + tokens, dtype=torch.int64, device=device)
    tgt = src + tokens
    seconds = time_op(lambda: sgl.move_kv(kv_pool, tgt_loc=tgt, src_loc=src), device, 1, repeats)
    return statistics.median(seconds) / tokens


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
